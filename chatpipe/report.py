"""The report card: report.md with system info, provenance, params, timings, the summary table and plots.

    from chatpipe.report import summary_table, render_report, plot_curves, stage_runs
    table = summary_table(json.loads(Path("artifacts/eval/results.json").read_text()))
    runs = stage_runs(MlflowClient(), experiment_id, parent_run_id)    # {stage: Run}
    plot_curves(client, runs, "loss", Path("artifacts/report/loss.png"))

Numbers come from ``artifacts/eval/results.json`` (written by the eval stage, each stage's numbers
tagged with the git commit and dvc.lock hashes they came from) and from MLflow (wall times, curves).
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import yaml

from chatpipe.io import atomic_write
from chatpipe.settings import MODEL_STAGES, stages_before
from chatpipe.tracking import first_run

# Summary table: row label -> (where in a stage's eval results, key). The tiny-world CORE (our
# synthetic in-context tasks) and the DCLM CORE (the published 22-task metric) are different
# metrics: never one row.
CORE_ROWS: list[tuple[str, str, str]] = [("tiny-world CORE", "core_tinyworld", "core"), ("DCLM CORE", "core", "core")]
# ChatCORE benchmark rows: (row label, results key). A task that stood in for a benchmark (its
# results say ``stands_in_for``) takes the benchmark's row under its own name: the tiny profile's
# tinyworld_gsm is never shown as GSM8K.
CHAT_ROWS: list[tuple[str, str]] = [
    ("ARC-E", "ARC-Easy"),
    ("ARC-C", "ARC-Challenge"),
    ("MMLU", "MMLU"),
    ("GSM8K", "GSM8K"),
    ("HumanEval", "HumanEval"),
    ("SpellingBee", "SpellingBee"),
]
COLUMNS = list(MODEL_STAGES)
# which curves go in which plot: metric-name fragment per plot
CURVES = {"loss": "loss", "bpb": "bpb", "reward": "reward"}


def system_info() -> dict[str, Any]:
    """CPU, GPU, memory and library versions of this machine."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    try:
        mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (ValueError, OSError):
        mem_gb = float("nan")
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_gb": round(mem_gb, 1),
        "gpus": ", ".join(gpus) or "none",
    }


def dvc_lock_hashes(path: Path = Path("dvc.lock")) -> dict[str, str]:
    """Per-stage hash of its dvc.lock entry (deps, params, outs), plus ``dvc.lock`` for the whole file."""
    from chatpipe.tracking import dvc_lock_hash, dvc_stage_hashes

    if not path.exists():
        return {"dvc.lock": "none"}
    return {"dvc.lock": dvc_lock_hash(path), **dvc_stage_hashes(path)}


def _cell(stage_results: dict | None, where: str, key: str) -> float | None:
    counted = _counted(stage_results, where, key)
    if counted is not None:
        return counted[0]
    if not stage_results:
        return None
    return (stage_results.get(where) or {}).get(key) if key in ("core", "chatcore") else None


def _counted(stage_results: dict | None, where: str, key: str) -> tuple[float, int] | None:
    """(accuracy, number of items) of one task cell; None for aggregate rows and missing tasks."""
    if not stage_results or key in ("core", "chatcore"):
        return None
    task = ((stage_results.get(where) or {}).get("tasks") or {}).get(key)
    if task is None or task.get("accuracy") is None:
        return None
    return task["accuracy"], int(task.get("num_examples") or 0)


def accuracy_cell(acc: float, n: int, previous: tuple[float, int] | None = None) -> str:
    """``0.375 [0.14, 0.69] n=8``: accuracy, its 95% Wilson interval and the item count; ``(≈)`` when
    the change from the previous stage's ``(accuracy, n)`` lies within the noise of the difference."""
    from chatpipe.evals.metrics import wilson_interval, within_noise

    if n < 1:
        return f"{acc:.3f} n=0"
    lo, hi = wilson_interval(acc, n)
    text = f"{acc:.3f} [{lo:.2f}, {hi:.2f}] n={n}"
    if previous is not None and previous[1] > 0 and within_noise(acc, n, *previous):
        text += " (≈)"
    return text


def stand_ins(results: dict) -> dict[str, str]:
    """``{task: benchmark}`` of the ChatCORE tasks that stood in for a benchmark in any column."""
    out = {}
    for col in COLUMNS:
        tasks = (((results.get("stages") or {}).get(col) or {}).get("chatcore") or {}).get("tasks") or {}
        out.update({label: t["stands_in_for"] for label, t in tasks.items() if t.get("stands_in_for")})
    return out


