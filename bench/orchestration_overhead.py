"""Orchestration overhead: the pipeline through Prefect -> DVC -> torchx vs the stages called directly.

    python bench/orchestration_overhead.py [--stages data tokenizer pretrain] [--max-steps N]

Both runs start from a fresh copy of this repo (git + DVC initialised, same params):
- orchestrated: ``python -m flows.pipeline --stages ...`` (temporary Prefect server, ``dvc repro``
  per stage, torchx ``local_cwd`` launch, torchrun worker);
- direct: ``python -m stages.<stage>`` for each stage, one process each.
Prints both wall times and their ratio last (goal <= 1.10).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.project import make_project, project_env  # noqa: E402


def timed(project: Path, *cmds: list[str]) -> float:
    """Wall seconds to run ``cmds`` one after the other in ``project`` (any failure aborts)."""
    env = project_env(project)
    env.pop("OMP_NUM_THREADS")  # use every core, as a user would
    t0 = time.perf_counter()
    for cmd in cmds:
        subprocess.run(cmd, cwd=project, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", nargs="+", default=["data", "tokenizer", "pretrain"])
    p.add_argument("--max-steps", type=int, default=0, help="override pretrain.max_steps (0: keep params.yaml)")
    args = p.parse_args()
    overlay = {"pretrain": {"max_steps": args.max_steps}} if args.max_steps else {}
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        # keep the real `tiny` params (make_project would shrink them), except the optional step override
        direct_dir = make_project(Path(tmp) / "direct", overlay, small=False)
        flow_dir = make_project(Path(tmp) / "flow", overlay, small=False)
        direct = timed(direct_dir, *[[py, "-m", f"stages.{s}"] for s in args.stages])
        flow = timed(flow_dir, [py, "-m", "flows.pipeline", "--stages", *args.stages])
    print(f"stages: {' '.join(args.stages)}")
    print(f"direct (python -m stages.<stage>):      {direct:7.1f} s")
    print(f"orchestrated (Prefect -> DVC -> torchx): {flow:7.1f} s")
    print(f"ratio orchestrated/direct: {flow / direct:.3f}")


if __name__ == "__main__":
    main()
