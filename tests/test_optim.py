"""Tests for chatpipe.train.optim: optimizer grouping and lrs, schedules at hand-checked steps, momentum ramp."""

from __future__ import annotations

import pytest
import torch

from chatpipe.model.gpt import GPT, GPTConfig
from chatpipe.train.optim import (
    apply_schedules,
    build_optimizers,
    lr_multiplier,
    muon_momentum,
    muon_update,
    polar_express,
)


def model_with_width(n_embd: int) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=8, vocab_size=32, n_layer=2, n_head=1, n_kv_head=1, n_embd=n_embd))
    model.init_weights()
    return model


def test_build_optimizers_groups_and_scaled_lrs():
    model = model_with_width(192)  # (192/768)^-0.5 = 2
    adamw, muon = build_optimizers(model, matrix_lr=0.03, embedding_lr=0.2, unembedding_lr=0.004, weight_decay=0.1)
    assert isinstance(adamw, torch.optim.AdamW) and isinstance(muon, torch.optim.Muon)
    lm_group, emb_group = adamw.param_groups
    assert lm_group["params"] == [model.lm_head.weight] and emb_group["params"] == [model.wte.weight]
    assert lm_group["lr"] == pytest.approx(0.008) and emb_group["lr"] == pytest.approx(0.4)
    assert adamw.defaults["weight_decay"] == 0.0 and adamw.defaults["betas"] == (0.8, 0.95)
    g = muon.param_groups[0]
    assert (g["lr"], g["momentum"], g["nesterov"], g["weight_decay"]) == (0.03, 0.95, True, 0.1)
    every = [p for opt in (adamw, muon) for grp in opt.param_groups for p in grp["params"]]
    assert len(every) == len({id(p) for p in every}) == len(list(model.parameters()))
    assert all(grp["initial_lr"] == grp["lr"] for opt in (adamw, muon) for grp in opt.param_groups)


def test_steps_change_every_param():
    model = model_with_width(64)
    with torch.no_grad():  # zero-init projections get no gradient signal otherwise in one step
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    before = [p.detach().clone() for p in model.parameters()]
    opts = build_optimizers(model)
    x = torch.randint(0, 32, (2, 8))
    model(x, x).backward()
    for opt in opts:
        opt.step()
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_warmdown_schedule_hand_checked():
    kw = dict(warmup_steps=10, warmdown_ratio=0.2, final_lr_frac=0.05)
    f = lambda s: lr_multiplier(s, 100, **kw)  # noqa: E731
    assert f(0) == pytest.approx(0.1)
    assert f(4) == pytest.approx(0.5)
    assert f(9) == pytest.approx(1.0)
    assert f(50) == 1.0 and f(79) == 1.0
    assert f(89) == pytest.approx(0.05 + 0.95 * 0.5)  # 10 of 20 warmdown steps left
    assert f(99) == pytest.approx(0.05)
    assert f(500) == pytest.approx(0.05)  # past the end: clamped


def test_warmdown_short_run_still_ends_low():
    vals = [lr_multiplier(s, 5, warmup_steps=10, warmdown_ratio=0.5, final_lr_frac=0.0) for s in range(5)]
    assert vals[-1] == 0.0 and max(vals) <= 1.0


def test_cosine_schedule_hand_checked():
    kw = dict(warmup_steps=10, warmdown_ratio=0.0, final_lr_frac=0.1, schedule="cosine")
    assert lr_multiplier(4, 111, **kw) == pytest.approx(0.5)
    assert lr_multiplier(10, 111, **kw) == pytest.approx(1.0)
    assert lr_multiplier(60, 111, **kw) == pytest.approx(0.55)  # halfway: (1 + 0.1) / 2
    assert lr_multiplier(110, 111, **kw) == pytest.approx(0.1)


def test_unknown_schedule_names_allowed_values():
    with pytest.raises(ValueError, match="warmdown, cosine"):
        lr_multiplier(0, 10, warmup_steps=0, warmdown_ratio=0.2, final_lr_frac=0.0, schedule="linear")


def test_muon_momentum_ramp():
    assert muon_momentum(0) == pytest.approx(0.85)
    assert muon_momentum(150) == pytest.approx(0.90)
    assert muon_momentum(300) == pytest.approx(0.95) and muon_momentum(10_000) == pytest.approx(0.95)
    assert muon_momentum(5, warmup_steps=0) == 0.95


def test_apply_schedules_sets_lr_and_muon_momentum_only():
    adamw, muon = build_optimizers(model_with_width(64))
    apply_schedules([adamw, muon], 0.5, 0.9)
    assert all(g["lr"] == pytest.approx(0.5 * g["initial_lr"]) for o in (adamw, muon) for g in o.param_groups)
    assert muon.param_groups[0]["momentum"] == 0.9 and "momentum" not in adamw.param_groups[0]
    apply_schedules([adamw, muon], 1.0, None)
    assert muon.param_groups[0]["momentum"] == 0.9
    assert adamw.param_groups[1]["lr"] == adamw.param_groups[1]["initial_lr"]


