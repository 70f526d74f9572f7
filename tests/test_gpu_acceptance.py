"""bench/gpu_acceptance.py: refuses a machine without CUDA clearly, and its plausibility checks and plan
estimates are right (the GPU measurement itself only runs on a GPU node)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))


def test_refuses_without_a_gpu_with_a_clear_message():
    env = {"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}  # no GPU even on a GPU machine
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_acceptance.py")], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA GPU on this machine" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""  # nothing measured, nothing printed as if it were


def test_implausible_numbers_are_named():
    import gpu_acceptance

    good = {"tok_s": 4e5, "mfu": 0.45, "peak_gib": 40.0, "loss": 10.4}
    assert gpu_acceptance.implausible(good, device_gib=80.0) == []
    problems = gpu_acceptance.implausible(
        {"tok_s": 0.0, "mfu": 1.3, "peak_gib": 95.0, "loss": float("nan")}, device_gib=80.0
    )
    assert len(problems) == 4
    assert "MFU 130.0% is outside" in problems[0] and "95.0 GiB" in problems[1]
    assert gpu_acceptance.implausible({**good, "mfu": 1.0}, 80.0)  # exactly 100% is not plausible either


def test_plan_estimate_is_chatpipe_plans():
    import gpu_acceptance

    from chatpipe.train.pretrain_plan import make_plan

    plan = make_plan("speedrun", "H100")  # d24
    est = gpu_acceptance.plan_estimate(24, "H100")
    assert est["memory_gib"] == pytest.approx(plan.memory_gib)
    assert est["tok_s"] == pytest.approx(989e12 * 0.4 / plan.flops_per_token)
    d12 = gpu_acceptance.plan_estimate(12, "H100")
    assert d12["tok_s"] > 2 * est["tok_s"] and d12["memory_gib"] < est["memory_gib"]  # the depth is applied
    cfg, vocab = gpu_acceptance.profile_at(12)
    assert (cfg.depth, vocab, cfg.fp8, cfg.value_embeds) == (12, 32768, True, True)  # the speedrun recipe at d12
    assert gpu_acceptance.gpu_kind("NVIDIA H100 80GB HBM3") == "H100"
    assert gpu_acceptance.gpu_kind("NVIDIA GeForce RTX 4090") is None
