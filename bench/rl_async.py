"""Asynchronous RL against synchronous RL: the RL stage's wall time and held-out pass@1, side by side.

Runs the RL stage through ``python -m chatpipe.launch rl`` (as DVC does) on the default pipeline's
SFT model, once synchronously (one process, every core) and once per ``--staleness`` with the
rollout role (``rl.rollout.role``: the role on ``rollout.threads`` cores, the trainer on the rest),
each seed in turn, one run at a time. Prints one markdown row per run: the stage's wall time and its
ratio to the synchronous run of the same seed, the first and final pass@1 on ``test`` (held out;
``val``'s change, the tuning split, beside it), and where each role spent its time (the trainer's
share waiting for rollouts, the role's share waiting for weights), then the mean ratio and test
pass@1 change per setting. Every run starts in a new dir under ``--workdir``.

    python bench/rl_async.py --seeds 1 2 3 --staleness 1 2
    python bench/rl_async.py --seeds 1 --staleness 1 -- --max_steps=20     # extra stages.rl flags
    python bench/rl_async.py --seeds 1 --staleness 1 --bound               # and the best two roles could do
    python bench/rl_async.py --seeds 1 --staleness 3 --workers 1 2 4 -- --rollout.threads=2   # N rollout workers

With ``--workers`` each asynchronous setting runs once per count (``rl.rollout.workers``; each worker
on ``rollout.threads`` cores, the trainer on the rest: on 16 cores and 2 threads a worker, 4 workers
leave the trainer 8; ``--staleness`` at least workers - 1, or the bound keeps the extra workers
waiting). The ``rollout tok/s`` column is one worker's sampling rate (tokens over the
seconds it sampled) and, after the slash, the rate the trainer received them at (every step's tokens
over the seconds of the steps, waits included): what N workers sampling different steps at once
deliver, which the update bounds. A synchronous run's are its sampling rate and the same over its steps.

With ``--bound`` each seed also runs synchronously on one thread, and the bench prints what no split
of this run over two one-core roles can beat: the synchronous run's time outside its steps (startup,
the evaluations, the save) plus the one-thread sampling and update seconds, either as a fixed split
runs them (sampling on one core, the update on the other: their maximum) or as evenly as any split
could (their mean). The trainer borrowing the role's core while the role waits for weights
(``rl.rollout.lend_cores``, on by default) is not a fixed split: it can pass the first bound, not the second.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from rl_controls import TEST, VAL, project_dir, stage_env  # pass@1's keys; a fresh dir a run; its env

REPO = Path(__file__).resolve().parents[1]
LINKED = ("tokenizer", "sft")  # what these runs read (the reward model's link is left dangling if absent)


def run(workdir: Path, seed: int, staleness: int | None, extra: list[str], threads: int = 0, workers: int = 1) -> dict:
    """One RL stage run (``staleness`` None: synchronous, else with ``workers`` rollout workers; ``threads``
    > 0: that many intra-op threads, else the launcher's split of the cores); its wall time, summary and
    async means."""
    name = f"seed{seed}_" + ("sync" if staleness is None else f"async{staleness}") + (f"_{threads}t" if threads else "")
    name += f"_{workers}w" if staleness is not None and workers > 1 else ""
    project = project_dir({"dir": str(workdir / name)})  # a fresh dir: no run resumes another's checkpoint
    flags = [f"--seed={seed}", "--log_every=1", *extra]
    if staleness is not None:
        flags += ["--rollout.role=true", f"--rollout.max_staleness={staleness}", f"--rollout.workers={workers}"]
    env = stage_env(**({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    t0 = time.perf_counter()
    with (project / "rl.log").open("w") as log:
        cmd = [sys.executable, "-m", "chatpipe.launch", "rl", "--", *flags]
        code = subprocess.run(cmd, cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    text = (project / "rl.log").read_text()
    if code:
        return {"name": name, "seed": seed, "staleness": staleness, "workers": workers, "error": text[-2000:]}
    meta = json.loads((project / "artifacts" / "rl" / "meta.json").read_text())
    means = {k: mean_logged(text, k) for k in ("async/trainer_idle", "async/rollout_idle", "async/staleness")}
    summary = meta["summary"]
    steps_seconds = summary["gen_seconds"] + summary["train_seconds"]  # the trainer's waits for rollouts included
    means["delivered_tokens_per_s"] = summary["rollout_tokens"] / max(steps_seconds, 1e-9)
    out = {"name": name, "seed": seed, "staleness": staleness, "workers": workers, "wall": wall}
    return out | {"summary": summary, **means}


def mean_logged(log: str, key: str) -> float | None:
    values = [float(v) for v in re.findall(rf"{re.escape(key)} ([-0-9.e]+)", log)]
    return sum(values) / len(values) if values else None


def row(r: dict, sync_wall: float | None) -> str:
    if "error" in r:
        return f"| {r['name']} | failed: {r['error'][-300:]!r} |"
    s = r["summary"]
    first, final = s[f"first_{TEST}"], s[f"final_{TEST}"]
    val_change = s[f"final_{VAL}"] - s[f"first_{VAL}"]
    ratio = f"{r['wall'] / sync_wall:.2f}" if sync_wall else "-"
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    cells = [r["name"], f"{r['wall']:.0f}", ratio, f"{first:.4f}", f"{final:.4f}", f"{final - first:+.4f}"]
    cells.append(f"{val_change:+.4f}")
    cells += [fmt(r["async/staleness"]), fmt(r["async/trainer_idle"]), fmt(r["async/rollout_idle"])]
    cells.append(f"{s['rollout_tokens_per_s']:,.0f} / {r['delivered_tokens_per_s']:,.0f}")
    return "| " + " | ".join(cells) + " |"


def bound_line(sync: dict, one_thread: dict) -> str:
    """The walls no two-role split can beat (``--bound``), from a synchronous run on every core and one
    on a single thread, each as a share of the synchronous wall."""
    if "error" in sync or "error" in one_thread:
        return f"seed {sync['seed']}: no bound (a run failed)"
    s, s1 = sync["summary"], one_thread["summary"]
    outside = sync["wall"] - s["gen_seconds"] - s["train_seconds"]  # startup, evaluations, save
    gen1, upd1 = s1["gen_seconds"], s1["train_seconds"]
    this_split, even_split = outside + max(gen1, upd1), outside + (gen1 + upd1) / 2
    return (
        f"seed {sync['seed']}: sync {sync['wall']:.0f} s = outside the steps {outside:.1f} + sampling "
        f"{s['gen_seconds']:.1f} + update {s['train_seconds']:.1f}; one thread: sampling {gen1:.1f}, update "
        f"{upd1:.1f}; best with this split {this_split:.1f} s ({this_split / sync['wall']:.2f}), "
        f"with an even split {even_split:.1f} s ({even_split / sync['wall']:.2f})"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--staleness", type=int, nargs="+", default=[1], help="max_staleness of the async runs")
    p.add_argument("--workdir", type=Path, default=REPO / "artifacts" / "bench_rl_async")
    p.add_argument("--workers", type=int, nargs="+", default=[1], help="rollout workers of each async run")
    p.add_argument("--bound", action="store_true", help="also a one-thread synchronous run per seed, and the bound")
    p.add_argument("rl_args", nargs="*", help="extra stages.rl flags for every run, e.g. --max_steps=40")
    args = p.parse_args()
    args.workdir = args.workdir / time.strftime("%Y%m%d-%H%M%S")  # this invocation's runs, each in a new dir
    missing = [a for a in LINKED if not (REPO / "artifacts" / a).is_dir()]
    if missing:
        sys.exit(f"artifacts/{', artifacts/'.join(missing)} missing: run the pipeline (python -m flows.pipeline) first")
    print("| run | wall s | / sync | test pass@1, first | test, final | test, change | val (tuning) change "
          "| staleness | trainer waits | role waits | rollout tok/s, a worker / delivered |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    results, bounds = [], []
    for seed in args.seeds:
        sync = run(args.workdir, seed, None, args.rl_args)
        print(row(sync, None), flush=True)
        results.append(sync)
        for k in args.staleness:
            for workers in args.workers:
                results.append(run(args.workdir, seed, k, args.rl_args, workers=workers))
                print(row(results[-1], sync.get("wall")), flush=True)
        if args.bound:
            bounds.append(bound_line(sync, run(args.workdir, seed, None, args.rl_args, threads=1)))
    print()
    for line in bounds:
        print(line)
    syncs = {r["seed"]: r for r in results if r["staleness"] is None and "error" not in r}
    for k, workers in [(None, 1), *((k, w) for k in args.staleness for w in args.workers)]:
        done = [r for r in results if (r["staleness"], r["workers"]) == (k, workers) and "error" not in r]
        ratios = [r["wall"] / syncs[r["seed"]]["wall"] for r in done if r["seed"] in syncs]
        change = [r["summary"][f"final_{TEST}"] - r["summary"][f"first_{TEST}"] for r in done]
        label = "synchronous" if k is None else f"max_staleness {k}" + (f", {workers} workers" if workers > 1 else "")
        if done:
            print(
                f"{label}: {len(done)} seeds, wall / sync {sum(ratios) / len(ratios):.2f}, "
                f"mean test pass@1 change {sum(change) / len(change):+.4f}"
            )


if __name__ == "__main__":
    main()
