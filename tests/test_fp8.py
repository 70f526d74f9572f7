"""FP8 training (chatpipe.model.fp8) on CPU through torchao's emulation, with every speedrun model option.

CHATPIPE_TEST_FP8_ON_CPU=1 is the test-only allowance: users on CPU are refused (checked below).
"""

from __future__ import annotations

import math
import sys

import pytest
import torch

from chatpipe.data.synthetic import pretrain_documents
from chatpipe.inference.engine import Engine
from chatpipe.model.files import load_model, save_model_dir
from chatpipe.model.fp8 import (
    CPU_TEST_ENV,
    FP8_RECIPES,
    TensorwiseFloat8Linear,
    check_fp8,
    enable_fp8,
    float8_layers,
    plain_linears,
)
from chatpipe.model.gpt import GPT, config_from_depth, nanochat_options
from chatpipe.runtime import Runtime
from chatpipe.settings import PretrainSettings
from chatpipe.tokenizer import Tokenizer
from chatpipe.train.checkpoint import load_checkpoint, save_checkpoint
from chatpipe.train.optim import apply_schedules, build_optimizers
from chatpipe.train.step import evaluate_loss_bpb, train_schedule, train_step

pytest.importorskip("torchao.float8", reason="the gpu/test extra (torchao) is not installed")

STEPS, RESUME_AT, SEQ, ROWS = 30, 15, 32, 4
RT = Runtime(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), dtype=torch.float32)
# the speedrun's recipe: MuonAdamW with nanochat's LRs and weight decay, warmup then warmdown
RECIPE = PretrainSettings(
    optimizer="normuon_polar_express", embedding_lr=0.3, unembedding_lr=0.008, weight_decay=0.28, warmup_steps=3
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.train(pretrain_documents(0, 200), vocab_size=512)


@pytest.fixture
def allow_cpu(monkeypatch):
    monkeypatch.setenv(CPU_TEST_ENV, "1")


@pytest.fixture
def one_thread():
    """One intra-op thread: this model's ops are tiny, and on a busy 2-core machine two threads
    wait on each other (measured: 0.09 s a step with one thread, up to 2.4 s with two)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def speedrun_d2(vocab_size: int) -> GPT:
    """d2 (n_embd 128, 2 heads of 64) with every speedrun option: value embeddings, lambdas, smear,
    backout, SSSL windows, rotary base 1e5, QK scale 1.2, vocab padded to 64."""
    torch.manual_seed(0)
    model = GPT(config_from_depth(2, vocab_size, SEQ, head_dim=64, window_pattern="SSSL", **nanochat_options(SEQ)))
    model.init_weights()
    return model


def batch(step: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s rows, the same on every call: a token follows a fixed permutation of the
    previous one 70% of the time, else a random one (learnable, and the loss stays well above 0)."""
    g = torch.Generator().manual_seed(1000 + step)
    perm = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(1))
    cols = [torch.randint(0, vocab_size, (ROWS, 1), generator=g)]
    for _ in range(SEQ):
        noise = torch.randint(0, vocab_size, (ROWS, 1), generator=g)
        cols.append(torch.where(torch.rand(ROWS, 1, generator=g) < 0.7, perm[cols[-1]], noise))
    rows = torch.cat(cols, 1)
    return rows[:, :-1], rows[:, 1:]


def train(model: GPT, optimizers: list, start: int, stop: int, vocab: int) -> list[float]:
    losses = []
    for step in range(start, stop):
        rows = batch(step, vocab)
        apply_schedules(optimizers, *train_schedule(RECIPE, STEPS)(step))  # the stages' LR and momentum at `step`
        losses.append(
            train_step(model, lambda rows=rows: rows, optimizers, grad_accum=1, rt=RT, grad_clip=RECIPE.grad_clip)
        )
    return losses


def optimizers_for(model: GPT) -> list:
    return build_optimizers(model, **RECIPE.optimizer_kwargs())