def test_fp32_newton_schulz_matches_torch_iteration():
    import torch.optim._muon as torch_muon

    from chatpipe.train.optim import newton_schulz_fp32

    torch.manual_seed(0)
    for shape in [(64, 32), (32, 64)]:
        g = torch.randn(shape)
        ours = newton_schulz_fp32(g, (3.4445, -4.775, 2.0315), 5, 1e-7)
        ref = torch_muon._zeropower_via_newtonschulz(g, (3.4445, -4.775, 2.0315), 5, 1e-7).float()
        assert ours.dtype == torch.float32 and ours.shape == g.shape
        # bf16 reference: agree to bf16 precision; singular values pushed towards ~1
        assert (ours - ref).abs().max() < 0.05
        s = torch.linalg.svdvals(ours)
        assert s.min() > 0.3 and s.max() < 1.5


def test_cpu_muon_step_restores_torch_function():
    import torch.optim._muon as torch_muon

    from chatpipe.train.optim import Muon

    before = torch_muon._zeropower_via_newtonschulz
    w = torch.nn.Parameter(torch.randn(16, 8))
    opt = Muon([w], lr=0.02)
    w0 = w.detach().clone()
    w.grad = torch.randn(16, 8)
    opt.step()
    assert torch_muon._zeropower_via_newtonschulz is before
    assert not torch.equal(w0, w.detach())


def test_cpu_muon_runs_the_fp32_newton_schulz_and_names_a_moved_private_function(monkeypatch):
    """The swap reaches torch's step (the fp32 iteration runs), and a torch whose private name moved
    fails at the first step with a message naming the name, the tested version and the way out."""
    import torch.optim._muon as torch_muon

    from chatpipe.train import optim

    calls = []
    real = optim.newton_schulz_fp32
    monkeypatch.setattr(optim, "newton_schulz_fp32", lambda *a, **k: calls.append(1) or real(*a, **k))
    w = torch.nn.Parameter(torch.randn(16, 8))
    opt = optim.Muon([w], lr=0.02)
    w.grad = torch.randn(16, 8)
    opt.step()
    assert calls == [1]
    monkeypatch.delattr(torch_muon, "_zeropower_via_newtonschulz")
    with pytest.raises(RuntimeError, match=r"no torch.optim._muon._zeropower_via_newtonschulz.*torch<2.13.1"):
        opt.step()


def _polar_stack(rows: int, cols: int, rank: int | None) -> torch.Tensor:
    """A stack of normalised matrices, ill-conditioned (low rank + 1% noise) when ``rank`` is given."""
    gen = torch.Generator().manual_seed(rows + cols)
    g = torch.randn(3, rows, cols, generator=gen)
    if rank is not None:
        g = torch.randn(3, rows, rank, generator=gen) @ torch.randn(3, rank, cols, generator=gen) + 0.01 * g
    return g / (1.01 * g.norm(dim=(-2, -1), keepdim=True) + 1e-6)


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (64, 128)])
@pytest.mark.parametrize("rank", [None, 4])
def test_gram_space_polar_express_computes_the_direct_polynomial(shape, rank):
    x = _polar_stack(*shape, rank)
    exact = polar_express(x.double())  # the direct form in float64
    direct, gram = polar_express(x), polar_express(x, form="gram")

    def err(y):
        return ((y.double() - exact).norm() / exact.norm()).item()

    # float32 rounding only: within a few times the direct form's own error, far below a wrong polynomial's
    assert err(gram) < max(10 * err(direct), 1e-5)
    assert err(polar_express(x, steps=4, form="gram")) > 100 * err(gram)  # one iteration fewer is visibly different
    assert not torch.equal(direct, gram)  # the gram form really ran


def test_gram_space_polar_express_leaves_square_stacks_direct_and_rejects_unknown_forms():
    x = _polar_stack(64, 64, None)
    assert torch.equal(polar_express(x, form="gram"), polar_express(x))  # no saving at 1:1, so the direct form
    with pytest.raises(ValueError, match="form='fast'.*direct, gram"):
        polar_express(x, form="fast")


def test_polar_express_setting_reaches_muon_adamw_and_needs_it():
    model = GPT(GPTConfig(sequence_len=16, vocab_size=64, n_layer=1, n_head=2, n_kv_head=2, n_embd=64))
    [opt] = build_optimizers(model, optimizer="normuon_polar_express", polar_express="gram")
    assert opt.polar_express == "gram"
    with pytest.raises(ValueError, match="needs optimizer='normuon_polar_express'"):
        build_optimizers(model, optimizer="muon_newton_schulz", polar_express="gram")
    with pytest.raises(ValueError, match="polar_express='gramm'; allowed: direct, gram"):
        build_optimizers(model, optimizer="normuon_polar_express", polar_express="gramm")


