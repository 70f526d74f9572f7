"""chatpipe.model.attention: blockwise causal attention against torch's kernel, and when the model uses it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import chatpipe.model.gpt as gpt
from chatpipe.model.attention import BLOCK_ROWS, MAX_LEN, BlockwiseCausal, blockwise_causal_attention
from chatpipe.model.gpt import GPT, _attention_plan, config_from_depth


def _sdpa(q, k, v, window):
    t = q.size(2)
    q_pos, k_pos = torch.arange(t).unsqueeze(1), torch.arange(t).unsqueeze(0)
    mask = (k_pos <= q_pos) & (q_pos - k_pos < (window or t))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.size(1) != q.size(1))


def _output_and_grads(fn, q, k, v, window, d_out):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = fn(q, k, v, window)
    out.backward(d_out)
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize(
    ("t", "window", "kv_heads"),
    [
        (256, None, 4),  # whole blocks
        (100, None, 4),  # a partial last block
        (256, 64, 4),  # window of one block: later blocks start mid-sequence
        (200, 100, 4),  # window not a multiple of the block
        (256, None, 2),  # grouped-query k/v heads
    ],
)
def test_output_and_gradients_equal_torch_attention(t, window, kv_heads):
    gen = torch.Generator().manual_seed(t + (window or 0) + kv_heads)
    q = torch.randn(2, 4, t, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, t, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    d_out = torch.randn(2, 4, t, 16, generator=gen, dtype=torch.float64)
    ours = _output_and_grads(blockwise_causal_attention, q, k, v, window, d_out)
    ref = _output_and_grads(_sdpa, q, k, v, window, d_out)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert (a - b).abs().max().item() < 1e-12, name
    # a mask off by one position is far outside that tolerance
    shifted = _output_and_grads(_sdpa, q, k, v, (window or t) - 1, d_out)
    assert (ours[0] - shifted[0]).abs().max().item() > 1e-3


def test_float32_and_bf16_autocast_match_torch_attention():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 64, generator=gen) for _ in range(3))
    assert (blockwise_causal_attention(q, k, v) - _sdpa(q, k, v, None)).abs().max().item() < 1e-5
    q.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the backward runs under the same autocast
        out = blockwise_causal_attention(q, k, v)
        ref = _sdpa(q, k, v, None)
    assert out.dtype == torch.bfloat16 and (out.float() - ref.float()).abs().max().item() < 0.05
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.float32


def test_the_model_takes_it_for_cpu_training_on_short_sequences_only():
    cpu = torch.device("cpu")
    assert _attention_plan(0, 256, None, cpu, training=True) == BlockwiseCausal(None)
    assert _attention_plan(0, 256, 64, cpu, training=True) == BlockwiseCausal(64)
    assert _attention_plan(0, 256, 512, cpu, training=True) == BlockwiseCausal(None)  # the window covers it all
    assert isinstance(_attention_plan(0, 256, None, cpu, training=False), list)  # evaluation, generation
    assert isinstance(_attention_plan(0, MAX_LEN + 1, None, cpu, training=True), list)  # would store too much
    assert isinstance(_attention_plan(0, 256, None, torch.device("meta"), training=True), list)  # not CPU
    assert BLOCK_ROWS < 256


def test_a_training_step_equals_the_one_through_torch_attention(monkeypatch):
    config = config_from_depth(2, 64, 128, head_dim=16, window_pattern="SL", n_kv_head=2)
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    for p in model.parameters():  # the zero-initialised output projections would hide the attention
        p.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    x, y = torch.randint(0, 64, (2, 2, 128), generator=torch.Generator().manual_seed(1))

    def loss_and_grads():
        model.zero_grad()
        loss = model(x, y)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, grads = loss_and_grads()
    monkeypatch.setattr(gpt, "BLOCKWISE_MAX_LEN", 0)  # every plan back to torch's kernel
    ref_loss, ref_grads = loss_and_grads()
    assert abs(loss.item() - ref_loss.item()) < 1e-6
    assert max((a - b).abs().max().item() for a, b in zip(grads, ref_grads)) < 1e-5
    assert not torch.equal(loss, model(x, torch.roll(y, 1, dims=1)).detach())  # the loss depends on the data
