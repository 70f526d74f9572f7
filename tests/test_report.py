"""report.md pieces: the summary table, provenance, timings, MLflow run lookup and plots."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from chatpipe.report import (
    format_seconds,
    plot_curves,
    provenance_lines,
    render_report,
    stage_runs,
    summary_table,
    summary_values,
    timing_table,
)

RESULTS = {
    "git_commit": "abc123",
    "profile": "tiny",
    "stages": {
        "base": {
            "bpb": 1.25,
            "git_commit": "abc123",
            "dvc_lock": "lock1",
            "dvc_stage_hash": "pre1",
            "model_sha256": "f" * 64,
            "core_tinyworld": {"core": 0.7907, "tasks": {}, "skipped": {}},
            "core": {
                "core": 0.4321,
                "tasks": {"copa": {"accuracy": 0.7, "centered": 0.4, "num_examples": 50}},
                "skipped": {"hellaswag": "data file not found: x/hellaswag.jsonl"},
            },
        },
        "sft": {
            "bpb": 1.5,
            "git_commit": "abc123",
            "dvc_lock": "lock1",
            "dvc_stage_hash": "sft1",
            "model_sha256": "e" * 64,
            "chatcore": {
                "chatcore": 0.1,
                "skipped": {},
                "tasks": {
                    "ARC-Easy": {"accuracy": 0.4, "centered": 0.2, "num_examples": 50},
                    "GSM8K": {"accuracy": 0.05, "centered": 0.05, "num_examples": 8},
                },
            },
        },
    },
}


def test_summary_table_has_every_row_and_column_and_blanks_for_missing() -> None:
    table = summary_table(RESULTS).splitlines()
    assert table[0] == "| metric | BASE | MID | SFT | RL |"
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table[2:]}
    assert list(rows) == [
        "tiny-world CORE",
        "DCLM CORE",
        "ARC-E",
        "ARC-C",
        "MMLU",
        "GSM8K",
        "HumanEval",
        "SpellingBee",
        "ChatCORE",
    ]
    assert rows["DCLM CORE"] == ["0.4321", "", "", ""]
    assert rows["tiny-world CORE"] == ["0.7907", "", "", ""]
    # accuracy, 95% Wilson interval, n: 20/50 -> [0.28, 0.54]; 0.05 of 8 -> centre 0.196 +- 0.192
    assert rows["ARC-E"] == ["", "", "0.400 [0.28, 0.54] n=50", ""]
    assert rows["GSM8K"] == ["", "", "0.050 [0.00, 0.39] n=8", ""]
    assert rows["ChatCORE"] == ["", "", "0.1000", ""]
    assert rows["MMLU"] == ["", "", "", ""]
    assert summary_values(RESULTS)["DCLM CORE"]["sft"] is None


def test_changes_within_noise_are_marked() -> None:
    def stage(acc: float, n: int) -> dict:
        return {
            "chatcore": {"chatcore": 0.0, "tasks": {"GSM8K": {"accuracy": acc, "centered": acc, "num_examples": n}}}
        }

    # the "regression" 0.375 -> 0.25 on 8 items is noise; 0.30 -> 0.60 on 256 items is not
    small = {"stages": {"sft": stage(0.375, 8), "rl": stage(0.25, 8)}}
    big = {"stages": {"sft": stage(0.30, 256), "rl": stage(0.60, 256)}}
    row = next(line for line in summary_table(small).splitlines() if line.startswith("| GSM8K |"))
    assert row.endswith("| 0.375 [0.14, 0.69] n=8 | 0.250 [0.07, 0.59] n=8 (≈) |")
    row = next(line for line in summary_table(big).splitlines() if line.startswith("| GSM8K |"))
    assert "(≈)" not in row


def _chat_stage(tasks: dict[str, tuple[float, int, str | None]]) -> dict:
    """A stage's results as the eval stage writes them: {label: (accuracy, n, benchmark stood in for)}."""
    out = {}
    for label, (acc, n, stands_in_for) in tasks.items():
        out[label] = {"accuracy": acc, "centered": acc, "num_examples": n}
        if stands_in_for:
            out[label]["stands_in_for"] = stands_in_for
    return {"bpb": 1.0, "chatcore": {"chatcore": 0.5, "tasks": out, "skipped": {}}}


