"""What RL adds: RL's arms against the replay-only control, on one SFT model, over seeds.

Run after the tiny pipeline has made ``artifacts/sft`` and ``artifacts/reward_model`` (the default
pipeline trains no reward model, RL reading none: ``python -m chatpipe.launch reward_model``), from
the repo root:

    python bench/rl_controls.py --seeds 1 2 3                 # every arm, 3 seeds: about 15 RL runs
    python bench/rl_controls.py --seeds 1 --arms replay_only rm_ppo_no_replay --parallel 2
    python bench/rl_controls.py --arms rm_ppo_no_replay --rm-steps 160   # the reward-model arms run longer

The arms (each ``python -m stages.rl`` with RL's defaults and these flags, nothing else changed):

- ``replay_only``: the rewards scaled to nothing (``reward_scale: 1e-9``), so the update is the
  replay's LM loss on the SFT mixture: the control, supervised steps on the same gold answers;
- ``verifier`` (RL's default) and ``verifier_no_replay`` (``CHATPIPE_RL__REPLAY=[]``): GRPO on the verifier;
- ``rm_ppo`` and ``rm_ppo_no_replay``: PPO on the reward model's scores alone
  (``algorithm: ppo``, ``reward_source: model``), the verifier only measuring.

Each run gets its own project dir under ``--workdir`` (links to the repo's artifacts, its own
checkpoints), so arms can run side by side (``--parallel``; each then gets ``2 / parallel`` threads
on 2 cores). It prints one markdown row per run: the SFT model's held-out pass@1 (RL's step-0
eval), the final one, the change, the change over the replay-only control of the same seed, the
reward model's mean score and the verifier's mean on the rollouts (first window -> last, where
the guard ran), the guard's trips and the wall time; then one row per arm, the mean over seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARMS = {
    "replay_only": ["--reward_scale=1e-9"],
    "verifier": [],
    "verifier_no_replay": [],
    "rm_ppo": ["--algorithm=ppo", "--reward_source=model"],
    "rm_ppo_no_replay": ["--algorithm=ppo", "--reward_source=model"],
}
NO_REPLAY = {"CHATPIPE_RL__REPLAY": "[]"}  # a list setting is set through the environment
LINKED = ("tokenizer", "sft", "reward_model")


def project_dir(workdir: Path, name: str) -> Path:
    """A fresh project dir for one run: the repo's input artifacts linked in, nothing else."""
    project = workdir / name
    (project / "artifacts").mkdir(parents=True, exist_ok=True)
    for art in LINKED:
        link = project / "artifacts" / art
        if not link.exists():
            link.symlink_to(REPO / "artifacts" / art)
    return project


