"""Qualify a GPU node for the speedrun: measured tokens/s, MFU and peak memory against `chatpipe plan`
and against nanochat's per-GPU figures.

    python bench/gpu_acceptance.py                       # every visible GPU, d24, bf16 and both fp8 recipes
    python bench/gpu_acceptance.py --gpus 0 --depths 12,24
    python bench/gpu_acceptance.py --peak-tflops 989     # a GPU chatpipe.train.step.PEAK_FLOPS does not name

For each visible GPU (one at a time, one process: a per-GPU check, no NCCL), each depth and each
precision (bf16 autocast; bf16 + FP8 matmuls through torchao's Float8Linear, and through chatpipe's
own tensorwise recipe), it builds the `speedrun` profile's model at that depth with its own device
batch and sequence length, compiles model and optimizer as the pretrain stage does, takes a few
warm-up steps (compilation), then times ``--steps`` training steps (d24: ``--d24-steps``) on random
tokens. It prints one row per run beside what ``chatpipe plan`` assumes for the same model (its MFU,
its memory estimate) and nanochat's per-GPU figure where one is known (:data:`NANOCHAT_PER_GPU`),
with chatpipe's ratio to it.

Then, at the d24 shape: a full-context attention row (SDPA ``is_causal``, the flash kernel), a
windowed row (FlexAttention with the sliding-window BlockMask) and the masked-SDPA row it replaced,
forward + backward each, so an attention regression shows apart from a matmul one; a check that
FlexAttention's gradients equal masked SDPA's; and a ``torch.profiler`` trace of a few d24 steps
whose top kernels by GPU time are printed (the trace is written to ``--trace``). The d24 MFU of each
precision is recorded in ``bench/gpu_measured.json`` (``--record``), which ``chatpipe plan`` reads
as its MFU for that GPU.

Fails loudly (exit 1, the reasons listed) when a number is implausible: MFU at or above 100% or not
above 0 (a wrong FLOPs count or timer), peak memory above the GPU's, a non-finite loss, or a run that
raised (FP8 on a GPU before compute capability 8.9, out of memory). On a machine without CUDA it
stops at once with a message and exit 2: there is nothing to qualify.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from chatpipe.model.fp8 import enable_fp8  # noqa: E402
from chatpipe.model.gpt import GPT  # noqa: E402
from chatpipe.runtime import Runtime  # noqa: E402
from chatpipe.settings import PretrainSettings  # noqa: E402
from chatpipe.testing.gpu_acceptance import (  # noqa: E402
    PRECISIONS,
    gpu_kind,
    implausible,
    nanochat_columns,
    plan_estimate,
    profile_at,
    record_mfu,
    target_report,
)
from chatpipe.train.optim import build_optimizers  # noqa: E402
from chatpipe.train.pretrain_plan import (  # noqa: E402
    GIB,
    MEASURED_MFU_FILE,
    model_config_for,
)
from chatpipe.train.step import PEAK_FLOPS, train_step  # noqa: E402

NO_GPU_EXIT = 2
WARMUP_STEPS = 3  # the first steps compile (model, optimizer); their time is not throughput
PROFILE_STEPS = 3  # d24 steps under torch.profiler (after the timed ones)
TOP_KERNELS = 15


def no_gpu_message() -> str | None:
    """Why this machine cannot be qualified, or None when it has CUDA GPUs."""
    if not torch.cuda.is_available():
        return (
            "gpu_acceptance: no CUDA GPU on this machine (torch.cuda.is_available() is False; "
            f"torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'}). This script qualifies a "
            "GPU node for the speedrun; run it there. CPU runs of the GPU code paths: the rehearsal_gpu profile."
        )
    return None


def measure(
    cfg: PretrainSettings,
    vocab: int,
    device: torch.device,
    *,
    precision: str,
    steps: int,
    peak: float,
    trace: Path | None,
) -> dict:
    """Time ``steps`` compiled training steps of the profile's model on ``device`` (one micro-batch each);
    with ``trace``, profile a few more steps there and keep the top kernels."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(model_config_for(cfg, vocab))
    model.init_weights()
    if precision != "bf16":
        enable_fp8(model, precision.split()[1])  # refuses GPUs before compute capability 8.9, naming it
    optimizers = build_optimizers(model, **cfg.optimizer_kwargs(), fused=True, compile=True, polar_dtype=torch.bfloat16)
    step_model = torch.compile(model)
    rt = Runtime(0, device.index or 0, 1, device, torch.bfloat16)
    # random tokens: throughput does not depend on the text; the loss only has to stay finite
    x = torch.randint(0, vocab, (cfg.device_batch_size, cfg.sequence_len), device=device)
    batch = (x, torch.roll(x, -1, dims=1))

    def step() -> float:
        return train_step(step_model, lambda: batch, optimizers, grad_accum=1, rt=rt)

    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(WARMUP_STEPS):
        step()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    losses = [step() for _ in range(steps)]
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    tok_s = steps * cfg.device_batch_size * cfg.sequence_len / seconds
    row = {
        "tok_s": tok_s,
        "mfu": model.flops_per_token() * tok_s / peak,
        "peak_gib": torch.cuda.max_memory_allocated(device) / GIB,
        "loss": losses[-1],
        "step_s": seconds / steps,
    }
    if trace is not None:
        row["top_kernels"] = profile_steps(step, trace)
    return row


