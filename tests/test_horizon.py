"""nanochat's training-horizon derivation (chatpipe.horizon, chatpipe.train.pretrain_plan.horizon_for) against its own numbers.

``../shared/reference/nanochat/derivation.jsonl`` holds what nanochat's ``base_train.py`` derived for
several depths, ratios and a FLOPs horizon (8 GPUs, device batch 16, seq 2048, head dim 128, SSSL,
weight decay 0.28); every line must come out of chatpipe's derivation the same.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from chatpipe.horizon import REFERENCE_BATCH, derive_horizon, power_lines_batch
from chatpipe.model.gpt import GPT
from chatpipe.settings import PretrainSettings
from chatpipe.train.pretrain_plan import PlanCounts, apply_horizon, horizon_for, model_config_for, plan_counts
from chatpipe.train.step import grad_accum_steps

REPO = Path(__file__).resolve().parents[1]
REF = Path(os.environ.get("CHATPIPE_NANOCHAT_REF", REPO.parent / "shared" / "reference" / "nanochat"))
DERIVATION = REF / "derivation.jsonl"
WORLD = 8  # the reference was derived for one 8-GPU node


def reference_lines() -> list[dict]:
    if not DERIVATION.exists():
        pytest.skip(f"nanochat derivation vectors not at {DERIVATION}")
    lines = [json.loads(line) for line in DERIVATION.read_text().splitlines() if line.strip()]
    assert lines, f"{DERIVATION} is empty"
    return lines


def nanochat_settings(row: dict) -> PretrainSettings:
    """nanochat's base_train options of the reference run, as chatpipe pretrain settings."""
    return PretrainSettings(
        depth=row["depth"],
        head_dim=128,
        sequence_len=2048,
        device_batch_size=16,
        window_pattern="SSSL",
        short_window="quarter",
        value_embeds=True,
        lambdas=True,
        smear=True,
        backout=True,
        rotary_base=100000.0,
        qk_scale=1.2,
        pad_vocab_to=64,
        optimizer="normuon_polar_express",
        total_batch_size=-1,
        max_steps=-1,
        target_param_data_ratio=row["ratio"],
        target_flops=row["target_flops"],
        lr_scaling=True,
        wd_scaling=True,
        weight_decay=0.28,
        matrix_lr=0.02,
        embedding_lr=0.3,
        unembedding_lr=0.008,
        scalar_lr=0.5,
    )


def test_every_line_of_nanochats_derivation_is_reproduced():
    rows = reference_lines()
    for row in rows:
        cfg = nanochat_settings(row)
        counts = plan_counts(cfg, row["vocab"])
        horizon = horizon_for(cfg, counts, WORLD)
        where = f"depth {row['depth']}, ratio {row['ratio']}, target_flops {row['target_flops']}"
        assert counts.run.num_params == row["params_total"], where
        got = (horizon.scaling_params, horizon.flops_per_token, horizon.target_tokens)
        assert got == (row["scaling_params"], row["flops_per_token"], row["target_tokens"]), where
        assert (horizon.total_batch_size, horizon.num_iterations) == (row["total_batch_size"], row["num_iterations"]), (
            where
        )
        assert grad_accum_steps(horizon.total_batch_size, 16, 2048, WORLD) == row["grad_accum"], where
        # the file rounds these two to 6 decimals (0.059738 is 0.0597384...), so a relative 1e-6 is below
        # its own precision for the weight decay: equal once rounded as the file rounds, which is stricter
        assert round(horizon.batch_lr_scale, 6) == row["batch_lr_scale"], where
        assert horizon.batch_lr_scale == pytest.approx(row["batch_lr_scale"], rel=1e-6), where
        assert round(horizon.weight_decay, 6) == row["weight_decay"], where
        run = apply_horizon(cfg, horizon)
        for key in ("matrix_lr", "embedding_lr", "unembedding_lr", "scalar_lr"):
            assert getattr(run, key) == pytest.approx(row[key], rel=1e-12), (where, key)
        assert (run.total_batch_size, run.max_steps, run.weight_decay) == (
            horizon.total_batch_size,
            horizon.num_iterations,
            horizon.weight_decay,
        )
    assert {row["target_flops"] > 0 for row in rows} == {True, False}  # both horizons are covered


