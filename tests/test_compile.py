"""The compiled training step (model, loss, optimizer) has no graph breaks and compiles once.

A d2 model with every speedrun option (value embeddings, lambdas, smear, backout, SSSL quarter
windows, rotary base, QK scale, padded vocab), bf16 autocast, FP8 through its CPU emulation, the
speedrun's MuonAdamW with compiled per-parameter updates and Polar Express in bf16. dynamo's own
counters say what it did: a graph break would split the step (and on GPU stall it between graphs),
a recompile would stop every step after the first to compile again.

Graph breaks, graph counts and recompiles are dynamo's decisions, made before any backend runs, so
both tests compile through ``aot_eager`` (dynamo and AOTAutograd trace forward and backward as
inductor would get them) and skip inductor's C++ code generation: seconds instead of minutes cold.
Compiled FlexAttention's numbers on CPU are checked in tests/test_attention.py.
Inductor's own kernels for the model and the optimizer are checked where their numbers matter
(tests/test_nanochat_reference.py, tests/test_rehearsal_gpu.py).
"""

from __future__ import annotations

import functools

import pytest
import torch

from chatpipe.model.fp8 import CPU_TEST_ENV, enable_fp8
from chatpipe.model.gpt import GPT, config_from_depth, nanochat_options
from chatpipe.runtime import Runtime
from chatpipe.train import optim
from chatpipe.train.optim import build_optimizers
from chatpipe.train.step import train_step

SEQ, ROWS, VOCAB, STEPS = 64, 4, 512, 5


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return rows[:, :-1], rows[:, 1:]


def _dynamo_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs": counters["stats"]["unique_graphs"],
        "recompiles": sum(v for k, c in counters.items() if "recompil" in k for v in c.values()),
    }


@pytest.mark.parametrize("recipe", ["torchao", "tensorwise"])
def test_the_compiled_speedrun_step_has_no_graph_breaks_and_compiles_once(monkeypatch, recipe):
    monkeypatch.setenv(CPU_TEST_ENV, "1")
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    monkeypatch.setattr(optim, "_COMPILED", {})  # the optimizer's process-wide cache: none kept from here
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: two threads on a busy 2-core machine wait on each other
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    model = GPT(config_from_depth(2, VOCAB, SEQ, head_dim=64, window_pattern="SSSL", **nanochat_options(SEQ)))
    model.init_weights()
    enable_fp8(model, recipe)
    optimizers = build_optimizers(
        model, optimizer="normuon_polar_express", weight_decay=0.28, compile=True, polar_dtype=torch.bfloat16
    )
    step_model = torch.compile(model)
    rt = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.bfloat16)
    counts, losses = [], []
    try:
        for step in range(STEPS):
            batch = _batch(step)
            losses.append(train_step(step_model, lambda batch=batch: batch, optimizers, grad_accum=1, rt=rt))
            counts.append(_dynamo_counts())
    finally:
        torch.set_num_threads(before)
    assert counts[0]["graph_breaks"] == 0, counts[0]
    # model forward (+ its backward) and the optimizer's per-shape update graphs, all on the first step
    assert counts[0]["graphs"] >= 2
    assert all(c == counts[0] for c in counts), counts  # nothing compiled again, no recompiles
    assert counts[0]["recompiles"] == 0
    assert all(torch.isfinite(torch.tensor(losses))) and len(set(losses)) == STEPS  # it trained on each batch


def test_the_compiled_forward_through_flex_attention_has_no_graph_breaks_and_compiles_once(monkeypatch):
    """The CUDA path's windowed attention, forced onto CPU (forward only: CPU flex has no backward):
    the block masks built with the model, found cached by the compiled forward."""
    import chatpipe.model.attention as attention
    import chatpipe.model.gpt as gpt

    monkeypatch.setattr(gpt, "FLEX_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    monkeypatch.setattr(attention, "_COMPILED_FLEX", None)  # built here with aot_eager, dropped after
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    seq = 256
    torch.manual_seed(0)
    model = GPT(config_from_depth(2, VOCAB, seq, head_dim=64, window_pattern="SSSL", **nanochat_options(seq)))
    model.init_weights()
    step_model = torch.compile(model)
    counts = []
    for step in range(3):
        x = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(step))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = step_model(x)
        counts.append(_dynamo_counts())
    assert counts[0]["graph_breaks"] == 0 and counts[0]["graphs"] >= 1, counts[0]
    assert all(c == counts[0] for c in counts), counts
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        eager = model(x)
    assert (logits - eager).abs().max().item() < 0.1  # bf16 logits, soft-capped at 15
