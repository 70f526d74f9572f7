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


# --- FlexAttention for sliding-window layers (the CUDA path) ------------------------------------------


def _listed_blocks(num_blocks: torch.Tensor, indices: torch.Tensor, n: int) -> torch.Tensor:
    """[n_q_blocks, n] bool: the key blocks a BlockMask lists for each query block (batch and head 0)."""
    dense = torch.zeros(num_blocks.size(-1), n, dtype=torch.bool)
    for row in range(num_blocks.size(-1)):
        dense[row, indices[0, 0, row, : num_blocks[0, 0, row]].long()] = True
    return dense


@pytest.mark.parametrize(("t", "window"), [(512, 129), (2048, 513), (640, 200), (300, 64), (256, 256)])
def test_the_block_mask_equals_the_boolean_mask_block_for_block(t, window):
    """Each FLEX_BLOCK x FLEX_BLOCK tile of the boolean mask SDPA took: all False -> not listed, all True
    -> listed as full (no mask work), mixed -> listed as partial (the mask applied inside)."""
    from torch.nn.attention.flex_attention import create_mask

    from chatpipe.model.attention import FLEX_BLOCK, sliding_window_block_mask, sliding_window_mask_mod
    from chatpipe.model.gpt import _causal_mask

    mask = _causal_mask(0, t, window, torch.device("cpu"))
    assert torch.equal(create_mask(sliding_window_mask_mod(window), None, None, t, t, device="cpu")[0, 0], mask)
    n = -(-t // FLEX_BLOCK)
    padded = torch.zeros(n * FLEX_BLOCK, n * FLEX_BLOCK, dtype=torch.bool)
    padded[:t, :t] = mask
    tiles = padded.view(n, FLEX_BLOCK, n, FLEX_BLOCK).transpose(1, 2)
    # a tile cut by the sequence end counts as full when every position inside the sequence is visible
    inside = torch.zeros_like(padded)
    inside[:t, :t] = True
    inside = inside.view(n, FLEX_BLOCK, n, FLEX_BLOCK).transpose(1, 2)
    any_true = tiles.any(-1).any(-1)
    all_true = (tiles | ~inside).all(-1).all(-1) & any_true
    block_mask = sliding_window_block_mask(t, window, torch.device("cpu"))
    partial = _listed_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, n)
    full = _listed_blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, n)
    assert torch.equal(full, all_true)
    assert torch.equal(partial, any_true & ~all_true)
    assert sliding_window_block_mask(t, window, torch.device("cpu")) is block_mask  # built once per shape
    if (t, window) == (
        2048,
        513,
    ):  # the speedrun's S layer: 70 of the 256 blocks a masked SDPA call computes, 42 without mask work
        assert (partial | full).sum() == 70 and full.sum() == 42


def test_sliding_windows_on_cuda_take_flex_and_full_context_keeps_causal_sdpa(monkeypatch):
    from chatpipe.model.attention import FlexWindow

    cuda = torch.device("cuda")  # planning only: nothing is allocated on it
    assert _attention_plan(0, 2048, 513, cuda, training=True) == FlexWindow(513, 2048)
    assert _attention_plan(0, 2048, 513, cuda, training=False) == FlexWindow(513, 2048)  # evaluation too
    assert _attention_plan(0, 2048, None, cuda, training=True) == [(0, 2048, 0, 2048, None, True)]
    assert _attention_plan(0, 256, 513, cuda, training=True) == [(0, 256, 0, 256, None, True)]  # window covers all
    assert isinstance(_attention_plan(5, 1, 513, cuda), list)  # decoding with the cache keeps SDPA
    assert _attention_plan(0, 256, 64, torch.device("cpu"), training=True) == BlockwiseCausal(64)  # CPU unchanged
    monkeypatch.setattr(gpt, "FLEX_DEVICES", ("meta",))  # a device whose masks this machine can build
    meta = torch.device("meta")
    assert _attention_plan(0, 2048, 513, meta) == FlexWindow(513, 2048)
    assert isinstance(_attention_plan(0, 2048, 513, meta, flex=False), list)  # a prefill into the KV cache: SDPA


# compiled FlexAttention's forward against masked SDPA, float32 on CPU: measured <= 2e-6 (the two sum
# the same products in different orders); 1e-5 leaves margin, and a window off by one key is > 1e-3
FLEX_TOLERANCE = 1e-5


@pytest.mark.slow  # each shape compiles flex_attention (~10 s warm, minutes cold, on 2 shared cores)
@pytest.mark.parametrize(("t", "window", "kv_heads"), [(256, 65, 4), (384, 129, 2)])
def test_compiled_flex_forward_equals_masked_sdpa(t, window, kv_heads):
    from chatpipe.model.attention import FlexWindow, flex_window_attention

    gen = torch.Generator().manual_seed(t)
    q = torch.randn(2, 4, t, 64, generator=gen)
    k, v = (torch.randn(2, kv_heads, t, 64, generator=gen) for _ in range(2))
    out = flex_window_attention(q, k, v, FlexWindow(window, t))
    assert (out - _sdpa(q, k, v, window)).abs().max().item() < FLEX_TOLERANCE
    assert (out - _sdpa(q, k, v, window - 1)).abs().max().item() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize(("seq", "kv_heads"), [(640, 1)])  # 2 kv heads: the kernel test above
def test_the_speedrun_d2_model_through_flex_equals_it_through_masked_sdpa(monkeypatch, seq, kv_heads):
    """The d2 speedrun model (SSSL, quarter windows, every option) on the flex path (forced onto CPU:
    the forward only, CPU flex has no backward) computes the logits of the SDPA path."""
    from chatpipe.model.gpt import nanochat_options

    config = config_from_depth(
        2, 256, seq, head_dim=32, n_kv_head=kv_heads, window_pattern="SSSL", **nanochat_options(seq)
    )
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    for p in model.parameters():  # the zero-initialised output projections would hide the attention
        p.data.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    assert model.windows[0] is not None and model.windows[0] < seq  # the first layer is a sliding window
    x = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x)
        monkeypatch.setattr(gpt, "FLEX_DEVICES", ("cuda", "cpu"))
        ours = model(x)
    assert (ours - ref).abs().max().item() < 1e-4  # logits soft-capped at 15; the flex kernel alone: 2e-6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward needs CUDA")
@pytest.mark.parametrize(("t", "window", "kv_heads"), [(2048, 513, 12), (1024, 257, 4)])
def test_flex_backward_equals_masked_sdpa_on_cuda(t, window, kv_heads):
    from chatpipe.model.attention import FlexWindow, flex_window_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 12, t, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, kv_heads, t, 128, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    d_out = torch.randn_like(q)

    def cuda_sdpa(q, k, v, window):
        pos = torch.arange(t, device="cuda")
        mask = (pos[None] <= pos[:, None]) & (pos[:, None] - pos[None] < window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.size(1) != q.size(1))

    ours = _output_and_grads(
        lambda q, k, v, w: flex_window_attention(q, k, v, FlexWindow(w, t)), q, k, v, window, d_out
    )
    ref = _output_and_grads(cuda_sdpa, q, k, v, window, d_out)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):  # bf16: both round to 8 bits of mantissa
        scale = b.float().abs().max().item()
        assert (a.float() - b.float()).abs().max().item() < 0.02 * scale, name
