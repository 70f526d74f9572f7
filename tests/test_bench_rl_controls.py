"""bench/rl_controls.py without its RL runs: what it would run (--plan) and what it prints (--results).

It runs as a subprocess, as a user runs it; the test imports nothing from bench/.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench" / "rl_controls.py"


def bench(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )


def test_every_arm_takes_equal_steps_each_seed_its_own_reward_model_each_run_a_fresh_dir(tmp_path):
    """Before: PPO at its defaults (2 epochs x 2 minibatches) took 4 optimizer steps and 4 replay
    batches per RL step against GRPO's 1; one reward model served every seed; runs reused their dirs."""
    args = ("--plan", "--seeds", "1", "2", "--workdir", str(tmp_path))
    proc = bench(*args, cwd=tmp_path)  # not from the repo root: it reads the repo's params.yaml all the same
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(proc.stdout)
    rl = [r for r in runs if r["kind"] == "rl"]
    assert len(rl) == 10 and {r["optimizer_steps"] for r in rl} == {1}
    assert {r["arm"]: r["replay_batches"] for r in rl} == {
        "replay_only": 1,
        "verifier": 1,
        "verifier_no_replay": 0,
        "rm_ppo": 1,
        "rm_ppo_no_replay": 0,
    }
    for r in rl:
        if r["arm"].startswith("rm_"):
            assert {"--ppo.epochs=1", "--ppo.num_minibatches=1"} <= set(r["cmd"])
            assert r["reward_model"].endswith(f"reward_model_seed{r['seed']}")
        else:
            assert r["reward_model"] is None
    models = [r for r in runs if r["kind"] == "reward_model"]
    assert [(r["seed"], r["cmd"][-1]) for r in models] == [(1, "--seed=1"), (2, "--seed=2")]
    assert runs.index(models[-1]) < runs.index(rl[0])  # the reward models first
    dirs = [Path(r["dir"]) for r in runs]
    assert len(set(dirs)) == len(dirs) and {d.parent for d in dirs} == {dirs[0].parent}
    assert dirs[0].parent.parent == tmp_path and not dirs[0].parent.exists()  # a new dir, made when it runs


def test_unequal_arms_are_refused_naming_the_counts(tmp_path):
    proc = bench("--plan", "--arms", "verifier", "rm_ppo", "--workdir", str(tmp_path), "--", "--ppo.epochs=2")
    assert proc.returncode != 0
    assert "rm_ppo: 2 steps, 2 replay" in proc.stderr and "verifier: 1 steps, 1 replay" in proc.stderr


def test_the_tables_report_test_pass_at_1_with_val_beside_labelled(tmp_path):
    def result(arm: str, test: tuple[float, float], val: tuple[float, float]) -> dict:
        summary = {"first_eval_test/pass_at_1": test[0], "final_eval_test/pass_at_1": test[1]}
        summary |= {"first_eval/pass_at_1": val[0], "final_eval/pass_at_1": val[1]}
        counts = {"optimizer_steps": 1, "replay_batches": 1, "replay_batches_measured": 1.0}
        return {"kind": "rl", "arm": arm, "seed": 1, "summary": summary, "windows": [], "wall": 9.0, **counts}

    results = [result("replay_only", (0.70, 0.80), (0.72, 0.90)), result("verifier", (0.70, 0.85), (0.72, 0.99))]
    (tmp_path / "results.json").write_text(json.dumps(results))
    proc = bench("--results", str(tmp_path / "results.json"))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "pass@1 on `test` (held out" in out and "val change (tuning)" in out
    # the verifier arm: test 0.70 -> 0.85 (+0.15), +0.05 over the control's 0.80; val +0.27 beside
    assert "| verifier | 1 | 1 / 1 (1) | 0.7000 | 0.8500 | +0.1500 | +0.0500 | +0.2700 |" in out
    assert "| verifier | 1 seeds | +0.1500 | +0.0500 | +0.2700 |" in out
