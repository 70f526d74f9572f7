"""Optimizers and schedules: AdamW for embedding/lm_head, Muon for the hidden matrices (SPEC §6).

Usage in a stage loop::

    optimizers = build_optimizers(model, matrix_lr=0.02, embedding_lr=0.2, weight_decay=0.0)
    for step in range(total_steps):
        lr_mult = lr_multiplier(step, total_steps, warmup_steps=40, warmdown_ratio=0.65, final_lr_frac=0.05)
        apply_schedules(optimizers, lr_mult, muon_momentum(step))
        ...  # forward/backward, then opt.step() for each optimizer

Every param group stores ``initial_lr``; schedules multiply it, so a resumed run needs only the step.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.optim._muon as _torch_muon

SCHEDULES = ("warmdown", "cosine")


def build_optimizers(
    model: torch.nn.Module,
    *,
    matrix_lr: float = 0.02,
    embedding_lr: float = 0.2,
    unembedding_lr: float = 0.004,
    weight_decay: float = 0.0,
    adam_betas: tuple[float, float] = (0.8, 0.95),
    adam_eps: float = 1e-10,
    fused: bool | None = None,
) -> list[torch.optim.Optimizer]:
    """Return ``[adamw, muon]`` over ``model.param_groups()`` (a :class:`chatpipe.model.gpt.GPT`).

    AdamW lrs are scaled by (n_embd / 768) ** -0.5 so wider models take smaller embedding steps;
    Muon's lr is used as given (its update is already shape-normalised).
    """
    groups = model.param_groups()
    scale = (model.config.n_embd / 768) ** -0.5
    adamw = torch.optim.AdamW(
        [
            {"params": groups["lm_head"], "lr": unembedding_lr * scale},
            {"params": groups["embedding"], "lr": embedding_lr * scale},
        ],
        betas=adam_betas,
        eps=adam_eps,
        weight_decay=0.0,
        fused=fused,
    )
    muon = Muon(groups["matrix"], lr=matrix_lr, momentum=0.95, nesterov=True, weight_decay=weight_decay)
    optimizers: list[torch.optim.Optimizer] = [adamw, muon]
    for opt in optimizers:
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return optimizers


def newton_schulz_fp32(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    """Muon's quintic Newton-Schulz orthogonalisation (same iteration as torch's), kept in fp32."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


class Muon(torch.optim.Muon):
    """``torch.optim.Muon``; on CPU its Newton-Schulz runs in fp32.

    torch runs the iteration in bf16, which is right on GPUs but ~50x slower than fp32 on CPUs
    without bf16 matrix units: 9.8 s of a 11 s tiny-profile step on a 2-core laptop.
    """

    def step(self, closure=None):
        on_gpu = all(p.is_cuda for g in self.param_groups for p in g["params"])
        ctx = contextlib.nullcontext() if on_gpu else _swap_newton_schulz(newton_schulz_fp32)
        with ctx:
            return super().step(closure)


@contextlib.contextmanager
def _swap_newton_schulz(fn):
    original = _torch_muon._zeropower_via_newtonschulz
    _torch_muon._zeropower_via_newtonschulz = fn
    try:
        yield
    finally:
        _torch_muon._zeropower_via_newtonschulz = original


def lr_multiplier(
    step: int,
    total_steps: int,
    *,
    warmup_steps: int,
    warmdown_ratio: float,
    final_lr_frac: float,
    schedule: str = "warmdown",
) -> float:
    """LR multiplier for ``step`` in [0, total_steps): reaches ``final_lr_frac`` at the last step.

    "warmdown": linear warmup, flat 1.0, then linear decay over the last ``warmdown_ratio`` of the
    steps. "cosine": linear warmup, then cosine from 1.0 down to ``final_lr_frac``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; allowed: {', '.join(SCHEDULES)}")
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0.0 <= warmdown_ratio <= 1.0:
        raise ValueError(f"warmdown_ratio must be in [0, 1], got {warmdown_ratio}")
    last = total_steps - 1
    step = min(max(step, 0), last)
    warm = (step + 1) / warmup_steps if step < warmup_steps else 1.0
    if schedule == "cosine":
        span = last - warmup_steps
        progress = 1.0 if span <= 0 else min(max((step - warmup_steps) / span, 0.0), 1.0)
        decay = final_lr_frac + (1.0 - final_lr_frac) * 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        down = warmdown_ratio * total_steps
        left = (last - step) / down if down > 0 else 1.0
        decay = 1.0 if left >= 1.0 else final_lr_frac + (1.0 - final_lr_frac) * left
    # min of both ramps: a run shorter than warmup + warmdown still ends at final_lr_frac
    return min(warm, decay)


def muon_momentum(step: int, warmup_steps: int = 300, start: float = 0.85, end: float = 0.95) -> float:
    """Muon momentum: linear ramp from ``start`` to ``end`` over ``warmup_steps``, then flat."""
    frac = 1.0 if warmup_steps <= 0 else min(max(step, 0) / warmup_steps, 1.0)
    return (1.0 - frac) * start + frac * end


def apply_schedules(optimizers: list[torch.optim.Optimizer], lr_mult: float, momentum: float | None) -> None:
    """Set lr = initial_lr * lr_mult in every group, and ``momentum`` on Muon groups when given."""
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * lr_mult
            if momentum is not None and isinstance(opt, torch.optim.Muon):
                group["momentum"] = momentum