def test_fp8_is_refused_on_cpu_without_the_test_allowance_and_names_the_missing_extra(monkeypatch):
    monkeypatch.delenv(CPU_TEST_ENV, raising=False)
    with pytest.raises(RuntimeError, match=r"fp8 needs CUDA with compute capability >= 8\.9 \(this run is on CPU\)"):
        check_fp8(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="fp8 needs CUDA"):
        enable_fp8(speedrun_d2(512))
    monkeypatch.setenv(CPU_TEST_ENV, "1")
    check_fp8(torch.device("cpu"))  # the allowance
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # as if the gpu extra were not installed
    with pytest.raises(RuntimeError, match=r"fp8 needs torchao: pip install -e '\.\[gpu\]'"):
        check_fp8(torch.device("cpu"))
    check_fp8(torch.device("cpu"), "tensorwise")  # chatpipe's own recipe needs only torch
    with pytest.raises(ValueError, match="fp8 recipe 'rowwise'; allowed: torchao, tensorwise"):
        check_fp8(torch.device("cpu"), "rowwise")


def _saved_for_backward(model: GPT, x: torch.Tensor) -> list[torch.Tensor]:
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model(x, x)
    return saved


def test_tensorwise_fp8_keeps_fp8_tensors_for_the_backward_and_matches_torchao(allow_cpu, one_thread):
    """The point of chatpipe's recipe: the backward reads 1-byte FP8 copies of each layer's input and
    weight, where torchao keeps the high-precision ones. Both compute the same casts."""
    x = batch(0, 512)[0]
    ours, theirs = enable_fp8(speedrun_d2(512), "tensorwise"), enable_fp8(speedrun_d2(512), "torchao")
    assert len(float8_layers(ours)) == 12 and isinstance(ours.blocks[0].mlp.c_fc, TensorwiseFloat8Linear)
    assert list(ours.state_dict()) == list(speedrun_d2(512).state_dict())  # a plain model's names
    fp8_dtypes = (torch.float8_e4m3fn, torch.float8_e5m2)
    assert sum(t.dtype in fp8_dtypes for t in _saved_for_backward(ours, x)) == 2 * 12  # input and weight each
    assert not any(t.dtype in fp8_dtypes for t in _saved_for_backward(theirs, x))
    for p in (*ours.parameters(), *theirs.parameters()):  # non-zero output projections: every layer matters
        p.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    ours(x, x).backward()
    theirs(x, x).backward()
    # the same e4m3/e5m2 casts: gradients agree to float rounding inside the matmuls (measured <= 1%
    # of each matrix's gradient norm; against full precision both are ~20% off)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        if a.dim() == 2:
            assert (a.grad - b.grad).norm() <= 0.02 * b.grad.norm(), name