def run_arm(workdir: Path, arm: str, seed: int, threads: int, extra: list[str], rm_steps: int = 0) -> dict:
    """One RL run (a reward-model arm for ``rm_steps`` steps when > 0); its log in the run's dir, its
    summary and guard windows read back."""
    name = f"{arm}_seed{seed}"
    if rm_steps > 0 and arm.startswith("rm_"):
        extra = [*extra, f"--max_steps={rm_steps}"]
    project = project_dir(workdir, name)
    env = {**os.environ, "PYTHONPATH": str(REPO), "CHATPIPE_PARAMS": str(REPO / "params.yaml")}
    env |= {"CHATPIPE_TRACKING__ENABLED": "false", "OMP_NUM_THREADS": str(threads)}
    env |= NO_REPLAY if arm.endswith("no_replay") else {}
    cmd = [sys.executable, "-m", "stages.rl", f"--seed={seed}", "--log_every=5", *ARMS[arm], *extra]
    t0 = time.perf_counter()
    with (project / "rl.log").open("w") as log:
        code = subprocess.run(cmd, cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t0
    if code:
        tail = (project / "rl.log").read_text()[-3000:]
        return {"arm": arm, "seed": seed, "error": f"exit {code}: {tail}"}
    meta = json.loads((project / "artifacts" / "rl" / "meta.json").read_text())
    windows = guard_windows((project / "rl.log").read_text())
    return {"arm": arm, "seed": seed, "summary": meta["summary"], "windows": windows, "wall": wall}


def guard_windows(log: str) -> list[dict[str, float]]:
    """The guard's windows from a run's step lines: model and verifier means, tripped."""
    out = []
    for line in log.splitlines():
        if "guard/model_mean" not in line:
            continue
        fields = dict(part.strip().split(" ", 1) for part in line.split("|") if part.strip().startswith("guard/"))
        out.append({k: float(v) for k, v in fields.items()})
    return out


def row(result: dict, control: dict[int, float]) -> str:
    """A markdown row for one run."""
    if "error" in result:
        return f"| {result['arm']} | {result['seed']} | failed: {result['error'][-200:]!r} |"
    s = result["summary"]
    first, final = s["first_eval/pass_at_1"], s["final_eval/pass_at_1"]
    over = f"{final - control[result['seed']]:+.4f}" if result["seed"] in control else "n/a"
    w = result["windows"]
    model = f"{w[0]['guard/model_mean']:.2f} -> {w[-1]['guard/model_mean']:.2f}" if w else "-"
    verifier = f"{w[0]['guard/verifier_mean']:.2f} -> {w[-1]['guard/verifier_mean']:.2f}" if w else "-"
    trips = int(sum(x.get("guard/tripped", 0) for x in w))
    cells = [result["arm"], result["seed"], f"{first:.4f}", f"{final:.4f}", f"{final - first:+.4f}", over]
    return "| " + " | ".join(map(str, [*cells, model, verifier, trips, f"{result['wall']:.0f}"])) + " |"


def means(results: list[dict], control: dict[int, float]) -> list[str]:
    """One row per arm: mean change over SFT and over the control, over the seeds that finished."""
    lines = []
    for arm in dict.fromkeys(r["arm"] for r in results):
        done = [r for r in results if r["arm"] == arm and "error" not in r]
        if not done:
            continue
        change = [r["summary"]["final_eval/pass_at_1"] - r["summary"]["first_eval/pass_at_1"] for r in done]
        over = [r["summary"]["final_eval/pass_at_1"] - control[r["seed"]] for r in done if r["seed"] in control]
        mean_over = f"{sum(over) / len(over):+.4f}" if over else "n/a"
        lines.append(f"| {arm} | {len(done)} seeds | mean change {sum(change) / len(change):+.4f} | {mean_over} |")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    p.add_argument("--parallel", type=int, default=1, help="runs at once (threads each: 2 / parallel, at least 1)")
    p.add_argument("--workdir", type=Path, default=REPO / "artifacts" / "bench_rl_controls")
    p.add_argument("--rm-steps", type=int, default=0, help="steps of the reward-model arms (0: RL's max_steps)")
    # RL's own eval (256 problems x 2 samples) is about +-0.05 at 95% for one run: too coarse to tell
    # arms +0.03 apart. 1024 x 4 (about +-0.02) costs each run about a minute more.
    p.add_argument("--eval-problems", type=int, default=1024, help="held-out problems of each run's pass@1")
    p.add_argument("--eval-samples", type=int, default=4, help="samples per held-out problem")
    p.add_argument("rl_args", nargs="*", help="extra stages.rl flags for every arm, e.g. --max_steps=40")
    args = p.parse_args()
    missing = [a for a in LINKED if not (REPO / "artifacts" / a).is_dir()]
    if missing:
        sys.exit(f"artifacts/{', artifacts/'.join(missing)} missing: run the pipeline (python -m flows.pipeline) first")
    threads = max(1, (os.cpu_count() or 2) // args.parallel)
    jobs = [(arm, seed) for seed in args.seeds for arm in args.arms]
    rl_args = [f"--eval_problems={args.eval_problems}", f"--eval_samples={args.eval_samples}", *args.rl_args]
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda j: run_arm(args.workdir, *j, threads, rl_args, args.rm_steps), jobs))
    control = {
        r["seed"]: r["summary"]["final_eval/pass_at_1"]
        for r in results
        if r["arm"] == "replay_only" and "error" not in r
    }
    print(
        "| arm | seed | SFT pass@1 | final pass@1 | change | over replay-only | RM score | verifier mean | trips | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(row(r, control))
    print("\n| arm | runs | change over SFT | over replay-only |\n|---|---|---|---|")
    print("\n".join(means(results, control)))
    (args.workdir / "results.json").write_text(json.dumps(results, indent=1))
    write_controls(results)


def write_controls(results: list[dict]) -> None:
    """``metrics/rl_controls.json``: each arm's mean change over SFT, keyed by the SFT model's hash, so
    the report card states RL's gain beside the replay-only control measured on the same model."""
    from chatpipe.io import sha256_file, write_json_atomic

    arms = {}
    for arm in dict.fromkeys(r["arm"] for r in results):
        done = [r["summary"] for r in results if r["arm"] == arm and "error" not in r]
        if done:
            change = [s["final_eval/pass_at_1"] - s["first_eval/pass_at_1"] for s in done]
            arms[arm] = {"mean_change": sum(change) / len(change), "runs": len(done), "changes": change}
    init = sha256_file(REPO / "artifacts" / "sft" / "model.pt")
    write_json_atomic(REPO / "metrics" / "rl_controls.json", {"init": init, "arms": arms})


if __name__ == "__main__":
    main()
