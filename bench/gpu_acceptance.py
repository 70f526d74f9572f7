"""Qualify a GPU node for the speedrun: measured tokens/s, MFU and peak memory against `chatpipe plan`.

    python bench/gpu_acceptance.py                       # every visible GPU, d12 and d24, bf16 and fp8
    python bench/gpu_acceptance.py --gpus 0 --depths 12  # one GPU, d12 only
    python bench/gpu_acceptance.py --peak-tflops 989     # a GPU chatpipe.train.loop.PEAK_FLOPS does not name

For each visible GPU (one at a time, one process: a per-GPU check, no NCCL), each depth and each
precision (bf16 autocast; bf16 + FP8 matmuls through torchao), it builds the `speedrun` profile's
model at that depth with its own device batch and sequence length, compiles model and optimizer as
the pretrain stage does, takes a few warm-up steps (compilation), then times ``--steps`` training
steps (d24: ``--d24-steps``) on random tokens. It prints one row per run beside what
``chatpipe plan`` assumes for the same model: tokens/s per GPU at the plan's MFU, and its memory
estimate.

Fails loudly (exit 1, the reasons listed) when a number is implausible: MFU at or above 100% or not
above 0 (a wrong FLOPs count or timer), peak memory above the GPU's, a non-finite loss, or a run that
raised (FP8 on a GPU before compute capability 8.9, out of memory). On a machine without CUDA it
stops at once with a message and exit 2: there is nothing to qualify.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from chatpipe.io import env_set  # noqa: E402
from chatpipe.model.fp8 import enable_fp8  # noqa: E402
from chatpipe.model.gpt import GPT  # noqa: E402
from chatpipe.runtime import Runtime  # noqa: E402
from chatpipe.settings import PretrainSettings, TokenizerSettings, load_section  # noqa: E402
from chatpipe.train.loop import PEAK_FLOPS, train_step  # noqa: E402
from chatpipe.train.optim import build_optimizers  # noqa: E402
from chatpipe.train.pretrain_plan import GIB, make_plan, model_config_for  # noqa: E402

PROFILE = "speedrun"
NO_GPU_EXIT = 2
WARMUP_STEPS = 3  # the first steps compile (model, optimizer); their time is not throughput


def no_gpu_message() -> str | None:
    """Why this machine cannot be qualified, or None when it has CUDA GPUs."""
    if not torch.cuda.is_available():
        return (
            "gpu_acceptance: no CUDA GPU on this machine (torch.cuda.is_available() is False; "
            f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}). This script qualifies a "
            "GPU node for the speedrun; run it there. CPU runs of the GPU code paths: the rehearsal_gpu profile."
        )
    return None


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
    """What `chatpipe plan --profile speedrun` assumes at ``depth``: tokens/s per GPU at its MFU, memory."""
    plan = with_env({"CHATPIPE_PRETRAIN__DEPTH": str(depth)}, make_plan, PROFILE, kind or "H100")
    return {"tok_s": plan.peak_flops * plan.mfu / plan.flops_per_token, "mfu": plan.mfu, "memory_gib": plan.memory_gib}


def measure(cfg: PretrainSettings, vocab: int, device: torch.device, *, fp8: bool, steps: int, peak: float) -> dict:
    """Time ``steps`` compiled training steps of the profile's model on ``device`` (one micro-batch each)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(model_config_for(cfg, vocab))
    model.init_weights()
    if fp8:
        enable_fp8(model)  # refuses GPUs before compute capability 8.9, naming it
    optimizers = build_optimizers(model, **cfg.optimizer_kwargs(), fused=True, compile=True, polar_dtype=torch.bfloat16)
    step_model = torch.compile(model)
    rt = Runtime(0, device.index or 0, 1, device, torch.bfloat16)
    # random tokens: throughput does not depend on the text; the loss only has to stay finite
    x = torch.randint(0, vocab, (cfg.device_batch_size, cfg.sequence_len), device=device)
    batch = (x, torch.roll(x, -1, dims=1))
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(WARMUP_STEPS):
        train_step(step_model, lambda: batch, optimizers, grad_accum=1, rt=rt)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    losses = [train_step(step_model, lambda: batch, optimizers, grad_accum=1, rt=rt) for _ in range(steps)]
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    tok_s = steps * cfg.device_batch_size * cfg.sequence_len / seconds
    return {
        "tok_s": tok_s,
        "mfu": model.flops_per_token() * tok_s / peak,
        "peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
        "loss": losses[-1],
        "step_s": seconds / steps,
    }


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


