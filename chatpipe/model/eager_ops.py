"""The model's elementwise pieces with hand-written backward passes, for eager training on CPU.

Uncompiled, autograd runs each of these as a chain of separate kernels, and each kernel reads and
writes the whole activation again. A profile of the tiny profile's eager step (2 threads, d4,
batch 16 x 256) put ReLU^2's backward alone at ~8% of the step (``pow`` backward as three passes,
then ``threshold_backward``) and RMSNorm's at ~4%: as much as compiling gains on the whole step.
Each function here computes its forward with exactly the ops the plain version uses (so logits are
bitwise equal) and its backward in as few passes as the math allows:

- ReLU^2: ``y = h * h`` with ``h = relu(x)``; ``dx = 2 h dy`` (``h`` is 0 wherever relu is).
- soft-capping: ``y = c tanh(x / c)``; ``dx = dy (1 - t^2)`` with ``t = tanh(x / c)``.
- RMSNorm: ``y = x r`` with ``r = rsqrt(mean(x^2) + eps)``; ``dx = r (dy - y mean(dy y))``.
- rotary: a rotation, so its backward is the rotation by the opposite angle.

Without gradients, under ``torch.compile``, off CPU and outside float32 the plain ops run instead:
inductor fuses them into fewer kernels than these, and the CUDA path stays what nanochat's is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _use_fused(x: torch.Tensor) -> bool:
    """Training on CPU in float32, uncompiled (without gradients, a custom node only costs time)."""
    return (
        torch.is_grad_enabled()
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and not torch.compiler.is_compiling()
    )


class _ReluSquared(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        h = torch.relu(x)
        ctx.save_for_backward(h)
        return h * h

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        (h,) = ctx.saved_tensors
        return h.mul(2.0).mul_(dy)


class _Softcap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cap: float) -> torch.Tensor:  # type: ignore[override]
        t = torch.tanh(x / cap)
        ctx.save_for_backward(t)
        return cap * t

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (t,) = ctx.saved_tensors
        return torch.addcmul(dy, dy * t, t, value=-1.0), None


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        eps = torch.finfo(x.dtype).eps  # F.rms_norm's default
        r = torch.rsqrt(x.square().mean(-1, keepdim=True).add_(eps))
        y = x * r
        ctx.save_for_backward(y, r)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        y, r = ctx.saved_tensors
        dot = (dy * y).mean(-1, keepdim=True)
        return torch.addcmul(dy, y, dot, value=-1.0).mul_(r)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _rotate(dy, cos, -sin), None, None


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2``."""
    return _ReluSquared.apply(x) if _use_fused(x) else F.relu(x).square()


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(x / cap)``: logits smoothly bounded to (-cap, cap)."""
    return _Softcap.apply(x, cap) if _use_fused(x) else cap * torch.tanh(x / cap)


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm over the last dim without learnable parameters (``F.rms_norm``, default eps)."""
    return _RMSNorm.apply(x) if _use_fused(x) else F.rms_norm(x, (x.size(-1),))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the last dim of x [B, H, T, D] by position angles."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if _use_fused(x) and not (cos.requires_grad or sin.requires_grad):
        return _Rotary.apply(x, cos, sin)
    return _rotate(x, cos, sin)
