"""The sampler-trainer gap of the RL stage, per trainer dtype x rollout dtype: the mean |log pi_trainer -
log pi_sampler| and the k3 KL(sampler || trainer) on the sampled tokens (the step log's ``gap/*``), and
the truncated weights pi_trainer / pi_sampler where the update applies them (``stale/*``).

Runs ``python -m stages.rl`` on the default pipeline's SFT model (``--artifacts``: a dir holding
``tokenizer/`` and ``sft/``), a few steps each, one run at a time, and prints one markdown row per
pair of dtypes: the means over the steps. PPO by default, whose update forwards every row (GRPO
forwards only the groups with signal, so its gap covers those rows alone).

    python bench/rl_gap.py                                   # float32 and bf16, trainer x rollouts
    python bench/rl_gap.py --artifacts /path/to/artifacts -- --max_steps=8   # extra stages.rl flags
    python bench/rl_gap.py --pairs bfloat16/bfloat16                          # one pair only

bf16 means something only where the CPU multiplies it (``grep -o avx512_bf16 /proc/cpuinfo``) or on
a GPU; elsewhere torch emulates it, slowly, with the same rounding.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rl_controls import stage_env  # this checkout first on the import path, tracking off

REPO = Path(__file__).resolve().parents[1]
# (trainer dtype, rollout dtype): the float32 run, bf16 rollouts of a float32 trainer, and both ways
# round on a bf16 trainer (``auto`` on a bf16 CPU picks bf16 for both)
PAIRS = (("float32", "float32"), ("float32", "bfloat16"), ("bfloat16", "bfloat16"), ("bfloat16", "float32"))
KEYS = ("gap/logp_abs", "gap/kl", "stale/weight_mean", "stale/weight_max", "stale/clipped_frac")
FLAGS = ["--algorithm=ppo", "--max_steps=4", "--eval_every=0", "--eval_problems=16", "--log_every=1"]


def run(workdir: Path, artifacts: Path, trainer: str, rollouts: str, extra: list[str]) -> dict:
    """One RL run in a fresh project dir with ``artifacts`` linked in; the logged means of :data:`KEYS`."""
    name = f"train_{trainer}_rollouts_{rollouts}"
    project = workdir / name
    (project / "artifacts").mkdir(parents=True)
    for art in ("tokenizer", "sft"):
        (project / "artifacts" / art).symlink_to(artifacts.resolve() / art)
    env = stage_env()
    cmd = [sys.executable, "-m", "stages.rl", *FLAGS, f"--dtype={trainer}", f"--rollout.dtype={rollouts}", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    (project / "rl.log").write_text(log)
    if proc.returncode:
        return {"name": name, "error": log[-2000:]}
    values = {k: [float(v) for v in re.findall(rf"{re.escape(k)} ([-0-9.e+]+)", log)] for k in KEYS}
    means = {k: sum(v) / len(v) if v else None for k, v in values.items()}
    return {"name": name, "trainer": trainer, "rollouts": rollouts, "steps": len(values["gap/kl"]),
            "seconds": time.perf_counter() - t0, **means}  # fmt: skip


def row(r: dict) -> str:
    if "error" in r:
        return f"| {r['name']} | failed: {r['error'][-300:]!r} |"
    fmt = lambda v: "-" if v is None else f"{v:.3g}"  # noqa: E731
    cells = [r["trainer"], r["rollouts"], str(r["steps"]), *(fmt(r[k]) for k in KEYS)]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--artifacts", type=Path, default=REPO / "artifacts", help="holds tokenizer/ and sft/")
    ap.add_argument("--workdir", type=Path, default=None, help="where the runs' projects go (default: a temp dir)")
    ap.add_argument("--pairs", nargs="*", default=[f"{t}/{r}" for t, r in PAIRS], help="trainer/rollouts dtypes")
    ap.add_argument("extra", nargs="*", help="after --: more stages.rl flags, for every run")
    args = ap.parse_args()
    for art in ("tokenizer", "sft"):
        if not (args.artifacts / art).is_dir():
            sys.exit(f"{args.artifacts / art} is missing: run the pipeline up to sft, or pass --artifacts")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rl_gap_"))
    print(f"flags: {' '.join(FLAGS + args.extra)}; projects in {workdir}")
    print("| trainer | rollouts | steps | " + " | ".join(KEYS) + " |")
    print("|---" * (3 + len(KEYS)) + "|")
    for trainer, rollouts in (pair.split("/") for pair in args.pairs):
        print(row(run(workdir, args.artifacts, trainer, rollouts, args.extra)), flush=True)


if __name__ == "__main__":
    main()
