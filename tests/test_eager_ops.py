"""The hand-written backward passes of chatpipe.model.eager_ops against autograd through the plain ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chatpipe.model import eager_ops

COS_SIN_SHAPE = (1, 1, 33, 8)


def _rotary_tables() -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(COS_SIN_SHAPE, generator=torch.Generator().manual_seed(1)) * 6.0
    return angles.cos(), angles.sin()


def _plain_rotary(x: torch.Tensor) -> torch.Tensor:
    cos, sin = _rotary_tables()
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


CASES = {
    "relu_squared": (eager_ops.relu_squared, lambda x: F.relu(x).square(), (3, 33, 40)),
    "softcap": (lambda x: eager_ops.softcap(x, 15.0), lambda x: 15.0 * torch.tanh(x / 15.0), (3, 33, 40)),
    "rms_norm": (eager_ops.rms_norm, lambda x: F.rms_norm(x, (x.size(-1),)), (3, 33, 40)),
    "rotary": (lambda x: eager_ops.apply_rotary(x, *_rotary_tables()), _plain_rotary, (2, 3, 33, 16)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_is_bitwise_the_plain_ops_and_backward_matches_autograd(name: str) -> None:
    fused, plain, shape = CASES[name]
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=gen) * 20.0).requires_grad_()  # softcap's tanh far from linear
    upstream = torch.randn(shape, generator=gen)
    y_fused, y_plain = fused(x), plain(x)
    assert torch.equal(y_fused, y_plain)  # logits stay bitwise what they were (reference tests)
    assert y_fused.grad_fn is not None and "Backward" in type(y_fused.grad_fn).__name__
    (g_fused,) = torch.autograd.grad(y_fused, x, upstream)
    (g_plain,) = torch.autograd.grad(y_plain, x, upstream)
    torch.testing.assert_close(g_fused, g_plain, rtol=1e-5, atol=1e-5)
    # and both against float64 autograd of the plain ops, the ground truth
    x64 = x.detach().double().requires_grad_()
    (g64,) = torch.autograd.grad(plain(x64) if name != "rotary" else _plain_rotary(x64), x64, upstream.double())
    torch.testing.assert_close(g_fused.double(), g64, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", sorted(CASES))
def test_plain_ops_run_outside_float32_cpu(name: str) -> None:
    """float64 (and, likewise, bf16 or CUDA or a compiled graph) takes the plain ops: no custom node."""
    fused, _, shape = CASES[name]
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    if name == "rotary":
        cos, sin = (t.double() for t in _rotary_tables())
        y = eager_ops.apply_rotary(x, cos, sin)
    else:
        y = fused(x)
    assert not type(y.grad_fn).__name__.startswith("_")


def test_gpt_step_uses_them_and_matches_the_plain_model() -> None:
    """One training step of a small GPT: gradients equal (to float32 rounding) with and without them."""
    from chatpipe.model.gpt import GPT, GPTConfig

    config = GPTConfig(sequence_len=32, vocab_size=97, n_layer=2, n_head=2, n_kv_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))  # zero-initialised projections would hide paths
    idx = torch.randint(0, 97, (3, 33), generator=torch.Generator().manual_seed(2))
    model(idx[:, :-1], idx[:, 1:]).backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with torch.no_grad():
        fused_logits = model(idx[:, :-1])
    original = eager_ops._use_fused
    eager_ops._use_fused = lambda x: False
    try:
        with torch.no_grad():
            assert torch.equal(fused_logits, model(idx[:, :-1]))
        model(idx[:, :-1], idx[:, 1:]).backward()
    finally:
        eager_ops._use_fused = original
    for name, p in model.named_parameters():
        torch.testing.assert_close(fused[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
