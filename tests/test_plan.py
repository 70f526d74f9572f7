"""`chatpipe plan`: budget numbers checked against hand computation for nanochat d20."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from chatpipe import runtime
from chatpipe.runtime import Runtime
from chatpipe.settings import PretrainSettings
from chatpipe.train.pretrain_plan import (
    check_memory_fits,
    estimate_memory_bytes,
    format_plan,
    main,
    make_plan,
    polar_express_dtype,
)

# d20 by hand: n_embd = 20 * 64 = 1280, 10 heads of 128, vocab 65,536, seq 2048
WTE = LM_HEAD = 65_536 * 1280
PER_LAYER = 4 * 1280 * 1280 + 2 * 1280 * 4 * 1280  # q, k, v, o + MLP up/down (4x)
D20_PARAMS = WTE + LM_HEAD + 20 * PER_LAYER
D20_FLOPS = 6 * (D20_PARAMS - WTE) + 12 * 10 * 128 * 2048 * 20  # matmuls + causal attention per layer


def test_d20_plan_matches_hand_computation(params_file):
    plan = make_plan("d20", gpu="H100", mfu=0.5, usd_per_gpu_hour=2.0)
    assert D20_PARAMS == 560_988_160 and plan.num_params == D20_PARAMS  # d20 has ~561M parameters
    assert plan.flops_per_token == D20_FLOPS
    assert plan.steps == 20 * D20_PARAMS // 524_288 == 21_400
    assert plan.tokens == 21_400 * 524_288
    assert plan.world_size == 8 and plan.grad_accum == 524_288 // (32 * 2048 * 8) == 1
    hours = D20_FLOPS * plan.tokens / (989e12 * 8 * 0.5) / 3600
    assert plan.hours == pytest.approx(hours) and plan.usd == pytest.approx(hours * 8 * 2.0)
    assert 30 < plan.memory_gib < 80  # fits an 80 GB H100 at device batch 32


def test_one_gpu_variant_keeps_the_math_by_accumulating(params_file):
    one, eight = make_plan("speedrun_1gpu"), make_plan("speedrun")
    assert one.world_size == 1 and one.grad_accum == 8 * eight.grad_accum
    assert (one.num_params, one.steps, one.tokens) == (eight.num_params, eight.steps, eight.tokens)
    assert one.hours == pytest.approx(8 * eight.hours)


def test_d26_profile_extends_d20(params_file):
    plan = make_plan("d26")
    assert plan.depth == 26 and plan.n_embd == 26 * 64 and plan.vocab_size == 65_536
    assert plan.grad_accum == 2  # device batch 16 on 8 GPUs


def test_memory_check_names_the_setting(monkeypatch):
    estimate = estimate_memory_bytes(D20_PARAMS, WTE, 20, 1280, 65_536, 64, 2048)
    check_memory_fits(estimate, torch.device("cpu"), 64)  # no limit known on CPU
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 80 << 30}))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA H100")
    with pytest.raises(RuntimeError, match="device_batch_size = 64 needs"):
        check_memory_fits(estimate, torch.device("cuda", 0), 64)


def test_cli_prints_plan(params_file, capsys):
    main(["--profile", "d20"])
    out = capsys.readouterr().out
    assert "560,988,160" in out and "21,400" in out and "grad accumulation 1" in out


def test_speedrun_is_nanochat_d24_recipe_and_plan_shows_both(params_file, capsys):
    plan = make_plan("speedrun")
    assert plan.depth == 24 and plan.n_embd == 1536 and plan.vocab_size == 32_768
    assert "normuon_polar_express" in plan.recipe and "value_embeds" in plan.recipe and "fp8" in plan.recipe
    # nanochat's d24 speedrun: ratio 8 over block matrices + lm_head, Power Lines batch from d12, sqrt LR scaling
    assert plan.scaling_params == 729_810_624 and plan.tokens <= 8 * plan.scaling_params
    assert (plan.steps, plan.total_batch_size, plan.grad_accum) == (5_568, 1_048_576, 4)
    assert plan.lr_scaled and round(plan.batch_lr_scale, 3) == 1.414 and round(plan.weight_decay, 4) == 0.0597
    main(["--profile", "speedrun,d20"])
    out = capsys.readouterr().out
    assert "5,568 x 1,048,576 tokens" in out and "LR scale         1.414" in out and "weight decay     0.0597" in out
    assert "21,400 x 524,288 tokens" in out and "off, LRs as set" in out  # d20 keeps its 2025 numbers
    assert "profile speedrun: depth 24" in out and "profile d20: depth 20" in out
    assert format_plan(make_plan("tiny")).startswith("profile tiny")


def test_unknown_gpu_is_rejected(params_file):
    with pytest.raises(ValueError, match="allowed: H100"):
        make_plan("speedrun", gpu="TPU")


def test_misspelt_profile_is_a_one_line_error_naming_the_allowed_ones(params_file, capsys):
    # before: the ParamsError escaped as a traceback
    assert main(["--profile", "speedrn"]) == 2
    err = capsys.readouterr().err
    assert "speedrn" in err and "allowed:" in err and "speedrun" in err and "tiny" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_cli_script_exit_status_for_a_misspelt_profile(params_file, capsys):
    from chatpipe.cli import main as cli_main

    assert cli_main(["plan", "--profile", "speedrn"]) == 2
    assert "allowed:" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("setting", "optimizer", "run_dtype", "cpu_bf16", "expected"),
    [
        ("auto", "normuon_polar_express", torch.float32, True, torch.bfloat16),  # CPU with bf16 dot products
        ("auto", "normuon_polar_express", torch.float32, False, torch.float32),  # CPU without: bf16 would be emulated
        ("auto", "normuon_polar_express", torch.bfloat16, False, torch.bfloat16),  # a bf16 run, as nanochat
        ("auto", "muon_newton_schulz", torch.bfloat16, True, torch.float32),  # Newton-Schulz stays float32
        ("float32", "normuon_polar_express", torch.bfloat16, True, torch.float32),
        ("bfloat16", "normuon_polar_express", torch.float32, False, torch.bfloat16),
    ],
)
def test_polar_express_dtype_resolves_auto_from_the_run_and_the_cpu(
    monkeypatch, setting, optimizer, run_dtype, cpu_bf16, expected
):
    monkeypatch.setattr(runtime, "cpu_multiplies_bf16", lambda: cpu_bf16)  # read by runtime.compute_dtype
    cfg = PretrainSettings(polar_express_dtype=setting, optimizer=optimizer)
    rt = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), dtype=run_dtype)
    assert polar_express_dtype(cfg, rt) == expected


def test_polar_express_dtype_names_the_allowed_values():
    with pytest.raises(ValidationError, match="(?s)polar_express_dtype.*'auto', 'float32' or 'bfloat16'"):
        PretrainSettings(polar_express_dtype="fp16")
