"""bench/gpu_acceptance.py: refuses a machine without CUDA clearly, and its plausibility checks and plan
estimates (chatpipe/testing/gpu_acceptance.py) are right (the GPU measurement itself only runs on a GPU node)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from chatpipe.testing import gpu_acceptance

REPO = Path(__file__).resolve().parents[1]


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
    good = {"tok_s": 4e5, "mfu": 0.45, "peak_gib": 40.0, "loss": 10.4}
    assert gpu_acceptance.implausible(good, device_gib=80.0) == []
    problems = gpu_acceptance.implausible(
        {"tok_s": 0.0, "mfu": 1.3, "peak_gib": 95.0, "loss": float("nan")}, device_gib=80.0
    )
    assert len(problems) == 4
    assert "MFU 130.0% is outside" in problems[0] and "95.0 GiB" in problems[1]
    assert gpu_acceptance.implausible({**good, "mfu": 1.0}, 80.0)  # exactly 100% is not plausible either


def test_plan_estimate_is_chatpipe_plans():
    from chatpipe.train.pretrain_plan import GIB, make_plan, measured_mfu

    plan = make_plan("speedrun", "H100")  # d24
    est = gpu_acceptance.plan_estimate(24, "H100")
    # the plan's formula for one compiled micro-batch (the plan's own figure adds the gradients its
    # 8-GPU batch accumulates): within 10% of the 66.6 GiB an H100 measured in bf16 (bench/README.md)
    grads = 4 * plan.num_params / GIB
    assert est["memory_gib"] == pytest.approx(plan.memory_gib - grads) and abs(est["memory_gib"] - 66.6) < 6.7
    mfu, source = measured_mfu("H100", fp8=True)  # what the bench last measured, not a constant
    assert plan.mfu == mfu and source.startswith("measured") and mfu != 0.4
    assert est["tok_s"] == pytest.approx(989e12 * mfu / plan.flops_per_token)
    d12 = gpu_acceptance.plan_estimate(12, "H100")
    assert d12["tok_s"] > 2 * est["tok_s"] and d12["memory_gib"] < est["memory_gib"]  # the depth is applied
    cfg, vocab = gpu_acceptance.profile_at(12)
    assert (cfg.depth, vocab, cfg.fp8, cfg.value_embeds) == (12, 32768, True, True)  # the speedrun recipe at d12
    assert gpu_acceptance.gpu_kind("NVIDIA H100 80GB HBM3") == "H100"
    assert gpu_acceptance.gpu_kind("NVIDIA GeForce RTX 4090") is None


def test_nanochat_columns_and_the_recorded_mfu_the_plan_reads(tmp_path):
    from chatpipe.train.pretrain_plan import measured_mfu

    row = {"mfu": 0.295}
    assert gpu_acceptance.nanochat_columns(24, "fp8 tensorwise", row).split() == ["123,000", "59%", "0.50"]
    assert gpu_acceptance.nanochat_columns(24, "bf16", row).split() == ["100,000", "50%", "0.59"]
    assert gpu_acceptance.nanochat_columns(12, "bf16", row).split() == ["-", "-", "-"]  # nanochat has no d12 figure
    rows = {
        "d24 bf16": {"mfu": 0.47, "tok_s": 1.0},
        "d24 fp8 torchao": {"mfu": 0.52, "tok_s": 1.1},
        "d24 fp8 tensorwise": {"mfu": 0.56, "tok_s": 1.2},
    }
    record = tmp_path / "gpu_measured.json"
    gpu_acceptance.record_mfu(record, "H100", "NVIDIA H100 80GB HBM3", rows, 24)
    assert measured_mfu("H100", fp8=True, path=record)[0] == 0.56  # the faster recipe's
    assert measured_mfu("H100", fp8=False, path=record)[0] == 0.47
    assert measured_mfu("A100", fp8=False, path=record) == (0.4, "assumed")  # never measured there
    record.write_text("[1, 2]")
    with pytest.raises(ValueError, match="gpu_measured.json: not the acceptance bench's MFU record"):
        measured_mfu("H100", fp8=True, path=record)


def test_the_issue_44_targets_are_reported_met_or_not():
    rows = {
        "d24 bf16": {"mfu": 0.345, "peak_gib": 66.6, "plan_gib": 66.5},
        "d24 fp8 torchao": {"mfu": 0.373, "peak_gib": 49.6, "plan_gib": 66.5},
        "d24 fp8 tensorwise": {"mfu": 0.56, "peak_gib": 60.0, "plan_gib": 66.5},
    }
    lines = gpu_acceptance.target_report(rows).splitlines()
    assert "56.0%" in lines[0] and lines[0].endswith(": met")  # the faster fp8 recipe counts
    assert "34.5%" in lines[1] and lines[1].endswith("NOT met")
    assert "1.62x" in lines[2] and lines[2].endswith(": met")
    assert "+0.2%" in lines[3] and lines[3].endswith(": met")
    assert "-9.8%" in lines[4] and lines[4].endswith(": met")
    assert "not every d24 row ran" in gpu_acceptance.target_report({"d24 bf16": rows["d24 bf16"]})
