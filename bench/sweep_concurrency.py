"""Sweep concurrency: the same points trained one at a time and two at a time, on the cores there are.

    python bench/sweep_concurrency.py [--sweep sweeps/isoflop_tiny.yaml] [--flops 3e11] [--depths 1 2]
                                      [--concurrency 1 2]

The sweep file's grid is cut to one FLOP budget and the given depths, then run as a user would
(``python -m flows.sweep``, a temporary Prefect server, MLflow on, no ``OMP_NUM_THREADS``) once per
concurrency, in a fresh copy of this repo. Every run gets its own runs directory; the data and
tokenizer (the shared prep, the same for every concurrency) are made by the first run and copied
into the others, so the runs differ only in how their points train. Printed per concurrency: the
points' wall time (first point's start to last point's end, from the results table), the whole
flow's wall time, each point's ``train_seconds`` and the intra-op threads its process chose; then
the ratio of the points' wall times, concurrency 1 over each other (> 1: running more at once pays).
Logs go to bench/out/sweep_concurrency/.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
OUT = REPO / "bench" / "out" / "sweep_concurrency"

from chatpipe.testing.project import make_project, project_env  # noqa: E402


def cut_sweep(source: Path, flops: float, depths: list[int], concurrency: int) -> dict:
    """The sweep file with its grid cut to one budget and ``depths``, run ``concurrency`` at a time."""
    sweep = yaml.safe_load(source.read_text())
    sweep["grid"] = {"pretrain.target_flops": [flops], "pretrain.depth": list(depths)}
    sweep["concurrency"] = concurrency
    sweep["metrics"] = sorted({*sweep.get("metrics", []), "pretrain.train_seconds"})
    return sweep


def reuse_prep(done_runs: Path | None, runs: Path) -> None:
    """Copy the shared prep (and code snapshot) an earlier run made, so this run only trains points."""
    if done_runs is None:
        return
    runs.mkdir(parents=True, exist_ok=True)
    for made in [*done_runs.glob("prep-*"), *done_runs.glob("code-*")]:
        shutil.copytree(made, runs / made.name, symlinks=True)


def run_sweep(project: Path, sweep: dict, runs: Path, log: Path) -> float:
    """Run the sweep in ``project``; returns the flow's wall seconds (a failure aborts, naming the log)."""
    path = project / f"sweep-c{sweep['concurrency']}.yaml"
    path.write_text(yaml.safe_dump(sweep, sort_keys=False))
    env = project_env(project, PREFECT_LOGGING_LEVEL="INFO")
    env.pop("OMP_NUM_THREADS")  # as a user runs it: each point's threads are the flow's to choose
    cmd = [sys.executable, "-m", "flows.sweep", path.name, "--runs-dir", str(runs)]
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("w") as out:
        if subprocess.run(cmd, cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"{' '.join(cmd)} failed; see {log}")
    return time.perf_counter() - t0


def points_summary(runs: Path, name: str) -> dict:
    """The points' wall time (first start to last end), and each point's train_seconds and threads."""
    rows = [r for r in csv.DictReader((runs / f"{name}-results" / "results.csv").open()) if r["status"] == "trained"]
    if not rows:
        raise SystemExit(f"{runs}: no point was trained (all cached?)")
    starts, ends = [float(r["start"]) for r in rows], [float(r["end"]) for r in rows]
    points = {}
    for r in rows:
        log = Path(r["dir"]) / "logs" / "sweep-pretrain.log"
        threads = [
            line.split("intra-op threads: ")[1].split()[0] for line in log.open() if "intra-op threads: " in line
        ]
        points[r["point"]] = {"train_seconds": float(r["pretrain.train_seconds"]), "threads": threads[:1]}
    return {"points_wall": max(ends) - min(starts), "points": points}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sweep", type=Path, default=REPO / "sweeps" / "isoflop_tiny.yaml")
    p.add_argument("--flops", type=float, default=3.0e11)
    p.add_argument("--depths", type=int, nargs="+", default=[1, 2])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2])
    args = p.parse_args()
    print(f"cores: {len(os.sched_getaffinity(0))}", flush=True)
    results, done_runs = {}, None
    with tempfile.TemporaryDirectory(prefix="sweep-concurrency-") as tmp:
        project = make_project(Path(tmp) / "proj", small=False)
        for c in args.concurrency:
            sweep = cut_sweep(args.sweep, args.flops, args.depths, c)
            runs = Path(tmp) / f"runs-c{c}"
            reuse_prep(done_runs, runs)
            flow_wall = run_sweep(project, sweep, runs, OUT / f"c{c}.log")
            results[c] = {**points_summary(runs, sweep["name"]), "flow_wall": flow_wall}
            done_runs = runs
            r = results[c]
            print(f"concurrency {c}: points {r['points_wall']:.1f} s, flow {flow_wall:.1f} s", flush=True)
            for point, info in r["points"].items():
                print(f"  {point}: train_seconds {info['train_seconds']:.1f}, threads {info['threads']}", flush=True)
    base = results[args.concurrency[0]]["points_wall"]
    for c in args.concurrency[1:]:
        print(f"points wall, concurrency {args.concurrency[0]} / {c}: {base / results[c]['points_wall']:.2f}x")


if __name__ == "__main__":
    main()
