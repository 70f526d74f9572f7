"""Pretrain's plan: the runtime decisions the pretrain stage takes before its first step, and what a
profile's pretraining will cost, before spending it: ``chatpipe plan --profile speedrun``.

The decisions (one copy, so the stage does what the plan prints): the model config a settings section
asks for (:func:`model_config_for`), the training horizon (:func:`horizon_for`, :func:`apply_horizon`)
derived from the model's numbers, asked of the model once (:func:`plan_counts`),
whether ``torch.compile`` pays (:func:`compile_pays`), the Polar Express dtype
(:func:`polar_express_dtype`) and whether the model fits the device (:func:`check_memory_fits`).

``chatpipe plan`` prints the model's parameter count, FLOPs per token, tokens to train, steps, gradient accumulation,
estimated time and cost on a given GPU, and an estimate of memory per GPU. The model is built on
the ``meta`` device, so planning a 1B-parameter model allocates nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from chatpipe.horizon import REFERENCE_DEPTH, Horizon, derive_horizon
from chatpipe.io import env_set
from chatpipe.model.gpt import MODEL_OPTIONS, GPTConfig, ModelCounts, config_from_depth, count_model, quarter_window
from chatpipe.runtime import Runtime, compute_dtype, dtype_named
from chatpipe.settings import LaunchSettings, PretrainSettings, TokenizerSettings, load_section
from chatpipe.train.step import PEAK_FLOPS, grad_accum_steps

log = logging.getLogger(__name__)
GIB = 1024**3
# d24 MFU per GPU kind and precision as bench/gpu_acceptance.py last measured it (it rewrites the file);
# `chatpipe plan` assumes it for that GPU, DEFAULT_MFU where the GPU was never measured
MEASURED_MFU_FILE = Path(__file__).resolve().parents[2] / "bench" / "gpu_measured.json"
DEFAULT_MFU = 0.4

# torch.compile on the project's 2-core CPU, tiny model (bench/pretrain_vs_nanochat.py, bench/README.md):
# compiling the model costs ~39 s with an empty inductor cache (~6 s warm) and saves ~0.08 s per
# 4096-token step (0.75 -> 0.67 s; eager attention already runs as batched matmuls); compiling the
# optimizer costs another ~29 s and saves ~0.01 s (72 -> 62 ms, Polar Express in bf16). So the model
# pays after ~500 steps from a cold cache (the eval model, compiled with it, adds more), the
# optimizer only after ~3,000. ``auto`` follows the cold numbers: a fresh machine pays them.
COMPILE_MIN_STEPS_CPU = 500
COMPILE_OPTIMIZER_MIN_STEPS_CPU = 3000


def model_config_for(cfg: PretrainSettings, vocab_size: int) -> GPTConfig:
    """The GPTConfig a pretrain settings section asks for (shape from depth, plus the recipe options).

    The settings name each recipe option as GPTConfig does (:data:`MODEL_OPTIONS`), so they are read
    by name; only ``short_window`` ("half" | "quarter") becomes a window length here."""
    options = {name: getattr(cfg, name) for name in MODEL_OPTIONS}
    options["short_window"] = quarter_window(cfg.sequence_len) if cfg.short_window == "quarter" else 0
    shape = {"head_dim": cfg.head_dim, "n_kv_head": cfg.n_kv_head or None, "window_pattern": cfg.window_pattern}
    return config_from_depth(cfg.depth, vocab_size, cfg.sequence_len, **shape, **options)


def legacy_ratio_params(counts: ModelCounts) -> int:
    """Parameters the 2025 recipe's data:param ratio counts (d20 and the fixed-batch profiles keep it):
    all of them, minus the lookup tables when the model has value embeddings."""
    n = counts.num_params
    return n - counts.embedding_params if counts.value_embeds else n


def uses_nanochat_horizon(cfg: PretrainSettings) -> bool:
    """Whether the profile asks for nanochat's 2026 derivation (chatpipe.horizon): an automatic batch,
    LR or weight-decay scaling, or a FLOPs horizon. Otherwise the 2025 recipe's numbers stay as they were."""
    return cfg.total_batch_size == -1 or cfg.lr_scaling or cfg.wd_scaling or cfg.target_flops > 0


