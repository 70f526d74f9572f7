"""PPO on the reward model's scores alone, over seeds: does it raise the verifier's held-out pass@1?

Run after the tiny pipeline has made ``artifacts/sft`` (``dvc repro sft`` or the flow), from the repo root:

    python bench/reward_model_ppo.py --seeds 1 2 3          # trains artifacts/reward_model first if missing

For each seed it runs ``stages.rl`` with ``algorithm=ppo reward.source=model`` (no verifier in the
loss) into its own checkpoint dir, and prints one markdown row per seed: the SFT model's held-out
pass@1 (RL's step-0 eval), the final one, the change, the last step's mean reward-model and
verifier scores of the rollouts, and the wall time. Reading a failure: a reward-model score that
rises while the verifier's mean does not is the policy gaming the reward model (the reward model is
the cause; its held-out accuracy on ``sampled`` pairs says how well it ranks the model's own
answers); neither rising is PPO's (its LRs, KL, steps).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


LOGS = REPO / "artifacts" / "bench_reward_model_ppo"


def run(cmd: list[str], env: dict[str, str], name: str) -> str:
    """Run ``cmd``, its output written as it comes to ``LOGS/name.log`` (a long run can be followed
    with ``tail -f``, and a killed one leaves its steps there); returns that output."""
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / f"{name}.log"
    with log.open("w") as f:
        code = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, text=True).returncode
    text = log.read_text()
    if code:
        sys.exit(f"{' '.join(cmd)} failed (log: {log}):\n{text[-3000:]}")
    return text


def last_step_means(log: str) -> tuple[str, str]:
    """The last logged reward/model_mean and reward/verifier_mean of a run's step lines."""
    model = verifier = "n/a"
    for line in log.splitlines():
        for key in ("reward/model_mean", "reward/verifier_mean"):
            if key in line:
                value = line.split(key, 1)[1].split()[0]
                model, verifier = (value, verifier) if key == "reward/model_mean" else (model, value)
    return model, verifier


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("rl_args", nargs="*", help="extra stages.rl flags, e.g. --max_steps=120 --ppo.kl_coef=0.05")
    args = p.parse_args()
    env = {**os.environ, "CHATPIPE_TRACKING__ENABLED": os.environ.get("CHATPIPE_TRACKING__ENABLED", "false")}
    if not (REPO / "artifacts" / "reward_model" / "meta.json").exists():
        run([sys.executable, "-m", "stages.reward_model"], env, "reward_model")
    rm = json.loads((REPO / "artifacts" / "reward_model" / "meta.json").read_text())["summary"]
    print(f"reward model held-out pair accuracy {rm['val_pair_accuracy']:.3f} ({rm['val_pairs']} pairs)", rm)
    print("| seed | SFT pass@1 | PPO(RM) pass@1 | change | RM score (last step) | verifier (last step) | wall s |")
    print("|---|---|---|---|---|---|---|")
    for seed in args.seeds:
        t0 = time.perf_counter()
        flags = ["--algorithm=ppo", "--reward.source=model", f"--seed={seed}", "--log_every=1", *args.rl_args]
        log = run([sys.executable, "-m", "stages.rl", *flags], env, f"rl_seed{seed}")
        wall = time.perf_counter() - t0
        summary = json.loads((REPO / "artifacts" / "rl" / "meta.json").read_text())["summary"]
        first, final = summary["first_eval/pass_at_1"], summary["final_eval/pass_at_1"]
        model, verifier = last_step_means(log)
        print(f"| {seed} | {first:.4f} | {final:.4f} | {final - first:+.4f} | {model} | {verifier} | {wall:.0f} |")


if __name__ == "__main__":
    main()