def qualify_gpu(index: int, depths: list[int], steps: dict[int, int], peak_tflops: float | None) -> list[str]:
    """Measure every depth x precision on GPU ``index``, print a row each; return the failures."""
    device = torch.device("cuda", index)
    name = torch.cuda.get_device_name(device)
    device_gib = torch.cuda.get_device_properties(device).total_memory / GIB
    kind = gpu_kind(name)
    peak = peak_tflops * 1e12 if peak_tflops else PEAK_FLOPS.get(kind or "", 0.0)
    if not peak:  # without a peak there is no MFU, and no plausibility check of it
        return [f"GPU {index} ({name}): peak FLOP/s unknown; pass --peak-tflops (bf16 dense)"]
    print(f"GPU {index}: {name}, {device_gib:.1f} GiB, peak {peak / 1e12:.0f} TFLOP/s (bf16 dense)")
    print(f"  {'run':<10} {'tok/s':>10} {'plan tok/s':>11} {'MFU':>6} {'plan MFU':>9} {'peak GiB':>9} {'plan GiB':>9}")
    failures = []
    for depth in depths:
        cfg, vocab = profile_at(depth)
        est = plan_estimate(depth, kind)
        for fp8 in (False, True):
            label = f"d{depth} {'fp8' if fp8 else 'bf16'}"
            try:
                row = measure(cfg, vocab, device, fp8=fp8, steps=steps[depth], peak=peak)
            except Exception as e:  # OOM, FP8 refused, a compile failure: the node does not qualify
                failures.append(f"GPU {index} {label}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                print(f"  {label:<10} FAILED ({type(e).__name__})")
                continue
            finally:
                torch._dynamo.reset()  # each run compiles afresh; nothing cached holds the last model's memory
                torch.cuda.empty_cache()
            print(
                f"  {label:<10} {row['tok_s']:>10,.0f} {est['tok_s']:>11,.0f} {row['mfu']:>6.1%} {est['mfu']:>9.0%} "
                f"{row['peak_gib']:>9.1f} {est['memory_gib']:>9.1f}"
            )
            failures += [f"GPU {index} {label}: {p}" for p in implausible(row, device_gib)]
    return failures


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when every run is plausible, 1 with the reasons when not, 2 without a CUDA GPU."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="all", help="'all' or comma-separated device indices")
    p.add_argument("--depths", default="12,24", help="comma-separated model depths (speedrun recipe)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (after the warm-up)")
    p.add_argument("--d24-steps", type=int, default=4, help="timed steps at depth 24 (a few: it is slow)")
    p.add_argument("--peak-tflops", type=float, default=None, help="bf16 dense peak, for GPUs not in PEAK_FLOPS")
    args = p.parse_args(argv)
    reason = no_gpu_message()
    if reason:
        print(reason, file=sys.stderr)
        return NO_GPU_EXIT
    gpus = range(torch.cuda.device_count()) if args.gpus == "all" else [int(g) for g in args.gpus.split(",")]
    depths = [int(d) for d in args.depths.split(",")]
    steps = {d: args.d24_steps if d >= 24 else args.steps for d in depths}
    failures = []
    for index in gpus:
        failures += qualify_gpu(index, depths, steps, args.peak_tflops)
    if failures:
        print("NOT QUALIFIED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print(f"qualified: {len(gpus)} GPU(s), every run plausible")
    return 0


if __name__ == "__main__":
    sys.exit(main())