@dataclass(frozen=True)
class PlanCounts:
    """What the horizon and the plan derive everything from: the model's numbers, asked once."""

    run: ModelCounts  # the model the settings ask for
    reference: ModelCounts | None  # the same recipe at depth 12; only nanochat's derivation reads it


def plan_counts(cfg: PretrainSettings, vocab_size: int) -> PlanCounts:
    """The one visit to the model: the counts of the model ``cfg`` asks for and, where nanochat's
    derivation runs (:func:`uses_nanochat_horizon`), of its d12 reference; both built on the meta
    device (allocates nothing)."""
    run = count_model(model_config_for(cfg, vocab_size))
    if not uses_nanochat_horizon(cfg):
        return PlanCounts(run, None)
    reference_cfg = cfg.model_copy(update={"depth": REFERENCE_DEPTH})
    return PlanCounts(run, count_model(model_config_for(reference_cfg, vocab_size)))


def horizon_for(cfg: PretrainSettings, counts: PlanCounts, world_size: int) -> Horizon:
    """The run's batch, steps, LR scale and weight decay (chatpipe.horizon), from the model's
    :func:`plan_counts` and the settings alone."""
    run = counts.run
    # what both derivations take from the settings as they are
    given = {
        "flops_per_token": run.flops_per_token,
        "ratio": cfg.target_param_data_ratio,
        "total_batch_size": cfg.total_batch_size,
        "num_iterations": cfg.max_steps,
        "weight_decay": cfg.weight_decay,
    }
    if not uses_nanochat_horizon(cfg):  # fixed batch, ratio over the 2025 count, LRs and decay as given
        n = legacy_ratio_params(run)
        return derive_horizon(scaling_params=n, reference_params=n, lr_scaling=False, wd_scaling=False, **given)
    if counts.reference is None:
        raise ValueError("nanochat's horizon needs the d12 reference's counts; count with plan_counts(cfg, vocab_size)")
    horizon = derive_horizon(
        scaling_params=run.scaling_params,
        reference_params=counts.reference.scaling_params,
        target_flops=cfg.target_flops,
        lr_scaling=cfg.lr_scaling,
        wd_scaling=cfg.wd_scaling,
        **given,
    )
    if cfg.device_batch_size == "auto":  # chosen later to divide this batch (choose_device_batch)
        return horizon
    unit = cfg.device_batch_size * cfg.sequence_len * world_size
    if horizon.total_batch_size % unit:  # gradient accumulation needs whole micro-batches on every rank
        raise ValueError(
            f"pretrain.total_batch_size resolved to {horizon.total_batch_size:,} tokens, not a multiple of "
            f"device_batch_size x sequence_len x world size = {unit:,}; lower device_batch_size"
        )
    return horizon


def apply_horizon(cfg: PretrainSettings, horizon: Horizon) -> PretrainSettings:
    """``cfg`` with the horizon's batch and steps, and its scaled LRs and weight decay where switched on."""
    update: dict[str, Any] = {
        "total_batch_size": horizon.total_batch_size,
        "max_steps": horizon.num_iterations,
        "weight_decay": horizon.weight_decay,
    }
    if horizon.lr_scaled:  # every AdamW and Muon LR setting, as nanochat scales its four LR arguments
        update.update({k: getattr(cfg, k) * horizon.batch_lr_scale for k in (*cfg.LR_KEYS, "scalar_lr")})
    return cfg.model_copy(update=update)


def compile_pays(setting: bool | str, total_steps: int, device: torch.device, part: str = "model") -> bool:
    """Resolve ``compile: auto`` for the ``model`` or the ``optimizer``: always on CUDA; on CPU
    only for runs of at least COMPILE_MIN_STEPS_CPU (model) or COMPILE_OPTIMIZER_MIN_STEPS_CPU
    (optimizer) steps, where the per-step saving has paid back the compile time."""
    if part not in ("model", "optimizer"):
        raise ValueError(f"part={part!r}; allowed: 'model', 'optimizer'")
    if setting != "auto":
        return bool(setting)
    min_steps = COMPILE_MIN_STEPS_CPU if part == "model" else COMPILE_OPTIMIZER_MIN_STEPS_CPU
    return device.type == "cuda" or total_steps >= min_steps