def test_power_lines_batch_and_scalings_by_hand():
    # 4x the reference's tokens: 4**0.383 = 1.70 -> 2**19 * 1.70 rounds (in log2) to 2**20
    assert power_lines_batch(4e9, 1e9) == 2 * REFERENCE_BATCH
    assert power_lines_batch(1e9, 1e9) == REFERENCE_BATCH
    assert power_lines_batch(-2e9, -1e9) == REFERENCE_BATCH  # ratio off: N / N_ref, 2**0.383 = 1.30 -> 2**19
    h = derive_horizon(scaling_params=400, reference_params=100, flops_per_token=10, ratio=10.0 * (1 << 20))
    assert h.total_batch_size == 1 << 20 and h.target_tokens == 4000 << 20 and h.num_iterations == 4000
    assert h.batch_lr_scale == pytest.approx(math.sqrt(2)) and h.lr_scaled
    assert h.weight_decay == pytest.approx(0.28 * math.sqrt(2) / 4)
    off = derive_horizon(
        scaling_params=400,
        reference_params=100,
        flops_per_token=10,
        ratio=10.0,
        total_batch_size=1000,
        weight_decay=0.1,
        lr_scaling=False,
        wd_scaling=False,
    )
    assert (off.total_batch_size, off.num_iterations, off.weight_decay, off.lr_scaled) == (1000, 4, 0.1, False)
    flops = derive_horizon(scaling_params=400, reference_params=100, flops_per_token=10, ratio=-1, target_flops=1e6)
    assert flops.total_batch_size == REFERENCE_BATCH * 2 and flops.num_iterations == round(1e6 / (10 * (1 << 20)))
    steps = derive_horizon(scaling_params=400, reference_params=100, flops_per_token=10, ratio=20, num_iterations=7)
    assert steps.num_iterations == 7  # max_steps wins over both horizons


def test_lr_scaling_touches_every_lr_and_nothing_when_off():
    cfg = PretrainSettings(total_batch_size=-1, lr_scaling=True, wd_scaling=False, weight_decay=0.2)
    counts = plan_counts(cfg, 1024)
    horizon = horizon_for(cfg, counts, 1)
    run = apply_horizon(cfg, horizon)
    for key in (*cfg.LR_KEYS, "scalar_lr"):
        assert getattr(run, key) == pytest.approx(getattr(cfg, key) * horizon.batch_lr_scale)
    assert run.weight_decay == 0.2 and horizon.batch_lr_scale != 1.0
    fixed = PretrainSettings()  # tiny defaults: the 2025 numbers, nothing derived
    fixed_run = apply_horizon(fixed, horizon_for(fixed, counts, 1))
    assert fixed_run.lrs() == fixed.lrs() and fixed_run.weight_decay == fixed.weight_decay


def test_a_horizon_needs_a_length_and_bad_values_name_the_allowed_ones():
    with pytest.raises(ValidationError, match="target_param_data_ratio = -1 .*needs target_flops > 0 or max_steps"):
        PretrainSettings(target_param_data_ratio=-1, max_steps=-1)
    with pytest.raises(ValidationError, match="target_param_data_ratio = 0.0; allowed: a number > 0, or -1"):
        PretrainSettings(target_param_data_ratio=0)
    with pytest.raises(ValidationError, match="target_flops = -5.0; allowed: a number > 0, or -1"):
        PretrainSettings(target_flops=-5)
    with pytest.raises(ValidationError, match="lr_scaling"):
        PretrainSettings(lr_scaling="sometimes")
    PretrainSettings(target_param_data_ratio=-1, target_flops=1e18, max_steps=-1)  # the scaling-laws horizon


def test_a_batch_that_does_not_split_into_micro_batches_is_refused():
    cfg = PretrainSettings(total_batch_size=-1, device_batch_size=3, sequence_len=256, lr_scaling=True)
    with pytest.raises(ValueError, match="not a multiple of device_batch_size x sequence_len x world size"):
        horizon_for(cfg, plan_counts(cfg, 1024), 1)


def test_the_plan_counts_the_model_once_as_the_stage_builds_it():
    cfg = PretrainSettings(total_batch_size=-1, lr_scaling=True, depth=2, sequence_len=64)
    counts = plan_counts(cfg, 300)
    built = GPT(model_config_for(cfg, 300)).counts()  # on the CPU, as the stage builds its model
    assert counts.run == built and counts.reference.n_layer == 12
    assert PretrainSettings().total_batch_size > 0 and plan_counts(PretrainSettings(), 300).reference is None
    with pytest.raises(ValueError, match="needs the d12 reference's counts"):
        horizon_for(cfg, PlanCounts(built, None), 1)