def test_a_stand_in_is_labelled_with_its_own_name_and_a_real_benchmark_with_its() -> None:
    tiny = {
        "profile": "tiny",
        "stages": {
            "sft": _chat_stage(
                {"ARC-Easy": (0.3, 50, None), "tinyworld_mc": (0.9, 50, "MMLU"), "tinyworld_gsm": (0.99, 100, "GSM8K")}
            )
        },
    }
    rows = [line.split("|")[1].strip() for line in summary_table(tiny).splitlines()[2:]]
    assert rows == [
        "tiny-world CORE",
        "DCLM CORE",
        "ARC-E",
        "ARC-C",
        "tinyworld_mc",
        "tinyworld_gsm",
        "HumanEval",
        "SpellingBee",
        "ChatCORE",
    ]
    assert summary_values(tiny)["tinyworld_gsm"]["sft"] == 0.99
    md = render_report(results=tiny, system={}, locks={}, params={}, timings="", plots=[])
    assert "GSM8K" not in md and "MMLU" not in md
    assert "| tinyworld_gsm |" in md and "- tinyworld_gsm: accuracy 0.9900" in md
    assert "`tinyworld_mc`, `tinyworld_gsm`: stand-ins" in md

    real = {"profile": "speedrun", "stages": {"sft": _chat_stage({"GSM8K": (0.05, 1319, None)})}}
    table = summary_table(real)
    assert "| GSM8K |" in table and "tinyworld" not in table
    md = render_report(results=real, system={}, locks={}, params={}, timings="", plots=[])
    assert "- GSM8K: accuracy 0.0500" in md and "stand-in" not in md


def test_every_column_names_its_commit_and_lock_hash() -> None:
    lines = provenance_lines(RESULTS)
    assert len(lines) == 2
    assert "BASE" in lines[0] and "abc123" in lines[0] and "lock1" in lines[0] and "pre1" in lines[0]
    assert "SFT" in lines[1] and "sft1" in lines[1] and "eeeeeeeeeeee" in lines[1]


def _run(run_id: str, start: int, end: int | None, metrics: dict | None = None, tags: dict | None = None):
    return SimpleNamespace(
        info=SimpleNamespace(run_id=run_id, start_time=start, end_time=end, run_name="x"),
        data=SimpleNamespace(metrics=metrics or {}, tags=tags or {}),
    )


def test_timing_table_and_cost() -> None:
    runs = {"pretrain": _run("aaaaaaaa1", 0, 3_600_000), "eval": _run("bbbbbbbb2", 0, 90_000)}
    table, total, cost = timing_table(runs, cost_per_hour=24.0)
    assert total == pytest.approx(3690.0) and cost == pytest.approx(24.6)
    assert "| pretrain | 1h 00m 00s | 24.00 | `aaaaaaaa` |" in table
    assert "| eval | 1m 30s | 0.60 |" in table
    assert format_seconds(4.24) == "4.2s"


def test_render_report_sections() -> None:
    md = render_report(
        results=RESULTS,
        system={"cpu": "test cpu", "torch": "2.13"},
        locks={"dvc.lock": "lock1"},
        params={"eval": {"max_per_task": 50}},
        timings="(timings)",
        plots=["loss.png"],
    )
    for needle in (
        "## Summary",
        "| DCLM CORE | 0.4321 |",
        "| tiny-world CORE | 0.7907 |",
        "## System",
        "test cpu",
        "## Provenance",
        "`lock1`",
        "(timings)",
        "![loss](loss.png)",
        "max_per_task: 50",
        "hellaswag: data file not found",
        "val bpb: 1.2500",
        "GSM8K: accuracy 0.0500",
    ):
        assert needle in md, needle


