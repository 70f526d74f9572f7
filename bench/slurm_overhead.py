"""Per-stage launch overhead: every stage of the tiny pipeline as a Slurm job vs torchx ``local_cwd``.

    bash scripts/slurm-local.sh up && export SLURM_CONF=/tmp/chatpipe-slurm/etc/slurm.conf
    python bench/slurm_overhead.py [--stages data tokenizer pretrain] [--small]

Two fresh copies of this repo (chatpipe/testing/project.py), the same params and the same math:
- local: ``python -m chatpipe.launch <stage>`` on ``local_cwd`` with the ``slurm`` profile's params,
  multi-process stages as 1 node x 2 gloo processes;
- slurm: the same command under the ``slurm`` profile, multi-process stages as 2 nodes x 1 process
  (a heterogeneous job), one-process stages as one-node jobs.
Stages run in pipeline order, each on both launchers back to back (so a change in load hits both);
each is timed from the launcher's start to its exit (submission, scheduling, rendezvous, the work,
accounting). Printed per stage: both wall times, the
difference (Slurm's launch overhead) and their ratio; the total ratio comes last. Logs go to
bench/out/slurm/.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
OUT = REPO / "bench" / "out" / "slurm"

from chatpipe.settings import STAGES  # noqa: E402
from chatpipe.testing.project import PIPELINE_PARAMS, make_project, project_env  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_stage(stage: str, project: Path, env: dict[str, str], log: Path) -> float:
    """Wall seconds of ``python -m chatpipe.launch <stage>`` in ``project`` (a failure aborts the bench)."""
    t0 = time.perf_counter()
    with log.open("a") as out:
        cmd = [sys.executable, "-m", "chatpipe.launch", stage]
        if subprocess.run(cmd, cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"{stage} failed; see {log}")
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stages", nargs="+", choices=STAGES, default=STAGES)
    p.add_argument("--small", action="store_true", help="the test suite's small params instead of tiny's")
    args = p.parse_args()
    if not os.environ.get("SLURM_CONF") and not Path("/etc/slurm/slurm.conf").exists():
        raise SystemExit("no Slurm cluster: run `bash scripts/slurm-local.sh up` and export SLURM_CONF")
    # tiny as it is (the slurm profile splits its batches over the 2 ranks), or the test suite's small params
    params = dict(PIPELINE_PARAMS) if args.small else {}
    launchers = {
        # the slurm profile's params (batches split over 2 ranks) on local_cwd: only the launch differs
        "local": {
            "CHATPIPE_PROFILE": "slurm",
            "CHATPIPE_LAUNCH__SCHEDULER": "local_cwd",
            "CHATPIPE_LAUNCH__NNODES": "1",
            "CHATPIPE_LAUNCH__NPROC_PER_NODE": "2",
            "CHATPIPE_LAUNCH__RDZV_BACKEND": "c10d",
            "CHATPIPE_LAUNCH__RDZV_PORT": str(free_port()),
        },
        "slurm": {"CHATPIPE_PROFILE": "slurm", "CHATPIPE_LAUNCH__RDZV_PORT": str(free_port())},
    }
    OUT.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, float]] = {name: {} for name in launchers}
    with tempfile.TemporaryDirectory() as tmp:
        runs = {}
        for name, launch_env in launchers.items():
            project = make_project(Path(tmp) / name, params, small=args.small)
            env = project_env(project, **launch_env)
            # one thread per rank on both launchers: the two Slurm "nodes" share this host's cores, and
            # torchrun already gives each of its 2 local processes one thread, so only the launch differs
            env["OMP_NUM_THREADS"] = "1"
            (OUT / f"{name}.log").write_text("")
            runs[name] = (project, env)
        # each stage on both launchers back to back, so a change in the machine's load hits both alike
        for stage in args.stages:
            for name, (project, env) in runs.items():
                results[name][stage] = time_stage(stage, project, env, OUT / f"{name}.log")
            lo, sl = results["local"][stage], results["slurm"][stage]
            print(f"  {stage}: local {lo:.1f} s, slurm {sl:.1f} s", flush=True)
    print(f"{'stage':<10} {'local s':>8} {'slurm s':>8} {'overhead s':>10} {'ratio':>6}")
    for stage in args.stages:
        lo, sl = results["local"][stage], results["slurm"][stage]
        print(f"{stage:<10} {lo:8.1f} {sl:8.1f} {sl - lo:10.1f} {sl / lo:6.2f}")
    total_local, total_slurm = sum(results["local"].values()), sum(results["slurm"].values())
    print(f"{'total':<10} {total_local:8.1f} {total_slurm:8.1f} {total_slurm - total_local:10.1f}")
    print(f"slurm / local_cwd wall time over the pipeline: {total_slurm / total_local:.2f}")


if __name__ == "__main__":
    main()