def polar_express_dtype(cfg: PretrainSettings, rt: Runtime) -> torch.dtype:
    """Resolve ``polar_express_dtype: auto`` (MuonAdamW only; muon_newton_schulz stays float32): bfloat16
    where the run trains in bfloat16 (nanochat's choice on GPU) or the CPU multiplies bfloat16
    natively (there Polar Express takes half the time of float32 on the tiny model, and val bpb per
    CPU-second is lower: bench/README.md), float32 elsewhere."""
    if cfg.optimizer != "normuon_polar_express":
        return torch.float32
    if cfg.polar_express_dtype != "auto" or rt.dtype == torch.bfloat16:
        return dtype_named(cfg.polar_express_dtype) or rt.dtype
    # a float32 run: bfloat16 only on a CPU that multiplies it natively, the rule compute_dtype trains by
    return compute_dtype("auto", use_cuda=False, training=True) if rt.device.type == "cpu" else torch.float32


@dataclass
class Plan:
    """Pretraining budget of one profile on one kind of GPU."""

    profile: str
    recipe: str  # model options and optimizer, e.g. "nanochat-2026 (normuon_polar_express, fp8)"
    depth: int
    n_embd: int
    n_layer: int
    vocab_size: int
    num_params: int
    flops_per_token: int
    tokens: int
    steps: int
    total_batch_size: int
    scaling_params: int  # N, what the data:param ratio counts
    batch_lr_scale: float  # sqrt(B / 2**19)
    lr_scaled: bool  # whether the LRs are multiplied by batch_lr_scale (lr_scaling)
    weight_decay: float  # as the run uses it (scaled where wd_scaling is on)
    world_size: int
    grad_accum: int
    total_flops: float
    gpu: str
    peak_flops: float
    mfu: float
    mfu_source: str  # "given", "assumed" (DEFAULT_MFU) or "measured by bench/gpu_acceptance.py at <commit>"
    hours: float
    usd: float
    memory_gib: float  # compiled step (a GPU run)
    memory_eager_gib: float  # the eager step, as MemTracker measures it
    device_batch_size: int  # rows per GPU per forward, as set or as `auto` chose it
    batch_choice: str  # why `auto` chose it (BatchChoice.reason); "" where the profile sets the batch


# Activation bytes saved per token, per layer and channel, (eager, compiled), by whether the model has
# value embeddings (the speedrun recipe: value embeddings on half the layers, lambdas) or not (d20).
# Eager: torch's MemTracker under FakeTensorMode (tests/test_memory_plan.py) at d6, sequence 2048, batch 4,
# vocab 32,768 and 8,192: 58.8 with value embeddings, 52.1 without. Compiled: the acceptance bench's
# peak (max_memory_allocated) of the speedrun's d12 and d24 bf16 steps on H100/H200 (bench/README.md):
# 44.4; without value embeddings scaled by the eager ratio (not measured on a GPU).
ACT_BYTES_PER_LAYER_CHANNEL = {True: (58.8, 44.4), False: (52.1, 39.3)}
# per logit, (eager, compiled). Eager: the soft-cap's tanh and log_softmax's output kept for the backward
# (fp32), and two fp32 temporaries alive at the end of the forward. Compiled: inductor fuses the cap and
# the loss and keeps about the bf16 logits (the same d12/d24 fit).
LOGIT_BYTES = (16.0, 2.3)


