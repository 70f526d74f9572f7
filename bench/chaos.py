"""Chaos bench: kill -9 the training workers at random moments, SIGTERM the flow, and check that
every re-run ends with the same weights and leaves nothing behind.

    python bench/chaos.py                       # 10 kills per training stage + 1 flow SIGTERM each
    python bench/chaos.py --trials 2 --flow-trials 0 --stages pretrain   # what the slow test runs

In a throwaway copy of the repo (small params, as chatpipe/testing/project.py), first one uninterrupted
``dvc repro rl`` gives the reference sha256 of artifacts/{base,mid,sft,rl}/model.pt. Then for each
stage and trial: remove the stage's checkpoints and output, start ``dvc repro --single-item
<stage>`` (the command each flow task runs), kill -9 its worker at a random moment (every third
trial: the moment a checkpoint temp dir appears, i.e. during a checkpoint write), re-run it to
completion and check:

- the final model.pt is bitwise the reference's;
- no process left behind (any process whose cwd is the project: launcher, worker, DVC);
- no temp files left (hidden ``.*.tmp*`` / ``.*.old*`` entries under checkpoints/ and artifacts/);
- no MLflow run left RUNNING (read from the sqlite store).

Flow trials SIGTERM ``python -m flows.pipeline --stages <stage>`` at a random moment after its
worker started, then re-run the flow and check the same. Prints one summary line per stage and a
JSON summary (``--json`` writes it to a file).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chatpipe.testing.project import BIN, make_project, processes_in, project_env  # noqa: E402

OUTPUT = {"pretrain": "base", "midtrain": "mid", "sft": "sft", "rl": "rl"}
# Small enough for a shared 2-core machine; checkpoints often, so kills land during writes too.
CHAOS_PARAMS = {
    "pretrain": {"max_steps": 16, "checkpoint_every": 2, "eval_every": 8, "keep_checkpoints": 2},
    "midtrain": {"max_steps": 8, "checkpoint_every": 2},
    "sft": {"max_steps": 8, "checkpoint_every": 2, "eval_prompts": 2, "eval_arith": 2, "eval_max_tokens": 8},
    "rl": {
        "max_steps": 6,
        "num_train_problems": 32,
        "prompts_per_step": 2,
        "group_size": 4,
        "max_new_tokens": 12,
        "eval_every": 3,
        "eval_problems": 4,
        "eval_samples": 1,
        "checkpoint_every": 1,
        "log_every": 1,
    },
}


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def project_procs(project: Path) -> list[psutil.Process]:
    """Live processes running in the project (ours: the project is a fresh temp dir)."""
    return [p for p, _ in processes_in(project)]


def workers(project: Path, stage: str) -> list[psutil.Process]:
    out = []
    for p in project_procs(project):
        try:
            if f"stages.{stage}" in " ".join(p.cmdline()) and "-c" not in p.cmdline()[:2]:
                out.append(p)
        except psutil.Error:
            continue
    return out


def temp_leftovers(project: Path) -> list[str]:
    found = []
    for root in ("checkpoints", "artifacts"):
        base = project / root
        if base.exists():
            for dirpath, dirnames, filenames in os.walk(base):
                for name in dirnames + filenames:
                    if name.startswith(".") and (".tmp" in name or ".old" in name):
                        found.append(str(Path(dirpath, name).relative_to(project)))
    return found


def running_runs(project: Path) -> int:
    db = project / "mlruns" / "mlflow.db"
    if not db.exists():
        return 0
    with sqlite3.connect(db) as con:
        return con.execute("select count(*) from runs where status = 'RUNNING'").fetchone()[0]


def forget_run_cache(project: Path) -> None:
    """Drop DVC's run cache, so a stage whose output is missing runs (and resumes) instead of
    being restored from the reference run's cached output."""
    shutil.rmtree(project / ".dvc" / "cache" / "runs", ignore_errors=True)