def summary_rows(results: dict) -> list[tuple[str, str, str]]:
    """(row label, where, key) of the summary table: each benchmark row, or in its place the rows of
    the tasks that stood in for it (then labelled with the task's own name), and ChatCORE last."""
    standing_in = stand_ins(results)
    rows = list(CORE_ROWS)
    for label, benchmark in CHAT_ROWS:
        own = [(task, "chatcore", task) for task, target in standing_in.items() if target == benchmark]
        ran_itself = any(_counted(r, "chatcore", benchmark) for r in (results.get("stages") or {}).values())
        rows += ([(label, "chatcore", benchmark)] if ran_itself or not own else []) + own
    return rows + [("ChatCORE", "chatcore", "chatcore")]


def summary_values(results: dict) -> dict[str, dict[str, float | None]]:
    """``{row: {column: value or None}}`` from the eval results document."""
    stages = results.get("stages", {})
    return {
        row: {col: _cell(stages.get(col), where, key) for col in COLUMNS} for row, where, key in summary_rows(results)
    }


def summary_table(results: dict) -> str:
    """The markdown summary table: rows tiny-world CORE, DCLM CORE .. ChatCORE, columns BASE MID SFT RL
    (blank = not run). Task accuracies carry their 95% interval and n, and ``(≈)`` where the change
    from the previous evaluated stage is within noise."""
    values = summary_values(results)
    stages = results.get("stages", {})
    lines = ["| metric | " + " | ".join(c.upper() for c in COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    for row, where, key in summary_rows(results):
        cells, previous = [], None
        for c in COLUMNS:
            counted = _counted(stages.get(c), where, key)
            if counted is not None:
                cells.append(accuracy_cell(*counted, previous))
                previous = counted
            else:
                cells.append("" if values[row][c] is None else f"{values[row][c]:.4f}")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def provenance_lines(results: dict) -> list[str]:
    """One line per evaluated stage: the commit, dvc.lock hash and model hash its numbers came from."""
    out = []
    for col in COLUMNS:
        r = results.get("stages", {}).get(col)
        if r:
            out.append(
                f"- {col.upper()}: git `{r.get('git_commit')}`, dvc.lock `{r.get('dvc_lock')}`, "
                f"model stage lock entry `{r.get('dvc_stage_hash')}`, "
                f"model.pt sha256 `{(r.get('model_sha256') or '')[:12]}`"
            )
    return out


def stage_runs(client: Any, experiment_id: str, parent_run_id: str | None) -> dict[str, Any]:
    """The MLflow run of each pipeline stage: nested under the parent when there, else the newest one.

    A stage DVC skipped in this pipeline run has no nested run; its newest earlier run stands in.
    """
    runs: dict[str, Any] = {}
    if parent_run_id:
        for run in client.search_runs(
            [experiment_id],
            f"tags.mlflow.parentRunId = '{parent_run_id}'",
            order_by=["attributes.start_time DESC"],
            max_results=500,
        ):
            runs.setdefault(run.data.tags.get("stage", run.info.run_name), run)
    for stage in stages_before("report"):  # the stages a report describes, in pipeline order
        if stage not in runs:
            found = first_run(client, experiment_id, f"tags.stage = '{stage}'")
            if found:
                runs[stage] = found
    return {s: runs[s] for s in stages_before("report") if s in runs}


# stage -> the file in artifacts/ that records the MLflow run id which produced it
ARTIFACT_RECORDS = {
    "pretrain": "base/meta.json",
    "midtrain": "mid/meta.json",
    "sft": "sft/meta.json",
    "reward_model": "reward_model/meta.json",
    "rl": "rl/meta.json",
    "eval": "eval/results.json",
}


def artifact_runs(client: Any, experiment_id: str, artifacts: Path = Path("artifacts")) -> dict[str, Any]:
    """The MLflow run that produced each stage's artifacts, in pipeline order.

    Model stages and eval record their run id (``mlflow_run_id``) in the artifact's meta.json /
    results.json: that run and no other is used, so a newer FAILED or killed run is never credited.
    An artifact without a recorded id (tracking was off) gets no run. ``data`` and ``tokenizer``
    record none (a re-run with the same inputs must keep their hash), so their newest FINISHED
    run stands in.
    """
    runs: dict[str, Any] = {}
    for stage in stages_before("report"):
        record = ARTIFACT_RECORDS.get(stage)
        if record is None:
            found = first_run(client, experiment_id, f"tags.stage = '{stage}' and attributes.status = 'FINISHED'")
            if found:
                runs[stage] = found
            continue
        path = artifacts / record
        try:
            run_id = json.loads(path.read_text()).get("mlflow_run_id")
        except (OSError, ValueError):
            continue  # stage not run
        if run_id:
            try:
                runs[stage] = client.get_run(run_id)
            except Exception as e:  # the store was reset or is another one
                raise ValueError(f"{path}: mlflow_run_id {run_id} is not in the tracking store ({e})") from e
    return runs


def wall_seconds(run: Any, now_ms: int | None = None) -> float:
    """Wall time of a run (to now if it has not ended)."""
    end = run.info.end_time or now_ms or int(time.time() * 1000)
    return max(0.0, (end - run.info.start_time) / 1000.0)


def timing_table(runs: dict[str, Any], cost_per_hour: float) -> tuple[str, float, float]:
    """Markdown table of wall time and estimated cost per stage; returns (table, total s, total cost)."""
    lines = ["| stage | wall time | est. cost (USD) | run id |", "|---|---|---|---|"]
    total = 0.0
    for stage, run in runs.items():
        s = wall_seconds(run)
        total += s
        lines.append(f"| {stage} | {format_seconds(s)} | {s / 3600 * cost_per_hour:.2f} | `{run.info.run_id[:8]}` |")
    total_cost = total / 3600 * cost_per_hour
    lines.append(f"| **total** | **{format_seconds(total)}** | **{total_cost:.2f}** | |")
    return "\n".join(lines), total, total_cost


def format_seconds(s: float) -> str:
    """``1h 02m 03s`` / ``2m 03s`` / ``4.2s``."""
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    return f"{h}h {m:02d}m {sec:02d}s" if h else f"{m}m {sec:02d}s"


def curve_series(client: Any, runs: dict[str, Any], fragment: str) -> list[tuple[str, list[int], list[float]]]:
    """(label, steps, values) for every metric whose name contains ``fragment`` and has >= 2 points."""
    series = []
    for stage, run in runs.items():
        for key in sorted(run.data.metrics):
            if fragment not in key:
                continue
            history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
            if len(history) >= 2:
                series.append((f"{stage}: {key}", [m.step for m in history], [m.value for m in history]))
    return series


def plot_curves(client: Any, runs: dict[str, Any], name: str, path: Path) -> bool:
    """Draw the ``name`` curves (see :data:`CURVES`) of all stages into a PNG; False if there are none."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = curve_series(client, runs, CURVES[name])
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for label, steps, values in series:
        ax.plot(steps, values, label=label, marker="." if len(steps) < 30 else None)
    ax.set_xlabel("step")
    ax.set_ylabel(name)
    ax.set_title(f"{name} curves")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_write(path, "wb") as f:
        fig.savefig(f, format=path.suffix.lstrip(".") or "png")
    plt.close(fig)
    return True


def render_report(
    *,
    results: dict,
    system: dict,
    locks: dict[str, str],
    params: dict[str, Any],
    timings: str,
    plots: list[str],
    title: str = "chatpipe report",
) -> str:
    """The whole report.md as a string."""
    parts = [f"# {title}", ""]
    parts += [
        f"Generated {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; profile `{results.get('profile', '?')}`; "
        f"git commit `{results.get('git_commit', '?')}`.",
        "",
    ]
    parts += [
        "## Summary",
        "",
        summary_table(results),
        "",
        "tiny-world CORE: mean centered accuracy of the synthetic tiny-world in-context tasks; "
        "DCLM CORE: the published CORE metric over the DCLM tasks found (scored like the reference evaluator); "
        "task rows: accuracy (pass@k for generative tasks) with its 95% Wilson "
        "interval and the number of held-out items n; (≈): the change from the previous stage lies within "
        "the 95% noise of the difference, so it is not evidence of a change; ChatCORE: mean centered "
        "accuracy. Blank: not evaluated.",
        "",
        *_stand_in_note(results),
    ]
    prov = provenance_lines(results)
    if prov:
        parts += ["Where each column's numbers came from:", "", *prov, ""]
    skipped = _skipped(results)
    if skipped:
        parts += ["Not evaluated:", "", *skipped, ""]
    parts += ["## System", "", "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in system.items()], ""]
    parts += [
        "## Provenance (dvc.lock)",
        "",
        "| stage | hash |",
        "|---|---|",
        *[f"| {k} | `{v}` |" for k, v in locks.items()],
        "",
    ]
    parts += ["## Wall time and cost", "", timings, ""]
    parts += ["## Per-stage results", ""]
    for col in COLUMNS:
        r = results.get("stages", {}).get(col)
        if not r:
            continue
        parts += [f"### {col.upper()}", "", f"- val bpb: {r['bpb']:.4f}"]
        for key, name in (("core_tinyworld", "tiny-world CORE"), ("core", "DCLM CORE")):
            for label, t in ((r.get(key) or {}).get("tasks") or {}).items():
                parts.append(
                    f"- {name} {label}: accuracy {t['accuracy']:.4f}, centered {t['centered']:+.4f} "
                    f"({t['num_examples']} items)"
                )
        for name, t in ((r.get("chatcore") or {}).get("tasks") or {}).items():
            parts.append(
                f"- {name}: accuracy {t['accuracy']:.4f}, centered {t['centered']:+.4f} ({t['num_examples']} items)"
            )
        parts.append("")
    if plots:
        parts += ["## Curves", "", *[f"![{Path(p).stem}]({p})" for p in plots], ""]
    parts += ["## Params", ""]
    for section, values in params.items():
        parts += [f"### {section}", "", "```yaml", yaml.safe_dump(values, sort_keys=False).rstrip(), "```", ""]
    return "\n".join(parts)


def _stand_in_note(results: dict) -> list[str]:
    # Says what a stand-in row is without naming the benchmark: the report never puts a benchmark's
    # name next to another task's number.
    names = ", ".join(f"`{task}`" for task in stand_ins(results))
    if not names:
        return []
    return [
        f"{names}: stand-ins (such as the tiny world's synthetic tasks), run in the place of benchmarks "
        "this profile does not run; "
        "their numbers say nothing about those benchmarks, and the ChatCORE here averages them in, so it "
        "is not comparable with a ChatCORE over the real tasks.",
        "",
    ]


def _skipped(results: dict) -> list[str]:
    out = []
    for col in COLUMNS:
        r = results.get("stages", {}).get(col) or {}
        for kind in ("core", "core_tinyworld", "chatcore"):
            for name, why in ((r.get(kind) or {}).get("skipped") or {}).items():
                out.append(f"- {col.upper()} {name}: {why}")
    return out


# what each split of RL's pass@k is for: settings may be chosen on val; test is the figure to report
SPLIT_ROLES = {"val": "tuning", "test": "held out", "train": "trained on"}
SPLIT_NOTES = {
    "val": "tuning: settings may be chosen on it",
    "test": "held out: no setting was tuned on it; the figure to report",
    "train": "the split RL trains on",
}


def rl_splits(settings: dict, summary: dict) -> list[tuple[str, str]]:
    """(split, metric prefix) of each split the RL run measured pass@1 on before and after: its
    ``eval_split`` (``eval``) and, where set, its ``test_split`` (``eval_test``)."""
    named = [(settings.get("eval_split") or "val", "eval"), (settings.get("test_split") or "none", "eval_test")]
    return [
        (split, prefix)
        for split, prefix in named
        if split != "none" and f"first_{prefix}/pass_at_1" in summary and f"final_{prefix}/pass_at_1" in summary
    ]


def rl_section(meta: dict, controls: dict | None = None) -> list[str]:
    """Markdown lines for the RL stage's own pass@1 before and after training (from
    ``artifacts/rl/meta.json``) on each split it measured, each labelled with what it is for (val:
    tuning; test: held out), with its 95% interval over the problems; what trained it; the
    replay-only control of ``controls`` (``bench/rl_controls.py``'s ``metrics/rl_controls.json``)
    when it was measured on the same SFT model, on the same split; and the reward-hacking guard's windows."""
    summary, settings = meta.get("summary") or {}, meta.get("settings") or {}
    n = int(settings.get("eval_problems") or 0)
    splits = rl_splits(settings, summary)
    if not splits or n < 1:
        return []
    first = {split: summary[f"first_{prefix}/pass_at_1"] for split, prefix in splits}
    final = {split: summary[f"final_{prefix}/pass_at_1"] for split, prefix in splits}
    replay = "on" if settings.get("replay") and settings.get("replay_coef") else "off"
    reward = settings.get("reward")  # a section since 2026-12-06; a run of before kept rl.reward_source flat
    source = reward.get("source") if isinstance(reward, dict) else settings.get("reward_source")
    named = " and ".join(f"`{split}` ({SPLIT_NOTES.get(split, split)})" for split in first)
    return [
        "## RL pass@1",
        "",
        f"Task `{settings.get('task')}`, {named}, {n} problems each x "
        f"{settings.get('eval_samples')} samples at temperature {settings.get('eval_temperature')}; "
        f"{summary.get('steps')} RL steps of `{settings.get('algorithm')}` on the `{source}` "
        f"reward, chat replay {replay}. Interval: 95% Wilson over problems.",
        "",
        "| | " + " | ".join(f"`{split}` pass@1 ({SPLIT_ROLES.get(split, split)})" for split in first) + " |",
        "|---|" + "---|" * len(first),
        md_row("before RL (sft)", *(accuracy_cell(first[s], n) for s in first)),
        md_row("after RL", *(accuracy_cell(final[s], n, (first[s], n)) for s in first)),
        md_row("change", *(f"{final[s] - first[s]:+.3f}" for s in first)),
        *control_rows(meta, controls, {s: final[s] - first[s] for s in first}),
        "",
        *guard_lines(summary),
    ]


def md_row(*cells: str) -> str:
    return "| " + " | ".join(cells) + " |"


def control_rows(meta: dict, controls: dict | None, change: dict[str, float]) -> list[str]:
    """The replay-only control's change (supervised steps on the replay mixture, no reward) and RL's
    gain over it on the split the control was measured on (``controls["split"]``; before it was
    recorded, val), when ``controls`` were measured on this run's SFT model; else a row saying how."""
    init = (meta.get("inputs") or {}).get("init")
    arms = (controls or {}).get("arms") or {}
    if not controls or controls.get("init") != init or "replay_only" not in arms:
        return ["| replay-only control | not measured on this SFT model (`python bench/rl_controls.py`) |"]
    split = controls.get("split") or "val"
    if split not in change:
        return [f"| replay-only control | measured on `{split}`, which this run did not evaluate |"]
    control = arms["replay_only"]["mean_change"]
    runs = arms["replay_only"]["runs"]
    return [
        f"| replay-only control on `{split}` (mean of {runs} seeds) | {control:+.3f} |",
        f"| RL over the control on `{split}` | {change[split] - control:+.3f} |",
    ]


def guard_lines(summary: dict) -> list[str]:
    """The reward-hacking guard's verdict (runs trained on a reward model's scores)."""
    if "guard_trips" not in summary:
        return []
    trips = int(summary["guard_trips"])
    first = {k: summary.get(f"guard_first_{k}", float("nan")) for k in ("model_mean", "verifier_mean", "accuracy")}
    last = {k: summary.get(f"guard_last_{k}", float("nan")) for k in ("model_mean", "verifier_mean", "accuracy")}
    verdict = f"**tripped {trips} times**" if trips else "never tripped"
    return [
        f"Reward-hacking guard: {verdict}. Rollouts, first window -> last: reward-model score "
        f"{first['model_mean']:.3f} -> {last['model_mean']:.3f}, verifier {first['verifier_mean']:.3f} -> "
        f"{last['verifier_mean']:.3f}, the reward model's accuracy on their verifier-ranked pairs "
        f"{first['accuracy']:.3f} -> {last['accuracy']:.3f}.",
        "",
    ]


def reward_model_section(meta: dict) -> list[str]:
    """Markdown lines for the reward model's held-out pair accuracy and score-margin distribution
    (from ``artifacts/reward_model/meta.json``), with the accuracy's 95% interval over the pairs."""
    summary, settings = meta.get("summary") or {}, meta.get("settings") or {}
    acc, n = summary.get("val_pair_accuracy"), int(summary.get("val_pairs") or 0)
    if acc is None or n < 1:
        return []
    quantiles = [k for k in sorted(summary) if k.startswith("val_margin/q")]
    kinds = [k for k in sorted(summary) if k.startswith("val_pair_accuracy_")]
    lines = [
        "## Reward model",
        "",
        f"Source `{settings.get('source')}`, {summary.get('train_pairs')} train pairs, {n} held-out pairs it never "
        f"trained on; {meta.get('step')} steps from `{settings.get('init_dir')}`. Interval: 95% Wilson over pairs.",
        "",
        "| held-out | value |",
        "|---|---|",
        f"| pair accuracy | {accuracy_cell(acc, n)} |",
        *(f"| pair accuracy, {k.removeprefix('val_pair_accuracy_')} pairs | {summary[k]:.3f} |" for k in kinds),
        f"| margin mean (r_chosen - r_rejected) | {summary.get('val_margin/mean', float('nan')):.3f} |",
        *(f"| margin {k.removeprefix('val_margin/')} | {summary[k]:.3f} |" for k in quantiles),
        "",
    ]
    return lines