def estimate_memory_bytes(
    num_params: int,
    num_embedding_params: int,
    n_layer: int,
    n_embd: int,
    vocab_size: int,
    device_batch_size: int,
    sequence_len: int,
    grad_accum: int = 1,
    *,
    compiled: bool = True,
    value_embeds: bool = False,
) -> int:
    """Peak memory of one training step of one GPU (bf16 autocast, fp32 master weights); the peak is at
    the end of the forward. ``compiled``: the model under torch.compile (every GPU run), else the eager
    step, as torch's MemTracker measures it.

    Weights in fp32 (4 B/param); AdamW moments (8 B/param) for the lookup tables and lm_head, Muon
    momentum (4 B/param) for the block matrices; bf16 copies of every matmul weight, which the backward
    keeps (2 B/param); activations :data:`ACT_BYTES_PER_LAYER_CHANNEL` per token, layer and channel;
    :data:`LOGIT_BYTES` per logit. Gradients (4 B/param) only with gradient accumulation: a single
    micro-batch's step frees them before the next forward (``zero_grad(set_to_none=True)``).
    Left out: CUDA's allocator fragmentation and kernel workspace, FP8's smaller saved copies
    (docs/scaling.md).
    """
    tokens = device_batch_size * sequence_len
    lm_head = n_embd * vocab_size
    adam_params = num_embedding_params + lm_head
    matrices = num_params - adam_params
    states = 4 * num_params + 8 * adam_params + 4 * matrices + (4 * num_params if grad_accum > 1 else 0)
    weight_copies = 2 * (matrices + lm_head)
    per_channel = ACT_BYTES_PER_LAYER_CHANNEL[value_embeds][compiled]
    activations = tokens * (per_channel * n_layer * n_embd + LOGIT_BYTES[compiled] * vocab_size)
    return int(states + weight_copies + activations)


def model_memory_bytes(
    counts: ModelCounts, device_batch_size: int, sequence_len: int, grad_accum: int = 1, compiled: bool = True
) -> int:
    """:func:`estimate_memory_bytes` of a model of ``counts`` (:meth:`chatpipe.model.gpt.GPT.counts`;
    its padded vocabulary: what lm_head computes)."""
    return estimate_memory_bytes(
        counts.num_params,
        counts.embedding_params,
        counts.n_layer,
        counts.n_embd,
        counts.padded_vocab_size,
        device_batch_size,
        sequence_len,
        grad_accum,
        compiled=compiled,
        value_embeds=counts.value_embeds,
    )


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


# Memory of each GPU `chatpipe plan --gpu` names, as its driver reports it (nvidia-smi's MiB; the 80 GB
# A100): the budget `device_batch_size: auto` plans for when neither --memory-gib nor pretrain.memory_gib sets one
GPU_MEMORY_GIB = {
    "H100": 81_559 / 1024,
    "H200": 143_771 / 1024,
    "H800": 81_559 / 1024,
    "A100": 81_920 / 1024,
    "L40S": 46_068 / 1024,
    "A10": 23_028 / 1024,
}


@dataclass(frozen=True)
class BatchChoice:
    """What ``device_batch_size: auto`` chose (:func:`choose_device_batch`), and why."""

    device_batch_size: int
    grad_accum: int
    peak_bytes: int  # the chosen batch's planned peak per device
    budget_bytes: int
    budget: str  # where the budget comes from, e.g. "--memory-gib 80"
    larger: int | None  # the next larger batch that divides the rows per rank; None: none is larger
    larger_peak_bytes: int | None

    def reason(self) -> str:
        """One line: the chosen batch's planned peak, and the next larger one's, against the budget."""
        chosen = (
            f"batch {self.device_batch_size} plans ~{sized(self.peak_bytes)} of the "
            f"{sized(self.budget_bytes)} budget ({self.budget})"
        )
        if self.larger is None or self.larger_peak_bytes is None:
            return f"{chosen}; no larger batch divides the rows each rank takes per step"
        return f"{chosen}; batch {self.larger} would plan ~{sized(self.larger_peak_bytes)}"


def sized(n_bytes: float) -> str:
    """``n_bytes`` in GiB to a tenth, or in MiB below a tenth of a GiB (a tiny model's whole step)."""
    return f"{n_bytes / GIB:.1f} GiB" if n_bytes >= GIB / 10 else f"{n_bytes / 2**20:.1f} MiB"


def rows_per_rank(total_batch_size: int, sequence_len: int, world_size: int) -> int:
    """Rows of ``sequence_len`` tokens each rank trains on per optimizer step: what every micro-batch divides."""
    unit = sequence_len * world_size
    if total_batch_size % unit:
        raise ValueError(
            f"pretrain.total_batch_size = {total_batch_size:,} tokens is not a multiple of sequence_len x world "
            f"size = {unit:,}: no device_batch_size divides it"
        )
    return total_batch_size // unit


