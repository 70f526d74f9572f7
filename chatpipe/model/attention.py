"""Causal attention for training on CPU: blocks of queries against only the keys they can see.

torch's CPU attention kernel (the flash-style ``scaled_dot_product_attention``) runs well below the
CPU's matmul rate at training lengths. At batch 16, 4 heads of 64 and 256 positions on 2 cores, a
causal layer's forward and backward take 28-31 ms there and 21-23 ms here (eager and compiled),
where every product is one batched matmul; the tiny model's whole training step gets 2.5-3.6% faster.
The price is memory: the backward keeps each block's softmax (batch x heads x about T^2/2 floats
per layer), so the model takes this path only for sequences up to :data:`MAX_LEN`.

Each block of :data:`BLOCK_ROWS` queries meets the keys from the first one its window reaches up to
its own last position, with the scale and the causal/window mask folded into the matmul (a bias
of 0 and -inf). The backward is the textbook one: dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)),
dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d), so every product again runs as a batched matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_ROWS = 64  # query rows per block: at T=256, 64 beat 128 (compiled) and 32 (both)
MAX_LEN = 512  # longer sequences keep torch's kernel, which does not store the softmax


@dataclass(frozen=True)
class BlockwiseCausal:
    """Attention plan: :func:`blockwise_causal_attention` over the whole sequence (``window`` keys or all)."""

    window: int | None


def _block_bias(q0: int, q1: int, k0: int, window: int | None, like: torch.Tensor) -> torch.Tensor:
    """Zero where query q0..q1 may see key k0..q1, -inf elsewhere: [q1 - q0, q1 - k0]."""
    q_pos = torch.arange(q0, q1, device=like.device).unsqueeze(1)
    k_pos = torch.arange(k0, q1, device=like.device).unsqueeze(0)
    allowed = (k_pos <= q_pos) if window is None else (k_pos <= q_pos) & (q_pos - k_pos < window)
    zero = torch.zeros((), dtype=like.dtype, device=like.device)
    return torch.where(allowed, zero, float("-inf"))


def _blocks(t: int, window: int | None) -> list[tuple[int, int, int]]:
    """(first query, end query, first key) of each block."""
    return [
        (q0, min(q0 + BLOCK_ROWS, t), 0 if window is None else max(0, q0 - window + 1))
        for q0 in range(0, t, BLOCK_ROWS)
    ]


class _BlockwiseCausal(torch.autograd.Function):
    """[B*H, T, D] tensors in, the attention output out; the backward by hand (see the module docstring)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")  # the backward runs under the forward's autocast state
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:  # type: ignore[override]
        scale = q.size(-1) ** -0.5
        outs, probs = [], []
        for q0, q1, k0 in _blocks(q.size(1), window):
            scores = torch.baddbmm(_block_bias(q0, q1, k0, window, q), q[:, q0:q1], k[:, k0:q1].mT, alpha=scale)
            probs.append(torch.softmax(scores, dim=-1))
            outs.append(torch.bmm(probs[-1], v[:, k0:q1]))
        out = torch.cat(outs, dim=1)
        ctx.save_for_backward(q, k, v, out, *probs)
        ctx.window = window
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, d_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        q, k, v, out, *probs = ctx.saved_tensors
        scale = q.size(-1) ** -0.5
        d_out = d_out.contiguous()
        delta = (d_out * out).sum(-1, keepdim=True)  # rowsum(dO * O) = rowsum(P * dP)
        dq, dk, dv = [], torch.zeros_like(k), torch.zeros_like(v)
        for (q0, q1, k0), p in zip(_blocks(q.size(1), ctx.window), probs):
            d_blk = d_out[:, q0:q1]
            dv[:, k0:q1] += torch.bmm(p.mT, d_blk)
            ds = (torch.bmm(d_blk, v[:, k0:q1].mT) - delta[:, q0:q1]) * p
            dq.append(torch.bmm(ds, k[:, k0:q1]) * scale)
            dk[:, k0:q1] += torch.bmm(ds.mT, q[:, q0:q1]) * scale
        return torch.cat(dq, dim=1), dk, dv, None


def blockwise_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None
) -> torch.Tensor:
    """Causal (optionally sliding-window) attention of [B, H, T, D] tensors, like
    ``scaled_dot_product_attention(q, k, v, is_causal=True)`` with the default scale.

    k and v may have fewer heads (grouped-query attention); they are repeated to q's heads.
    """
    b, h, t, d = q.shape
    if k.size(1) != h:
        k, v = k.repeat_interleave(h // k.size(1), dim=1), v.repeat_interleave(h // v.size(1), dim=1)
    flat = [x.reshape(b * h, t, d).contiguous() for x in (q, k, v)]
    return _BlockwiseCausal.apply(*flat, window).view(b, h, t, d)


# --- GPU: sliding-window layers through FlexAttention -------------------------------------------------
#
# On CUDA a sliding-window ('S') layer over a whole sequence used to call scaled_dot_product_attention
# with a boolean [T, T] mask: no flash kernel takes an arbitrary mask, so the memory-efficient kernel
# computed every (query, key) block, the ones the window masks included. FlexAttention's BlockMask
# lists, per block of FLEX_BLOCK queries, the key blocks that are partly visible (the mask is applied
# inside) and the ones that are wholly visible (no mask work); every other block is skipped. At a
# quarter-context window that is about 1/4 + a diagonal of the T^2/2 causal blocks. Full-context
# layers keep SDPA with is_causal=True (the flash kernel).

FLEX_BLOCK = 128  # FlexAttention's default tile; the BlockMask is kept at this granularity


@dataclass(frozen=True)
class FlexWindow:
    """Attention plan: compiled FlexAttention over the whole sequence with a sliding-window causal mask."""

    window: int
    length: int


def sliding_window_mask_mod(window: int):
    """FlexAttention mask_mod: query q may see key k when k <= q and q - k < window (itself included)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return mask_mod


_BLOCK_MASKS: dict[tuple[int, int, str], object] = {}


def sliding_window_block_mask(length: int, window: int, device: torch.device):
    """The BlockMask of a ``window``-key causal window over ``length`` positions, built once per shape and
    device (building it evaluates the mask over every block; the training step reuses it every step)."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (length, window, str(device))
    _compiled_flex_attention()  # built here too: a compiled forward then finds both ready (no recompile)
    if key not in _BLOCK_MASKS:
        _BLOCK_MASKS[key] = create_block_mask(
            sliding_window_mask_mod(window), None, None, length, length, device=device, BLOCK_SIZE=FLEX_BLOCK
        )
    return _BLOCK_MASKS[key]


_COMPILED_FLEX = None


def _compiled_flex_attention():
    """flex_attention compiled once per process (uncompiled it materialises the whole score matrix)."""
    global _COMPILED_FLEX
    if _COMPILED_FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX


def flex_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: FlexWindow) -> torch.Tensor:
    """Sliding-window causal attention of [B, H, T, D] tensors (k, v may have fewer heads: grouped-query),
    with the default 1/sqrt(D) scale: what masked ``scaled_dot_product_attention`` computes."""
    block_mask = sliding_window_block_mask(plan.length, plan.window, q.device)
    gqa = k.size(1) != q.size(1)
    if torch.is_autocast_enabled(q.device.type):  # flex is no autocast op: run it in the autocast dtype, as SDPA
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return _compiled_flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=gqa)
