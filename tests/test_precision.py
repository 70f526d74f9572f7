"""Sampling with the linear layers in bf16 (chatpipe.inference.precision.linears_in)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from chatpipe.inference.engine import Engine
from chatpipe.inference.precision import MIN_WIDTH, linears_in
from chatpipe.model.gpt import GPT, GPTConfig
from chatpipe.rl.rollout import Problem, collect_rollouts
from chatpipe.tokenizer import Tokenizer

TOK = Tokenizer.from_ranks({bytes([i]): i for i in range(256)})


def small_gpt(width: int = 64) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(sequence_len=64, vocab_size=TOK.vocab_size, n_layer=2, n_head=1, n_kv_head=1, n_embd=width)
    model = GPT(config)
    model.init_weights()
    for p in model.parameters():  # init_weights zeroes the output projections: make every layer count
        p.data.add_(0.02 * torch.randn_like(p))
    return model.eval()


def wide_linears(model: torch.nn.Module) -> list[torch.nn.Linear]:
    return [m for m in model.modules() if type(m) is torch.nn.Linear and min(m.weight.shape) >= MIN_WIDTH]


def test_each_wide_linear_multiplies_in_bf16_inside_and_is_its_own_again_after():
    model = small_gpt()
    idx = torch.randint(0, TOK.vocab_size, (3, 10))
    with torch.no_grad():
        want = model(idx)
        layer = model.lm_head
        x = torch.randn(4, layer.in_features)
        with linears_in(model, torch.bfloat16) as switched:
            assert switched == len(wide_linears(model)) > 0
            got_layer = layer(x)
            got = model(idx)
        after = model(idx)
    ref = F.linear(x.bfloat16(), layer.weight.bfloat16()).float()
    assert torch.equal(got_layer, ref), "the layer's input and weight are both cast, its output cast back"
    assert got_layer.dtype == torch.float32
    assert not torch.equal(got, want), "the model computed in float32 inside the block"
    torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)  # bf16 rounding, not another model
    assert torch.equal(after, want), "a layer kept its bf16 forward after the block"
    assert all("forward" not in vars(m) for m in model.modules())


def test_narrow_layers_float32_and_none_change_nothing():
    model = small_gpt(width=32)  # every layer narrower than MIN_WIDTH on one side
    with linears_in(model, torch.bfloat16) as switched:
        assert switched == 0
    wide = small_gpt()
    for dtype in (None, torch.float32):
        with linears_in(wide, dtype) as switched:
            assert switched == 0


def test_the_copies_are_made_on_entry_so_an_updated_policy_is_sampled_as_updated():
    model = small_gpt()
    layer = model.lm_head
    x = torch.randn(2, layer.in_features)
    with torch.no_grad(), linears_in(model, torch.bfloat16):
        before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # an optimizer step between two RL steps' rollouts
        with linears_in(model, torch.bfloat16):
            now = layer(x)
    assert torch.equal(now, F.linear(x.bfloat16(), layer.weight.bfloat16()).float())
    assert not torch.equal(now, before)


def test_an_error_inside_restores_every_layer_and_a_second_entry_is_refused():
    model = small_gpt()
    with pytest.raises(KeyError), linears_in(model, torch.bfloat16):
        raise KeyError("a failed rollout")
    assert all("forward" not in vars(m) for m in model.modules())
    with linears_in(model, torch.bfloat16):
        with pytest.raises(RuntimeError, match="entered twice"), linears_in(model, torch.bfloat16):
            pass
        assert all("forward" in vars(m) for m in wide_linears(model)), "the refused entry undid the first one"
    assert all("forward" not in vars(m) for m in model.modules())


def test_rollouts_sample_in_bf16_and_leave_the_policy_as_it_was():
    model = small_gpt()
    engine = Engine(model, TOK)
    conv = {"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "#### 2"}]}
    problems = [Problem(conv, lambda text: float("2" in text))] * 2
    seen = []
    hook = model.lm_head.register_forward_hook(lambda m, args, out: seen.append("forward" in vars(m)))
    kw = dict(group_size=3, max_new_tokens=6, seed=0)
    batch = collect_rollouts(engine, problems, matmul_dtype=torch.bfloat16, **kw)
    hook.remove()
    assert seen and all(seen), "every forward of the rollouts ran the bf16 linear"
    assert batch.inputs.shape[0] == 6 and batch.mask.sum() > 0
    assert all("forward" not in vars(m) for m in model.modules())
    again = collect_rollouts(engine, problems, matmul_dtype=torch.bfloat16, **kw)
    assert torch.equal(again.inputs, batch.inputs), "seeded rollouts in bf16 are reproducible"
