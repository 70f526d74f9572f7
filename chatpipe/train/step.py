"""Plain functions every training stage shares: batch math, one optimizer step, its schedule, bpb eval, MFU.

The loop that calls them is :func:`chatpipe.train.loop.run_loop`, one for every training stage.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable

import torch

from chatpipe.runtime import Runtime, all_reduce_sum
from chatpipe.train.optim import lr_multiplier, muon_momentum

# Dense bf16 peak FLOP/s per GPU, for MFU. Unknown devices report no MFU.
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def due(step: int, every: int) -> bool:
    """True at every ``every``-th step (eval, checkpoint, sample cadences); never when ``every`` is 0."""
    return bool(every) and step % every == 0


def grad_accum_steps(total_batch_size: int, device_batch_size: int, seq_len: int, world_size: int) -> int:
    """Micro-steps per optimizer step so that 1 GPU and N GPUs do the same math."""
    per_micro = device_batch_size * seq_len * world_size
    if total_batch_size % per_micro:
        raise ValueError(
            f"total_batch_size = {total_batch_size} tokens is not a multiple of device_batch_size x sequence_len "
            f"x world_size = {device_batch_size} x {seq_len} x {world_size} = {per_micro}; "
            f"allowed: multiples of {per_micro}"
        )
    return total_batch_size // per_micro


def peak_flops(device: torch.device) -> float:
    """Peak bf16 FLOP/s of this GPU, or 0.0 when unknown (CPU)."""
    if device.type != "cuda":
        return 0.0
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_FLOPS.items() if k in name), 0.0)


def step_optimizers(
    model: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer], grad_clip: float
) -> torch.Tensor:
    """Step every optimizer on the gradients ``model`` holds (clipped to norm ``grad_clip`` when > 0),
    then zero them; returns their total norm before clipping, as a tensor so nothing waits on it here.

    Reading the norm leaves the gradients as they are: a run logs it without changing its weights."""
    params = [p for p in model.parameters() if p.grad is not None]
    if grad_clip > 0:
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)
    return norm


def train_step_stats(
    model: torch.nn.Module,
    next_batch: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    optimizers: Iterable[torch.optim.Optimizer],
    *,
    grad_accum: int,
    rt: Runtime,
    grad_clip: float = 0.0,
) -> tuple[float, float]:
    """Forward/backward ``grad_accum`` micro-batches, step every optimizer; returns (the mean loss over
    ranks, the gradient norm before clipping: the same on every rank once DDP has averaged).

    The LM stages' step; the row they log is built from these by :func:`chatpipe.train.loop.step_row`."""
    total = torch.zeros((), device=rt.device)
    for micro in range(grad_accum):
        x, y = next_batch()
        # DDP all-reduces only on the last micro-step; the others accumulate locally.
        sync = micro == grad_accum - 1 or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if sync else model.no_sync(), rt.autocast():
            loss = model(x, y)
        (loss / grad_accum).backward()
        total += loss.detach()
    norm = step_optimizers(model, optimizers, grad_clip)
    # one all-reduce and one device-to-host copy for both numbers
    sums = all_reduce_sum(torch.stack([total / grad_accum, norm.to(total.dtype)])) / rt.world_size
    loss_mean, grad_norm = sums.tolist()
    return loss_mean, grad_norm


def train_step(*args, **kwargs) -> float:
    """The mean loss alone of :func:`train_step_stats` (same arguments), for benchmarks timing the step."""
    return train_step_stats(*args, **kwargs)[0]


def train_schedule(cfg, total_steps: int) -> Callable[[int], tuple[float, float]]:
    """The schedule of a :class:`~chatpipe.settings.TrainSettings` stage: step -> (LR multiplier
    (warmup, flat, warmdown to ``final_lr_frac``), Muon momentum (warmed up over ``momentum_warmup_steps``))."""
    lr_kw = cfg.lr_schedule()

    def at(step: int) -> tuple[float, float]:
        return lr_multiplier(step, total_steps, **lr_kw), muon_momentum(step, cfg.momentum_warmup_steps)

    return at


@torch.no_grad()
def evaluate_loss_bpb(
    model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], token_bytes: torch.Tensor, rt: Runtime
) -> tuple[float, float]:
    """Mean loss (nats) over targets (-1 ignored) and bits per byte, in one pass over all ranks.

    Bits per byte = summed losses of targets with a byte length / (ln 2 x summed byte lengths);
    special tokens such as ``<|assistant_end|>`` have none and are excluded.
    """
    # float64 sums: byte and target counts pass 2**24 at speedrun eval sizes
    sums = torch.zeros(4, dtype=torch.float64, device=rt.device)  # loss, targets, loss on bytes, bytes
    was_training = model.training
    model.eval()
    for x, y in batches:
        with rt.autocast():
            loss = model(x, y, loss_reduction="none").float()
        valid = y >= 0
        nbytes = torch.where(valid, token_bytes[y.clamp(min=0)], 0)
        sums += torch.stack(
            [loss.sum().double(), valid.sum().double(), (loss * (nbytes > 0)).sum().double(), nbytes.sum().double()]
        )
    model.train(was_training)
    all_reduce_sum(sums)
    loss_sum, targets, byte_nats, total_bytes = sums.tolist()
    return loss_sum / max(targets, 1.0), byte_nats / (math.log(2) * max(total_bytes, 1.0))


def evaluate_bpb(
    model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], token_bytes: torch.Tensor, rt: Runtime
) -> float:
    """Bits per byte only (see :func:`evaluate_loss_bpb`)."""
    return evaluate_loss_bpb(model, batches, token_bytes, rt)[1]


def fixed_batches(make_next: Callable[[], tuple[torch.Tensor, torch.Tensor]], n: int):
    """``n`` batches from a batch function (for eval loops)."""
    for _ in range(n):
        yield make_next()