@pytest.fixture(scope="module")
def plain_losses(tok) -> list[float]:
    """The plain run (no FP8) both recipes are compared with, trained once."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    plain = speedrun_d2(tok.vocab_size)
    losses = train(plain, optimizers_for(plain), 0, STEPS, tok.vocab_size)
    torch.set_num_threads(before)
    return losses


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_fp8_run_tracks_plain_run_evaluates_samples_saves_and_resumes_bitwise(
    allow_cpu, one_thread, tok, tmp_path, plain_losses, recipe
):
    vocab = tok.vocab_size
    fp8 = enable_fp8(speedrun_d2(vocab), recipe)
    assert len(float8_layers(fp8)) == 2 * 6  # q, k, v, proj, fc, mlp proj per block; gates stay high precision
    opts = optimizers_for(fp8)
    fp8_losses = train(fp8, opts, 0, RESUME_AT, vocab)
    ckpt = save_checkpoint(tmp_path / "work", RESUME_AT, model=fp8, optimizers=opts, meta={"world_size": 1})
    fp8_losses += train(fp8, opts, RESUME_AT, STEPS, vocab)

    # Tolerance. FP8 (e4m3) keeps 3 mantissa bits: each cast rounds by up to 2**-4 relative, but with
    # tensorwise scales the errors of a 64-512 term dot product mostly cancel. From the same weights
    # (step 0) the loss must agree within 0.1% (measured: < 1e-4). After that the two runs are two
    # roundings of a chaotic trajectory at nanochat's LRs on a tiny model and drift apart: measured
    # on the Intel kind, at most 1.5% at one step (a loss spike) and 0.2% on average over 30 steps.
    # 5% at any step and 1% on average leave 3-5x margin for the other CPU kind; a broken FP8 path
    # (a wrong scale, gradients not reaching the weights) fails the step-0 bound or the learning check.
    rel = [abs(a - b) / a for a, b in zip(plain_losses, fp8_losses)]
    assert rel[0] <= 1e-3 and max(rel) <= 0.05 and sum(rel) / len(rel) <= 0.01, rel
    assert max(rel) > 0  # the FP8 run did compute in FP8: not the same numbers as the plain run
    for losses in (plain_losses, fp8_losses):
        assert losses[-1] < 0.6 * losses[0], losses

    # the checkpoint is a plain model's: it loads into a model without FP8 and computes what the
    # FP8 model computes with its layers swapped back (evaluation, sampling, export)
    save_model_dir(tmp_path / "base", fp8, {"model_config": fp8.config.to_dict()})
    loaded, _ = load_model(tmp_path / "base")
    assert float8_layers(loaded) == []
    x, y = batch(999, vocab)
    token_bytes = tok.token_bytes()
    with torch.no_grad(), plain_linears(fp8):
        assert float8_layers(fp8) == []
        assert torch.equal(fp8(x), loaded(x))
        loss, bpb = evaluate_loss_bpb(fp8, [(x, y)], token_bytes, RT)
        seqs, _ = Engine(fp8, tok).generate_batch(tok.encode("The", prepend=tok.bos_id), max_tokens=8, temperature=0.0)
    assert (loss, bpb) == evaluate_loss_bpb(loaded, [(x, y)], token_bytes, RT) and math.isfinite(bpb)
    prompt = tok.encode("The", prepend=tok.bos_id)
    assert seqs == Engine(loaded, tok).generate_batch(prompt, max_tokens=8, temperature=0.0)[0]
    assert len(seqs[0]) > 2 and len(float8_layers(fp8)) == 12  # swapped back after the block

    # resume: a fresh FP8 model and optimizer from the step-15 checkpoint end bitwise where the run did
    resumed = enable_fp8(speedrun_d2(vocab), recipe)
    resumed_opts = optimizers_for(resumed)
    load_checkpoint(ckpt, model=resumed, optimizers=resumed_opts)
    assert train(resumed, resumed_opts, RESUME_AT, STEPS, vocab) == fp8_losses[RESUME_AT:]
    for (name, a), b in zip(fp8.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_pretrain_stage_trains_in_fp8_with_the_test_allowance_and_refuses_without(tmp_path):
    """The stage end to end: the check before any work, FP8 training, val bpb and samples with the
    layers swapped back, a final model that loads into a plain GPT."""
    from chatpipe.testing.project import BIN, make_project, newest_pretrain_run, run

    project = make_project(
        tmp_path, {"pretrain": {"fp8": True, "max_steps": 4, "eval_every": 2, "sample_every": 2, "checkpoint_every": 2}}
    )
    refused = run(project, str(BIN / "python"), "-m", "stages.pretrain", check=False)
    assert refused.returncode != 0 and "fp8 needs CUDA with compute capability >= 8.9" in refused.stderr
    assert not (project / "checkpoints" / "pretrain").exists()  # refused before any work
    run(project, str(BIN / "dvc"), "repro", "pretrain", **{CPU_TEST_ENV: "1"})
    model, meta = load_model(project / "artifacts" / "base")
    assert float8_layers(model) == [] and math.isfinite(meta["summary"]["val_bpb"])
    run_params = newest_pretrain_run(project).data.params  # the derived horizon is a param of the stage's run
    params = {k: v for k, v in run_params.items() if k.startswith("horizon.")}
    assert params["horizon.num_iterations"] == "4" and int(params["horizon.total_batch_size"]) > 0
    assert {"horizon.batch_lr_scale", "horizon.weight_decay", "horizon.scaling_params"} <= set(params)


def test_an_fp8_trained_model_exports_to_transformers_with_the_logits_of_its_plain_swap(
    allow_cpu, one_thread, tok, tmp_path
):
    """Export of an FP8 run: the weights under the plain names, logits equal to the swapped-back model's.
    (The built-in NanoChat class lacks the speedrun's options, so this model has the ones it has.)"""
    transformers = pytest.importorskip("transformers")
    from chatpipe.export import hf
    from chatpipe.model.gpt import GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(sequence_len=SEQ, vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_kv_head=1, n_embd=64))
    model.init_weights()
    enable_fp8(model)
    train(model, optimizers_for(model), 0, 3, tok.vocab_size)
    assert float8_layers(model)
    out = hf.export_model(model, tok, {"model_config": model.config.to_dict()}, tmp_path / "hf", report_path=None)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()
    x, _ = batch(7, tok.vocab_size)
    with torch.no_grad(), plain_linears(model):
        ours = model(x)
        assert torch.allclose(theirs(x).logits, ours, atol=1e-5), (theirs(x).logits - ours).abs().max()