def forget_stage(project: Path, stage: str) -> None:
    """Drop ``stage`` from dvc.lock and remove its checkpoints and output, so DVC runs it from
    scratch (otherwise it checks the reference run's output out of its cache)."""
    import yaml

    lock_path = project / "dvc.lock"
    lock = yaml.safe_load(lock_path.read_text())
    lock.get("stages", {}).pop(stage, None)
    lock_path.write_text(yaml.safe_dump(lock, sort_keys=False))
    shutil.rmtree(project / "checkpoints" / stage, ignore_errors=True)
    shutil.rmtree(project / "artifacts" / OUTPUT[stage], ignore_errors=True)


def start(project: Path, *cmd: str) -> subprocess.Popen:
    forget_run_cache(project)
    log = open(project / "logs" / "chaos.log", "ab")  # noqa: SIM115 - closed by the child's exit
    return subprocess.Popen(list(cmd), cwd=project, env=project_env(project), stdout=log, stderr=subprocess.STDOUT)


def repro(project: Path, stage: str, check: bool = True, single: bool = True) -> int:
    proc = start(project, str(BIN / "dvc"), "repro", *(["--single-item"] if single else []), stage)
    rc = proc.wait(timeout=1800)
    if check and rc != 0:
        tail = (project / "logs" / "chaos.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"dvc repro {stage} exited {rc}\n{tail}")
    return rc


def wait_for(predicate, timeout: float, poll: float = 0.005) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return False


def newest_step(project: Path, stage: str) -> int:
    """Highest complete checkpoint step of the stage so far (-1: none)."""
    ckpt = project / "checkpoints" / stage
    steps = [int(p.name[5:]) for p in ckpt.glob("step_*") if p.name[5:].isdigit()] if ckpt.exists() else []
    return max(steps, default=-1)


def kill_trial(project: Path, stage: str, rng: random.Random, during_write: bool) -> dict:
    """kill -9 of the stage's worker, then a clean re-run; returns what happened.

    The moment: the instant a checkpoint temp dir appears (``during_write``), or a random point of
    training: once the newest checkpoint reaches a random step (0: right after the worker starts),
    plus up to a second. A run that ends before the moment is retried (up to 3 times), so a
    trial is a kill unless the stage keeps finishing first.
    """
    every, total = CHAOS_PARAMS[stage]["checkpoint_every"], CHAOS_PARAMS[stage]["max_steps"]
    for _attempt in range(3):
        forget_stage(project, stage)
        proc = start(project, str(BIN / "dvc"), "repro", "--single-item", stage)
        killed, moment = False, ""
        started = wait_for(lambda proc=proc: workers(project, stage) or proc.poll() is not None, 300, poll=0.05)
        if started and proc.poll() is None:
            ckpt = project / "checkpoints" / stage
            if during_write:
                wait_for(lambda c=ckpt: c.exists() and any(p.name.startswith(".step_") for p in c.iterdir()), 300)
                moment = "checkpoint write"
            else:
                target = rng.randrange(0, total, every)  # 0, every, 2*every, ... below the last step
                extra = rng.uniform(0.0, 1.0)
                wait_for(
                    lambda t=target, proc=proc: t == 0 or newest_step(project, stage) >= t or proc.poll() is not None,
                    300,
                    poll=0.02,
                )
                time.sleep(extra)
                moment = f"{extra:.2f}s after checkpoint {target}" if target else f"{extra:.2f}s after worker start"
            for w in workers(project, stage):
                try:
                    w.kill()
                    killed = True
                except psutil.Error:
                    pass
        proc.wait(timeout=300)
        if killed:
            break
        repro(project, stage)  # finished first: let the stage complete, then try again
    resumed = newest_step(project, stage) > 0
    repro(project, stage)
    return {"killed": killed, "moment": moment, "resumed": resumed and killed}


def flow_trial(project: Path, stage: str, rng: random.Random, expected_s: float) -> dict:
    """SIGTERM the Prefect flow while the stage's worker runs, then re-run the flow."""
    forget_stage(project, stage)
    cmd = (str(BIN / "python"), "-m", "flows.pipeline", "--stages", stage)
    proc = start(project, *cmd)
    killed = False
    if wait_for(lambda: workers(project, stage), 600, poll=0.05):
        wait_for(lambda: proc.poll() is not None, rng.uniform(0.0, 0.6 * expected_s), poll=0.05)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            killed = True
    proc.wait(timeout=300)
    rerun = start(project, *cmd)
    if rerun.wait(timeout=1800) != 0:
        raise RuntimeError(f"flow re-run for {stage} failed; see {project / 'logs' / 'chaos.log'}")
    return {"killed": killed, "moment": "flow SIGTERM", "resumed": killed}


def check(project: Path, stage: str, reference: dict[str, str]) -> dict:
    time.sleep(0.5)  # let killed processes be reaped
    left = project_procs(project)
    return {
        "identical": sha(project / "artifacts" / OUTPUT[stage] / "model.pt") == reference[stage],
        "procs_left": [" ".join(p.cmdline())[:120] for p in left],
        "temps_left": temp_leftovers(project),
        "runs_running": running_runs(project),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=10, help="worker kill -9 trials per stage")
    ap.add_argument("--flow-trials", type=int, default=1, help="flow SIGTERM trials per stage")
    ap.add_argument("--stages", nargs="+", default=list(OUTPUT), choices=list(OUTPUT))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the summary here")
    ap.add_argument("--keep", action="store_true", help="keep the temp project")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped bench still cleans up below
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="chatpipe-chaos-"))
    project = make_project(tmp, CHAOS_PARAMS)
    (project / "logs").mkdir(exist_ok=True)
    summary: dict = {"stages": {}}
    try:
        last = max(args.stages, key=list(OUTPUT).index)
        t0 = time.monotonic()
        repro(project, "tokenizer", single=False)
        durations = {}
        for stage in OUTPUT:  # uninterrupted reference, stage by stage, timed
            if list(OUTPUT).index(stage) > list(OUTPUT).index(last):
                break
            t = time.monotonic()
            repro(project, stage)
            durations[stage] = time.monotonic() - t
        reference = {s: sha(project / "artifacts" / OUTPUT[s] / "model.pt") for s in durations}
        summary["reference_seconds"] = round(time.monotonic() - t0, 1)
        for stage in args.stages:
            rows = []
            for i in range(args.trials + args.flow_trials):
                if i < args.trials:
                    row = kill_trial(project, stage, rng, during_write=i % 3 == 2)
                else:
                    row = flow_trial(project, stage, rng, expected_s=durations[stage])
                row.update(check(project, stage, reference))
                rows.append(row)
                print(f"{stage} trial {i + 1}: {row}", flush=True)
            s = {
                "trials": len(rows),
                "kills": sum(r["killed"] for r in rows),
                "during_checkpoint_write": sum(r["moment"] == "checkpoint write" for r in rows),
                "flow_sigterms": sum(r["moment"] == "flow SIGTERM" and r["killed"] for r in rows),
                "resumes": sum(r["resumed"] for r in rows),
                "identical_finals": sum(r["identical"] for r in rows),
                "procs_left": sum(len(r["procs_left"]) for r in rows),
                "temps_left": sum(len(r["temps_left"]) for r in rows),
                "runs_left_running": max((r["runs_running"] for r in rows), default=0),
                "stage_seconds": round(durations[stage], 1),
            }
            summary["stages"][stage] = s
            print(f"== {stage}: {s}", flush=True)
        summary["seconds"] = round(time.monotonic() - t0, 1)
    finally:
        for p in project_procs(project):  # never leave anything of ours behind, even on error
            try:
                p.kill()
            except psutil.Error:
                pass
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
