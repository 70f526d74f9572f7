"""What RL adds: RL's arms against the replay-only control, on one SFT model, over seeds, on test.

Run after the tiny pipeline has made ``artifacts/sft`` (the flow, or ``dvc repro sft``), from the
repo root:

    python bench/rl_controls.py --seeds 1 2 3                 # every arm, 3 seeds: 3 reward models, 15 RL runs
    python bench/rl_controls.py --seeds 1 --arms replay_only rm_ppo_no_replay --parallel 2
    python bench/rl_controls.py --arms rm_ppo_no_replay --rm-steps 160   # the reward-model arms run longer
    python bench/rl_controls.py --plan                        # what would run (arms, flags, dirs, counts), as JSON
    python bench/rl_controls.py --results DIR/results.json    # the tables of an earlier run again

The arms (each ``python -m stages.rl`` with RL's defaults and these flags, nothing else changed):

- ``replay_only``: the rewards scaled to nothing (``reward.scale: 1e-9``), so the update is the
  replay's LM loss on the SFT mixture: the control, supervised steps on the same gold answers;
- ``verifier`` (RL's default) and ``verifier_no_replay`` (``CHATPIPE_RL__REPLAY=[]``): GRPO on the verifier;
- ``rm_ppo`` and ``rm_ppo_no_replay``: PPO on the reward model's scores alone
  (``algorithm: ppo``, ``reward.source: model``), the verifier only measuring.

Equal in steps: every arm takes one optimizer step and (with the replay on) one replay batch per RL
step. PPO runs at ``ppo.epochs: 1``, ``ppo.num_minibatches: 1``; at its defaults (2 x 2) it would
take 4 of each, and "over the replay-only control" would credit RL with 4x the replay. The bench
counts both per arm from its settings, refuses arms that differ, and prints the counts (and the
replay batches the run's replay cursor says it took).

Each seed trains its own reward model (``python -m stages.reward_model --seed=S``, extra flags from
``--rm-args``) for the reward-model arms. Every bench run makes a new dir under ``--workdir``, and
every run in it its own project dir (links to the repo's tokenizer and SFT model, nothing else), so
no run resumes another's checkpoints. Arms can run side by side (``--parallel``; each then gets
``2 / parallel`` threads on 2 cores).

Figures: pass@1 on **test**, the split no setting was tuned on (``rl.test_split``); val, the tuning
split, is printed beside it, labelled. One markdown row per run: the SFT model's test pass@1 (RL's
step-0 eval), the final one, the change, the change over the replay-only control of the same seed,
val's change, the reward model's mean score and the verifier's mean on the rollouts (first window ->
last, where the guard ran), the guard's trips and the wall time; then one row per arm, the mean over
seeds. ``metrics/rl_controls.json`` keeps each arm's mean test change (``split: test``) for the report.
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
sys.path.insert(0, str(REPO))  # the library, for the settings the counts are read from

# PPO at one epoch of one minibatch: one optimizer step and one replay batch per RL step, as GRPO takes
EQUAL_PPO = ["--algorithm=ppo", "--ppo.epochs=1", "--ppo.num_minibatches=1"]
ARMS = {
    "replay_only": ["--reward.scale=1e-9"],
    "verifier": [],
    "verifier_no_replay": [],
    "rm_ppo": [*EQUAL_PPO, "--reward.source=model"],
    "rm_ppo_no_replay": [*EQUAL_PPO, "--reward.source=model"],
}
NO_REPLAY = {"CHATPIPE_RL__REPLAY": "[]"}  # a list setting is set through the environment
LINKED = ("tokenizer", "sft")
TEST, VAL = "eval_test/pass_at_1", "eval/pass_at_1"  # RL's pass@1 on test (held out) and val (tuning)


def uses_reward_model(arm: str) -> bool:
    return arm.startswith("rm_")


def step_counts(arm: str, rl_args: list[str]) -> dict[str, int]:
    """Optimizer steps and replay batches per RL step of ``arm``, from the settings it runs with:
    GRPO steps once; PPO once per minibatch of every epoch, a replay batch beside each step."""
    from chatpipe.settings import RLSettings, load_section

    os.environ["CHATPIPE_PARAMS"] = str(REPO / "params.yaml")  # as every run reads it
    cfg = load_section(RLSettings, [*ARMS[arm], *rl_args])
    steps = 1 if cfg.algorithm == "grpo" else cfg.ppo.epochs * cfg.ppo.num_minibatches
    replay_on = bool(cfg.replay) and cfg.replay_coef > 0 and not arm.endswith("no_replay")
    return {"optimizer_steps": steps, "replay_batches": steps if replay_on else 0}


def check_equal(counts: dict[str, dict[str, int]]) -> None:
    """Every arm takes as many optimizer steps per RL step, and every arm with the replay as many replay batches."""
    steps = {c["optimizer_steps"] for c in counts.values()}
    replays = {c["replay_batches"] for c in counts.values()} - {0}
    if len(steps) > 1 or len(replays) > 1:
        table = ", ".join(f"{a}: {c['optimizer_steps']} steps, {c['replay_batches']} replay" for a, c in counts.items())
        sys.exit(f"arms differ in optimizer steps or replay batches per RL step ({table}); make them equal")


def plan(args: argparse.Namespace, bench_dir: Path) -> list[dict]:
    """Every run of this bench, in order: one reward model per seed (when a reward-model arm runs),
    then each arm x seed, each in its own project dir under ``bench_dir``."""
    rl_args = [f"--eval_problems={args.eval_problems}", f"--eval_samples={args.eval_samples}", *args.rl_args]
    counts = {arm: step_counts(arm, rl_args) for arm in args.arms}
    check_equal(counts)
    runs = []
    if any(uses_reward_model(a) for a in args.arms):
        for seed in args.seeds:
            cmd = [sys.executable, "-m", "stages.reward_model", f"--seed={seed}", *args.rm_args]
            runs.append(
                {"kind": "reward_model", "seed": seed, "dir": str(bench_dir / f"reward_model_seed{seed}"), "cmd": cmd}
            )
    for seed in args.seeds:
        for arm in args.arms:
            extra = [f"--max_steps={args.rm_steps}"] if args.rm_steps > 0 and uses_reward_model(arm) else []
            cmd = [sys.executable, "-m", "stages.rl", f"--seed={seed}", "--log_every=5", *ARMS[arm], *rl_args, *extra]
            run = {"kind": "rl", "arm": arm, "seed": seed, "dir": str(bench_dir / f"{arm}_seed{seed}"), "cmd": cmd}
            run["env"] = NO_REPLAY if arm.endswith("no_replay") else {}
            run["reward_model"] = str(bench_dir / f"reward_model_seed{seed}") if uses_reward_model(arm) else None
            runs.append(run | counts[arm])
    return runs


def project_dir(run: dict) -> Path:
    """A fresh project dir for one run: the repo's tokenizer and SFT model linked in, and for the
    reward-model arms the seed's own reward model; nothing else, and never a dir that exists."""
    project = Path(run["dir"])
    (project / "artifacts").mkdir(parents=True, exist_ok=False)
    for art in LINKED:
        (project / "artifacts" / art).symlink_to(REPO / "artifacts" / art)
    if run.get("reward_model"):
        (project / "artifacts" / "reward_model").symlink_to(Path(run["reward_model"]) / "artifacts" / "reward_model")
    return project


