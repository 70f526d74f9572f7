"""`device_batch_size: auto`: the largest device batch whose planned peak fits a memory budget and that
divides the rows each rank takes per step, so gradient accumulation keeps `total_batch_size`."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from chatpipe.io import env_set
from chatpipe.settings import LaunchSettings, ParamsError, PretrainSettings, TokenizerSettings, load_section
from chatpipe.train.pretrain_plan import (
    GIB,
    choose_device_batch,
    main,
    make_plan,
    memory_budget,
    model_memory_bytes,
    plan_counts,
    resolve_device_batch,
)

# d12 is the speedrun recipe at depth 12 (nanochat's reference), d20 the 2025 recipe, d24 the speedrun (8 GPUs, and one)
SCALES = {
    "d12": ("speedrun", {"CHATPIPE_PRETRAIN__DEPTH": "12"}),
    "d20": ("d20", {}),
    "d24": ("speedrun", {}),
    "d24 on one GPU": ("speedrun_1gpu", {}),
}


def peak_of(profile: str, env: dict[str, str], batch: int, total_batch_size: int) -> tuple[int, int]:
    """(planned compiled peak of ``batch`` with the accumulation it needs, rows per rank) for a profile."""
    with env_set(CHATPIPE_PROFILE=profile, **env):
        cfg = load_section(PretrainSettings)
        vocab = load_section(TokenizerSettings).vocab_size
        launch = load_section(LaunchSettings)
    counts = plan_counts(cfg, vocab).run
    rows = total_batch_size // (cfg.sequence_len * launch.nnodes * launch.nproc_per_node)
    return model_memory_bytes(counts, batch, cfg.sequence_len, max(1, rows // batch)), rows


@pytest.mark.parametrize("scale", SCALES)
def test_auto_fits_24_80_and_141_gib_and_the_next_batch_does_not(params_file, scale):
    profile, env = SCALES[scale]
    chosen = []
    for budget in (24, 80, 141):
        with env_set(**env):
            plan = make_plan(profile, memory_gib=budget, device_batch_size="auto")
        batch = plan.device_batch_size
        peak, rows = peak_of(profile, env, batch, plan.total_batch_size)
        assert rows % batch == 0 and plan.grad_accum == rows // batch  # the total batch stays
        assert batch * plan.grad_accum * 2048 * plan.world_size == plan.total_batch_size
        assert peak <= budget * GIB and plan.memory_gib == pytest.approx(peak / GIB)
        larger = [b for b in range(batch + 1, rows + 1) if rows % b == 0]
        assert all(peak_of(profile, env, b, plan.total_batch_size)[0] > budget * GIB for b in larger), scale
        assert f"batch {batch} plans ~{peak / GIB:.1f} GiB" in plan.batch_choice
        chosen.append(batch)
    assert chosen == sorted(chosen) and chosen[0] < chosen[-1]  # more memory, a larger batch


def test_an_impossible_budget_names_the_smallest_that_fits(params_file, capsys):
    plan = make_plan("speedrun", device_batch_size=1, memory_gib=5)
    least, _ = peak_of("speedrun", {}, 1, plan.total_batch_size)  # batch 1: the smallest peak
    need = math.ceil(least / GIB * 10) / 10  # GiB, rounded up to the tenth the message names
    with pytest.raises(ValueError, match=f"batch 1's, is ~{least / GIB:.1f} GiB per device.*at least {need:.1f} GiB"):
        make_plan("speedrun", memory_gib=least / GIB - 0.05, device_batch_size="auto")
    assert make_plan("speedrun", memory_gib=need, device_batch_size="auto").device_batch_size == 1  # it does fit
    assert main(["--profile", "speedrun", "--device-batch-size", "auto", "--memory-gib", "5"]) == 2
    assert f"at least {need:.1f} GiB" in capsys.readouterr().err


def test_cli_prints_the_choice_and_the_next_batchs_peak(params_file, capsys):
    assert main(["--profile", "speedrun", "--device-batch-size", "auto", "--memory-gib", "80"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "device batch" in x)
    assert "auto: batch 16 plans" in line and "(--memory-gib 80)" in line and "batch 32 would plan" in line
    main(["--profile", "speedrun"])  # a set batch is printed as set
    assert "device batch     16 rows per GPU per forward (set)" in capsys.readouterr().out


def test_without_a_budget_the_plan_takes_the_gpus_memory(params_file):
    h100 = make_plan("speedrun", gpu="H100", device_batch_size="auto")
    h200 = make_plan("speedrun", gpu="H200", device_batch_size="auto")
    assert "the H100's memory" in h100.batch_choice and h100.device_batch_size < h200.device_batch_size


def test_only_divisors_of_the_rows_per_rank_are_chosen():
    counts = plan_counts(PretrainSettings(depth=2), 512).run
    peak = {b: model_memory_bytes(counts, b, 64, 12 // b) for b in (1, 2, 3, 4, 6, 12)}
    budget = (peak[4] + peak[6]) // 2  # a batch of 5 would fit, but 12 rows do not split into fives
    choice = choose_device_batch(counts, 12 * 64 * 2, 64, 2, budget)
    assert (choice.device_batch_size, choice.grad_accum, choice.larger) == (4, 3, 6)
    assert (choice.peak_bytes, choice.larger_peak_bytes) == (peak[4], peak[6])
    with pytest.raises(ValueError, match="not a multiple of sequence_len x world size = 128"):
        choose_device_batch(counts, 1000, 64, 2, budget)


def test_the_stage_resolves_auto_once_and_logs_it(caplog):
    cfg = PretrainSettings(depth=2, device_batch_size="auto", total_batch_size=4096, sequence_len=64)
    counts = plan_counts(cfg, 512).run
    with pytest.raises(ValueError, match="'auto' on cpu needs a memory budget: set pretrain.memory_gib"):
        resolve_device_batch(cfg, counts, 1, torch.device("cpu"))
    small = model_memory_bytes(counts, 8, 64, 8) / GIB  # between batch 8's and 16's peak
    with caplog.at_level(logging.INFO):
        resolved = resolve_device_batch(cfg.model_copy(update={"memory_gib": small}), counts, 1, torch.device("cpu"))
    assert resolved.device_batch_size == 8 and "device_batch_size: auto -> 8 (grad accum 8)" in caplog.text
    assert "MiB of the" in caplog.text  # a tiny step is named in MiB, not as 0.0 GiB
    given = cfg.model_copy(update={"device_batch_size": 4})
    assert resolve_device_batch(given, counts, 1, torch.device("cpu")) is given


def test_on_a_gpu_the_budget_is_its_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: type("P", (), {"total_memory": 80 << 30}))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA H100")
    assert memory_budget(0, torch.device("cuda", 0)) == (80 << 30, "NVIDIA H100's memory")
    assert memory_budget(24, torch.device("cuda", 0)) == (24 << 30, "pretrain.memory_gib = 24")


@pytest.mark.parametrize("bad", ["big", "0", "-2", "2.5", "true", "Auto"])
def test_bad_device_batch_size_names_the_key_and_the_allowed_values(bad):
    with pytest.raises(ParamsError, match=r"pretrain\.device_batch_size.*allowed: 'auto' or an integer >= 1"):
        load_section(PretrainSettings, {"device_batch_size": bad})
    assert load_section(PretrainSettings, {"device_batch_size": "auto"}).device_batch_size == "auto"
    assert load_section(PretrainSettings, ["--device_batch_size=8"]).device_batch_size == 8