def profile_steps(step, trace: Path) -> str:
    """Run :data:`PROFILE_STEPS` steps under torch.profiler, write the Chrome trace, return the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILE_STEPS):
            step()
        torch.cuda.synchronize()
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    return prof.key_averages().table(sort_by="self_device_time_total", row_limit=TOP_KERNELS, max_name_column_width=70)


def _time_ms(fn, repeats: int = 10) -> float:
    """Mean milliseconds of ``fn()`` on the GPU (after two warm-up calls: compilation, autotuning)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats * 1e3


def attention_rows(cfg: PretrainSettings, vocab: int, device: torch.device, peak: float) -> list[str]:
    """Forward + backward of one attention layer at the profile's shape: full context (SDPA is_causal),
    the sliding window through FlexAttention, and through masked SDPA (the path FlexAttention replaced).
    Prints a row each and the gradient check; returns the failures."""
    import torch.nn.functional as F

    from chatpipe.model.attention import FlexWindow, flex_window_attention
    from chatpipe.model.gpt import layer_windows

    config = model_config_for(cfg, vocab)
    window = next(w for w in layer_windows(config) if w is not None)
    b, h, kv, t, d = cfg.device_batch_size, config.n_head, config.n_kv_head, cfg.sequence_len, config.head_dim
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, h, t, d, device=device, dtype=torch.bfloat16, generator=gen, requires_grad=True)
    k, v = (
        torch.randn(b, kv, t, d, device=device, dtype=torch.bfloat16, generator=gen, requires_grad=True) for _ in "kv"
    )
    pos = torch.arange(t, device=device)
    mask = (pos[None] <= pos[:, None]) & (pos[:, None] - pos[None] < window)
    gqa = kv != h
    paths = {
        "attn full (sdpa causal)": (
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa),
            t / 2,
        ),
        f"attn window {window} (flex)": (lambda: flex_window_attention(q, k, v, FlexWindow(window, t)), window),
        f"attn window {window} (masked sdpa)": (
            lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa),
            window,
        ),
    }
    print(f"  {'attention (fwd+bwd, one layer)':<36} {'ms':>8} {'TFLOP/s':>8} {'MFU':>6}")
    fa4 = flash_attn_4_window(q, k, v, window)
    if fa4 is not None:  # side by side where the package is installed (not a dependency until it wins)
        paths[f"attn window {window} (flash-attn-4)"] = (fa4, window)
    for label, (fn, keys) in paths.items():
        try:
            ms = _time_ms(lambda fn=fn: fn().sum().backward())
        except Exception as e:  # an optional kernel that does not run here is a line, not a failure
            print(f"  {label:<36} unavailable: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            continue
        flops = 3 * 4 * b * h * t * keys * d  # forward 2 matmuls x 2 FLOPs; backward twice the forward
        print(f"  {label:<36} {ms:>8.2f} {flops / ms / 1e9:>8.0f} {flops / ms / 1e-3 / peak:>6.1%}")
    return flex_backward_check(q, k, v, paths)


def flash_attn_4_window(q, k, v, window: int):
    """The sliding window through flash-attn-4 (``flash_attn.cute``, [B, T, H, D] layout), or None when
    that package is not installed."""
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        print("  flash-attn-4 not installed: no row for it (pip install flash-attn-4 to compare)")
        return None

    def run():
        out = flash_attn_func(*(x.transpose(1, 2) for x in (q, k, v)), causal=True, window_size=(window - 1, 0))
        return (out[0] if isinstance(out, tuple) else out).transpose(1, 2)

    return run


def flex_backward_check(q, k, v, paths: dict) -> list[str]:
    """FlexAttention's output and gradients against masked SDPA's on the same inputs (bf16: 2% of each's scale)."""
    flex, sdpa = (paths[label][0] for label in paths if label.endswith(("(flex)", "(masked sdpa)")))
    results = []
    for fn in (flex, sdpa):
        for x in (q, k, v):
            x.grad = None
        d_out = torch.randn(q.shape, device=q.device, dtype=q.dtype, generator=torch.Generator(q.device).manual_seed(1))
        out = fn()
        out.backward(d_out)
        results.append([out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()])
    failures, worst = [], 0.0
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        rel = ((a - b).abs().max() / b.abs().max()).item()
        worst = max(worst, rel)
        if not rel < 0.02:
            failures.append(f"flex attention {name} differs from masked SDPA by {rel:.2%} of its scale")
    print(f"  flex vs masked SDPA (out, dq, dk, dv): worst difference {worst:.3%} of scale (limit 2%)")
    return failures


def qualify_gpu(index: int, depths: list[int], steps: dict[int, int], args: argparse.Namespace) -> list[str]:
    """Measure every depth x precision on GPU ``index``, print a row each, then the attention rows and
    the profile; record the d24 MFUs; return the failures."""
    device = torch.device("cuda", index)
    name = torch.cuda.get_device_name(device)
    device_gib = torch.cuda.get_device_properties(device).total_memory / GIB
    kind = gpu_kind(name)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else PEAK_FLOPS.get(kind or "", 0.0)
    if not peak:  # without a peak there is no MFU, and no plausibility check of it
        return [f"GPU {index} ({name}): peak FLOP/s unknown; pass --peak-tflops (bf16 dense)"]
    print(f"GPU {index}: {name}, {device_gib:.1f} GiB, peak {peak / 1e12:.0f} TFLOP/s (bf16 dense)")
    print(
        f"  {'run':<18} {'tok/s':>9} {'MFU':>6} {'plan MFU':>8} {'peak GiB':>8} {'plan GiB':>8}"
        f" {'nanochat tok/s':>12} {'MFU':>6} {'ratio':>6}"
    )
    failures, rows, top = [], {}, None
    for depth in depths:
        cfg, vocab = profile_at(depth)
        est = plan_estimate(depth, kind)
        for precision in PRECISIONS:
            label = f"d{depth} {precision}"
            trace = args.trace if depth == max(depths) and precision == PRECISIONS[-1] else None
            try:
                row = measure(cfg, vocab, device, precision=precision, steps=steps[depth], peak=peak, trace=trace)
            except Exception as e:  # OOM, FP8 refused, a compile failure: the node does not qualify
                failures.append(f"GPU {index} {label}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
                print(f"  {label:<18} FAILED ({type(e).__name__})")
                continue
            finally:
                torch._dynamo.reset()  # each run compiles afresh; nothing cached holds the last model's memory
                torch.cuda.empty_cache()
            rows[label], top = {**row, "plan_gib": est["memory_gib"]}, row.get("top_kernels", top)
            print(
                f"  {label:<18} {row['tok_s']:>9,.0f} {row['mfu']:>6.1%} {est['mfu']:>8.0%} {row['peak_gib']:>8.1f}"
                f" {est['memory_gib']:>8.1f} {nanochat_columns(depth, precision, row)}"
            )
            failures += [f"GPU {index} {label}: {p}" for p in implausible(row, device_gib)]
    print_ratios(rows, depths)
    if 24 in depths:
        print(target_report(rows))
    cfg, vocab = profile_at(max(depths))
    failures += attention_rows(cfg, vocab, device, peak)
    if top:
        print(f"top {TOP_KERNELS} kernels by GPU time, {PROFILE_STEPS} d{max(depths)} steps ({args.trace}):\n{top}")
    if args.record and kind:
        record_mfu(Path(args.record), kind, name, rows, max(depths))
    return failures


def print_ratios(rows: dict, depths: list[int]) -> None:
    """Each fp8 recipe's speed against bf16 at each depth, and the faster recipe."""
    for depth in depths:
        bf16 = rows.get(f"d{depth} bf16")
        fp8 = {p: rows[f"d{depth} {p}"] for p in PRECISIONS[1:] if f"d{depth} {p}" in rows}
        if bf16 and fp8:
            ratios = ", ".join(f"{p} {r['tok_s'] / bf16['tok_s']:.2f}x" for p, r in fp8.items())
            best = max(fp8, key=lambda p: fp8[p]["tok_s"])
            print(f"  d{depth} against bf16: {ratios}; faster fp8 recipe: {best.split()[1]}")


def main(argv: list[str] | None = None) -> int:
    """Exit 0 when every run is plausible, 1 with the reasons when not, 2 without a CUDA GPU."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default="all", help="'all' or comma-separated device indices")
    p.add_argument("--depths", default="24", help="comma-separated model depths (speedrun recipe)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (after the warm-up)")
    p.add_argument("--d24-steps", type=int, default=4, help="timed steps at depth 24 (a few: it is slow)")
    p.add_argument("--peak-tflops", type=float, default=None, help="bf16 dense peak, for GPUs not in PEAK_FLOPS")
    p.add_argument("--trace", type=Path, default=REPO / "bench" / "out" / "gpu_trace.json", help="profiler trace")
    p.add_argument("--record", default=str(MEASURED_MFU_FILE), help="measured MFU file ('' = do not write)")
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
        failures += qualify_gpu(index, depths, steps, args)
    if failures:
        print("NOT QUALIFIED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print(f"qualified: {len(gpus)} GPU(s), every run plausible")
    return 0


if __name__ == "__main__":
    sys.exit(main())