def stage_env(**extra: str) -> dict[str, str]:
    """The environment of a stage run: this checkout first on the import path (before any PYTHONPATH
    the caller set, such as a folder of extra packages), the repo's params.yaml, tracking off."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "CHATPIPE_PARAMS": str(REPO / "params.yaml")}
    return env | {"CHATPIPE_TRACKING__ENABLED": "false", **extra}


def execute(run: dict, threads: int) -> dict:
    """One run (its log in its dir); an RL run's summary, guard windows and replay cursor read back."""
    project = project_dir(run)
    env = stage_env(OMP_NUM_THREADS=str(threads), **run.get("env", {}))
    t0 = time.perf_counter()
    with (project / "run.log").open("w") as log:
        code = subprocess.run(run["cmd"], cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    out = {k: v for k, v in run.items() if k not in ("cmd", "env")} | {"wall": time.perf_counter() - t0}
    if code:
        return out | {"error": f"exit {code}: {(project / 'run.log').read_text()[-3000:]}"}
    if run["kind"] == "reward_model":
        return out
    meta = json.loads((project / "artifacts" / "rl" / "meta.json").read_text())
    rows = (meta.get("replay") or {}).get("row", 0) / max(meta["settings"]["replay_rows"], 1)
    out["replay_batches_measured"] = rows / max(meta["step"], 1)  # the replay cursor: batches taken per RL step
    return out | {"summary": meta["summary"], "windows": guard_windows((project / "run.log").read_text())}


def guard_windows(log: str) -> list[dict[str, float]]:
    """The guard's windows from a run's step lines: model and verifier means, tripped."""
    out = []
    for line in log.splitlines():
        if "guard/model_mean" not in line:
            continue
        fields = dict(part.strip().split(" ", 1) for part in line.split("|") if part.strip().startswith("guard/"))
        out.append({k: float(v) for k, v in fields.items()})
    return out


def change(summary: dict, key: str) -> float:
    return summary[f"final_{key}"] - summary[f"first_{key}"]


def row(result: dict, control: dict[int, float]) -> str:
    """A markdown row for one RL run: test figures, val's change beside."""
    if "error" in result:
        return f"| {result['arm']} | {result['seed']} | failed: {result['error'][-200:]!r} |"
    s, seed = result["summary"], result["seed"]
    first, final = s[f"first_{TEST}"], s[f"final_{TEST}"]
    over = f"{final - control[seed]:+.4f}" if seed in control else "n/a"
    w = result["windows"]
    model = f"{w[0]['guard/model_mean']:.2f} -> {w[-1]['guard/model_mean']:.2f}" if w else "-"
    verifier = f"{w[0]['guard/verifier_mean']:.2f} -> {w[-1]['guard/verifier_mean']:.2f}" if w else "-"
    trips = int(sum(x.get("guard/tripped", 0) for x in w))
    steps = f"{result['optimizer_steps']} / {result['replay_batches']} ({result['replay_batches_measured']:g})"
    cells = [result["arm"], seed, steps, f"{first:.4f}", f"{final:.4f}", f"{final - first:+.4f}", over]
    cells += [f"{change(s, VAL):+.4f}", model, verifier, trips, f"{result['wall']:.0f}"]
    return "| " + " | ".join(map(str, cells)) + " |"


def means(results: list[dict], control: dict[int, float]) -> list[str]:
    """One row per arm: mean test change over SFT and over the control, and val's, over the seeds that finished."""
    lines = []
    for arm in dict.fromkeys(r["arm"] for r in results):
        done = [r for r in results if r["arm"] == arm and "error" not in r]
        if not done:
            continue
        test = [change(r["summary"], TEST) for r in done]
        val = [change(r["summary"], VAL) for r in done]
        over = [r["summary"][f"final_{TEST}"] - control[r["seed"]] for r in done if r["seed"] in control]
        mean_over = f"{sum(over) / len(over):+.4f}" if over else "n/a"
        cells = [arm, f"{len(done)} seeds", f"{sum(test) / len(test):+.4f}", mean_over, f"{sum(val) / len(val):+.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def report(results: list[dict]) -> None:
    """Print the per-run and per-arm tables: pass@1 on test (held out), val (tuning) beside."""
    results = [r for r in results if r.get("kind", "rl") == "rl"]
    control = {
        r["seed"]: r["summary"][f"final_{TEST}"] for r in results if r["arm"] == "replay_only" and "error" not in r
    }
    print("pass@1 on `test` (held out: nothing was tuned on it); `val` is the tuning split, its change beside.")
    print(
        "| arm | seed | optimizer steps / replay batches per RL step (replay measured) | test SFT pass@1 "
        "| test final pass@1 | test change | test over replay-only | val change (tuning) | RM score | "
        "verifier mean | trips | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(row(r, control))
    print(
        "\n| arm | runs | test change over SFT | test over replay-only | val change (tuning) |\n|---|---|---|---|---|"
    )
    print("\n".join(means(results, control)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    p.add_argument("--parallel", type=int, default=1, help="runs at once (threads each: 2 / parallel, at least 1)")
    p.add_argument("--workdir", type=Path, default=REPO / "artifacts" / "bench_rl_controls")
    p.add_argument("--rm-steps", type=int, default=0, help="steps of the reward-model arms (0: RL's max_steps)")
    p.add_argument("--rm-args", nargs="*", default=[], help="extra stages.reward_model flags, e.g. --max_steps=200")
    # RL's own eval (256 problems x 2 samples) is about +-0.05 at 95% for one run: too coarse to tell
    # arms +0.03 apart. 1024 x 4 (about +-0.02) costs each run about a minute more (twice: val and test).
    p.add_argument("--eval-problems", type=int, default=1024, help="problems of each run's pass@1, on val and on test")
    p.add_argument("--eval-samples", type=int, default=4, help="samples per problem")
    p.add_argument("--plan", action="store_true", help="print the runs as JSON and run nothing")
    p.add_argument("--results", type=Path, help="print the tables of an earlier run's results.json and run nothing")
    p.add_argument("rl_args", nargs="*", help="extra stages.rl flags for every arm, e.g. --max_steps=40")
    args = p.parse_args()
    if args.results:
        return report(json.loads(args.results.read_text()))
    bench_dir = args.workdir / time.strftime("%Y%m%d-%H%M%S")  # a new dir: no run resumes an older one's
    runs = plan(args, bench_dir)
    if args.plan:
        return print(json.dumps(runs, indent=1))
    missing = [a for a in LINKED if not (REPO / "artifacts" / a).is_dir()]
    if missing:
        sys.exit(f"artifacts/{', artifacts/'.join(missing)} missing: run the pipeline (python -m flows.pipeline) first")
    bench_dir.mkdir(parents=True, exist_ok=False)
    threads = max(1, (os.cpu_count() or 2) // args.parallel)
    with ThreadPoolExecutor(args.parallel) as pool:  # every seed's reward model before any RL run reads it
        results = list(pool.map(lambda r: execute(r, threads), [r for r in runs if r["kind"] == "reward_model"]))
        results += list(pool.map(lambda r: execute(r, threads), [r for r in runs if r["kind"] == "rl"]))
    (bench_dir / "results.json").write_text(json.dumps(results, indent=1))
    failed = [r for r in results if r["kind"] == "reward_model" and "error" in r]
    for r in failed:
        print(f"reward model of seed {r['seed']} failed: {r['error'][-500:]}")
    report(results)
    write_controls(results)


def write_controls(results: list[dict]) -> None:
    """``metrics/rl_controls.json``: each arm's mean change over SFT on test (``split``), val's beside,
    keyed by the SFT model's hash, so the report card states RL's gain beside the replay-only control
    measured on the same model and split."""
    from chatpipe.io import sha256_file, write_json_atomic

    arms = {}
    for arm in dict.fromkeys(r["arm"] for r in results if r["kind"] == "rl"):
        done = [r["summary"] for r in results if r["kind"] == "rl" and r["arm"] == arm and "error" not in r]
        if done:
            test, val = [change(s, TEST) for s in done], [change(s, VAL) for s in done]
            arms[arm] = {"mean_change": sum(test) / len(test), "runs": len(done), "changes": test}
            arms[arm] |= {"val_mean_change": sum(val) / len(val), "val_changes": val}
    init = sha256_file(REPO / "artifacts" / "sft" / "model.pt")
    write_json_atomic(REPO / "metrics" / "rl_controls.json", {"init": init, "split": "test", "arms": arms})


if __name__ == "__main__":
    main()