def _muon_update_in(dtype: torch.dtype, grads: torch.Tensor) -> torch.Tensor:
    """A first Muon update of ``grads`` with Polar Express's matmuls in ``dtype`` (fresh buffers)."""
    n, rows, cols = grads.shape
    buffers = (torch.zeros_like(grads), torch.zeros(n, rows, 1) if rows >= cols else torch.zeros(n, 1, cols))
    return muon_update(grads, *buffers, momentum=0.95, beta2=0.9, ns_steps=5, polar_dtype=dtype)


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (64, 64)])
def test_bfloat16_polar_express_gives_the_float32_update_to_bfloat16_precision(shape):
    grads = torch.randn(3, *shape, generator=torch.Generator().manual_seed(0))
    fp32, bf16 = _muon_update_in(torch.float32, grads), _muon_update_in(torch.bfloat16, grads)
    assert bf16.dtype == torch.float32  # only Polar Express's matmuls are bf16; the update is float32
    rel = ((bf16 - fp32).norm() / fp32.norm()).item()
    # bf16 keeps 8 mantissa bits and five iterations compound them: ~3-5% of the update, as on nanochat's GPUs
    assert 1e-3 < rel < 0.1
    random = _muon_update_in(torch.float32, torch.randn(3, *shape, generator=torch.Generator().manual_seed(1)))
    assert ((random - fp32).norm() / fp32.norm()).item() > 1.0  # what an unrelated update looks like


def test_polar_dtype_reaches_muon_adamw_keeps_float32_state_and_needs_the_recipe():
    model = GPT(GPTConfig(sequence_len=16, vocab_size=64, n_layer=1, n_head=2, n_kv_head=2, n_embd=64))
    [opt] = build_optimizers(model, optimizer="normuon_polar_express", polar_dtype=torch.bfloat16)
    assert opt.polar_dtype == torch.bfloat16
    before = model.blocks[0].attn.c_q.weight.detach().clone()
    model(torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))).backward()
    opt.step()
    state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert state and all(t.dtype == torch.float32 for t in state)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not torch.equal(before, model.blocks[0].attn.c_q.weight)
    with pytest.raises(ValueError, match="needs optimizer='normuon_polar_express'"):
        build_optimizers(model, optimizer="muon_newton_schulz", polar_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="polar_dtype=torch.float16; allowed: torch.float32, torch.bfloat16"):
        build_optimizers(model, optimizer="normuon_polar_express", polar_dtype=torch.float16)


def test_muon_adamw_bookkeeping_does_not_import_dynamo():
    """Building, stepping, zeroing and (re)loading MuonAdamW in a fresh process leaves torch._dynamo
    unimported: its import costs a tiny stage process ~2.5 s of CPU (torch's Optimizer base class
    imports it on first use). The state round-trips as the base class's would."""
    import subprocess
    import sys

    script = """
import sys, torch
from chatpipe.model.gpt import GPT, GPTConfig
from chatpipe.train.optim import build_optimizers
model = GPT(GPTConfig(sequence_len=8, vocab_size=32, n_layer=2, n_head=1, n_kv_head=1, n_embd=64))
(opt,) = build_optimizers(model, optimizer="normuon_polar_express")
for _ in range(2):
    model(torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8))).backward()
    opt.step()
    opt.zero_grad()
state = opt.state_dict()
assert sorted(state) == ["param_groups", "state"] and len(state["state"]) > 0
(other,) = build_optimizers(model, optimizer="normuon_polar_express")
other.load_state_dict(state)
assert all(p.grad is None for p in model.parameters())
assert torch.equal(other.state_dict()["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_init_lrs_are_the_model_dirs_trained_lrs_and_the_defaults_where_it_has_none():
    from chatpipe.settings import TrainSettings
    from chatpipe.train.optim import init_lrs

    trained = {"settings": {"matrix_lr": 0.011, "embedding_lr": 0.33, "unembedding_lr": 0.0055, "depth": 4}}
    assert init_lrs(trained) == {"matrix_lr": 0.011, "embedding_lr": 0.33, "unembedding_lr": 0.0055}
    imported = init_lrs({"settings": {"matrix_lr": 0.011}})  # e.g. a nanochat import: no embedding lrs recorded
    assert imported["matrix_lr"] == 0.011
    assert imported["embedding_lr"] == TrainSettings.model_fields["embedding_lr"].default
    assert init_lrs({}) == {k: TrainSettings.model_fields[k].default for k in TrainSettings.LR_KEYS}
