"""The judging half of bench/gpu_acceptance.py, which tests/test_gpu_acceptance.py checks without a GPU:
what ``chatpipe plan`` assumes for a speedrun model, nanochat's per-GPU figures beside a measured row,
why a row cannot be right, the issue-44 targets met or not, and the MFU record the plan reads."""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import torch

from chatpipe.io import env_set
from chatpipe.model.fp8 import FP8_RECIPES
from chatpipe.model.gpt import GPT
from chatpipe.settings import PretrainSettings, TokenizerSettings, load_section
from chatpipe.train.pretrain_plan import GIB, make_plan, model_config_for, model_memory_bytes
from chatpipe.train.step import PEAK_FLOPS

REPO = Path(__file__).resolve().parents[2]
PROFILE = "speedrun"
PRECISIONS = ("bf16", *(f"fp8 {recipe}" for recipe in FP8_RECIPES))
# nanochat's per-GPU throughput (tokens / time / 8 GPUs of its 8xH100 leaderboard runs; same FLOPs count
# and 989 TFLOP/s peak): d24 bf16 from its Run 1, fp8 from Run 6 (5,567 x 2**20 tokens in 99 min)
NANOCHAT_PER_GPU = {(24, "bf16"): (100_000, 0.50), (24, "fp8"): (123_000, 0.59)}
# the speed targets at d24 (issue 44): fp8 MFU, bf16 MFU, fp8 over bf16, and peak memory against the plan
TARGETS = {"fp8_mfu": 0.55, "bf16_mfu": 0.47, "fp8_over_bf16": 1.12, "memory_vs_plan": 0.10}


def gpu_kind(name: str) -> str | None:
    """The PEAK_FLOPS key (and `chatpipe plan --gpu` name) of a device name like 'NVIDIA H100 80GB HBM3'."""
    return next((k for k in PEAK_FLOPS if k in name), None)


def with_env(overrides: dict[str, str], fn, *args):
    """Call ``fn(*args)`` with environment variables set (settings read the profile and depth from there)."""
    with env_set(**overrides):
        return fn(*args)


def profile_at(depth: int) -> tuple[PretrainSettings, int]:
    """The speedrun's pretrain settings at ``depth`` (its batch, sequence, recipe options) and its vocab size."""
    env = {"CHATPIPE_PROFILE": PROFILE, "CHATPIPE_PRETRAIN__DEPTH": str(depth)}
    cfg = with_env(env, load_section, PretrainSettings)
    vocab = with_env(env, load_section, TokenizerSettings).vocab_size
    return cfg, vocab


def plan_estimate(depth: int, kind: str | None) -> dict[str, float]:
    """What `chatpipe plan --profile speedrun` assumes at ``depth``: tokens/s per GPU at its MFU, and its
    memory for the step measured here (compiled, one micro-batch: no gradients held across micro-batches)."""
    plan = with_env({"CHATPIPE_PRETRAIN__DEPTH": str(depth)}, make_plan, PROFILE, kind or "H100")
    cfg, vocab = profile_at(depth)
    with torch.device("meta"):
        model = GPT(model_config_for(cfg, vocab))
    memory = model_memory_bytes(model.counts(), cfg.device_batch_size, cfg.sequence_len) / GIB
    return {"tok_s": plan.peak_flops * plan.mfu / plan.flops_per_token, "mfu": plan.mfu, "memory_gib": memory}


def nanochat_columns(depth: int, precision: str, row: dict) -> str:
    """nanochat's per-GPU tok/s and MFU for this depth and precision, and chatpipe's ratio ('-' unknown)."""
    known = NANOCHAT_PER_GPU.get((depth, precision.split()[0]))
    if known is None:
        return f"{'-':>12} {'-':>6} {'-':>6}"
    tok_s, mfu = known
    return f"{tok_s:>12,} {mfu:>6.0%} {row['mfu'] / mfu:>6.2f}"


def implausible(row: dict, device_gib: float) -> list[str]:
    """Why a measured row cannot be right (empty when it is plausible)."""
    problems = []
    if not 0 < row["mfu"] < 1:  # a FLOPs count or a timer that is wrong, not a fast GPU
        problems.append(f"MFU {row['mfu']:.1%} is outside (0%, 100%)")
    if not 0 < row["peak_gib"] <= device_gib:
        problems.append(f"peak memory {row['peak_gib']:.1f} GiB is outside (0, {device_gib:.1f}] GiB")
    if not math.isfinite(row["loss"]):
        problems.append(f"loss {row['loss']} is not finite")
    if not row["tok_s"] > 0:
        problems.append(f"tokens/s {row['tok_s']} is not positive")
    return problems


def target_report(rows: dict) -> str:
    """One line per d24 target (:data:`TARGETS`): the measured value and whether it is met."""
    bf16 = rows.get("d24 bf16")
    fp8 = max((rows[f"d24 {p}"] for p in PRECISIONS[1:] if f"d24 {p}" in rows), key=lambda r: r["mfu"], default=None)
    if not bf16 or not fp8:
        return "  targets: not every d24 row ran"
    checks = [
        ("d24 fp8 MFU", f"{fp8['mfu']:.1%}", fp8["mfu"] >= TARGETS["fp8_mfu"], f">= {TARGETS['fp8_mfu']:.0%}"),
        ("d24 bf16 MFU", f"{bf16['mfu']:.1%}", bf16["mfu"] >= TARGETS["bf16_mfu"], f">= {TARGETS['bf16_mfu']:.0%}"),
        (
            "fp8 / bf16",
            f"{fp8['mfu'] / bf16['mfu']:.2f}x",
            fp8["mfu"] / bf16["mfu"] >= TARGETS["fp8_over_bf16"],
            ">= 1.12x",
        ),
    ]
    for name, row in (("bf16", bf16), ("fp8", fp8)):
        off = row["peak_gib"] / row["plan_gib"] - 1
        checks.append((f"d24 {name} peak vs plan", f"{off:+.1%}", abs(off) <= TARGETS["memory_vs_plan"], "within 10%"))
    return "\n".join(
        f"  target {name:<22} {value:>8} ({goal}): {'met' if ok else 'NOT met'}" for name, value, ok, goal in checks
    )


def record_mfu(path: Path, kind: str, name: str, rows: dict, depth: int) -> None:
    """Write the measured MFU at ``depth`` per precision for this GPU kind to ``path`` (what `chatpipe plan`
    reads): bf16, and fp8 as the faster recipe's."""
    bf16 = rows.get(f"d{depth} bf16")
    fp8 = [rows[f"d{depth} {p}"] for p in PRECISIONS[1:] if f"d{depth} {p}" in rows]
    if not bf16 or not fp8:
        return
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    data = json.loads(path.read_text()) if path.exists() else {}
    data[kind] = {
        "bf16": round(bf16["mfu"], 4),
        "fp8": round(max(r["mfu"] for r in fp8), 4),
        "depth": depth,
        "device": name,
        "commit": commit.stdout.strip() or "unknown",
        "date": time.strftime("%Y-%m-%d"),
    }
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(f"recorded d{depth} MFU for {kind} in {path}")
