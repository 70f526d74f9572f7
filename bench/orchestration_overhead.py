"""Orchestration overhead: the pipeline through Prefect -> DVC -> torchx vs the stages called directly.

    python bench/orchestration_overhead.py [--stages data tokenizer pretrain] [--max-steps N] [--repeats N]

Default: the whole ``tiny`` pipeline (every stage of dvc.yaml). Each run starts from a fresh copy
of this repo (git + DVC initialised, same params):
- orchestrated: ``python -m flows.pipeline --stages ...`` (temporary Prefect server, ``dvc repro``
  per stage, torchx ``local_cwd`` launch of the stage's worker);
- direct: ``python -m stages.<stage>`` for each stage, one process each.
With ``--repeats`` the two alternate which goes first, so drift in machine load cancels. Both
runs must produce the same final weights. Also printed: the orchestrated wall time over the sum of
its stage apps' own wall times (from the launcher's log lines), the overhead seen inside one run.
Logs go to bench/out/orchestration/. The ratio of the wall-time sums comes last (goal <= 1.10).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
OUT = REPO / "bench" / "out" / "orchestration"  # each run's full log (git-ignored)
STAGES = list(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])

from chatpipe.testing.project import make_project, project_env  # noqa: E402


def timed(project: Path, log: Path, *cmds: list[str]) -> float:
    """Wall seconds to run ``cmds`` one after the other in ``project``, output to ``log`` (a failure aborts)."""
    env = project_env(project)
    env["PREFECT_LOGGING_LEVEL"] = "INFO"  # the launcher's stage lines are INFO task logs
    env.pop("OMP_NUM_THREADS")  # use every core, as a user would
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with log.open("w") as out:
        for cmd in cmds:
            if subprocess.run(cmd, cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT).returncode:
                raise SystemExit(f"{' '.join(cmd)} failed; see {log}")
    return time.perf_counter() - t0


def stage_seconds(log: Path) -> dict[str, float]:
    """Each stage app's wall time as the launcher reported it (``[launch] <stage>: SUCCEEDED (<s> s)``)."""
    found = re.findall(r"\[launch\] (\w+): SUCCEEDED \(([\d.]+) s\)", log.read_text())
    return {stage: float(sec) for stage, sec in found}


def final_weights(project: Path) -> dict[str, str]:
    """sha256 of each model stage's final weights (from its meta.json), to check both runs did the same work."""
    out = {}
    for meta_path in sorted((project / "artifacts").glob("*/meta.json")):
        sha = json.loads(meta_path.read_text()).get("files", {}).get("model.pt")
        if sha:
            out[meta_path.parent.name] = sha
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", nargs="+", default=STAGES, choices=STAGES)
    p.add_argument("--max-steps", type=int, default=0, help="override pretrain.max_steps (0: keep params.yaml)")
    p.add_argument("--repeats", type=int, default=1, help="pairs of runs, alternating which goes first")
    args = p.parse_args()
    overlay = {"pretrain": {"max_steps": args.max_steps}} if args.max_steps else {}
    py = sys.executable
    commands = {
        "direct": [[py, "-m", f"stages.{s}"] for s in args.stages],
        "orchestrated": [[py, "-m", "flows.pipeline", "--stages", *args.stages]],
    }
    totals = {"direct": 0.0, "orchestrated": 0.0}
    weights: dict[str, dict[str, str]] = {}
    in_stages = 0.0
    print(f"stages: {' '.join(args.stages)}", flush=True)
    for rep in range(args.repeats):
        order = ["direct", "orchestrated"] if rep % 2 == 0 else ["orchestrated", "direct"]
        for kind in order:
            with tempfile.TemporaryDirectory() as tmp:
                # the real `tiny` params (make_project would shrink them), except the optional step override
                project = make_project(Path(tmp) / kind, overlay, small=False)
                log = OUT / f"{kind}-{rep + 1}.log"
                seconds = timed(project, log, *commands[kind])
                weights[kind] = final_weights(project)
            totals[kind] += seconds
            print(f"run {rep + 1} {kind:13s} {seconds:7.1f} s", flush=True)
            if kind == "orchestrated":
                stages = stage_seconds(log)
                in_stages += sum(stages.values())
                print(
                    f"      stage apps {sum(stages.values()):7.1f} s: "
                    + ", ".join(f"{k} {v:.1f}" for k, v in stages.items()),
                    flush=True,
                )
        if weights["direct"] != weights["orchestrated"]:
            raise SystemExit(f"the two runs produced different models: {weights}")
    print(f"same final weights in both ({', '.join(weights['direct']) or 'no model stage'})")
    print(f"direct (python -m stages.<stage>):       {totals['direct']:7.1f} s")
    print(f"orchestrated (Prefect -> DVC -> torchx): {totals['orchestrated']:7.1f} s")
    print(
        f"orchestrated wall / its own stage apps' wall (same run, noise-free view): "
        f"{totals['orchestrated'] / in_stages:.3f}"
    )
    print(f"ratio orchestrated/direct: {totals['orchestrated'] / totals['direct']:.3f}")


if __name__ == "__main__":
    main()
