"""Tests for chatpipe.model.cpu_kernel: decode attention read in place from the paged pool, in C."""

from __future__ import annotations

import pytest
import torch

from chatpipe.model import cpu_kernel
from chatpipe.model.paged_cache import BlockPool, PagedBatch, Sequence
from tests.test_model import tiny

CPU = torch.device("cpu")


def decode_logits(model, x: torch.Tensor, prefill: list[int]) -> tuple[torch.Tensor, list[bool]]:
    """Each row of ``x`` prefilled to ``prefill[i]`` tokens, then decoded one token a step to the end
    beside the rows that reached the same length, in inference mode: the logits [rows, T, V] (those at
    row i's positions from ``prefill[i]`` on are the decode steps'), and whether each step ran in the kernel."""
    pool = BlockPool(model.config, num_blocks=24, block_size=4)
    seqs = [Sequence(row.tolist()) for row in x]
    rows, total = x.shape
    out = torch.zeros(rows, total, model.config.padded_vocab_size)
    kernel = []
    with torch.inference_mode():
        for i, (seq, n) in enumerate(zip(seqs, prefill)):
            assert pool.reserve(seq, n)
            model(x[i : i + 1, :n], kv_cache=PagedBatch(pool, [seq], [n], CPU))
        for t in range(min(prefill), total):
            live = [i for i, s in enumerate(seqs) if s.length == t]  # the rows prefilled up to here
            for i in live:
                assert pool.reserve(seqs[i], seqs[i].length + 1)
            ids = x[live, t : t + 1]
            cache = PagedBatch(pool, [seqs[i] for i in live], [1] * len(live), CPU)
            kernel.append(cache.kernel)
            logits = model(ids, kv_cache=cache)
            for row, i in enumerate(live):
                out[i, t] = logits[row, -1]
    return out, kernel


@pytest.mark.parametrize("pattern,kv", [("L", 4), ("SL", 2)], ids=["full-attention", "window-and-gqa"])
def test_decode_steps_attend_in_the_kernel_and_match_the_full_forward_and_the_torch_path(pattern, kv, monkeypatch):
    """Rows of different lengths over several blocks, with grouped kv heads and a sliding window (4)
    that the rows outgrow: every decode step runs in the C kernel, and its logits are the full
    forward's, and the torch path's (gathered keys) to float32 rounding."""
    assert cpu_kernel.available(CPU), "the kernel must build on a machine with a C compiler"
    model = tiny(window_pattern=pattern, n_kv_head=kv, sequence_len=8).eval()
    x = torch.randint(0, 97, (3, 19))
    prefill = [5, 2, 9]
    full = model(x)
    in_kernel, kernel_used = decode_logits(model, x, prefill)
    monkeypatch.setenv(cpu_kernel.ENABLE_ENV, "0")
    on_torch, torch_used = decode_logits(model, x, prefill)
    assert all(kernel_used) and not any(torch_used)
    for i, n in enumerate(prefill):
        assert torch.allclose(in_kernel[i, n:], full[i, n:], atol=1e-4), i
        assert torch.allclose(in_kernel[i, n:], on_torch[i, n:], atol=1e-5), i


def test_a_pool_not_in_float32_or_autograd_on_keeps_the_torch_path():
    model = tiny(n_kv_head=2).eval()
    pool = BlockPool(model.config, num_blocks=8, block_size=4)
    seq = Sequence(list(range(1, 9)))
    assert pool.reserve(seq, 6)
    with torch.inference_mode():
        model(torch.tensor([seq.tokens[:5]]), kv_cache=PagedBatch(pool, [seq], [5], CPU))
        assert PagedBatch(pool, [seq], [1], CPU).kernel
    assert not PagedBatch(pool, [seq], [1], CPU).kernel  # autograd on: the kernel has no backward
    in_bf16 = BlockPool(model.config, num_blocks=8, block_size=4)
    in_bf16.storage(torch.bfloat16, CPU)  # as a prefill of a model in bf16 leaves it
    other = Sequence(list(range(1, 9)))
    assert in_bf16.reserve(other, 1)
    with torch.inference_mode():
        assert not PagedBatch(in_bf16, [other], [1], CPU).kernel


def test_a_missing_or_failing_compiler_is_named_and_leaves_no_library(tmp_path, monkeypatch):
    monkeypatch.setenv("CHATPIPE_KERNEL_CACHE", str(tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="no C compiler 'no-such-cc'"):
        cpu_kernel.build(compiler="no-such-cc")
    broken = tmp_path / "paged_attention.c"
    broken.write_text("this is not C;\n")
    monkeypatch.setattr(cpu_kernel, "SOURCE", broken)
    with pytest.raises(RuntimeError, match="could not build paged_attention.c: .*error"):
        cpu_kernel.build()
    assert list((tmp_path / "cache").iterdir()) == []  # the half-built file is gone
    monkeypatch.setattr(cpu_kernel, "SOURCE", cpu_kernel.Path(cpu_kernel.__file__).with_name("paged_attention.c"))
    built = cpu_kernel.build()
    assert built.parent == tmp_path / "cache" and cpu_kernel.build() == built  # cached: built once


def test_a_batch_made_for_the_kernel_but_run_with_autograd_on_attends_on_the_torch_path():
    """The kernel has no backward: a decode batch made with autograd off (so for the kernel) whose
    forward then runs with it on builds the torch path's tables in its first layer and still gives
    the full forward's logits."""
    model = tiny(window_pattern="SL", n_kv_head=2, sequence_len=8).eval()
    x = torch.randint(0, 97, (1, 10))
    pool = BlockPool(model.config, num_blocks=8, block_size=4)
    seq = Sequence(x[0].tolist())
    assert pool.reserve(seq, 10)
    with torch.no_grad():
        model(x[:, :9], kv_cache=PagedBatch(pool, [seq], [9], CPU))
        cache = PagedBatch(pool, [seq], [1], CPU)
    assert cache.kernel
    logits = model(x[:, 9:10], kv_cache=cache)
    assert not cache.kernel and logits.requires_grad
    assert torch.allclose(logits[0, -1], model(x)[0, -1], atol=1e-4)
