"""What a profile's pretraining will cost, before spending it: ``chatpipe plan --profile speedrun``.

Prints the model's parameter count, FLOPs per token, tokens to train, steps, gradient accumulation,
estimated time and cost on a given GPU, and an estimate of memory per GPU. The model is built on
the ``meta`` device, so planning a 1B-parameter model allocates nothing.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict, dataclass

import torch

from chatpipe.model.gpt import GPT, config_from_depth
from chatpipe.settings import LaunchSettings, PretrainSettings, TokenizerSettings, load_section
from chatpipe.train.loop import PEAK_FLOPS, grad_accum_steps

GIB = 1024**3


@dataclass
class Plan:
    """Pretraining budget of one profile on one kind of GPU."""

    profile: str
    depth: int
    n_embd: int
    n_layer: int
    vocab_size: int
    num_params: int
    flops_per_token: int
    tokens: int
    steps: int
    total_batch_size: int
    world_size: int
    grad_accum: int
    total_flops: float
    gpu: str
    peak_flops: float
    mfu: float
    hours: float
    usd: float
    memory_gib: float


def estimate_memory_bytes(
    num_params: int,
    num_embedding_params: int,
    n_layer: int,
    n_embd: int,
    vocab_size: int,
    device_batch_size: int,
    sequence_len: int,
) -> int:
    """Rough peak training memory of one GPU (bf16 autocast, flash attention, fp32 master weights).

    Weights + grads in fp32 (8 B/param), AdamW moments for embedding and lm_head (8 B/param), Muon
    momentum for the matrices (4 B/param); activations ~16 bytes per token per channel per layer
    (ReLU² MLP, no dropout); logits in bf16 plus fp32 softcap/loss copies (~6 B per vocab entry).
    """
    tokens = device_batch_size * sequence_len
    adam_params = 2 * num_embedding_params  # wte + lm_head
    states = 8 * num_params + 8 * adam_params + 4 * (num_params - adam_params)
    activations = 16 * tokens * n_embd * n_layer
    logits = 6 * tokens * vocab_size
    return states + activations + logits


def check_memory_fits(estimate_bytes: int, device: torch.device, device_batch_size: int) -> None:
    """Raise a clear error before training when the estimate exceeds the GPU's memory."""
    if device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    if estimate_bytes > total:
        raise RuntimeError(
            f"pretrain.device_batch_size = {device_batch_size} needs ~{estimate_bytes / GIB:.1f} GiB per GPU "
            f"but {torch.cuda.get_device_name(device)} has {total / GIB:.1f} GiB; lower device_batch_size "
            f"(total_batch_size stays, gradient accumulation makes up the difference)"
        )


def make_plan(profile: str, gpu: str = "H100", mfu: float = 0.4, usd_per_gpu_hour: float = 3.0) -> Plan:
    """Compute the plan of ``profile`` from params.yaml (the same settings the stages read)."""
    if gpu not in PEAK_FLOPS:
        raise ValueError(f"gpu = {gpu!r}; allowed: {', '.join(PEAK_FLOPS)}")
    previous = os.environ.get("CHATPIPE_PROFILE")
    os.environ["CHATPIPE_PROFILE"] = profile  # settings resolve the profile from here
    try:
        cfg = load_section(PretrainSettings)
        vocab = load_section(TokenizerSettings).vocab_size
        launch = load_section(LaunchSettings)
    finally:
        if previous is None:
            del os.environ["CHATPIPE_PROFILE"]
        else:
            os.environ["CHATPIPE_PROFILE"] = previous
    with torch.device("meta"):
        model = GPT(
            config_from_depth(
                cfg.depth,
                vocab,
                cfg.sequence_len,
                head_dim=cfg.head_dim,
                n_kv_head=cfg.n_kv_head or None,
                window_pattern=cfg.window_pattern,
            )
        )
    num_params, fpt = model.num_params(), model.flops_per_token()
    if cfg.max_steps > 0:
        steps = cfg.max_steps
    else:
        steps = int(cfg.target_param_data_ratio * num_params // cfg.total_batch_size)
    tokens = steps * cfg.total_batch_size
    world = launch.nnodes * launch.nproc_per_node
    accum = grad_accum_steps(cfg.total_batch_size, cfg.device_batch_size, cfg.sequence_len, world)
    total_flops = float(fpt) * tokens
    gpus = max(1, launch.nnodes * launch.gpus_per_node)
    hours = total_flops / (PEAK_FLOPS[gpu] * gpus * mfu) / 3600
    memory = estimate_memory_bytes(
        num_params,
        model.num_embedding_params(),
        model.config.n_layer,
        model.config.n_embd,
        vocab,
        cfg.device_batch_size,
        cfg.sequence_len,
    )
    return Plan(
        profile,
        cfg.depth,
        model.config.n_embd,
        model.config.n_layer,
        vocab,
        num_params,
        fpt,
        tokens,
        steps,
        cfg.total_batch_size,
        world,
        accum,
        total_flops,
        gpu,
        PEAK_FLOPS[gpu],
        mfu,
        hours,
        hours * gpus * usd_per_gpu_hour,
        memory / GIB,
    )


def format_plan(plan: Plan) -> str:
    """Human-readable plan."""
    return "\n".join(
        [
            f"profile {plan.profile}: depth {plan.depth} (n_embd {plan.n_embd}, {plan.n_layer} layers), "
            f"vocab {plan.vocab_size:,}",
            f"  parameters       {plan.num_params:,} ({plan.num_params / 1e6:.1f}M)",
            f"  FLOPs per token  {plan.flops_per_token:.4g}",
            f"  tokens to train  {plan.tokens:,} ({plan.tokens / plan.num_params:.1f} tokens/param)",
            f"  steps            {plan.steps:,} x {plan.total_batch_size:,} tokens",
            f"  world size       {plan.world_size} (grad accumulation {plan.grad_accum})",
            f"  total FLOPs      {plan.total_flops:.3e}",
            f"  time on {plan.gpu}   {plan.hours:.2f} h at {plan.mfu:.0%} MFU of {plan.peak_flops / 1e12:.0f} TFLOP/s "
            f"per GPU",
            f"  cost             ${plan.usd:,.0f}",
            f"  memory per GPU   ~{plan.memory_gib:.1f} GiB (estimate)",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """CLI: ``chatpipe plan --profile speedrun [--gpu H100 --mfu 0.4 --usd-per-gpu-hour 3 --json]``.

    Returns 2 with a one-line error (no traceback) for an unknown profile or bad params.
    """
    p = argparse.ArgumentParser(prog="chatpipe plan", description=__doc__.splitlines()[0])
    p.add_argument("--profile", default=None, help="params profile (default: params.yaml's)")
    p.add_argument("--gpu", default="H100", choices=sorted(PEAK_FLOPS))
    p.add_argument("--mfu", type=float, default=0.4, help="assumed model FLOPs utilisation")
    p.add_argument("--usd-per-gpu-hour", type=float, default=3.0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from chatpipe.settings import ParamsError, active_profile

    try:
        plan = make_plan(args.profile or active_profile(), args.gpu, args.mfu, args.usd_per_gpu_hour)
    except ParamsError as e:  # names the file, the profile and the allowed ones
        print(f"chatpipe plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        import json

        print(json.dumps(asdict(plan), indent=2))
    else:
        print(format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