def choose_device_batch(
    counts: ModelCounts,
    total_batch_size: int,
    sequence_len: int,
    world_size: int,
    budget_bytes: int,
    budget: str = "the budget",
    compiled: bool = True,
) -> BatchChoice:
    """The largest device batch that divides the rows each rank takes per step (gradient accumulation makes
    up the rest, so ``total_batch_size`` stays) and whose planned peak (:func:`model_memory_bytes`, with
    the gradients accumulation keeps) fits ``budget_bytes``. Every larger divisor's peak is over the budget.

    Raises ValueError naming the smallest budget that would fit when no batch fits."""
    rows = rows_per_rank(total_batch_size, sequence_len, world_size)
    sizes = [b for b in range(1, rows + 1) if rows % b == 0]
    peaks = {b: model_memory_bytes(counts, b, sequence_len, rows // b, compiled) for b in sizes}
    fitting = [b for b in sizes if peaks[b] <= budget_bytes]
    if not fitting:
        least = min(sizes, key=peaks.__getitem__)
        need = math.ceil(peaks[least] / GIB * 10) / 10
        raise ValueError(
            f"pretrain.device_batch_size = 'auto': no batch fits {sized(budget_bytes)} ({budget}); "
            f"the smallest peak, batch {least}'s, is ~{sized(peaks[least])} per device: give a budget of "
            f"at least {need:.1f} GiB, or a smaller model or sequence_len"
        )
    best = fitting[-1]
    larger = next((b for b in sizes if b > best), None)
    return BatchChoice(best, rows // best, peaks[best], budget_bytes, budget, larger, peaks[larger] if larger else None)


def memory_budget(memory_gib: float, device: torch.device, key: str = "pretrain.memory_gib") -> tuple[int, str]:
    """(bytes, where from) that ``device_batch_size: auto`` plans for: ``memory_gib`` when above 0, else
    the GPU's total memory (the same on every rank, so every rank chooses the same batch). On CPU no
    budget is assumed: host memory is shared with everything else the machine runs."""
    if memory_gib > 0:
        return int(memory_gib * GIB), f"{key} = {memory_gib:g}"
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        return total, f"{torch.cuda.get_device_name(device)}'s memory"
    raise ValueError(
        f"pretrain.device_batch_size = 'auto' on {device.type} needs a memory budget: set {key} "
        f"(GiB per device, above 0), or set device_batch_size to an integer >= 1"
    )


def resolve_device_batch(
    cfg: PretrainSettings, counts: ModelCounts, world_size: int, device: torch.device, compiled: bool = True
) -> PretrainSettings:
    """``cfg`` with ``device_batch_size: auto`` resolved (:func:`choose_device_batch`) against
    :func:`memory_budget`, the choice and its reason logged; a given batch leaves ``cfg`` as it is.
    Call it once, after the horizon has set ``total_batch_size``."""
    if cfg.device_batch_size != "auto":
        return cfg
    budget_bytes, budget = memory_budget(cfg.memory_gib, device)
    choice = choose_device_batch(
        counts, cfg.total_batch_size, cfg.sequence_len, world_size, budget_bytes, budget, compiled
    )
    log.info(
        "device_batch_size: auto -> %d (grad accum %d): %s",
        choice.device_batch_size,
        choice.grad_accum,
        choice.reason(),
    )
    return cfg.model_copy(update={"device_batch_size": choice.device_batch_size})


def measured_mfu(gpu: str, fp8: bool, path: Path = MEASURED_MFU_FILE) -> tuple[float, str]:
    """(MFU, where it comes from) for ``gpu`` in the run's precision: the acceptance bench's last
    measurement (``path``), or :data:`DEFAULT_MFU` with "assumed" where it has none."""
    if not path.exists():
        return DEFAULT_MFU, "assumed"
    try:
        entry = json.loads(path.read_text()).get(gpu)
    except (json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{path}: not the acceptance bench's MFU record ({e}); rerun bench/gpu_acceptance.py") from e
    precision = "fp8" if fp8 else "bf16"
    if not entry or precision not in entry:
        return DEFAULT_MFU, "assumed"
    return float(entry[precision]), f"measured by bench/gpu_acceptance.py at {entry.get('commit', '?')}"


def plan_batch(
    cfg: PretrainSettings, counts: ModelCounts, world: int, gpu: str, memory_gib: float | None
) -> tuple[int, str]:
    """(device batch, why) of a plan for ``gpu``: as the profile sets it, or ``auto``'s choice for the budget
    of ``memory_gib`` (--memory-gib), else pretrain.memory_gib, else the ``gpu``'s memory
    (:data:`GPU_MEMORY_GIB`). Needs ``cfg`` with the horizon applied. Compiled as a GPU run compiles."""
    if cfg.device_batch_size != "auto":
        return cfg.device_batch_size, ""
    if memory_gib:
        budget_bytes, budget = int(memory_gib * GIB), f"--memory-gib {memory_gib:g}"
    elif cfg.memory_gib:
        budget_bytes, budget = int(cfg.memory_gib * GIB), f"pretrain.memory_gib = {cfg.memory_gib:g}"
    else:
        budget_bytes, budget = int(GPU_MEMORY_GIB[gpu] * GIB), f"the {gpu}'s memory"
    compiled = compile_pays(cfg.compile, cfg.max_steps, torch.device("cuda"))
    args = (counts, cfg.total_batch_size, cfg.sequence_len, world, budget_bytes, budget, compiled)
    choice = choose_device_batch(*args)
    return choice.device_batch_size, f"auto: {choice.reason()}"


def make_plan(
    profile: str,
    gpu: str = "H100",
    mfu: float | None = None,
    usd_per_gpu_hour: float = 3.0,
    memory_gib: float | None = None,
    device_batch_size: int | str | None = None,
) -> Plan:
    """Compute the plan of ``profile`` from params.yaml (the same settings the stages read). ``mfu``
    None: what the acceptance bench last measured on ``gpu`` (:func:`measured_mfu`).
    ``device_batch_size`` overrides the profile's (``"auto"``: chosen for ``memory_gib``, :func:`plan_batch`)."""
    if gpu not in PEAK_FLOPS:
        raise ValueError(f"gpu = {gpu!r}; allowed: {', '.join(PEAK_FLOPS)}")
    batch_env = {} if device_batch_size is None else {"CHATPIPE_PRETRAIN__DEVICE_BATCH_SIZE": str(device_batch_size)}
    with env_set(CHATPIPE_PROFILE=profile, **batch_env):  # settings resolve the profile from here
        cfg = load_section(PretrainSettings)
        vocab = load_section(TokenizerSettings).vocab_size
        launch = load_section(LaunchSettings)
    counts = plan_counts(cfg, vocab)  # the model's numbers, once; everything below derives from them
    num_params, fpt = counts.run.num_params, counts.run.flops_per_token
    world = launch.nnodes * launch.nproc_per_node
    horizon = horizon_for(cfg, counts, world)
    batch, steps = horizon.total_batch_size, horizon.num_iterations
    tokens = steps * batch
    device_batch, batch_choice = plan_batch(apply_horizon(cfg, horizon), counts.run, world, gpu, memory_gib)
    accum = grad_accum_steps(batch, device_batch, cfg.sequence_len, world)
    total_flops = float(fpt) * tokens
    gpus = max(1, launch.nnodes * launch.gpus_per_node)
    mfu, mfu_source = (mfu, "given") if mfu is not None else measured_mfu(gpu, cfg.fp8)
    hours = total_flops / (PEAK_FLOPS[gpu] * gpus * mfu) / 3600
    memory = model_memory_bytes(counts.run, device_batch, cfg.sequence_len, accum)
    memory_eager = model_memory_bytes(counts.run, device_batch, cfg.sequence_len, accum, compiled=False)
    on = [k for k in ("value_embeds", "lambdas", "smear", "backout") if getattr(cfg, k)]
    recipe = f"{cfg.optimizer}; model options: {', '.join(on) or 'none'}; windows {cfg.window_pattern}"
    recipe += f" ({cfg.short_window})" + (", fp8" if cfg.fp8 else "")
    return Plan(
        profile,
        recipe,
        cfg.depth,
        counts.run.n_embd,
        counts.run.n_layer,
        vocab,
        num_params,
        fpt,
        tokens,
        steps,
        batch,
        horizon.scaling_params,
        horizon.batch_lr_scale,
        horizon.lr_scaled,
        horizon.weight_decay,
        world,
        accum,
        total_flops,
        gpu,
        PEAK_FLOPS[gpu],
        mfu,
        mfu_source,
        hours,
        hours * gpus * usd_per_gpu_hour,
        memory / GIB,
        memory_eager / GIB,
        device_batch,
        batch_choice,
    )


def format_plan(plan: Plan) -> str:
    """Human-readable plan."""
    return "\n".join(
        [
            f"profile {plan.profile}: depth {plan.depth} (n_embd {plan.n_embd}, {plan.n_layer} layers), "
            f"vocab {plan.vocab_size:,}",
            f"  recipe           {plan.recipe}",
            f"  parameters       {plan.num_params:,} ({plan.num_params / 1e6:.1f}M)",
            f"  FLOPs per token  {plan.flops_per_token:.4g}",
            f"  tokens to train  {plan.tokens:,} ({plan.tokens / plan.scaling_params:.1f} per counted param, "
            f"{plan.scaling_params:,} counted)",
            f"  steps            {plan.steps:,} x {plan.total_batch_size:,} tokens",
            f"  LR scale         {plan.batch_lr_scale:.3f} (sqrt of batch / 524,288; "
            f"{'applied to every LR' if plan.lr_scaled else 'off, LRs as set'})",
            f"  weight decay     {plan.weight_decay:.3g}",
            f"  world size       {plan.world_size} (grad accumulation {plan.grad_accum})",
            f"  device batch     {plan.device_batch_size} rows per GPU per forward"
            + (f" ({plan.batch_choice})" if plan.batch_choice else " (set)"),
            f"  total FLOPs      {plan.total_flops:.3e}",
            f"  time on {plan.gpu}   {plan.hours:.2f} h at {plan.mfu:.0%} MFU of {plan.peak_flops / 1e12:.0f} TFLOP/s "
            f"per GPU ({plan.mfu_source})",
            f"  cost             ${plan.usd:,.0f}",
            f"  memory per GPU   ~{plan.memory_gib:.1f} GiB compiled, ~{plan.memory_eager_gib:.1f} GiB eager (estimates)",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """CLI: ``chatpipe plan --profile speedrun [--gpu H100 --mfu 0.4 --usd-per-gpu-hour 3 --json]
    [--device-batch-size auto --memory-gib 24]``.

    Returns 2 with a one-line error (no traceback) for an unknown profile, bad params or a memory budget
    that no batch fits.
    """
    p = argparse.ArgumentParser(prog="chatpipe plan", description=__doc__.splitlines()[0])
    p.add_argument(
        "--profile", default=None, help="params profile, or several comma-separated (default: params.yaml's)"
    )
    p.add_argument("--gpu", default="H100", choices=sorted(PEAK_FLOPS))
    p.add_argument(
        "--mfu",
        type=float,
        default=None,
        help="model FLOPs utilisation (default: the acceptance bench's last measured)",
    )
    p.add_argument("--usd-per-gpu-hour", type=float, default=3.0)
    p.add_argument(
        "--device-batch-size",
        default=None,
        help="rows per GPU per forward instead of the profile's pretrain.device_batch_size; "
        "auto: the largest whose planned peak fits the memory budget",
    )
    p.add_argument(
        "--memory-gib",
        type=float,
        default=None,
        help="memory budget per GPU that device_batch_size auto plans for (default: pretrain.memory_gib, "
        "else the --gpu's memory)",
    )
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.memory_gib is not None and not args.memory_gib > 0:
        p.error(f"--memory-gib {args.memory_gib:g}: allowed: a number of GiB above 0")
    from chatpipe.settings import ParamsError, active_profile

    names = (args.profile or active_profile()).split(",")
    batch = dict(memory_gib=args.memory_gib, device_batch_size=args.device_batch_size)
    try:
        plans = [make_plan(name, args.gpu, args.mfu, args.usd_per_gpu_hour, **batch) for name in names]
    except (ParamsError, ValueError) as e:  # names the file, the profile and the allowed ones; or the budget
        print(f"chatpipe plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        import json

        out = [asdict(plan) for plan in plans]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
    else:
        print("\n\n".join(format_plan(plan) for plan in plans))
    return 0


if __name__ == "__main__":
    sys.exit(main())