def test_stage_runs_and_plots_from_a_real_mlflow_store(tmp_path: Path, monkeypatch) -> None:
    import mlflow

    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    exp = mlflow.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    client = mlflow.MlflowClient()
    parent = client.create_run(exp, run_name="pipeline").info.run_id
    old = client.create_run(exp, run_name="pretrain", tags={"stage": "pretrain"}).info.run_id  # an earlier run
    for step, loss in enumerate([4.0, 3.0, 2.5]):
        client.log_metric(old, "train/loss", loss, step=step)
    client.set_terminated(old)
    nested = client.create_run(exp, run_name="eval", tags={"stage": "eval", "mlflow.parentRunId": parent})
    client.log_metric(nested.info.run_id, "base/bpb", 1.0)  # one point: not a curve
    client.set_terminated(nested.info.run_id)

    runs = stage_runs(client, exp, parent)
    assert list(runs) == ["pretrain", "eval"]  # pipeline order; pretrain falls back to its newest run
    assert runs["eval"].info.run_id == nested.info.run_id and runs["pretrain"].info.run_id == old

    assert plot_curves(client, runs, "loss", tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plot_curves(client, runs, "bpb", tmp_path / "bpb.png")  # single points only
    assert not (tmp_path / "bpb.png").exists()


def test_rl_section_shows_pass_at_1_before_and_after_with_intervals() -> None:
    from chatpipe.report import rl_section

    meta = {
        "settings": {"task": "tinyworld_arith", "eval_split": "val", "eval_problems": 256, "eval_samples": 4},
        "summary": {"steps": 20, "first_eval/pass_at_1": 0.30, "final_eval/pass_at_1": 0.45},
    }
    md = "\n".join(rl_section(meta))
    assert "| before RL (sft) | 0.300 [0.25, 0.36] n=256 |" in md
    assert "| after RL | 0.450 [0.39, 0.51] n=256 |" in md  # 0.15 on 256 problems: not marked as noise
    assert "| change | +0.150 |" in md
    assert rl_section({"summary": {}}) == []


def test_rl_section_labels_val_as_tuning_and_test_as_held_out_and_compares_controls_on_one_split() -> None:
    from chatpipe.report import rl_section

    settings = {"task": "tinyworld_arith", "eval_split": "val", "test_split": "test", "eval_problems": 256}
    summary = {"steps": 20, "first_eval/pass_at_1": 0.30, "final_eval/pass_at_1": 0.45}
    summary |= {"first_eval_test/pass_at_1": 0.32, "final_eval_test/pass_at_1": 0.40}
    meta = {"inputs": {"init": "abc"}, "settings": settings, "summary": summary}
    md = "\n".join(rl_section(meta))
    assert "| | `val` pass@1 (tuning) | `test` pass@1 (held out) |" in md
    assert "| after RL | 0.450 [0.39, 0.51] n=256 | 0.400 [0.34, 0.46] n=256 (≈) |" in md  # +0.08: within noise
    assert "| change | +0.150 | +0.080 |" in md
    assert "`test` (held out: no setting was tuned on it; the figure to report)" in md
    # the bench's controls are compared on their own split: test here, so RL's test change
    controls = {"init": "abc", "split": "test", "arms": {"replay_only": {"mean_change": 0.05, "runs": 3}}}
    md = "\n".join(rl_section(meta, controls))
    assert "| replay-only control on `test` (mean of 3 seeds) | +0.050 |" in md
    assert "| RL over the control on `test` | +0.030 |" in md
    # controls of before (no split: they were measured on val) against a run without that split
    only_test = {**meta, "settings": {**settings, "eval_split": "train"}}
    md = "\n".join(rl_section(only_test, {**controls, "split": None}))
    assert "| replay-only control | measured on `val`, which this run did not evaluate |" in md


def test_report_credits_only_the_runs_that_produced_the_artifacts(tmp_path: Path, monkeypatch) -> None:
    """issue 15 item 4: a newer FAILED or killed (RUNNING) run never stands in for the producing one."""
    import json

    import mlflow

    from chatpipe.report import artifact_runs

    monkeypatch.chdir(tmp_path)
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    exp = mlflow.create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    client = mlflow.MlflowClient()

    def make(stage: str, status: str | None) -> str:
        run_id = client.create_run(exp, run_name=stage, tags={"stage": stage}).info.run_id
        if status:
            client.set_terminated(run_id, status=status)
        return run_id

    producing_pretrain = make("pretrain", "FINISHED")
    make("pretrain", "FAILED")
    make("pretrain", None)  # killed: still RUNNING
    good_tokenizer = make("tokenizer", "FINISHED")
    make("tokenizer", "FAILED")
    producing_eval = make("eval", "FINISHED")
    make("eval", None)
    artifacts = tmp_path / "artifacts"
    for name, doc in (
        ("base/meta.json", {"mlflow_run_id": producing_pretrain}),
        ("eval/results.json", {"mlflow_run_id": producing_eval}),
        ("mid/meta.json", {}),  # written without tracking: no run to credit
    ):
        (artifacts / name).parent.mkdir(parents=True, exist_ok=True)
        (artifacts / name).write_text(json.dumps(doc))

    runs = artifact_runs(client, exp, artifacts)
    assert {s: r.info.run_id for s, r in runs.items()} == {
        "tokenizer": good_tokenizer,
        "pretrain": producing_pretrain,
        "eval": producing_eval,
    }
