"""Pretrain stage: train the base GPT on the tokenized pretraining text.

    python -m stages.pretrain                                   # one process
    torchrun --nproc_per_node=2 -m stages.pretrain              # DDP (gloo on CPU, nccl on GPU)
    python -m chatpipe.launch pretrain -- --max_steps=50        # through torchx, as DVC does

Reads ``artifacts/data`` and ``artifacts/tokenizer``; writes in-progress checkpoints to
``checkpoints/pretrain/`` (kept across failed runs, so a re-run resumes) and the final model to
``artifacts/base/``. Logs loss, lr, tokens/s, val bpb (and MFU on GPU) to MLflow.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from chatpipe import runtime, tracking
from chatpipe.data.loader import RowLoader, TokenDocs, tokenize_shards
from chatpipe.horizon import Horizon
from chatpipe.inference.engine import Engine
from chatpipe.io import fingerprint, sha256_file
from chatpipe.model.fp8 import check_fp8, enable_fp8, float8_layers, plain_linears
from chatpipe.model.gpt import GPT, ModelCounts
from chatpipe.paths import ARTIFACTS, WORK
from chatpipe.settings import PretrainSettings, snapshot
from chatpipe.stage_metrics import Curves
from chatpipe.tokenizer import Tokenizer
from chatpipe.tracking import tracked_run
from chatpipe.train.loop import Every, Loop, LoopState, StepOut, run_loop
from chatpipe.train.optim import build_optimizers
from chatpipe.train.pretrain_plan import (
    PlanCounts,
    apply_horizon,
    check_memory_fits,
    compile_pays,
    horizon_for,
    model_config_for,
    model_memory_bytes,
    plan_counts,
    polar_express_dtype,
    resolve_device_batch,
)
from chatpipe.train.stage import finish_stage, resume_or_fresh, run_meta
from chatpipe.train.step import evaluate_bpb, fixed_batches, grad_accum_steps, train_schedule, train_step_stats

log = logging.getLogger("pretrain")
SAMPLE_PROMPTS = ["The capital of", "12 plus 7 is", "The word apple is spelled", "Once upon a time"]


def main(argv: list[str] | None = None) -> None:
    runtime.run_stage(PretrainSettings, train, argv, training=True)


def train(cfg: PretrainSettings, rt: runtime.Runtime) -> None:
    if cfg.fp8:
        check_fp8(rt.device)  # before any work: names the missing gpu extra, or the GPU that cannot
    work, out_dir, tok_dir = WORK / "pretrain", ARTIFACTS / "base", ARTIFACTS / "tokenizer"

    # --- data: tokenize the text shards once into the memory-mapped store (ranks split the shards)
    tok = Tokenizer.load(tok_dir)
    token_bytes = torch.load(tok_dir / "token_bytes.pt", weights_only=True).to(rt.device)
    inputs, train_docs, val_docs = tokenized_docs(work, tok, rt)

    # --- batch math, schedule length, LR and weight-decay scaling (chatpipe.horizon), the device batch
    # (`auto`: the largest whose planned peak fits the memory budget), then the model; `chatpipe plan`
    # shows the same: cfg now holds the batch, steps, LRs and decay
    counts = plan_counts(cfg, tok.vocab_size)  # the model's numbers, counted once on the meta device
    cfg, horizon = resolve_horizon(cfg, counts, rt.world_size)
    total_steps = cfg.max_steps
    use_compile = compile_pays(cfg.compile, total_steps, rt.device)
    cfg = resolve_device_batch(cfg, counts.run, rt.world_size, rt.device, compiled=use_compile)
    model = build_model(cfg, tok, counts.run, rt)
    grad_accum = grad_accum_steps(cfg.total_batch_size, cfg.device_batch_size, cfg.sequence_len, rt.world_size)
    log_run_shape(cfg, model, grad_accum, rt)
    optimizers = make_optimizers(cfg, model, rt)

    # --- resume from the newest valid checkpoint made with the same settings and inputs
    run_fp, meta = resume_or_fresh(work, cfg, inputs, model=model, optimizers=optimizers, rt=rt)
    state = LoopState.resumed(meta, total_steps)

    loader_kw = dict(batch_size=cfg.device_batch_size, seq_len=cfg.sequence_len, **rt.shard)
    # the checkpoint's loader state holds the packer cursor: resuming costs the same at any step;
    # the next batch is built in a background thread while the current step runs
    train_loader = RowLoader(train_docs, state=meta.get("loader"), prefetch=True, **loader_kw)
    step_model, eval_model = step_and_eval_models(model, use_compile, rt)
    log_code_paths(cfg, rt, model, step_model, total_steps)
    eval_steps = max(1, cfg.eval_tokens // (cfg.device_batch_size * cfg.sequence_len * rt.world_size))

    def val_bpb(step: int) -> dict[str, float]:
        loader = RowLoader(val_docs, **loader_kw)  # a fresh pass over the same val rows each time
        with plain_linears(model):  # evaluate in the precision the model will be used in, as nanochat does
            return {"val/bpb": evaluate_bpb(eval_model, fixed_batches(loader.next_batch, eval_steps), token_bytes, rt)}

    def one_step(step: int) -> StepOut:
        kw = dict(grad_accum=grad_accum, rt=rt, grad_clip=cfg.grad_clip)
        loss, grad_norm = train_step_stats(step_model, train_loader.next_batch, optimizers, **kw)
        return StepOut(grad_norm, loss, totals={"tokens": cfg.total_batch_size})

    # --- loop
    params = run_params(cfg, model, horizon, grad_accum, rt)
    with tracked_run("pretrain", params, rt) as run:
        metrics = Curves(run, "pretrain", ["train/loss", "val/bpb"], enabled=rt.is_main)
        samples = functools.partial(log_samples, model, tok, rt, run)
        loop = Loop(
            "pretrain",
            cfg,
            rt,
            work,
            model,  # the bare module: a checkpoint saves its weights, never the DDP or compiled wrapper's
            optimizers,
            step=one_step,
            schedule=train_schedule(cfg, total_steps),
            # samples: rank 0's greedy continuations, from step 1 on (the untrained model's say nothing)
            hooks=[
                Every(val_bpb, cfg.eval_every),
                Every(samples, cfg.sample_every, at_last=cfg.sample_every > 0, from_step=1),
            ],
            identity=run_meta("pretrain", run_fp, cfg, inputs, rt, model.config),
            stage_state=lambda: {"loader": train_loader.state()},
            flops_per_token=model.flops_per_token(),
        )
        run_loop(loop, state, run, metrics)

        # --- save the final model for the next stage
        train_loader.close()
        final = {"final/val_bpb": state.evals.get("val/bpb", float("nan"))}
        meta = loop.meta(state)
        finish_stage(
            out_dir, model, meta, summary(state), step=state.step, run=run, metrics=metrics, rt=rt, final=final
        )
    runtime.barrier()


def summary(state: LoopState) -> dict[str, float]:
    """The final ``summary`` of ``meta.json``: val bpb, training time and tokens over every run."""
    train_seconds, tokens = state.total("train_seconds"), state.total("tokens", 0)
    return {
        "val_bpb": state.evals.get("val/bpb", float("nan")),
        "train_seconds": train_seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / max(train_seconds, 1e-9),
    }


def run_params(
    cfg: PretrainSettings, model: GPT, horizon: Horizon, grad_accum: int, rt: runtime.Runtime
) -> dict[str, object]:
    """The MLflow params of the run: settings, model shape and the batch and schedule derived from them."""
    return {
        "pretrain": snapshot(cfg),
        "model_config": model.config.to_dict(),
        "num_params": model.num_params(),
        "grad_accum": grad_accum,
        "world_size": rt.world_size,
        "total_steps": cfg.max_steps,
        "horizon": horizon.as_params(),
    }


def step_and_eval_models(model: GPT, use_compile: bool, rt: runtime.Runtime) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the module train steps run: DDP-wrapped on several ranks, compiled when it pays; the module
    evaluation runs: compiled alike, never DDP)."""
    ddp_model = DDP(model) if rt.world_size > 1 else model
    step_model = runtime.compile(ddp_model) if use_compile else ddp_model
    eval_model = runtime.compile(model) if use_compile else model
    return step_model, eval_model


def tokenized_docs(work: Path, tok: Tokenizer, rt: runtime.Runtime) -> tuple[dict, TokenDocs, TokenDocs]:
    """(input hashes, train docs, val docs): the text shards tokenized once into ``work/tokens``,
    each rank taking its share of the shards; a changed tokenizer or data manifest re-tokenizes."""
    data_dir = ARTIFACTS / "data"
    inputs = {
        "tokenizer": sha256_file(ARTIFACTS / "tokenizer" / "tokenizer.json"),
        "data": json.loads((data_dir / "manifest.json").read_text()),
    }
    tokenize_shards(
        data_dir, tok, work / "tokens", fingerprint=fingerprint(inputs), rank=rt.rank, world_size=rt.world_size
    )
    return inputs, TokenDocs(work / "tokens", "train"), TokenDocs(work / "tokens", "val")


def build_model(cfg: PretrainSettings, tok: Tokenizer, counts: ModelCounts, rt: runtime.Runtime) -> GPT:
    """A freshly initialized GPT (same init on every rank; DDP also broadcasts rank 0's weights),
    FP8 on its block matrices if asked; stops before allocating it if it would not fit the device's
    memory by the plan's figure for ``counts`` (value embeddings and padded vocabulary included), as
    `chatpipe plan` prints it."""
    check_memory_fits(
        model_memory_bytes(counts, cfg.device_batch_size, cfg.sequence_len), rt.device, cfg.device_batch_size
    )
    torch.manual_seed(cfg.seed)
    model_config = model_config_for(cfg, tok.vocab_size)
    with torch.device(rt.device):
        model = GPT(model_config)
    model.init_weights()
    if cfg.fp8:
        enable_fp8(model)  # block matrices only; eval, samples and saved weights go through plain Linear
    return model


def log_run_shape(cfg: PretrainSettings, model: GPT, grad_accum: int, rt: runtime.Runtime) -> None:
    """One line with the model, its size and cost, and the run's steps and batch."""
    log.info(
        "model %s | %.2fM params | %.3g FLOPs/token | %d steps x %d tokens (grad accum %d, world %d)",
        model.config,
        model.num_params() / 1e6,
        model.flops_per_token(),
        cfg.max_steps,
        cfg.total_batch_size,
        grad_accum,
        rt.world_size,
    )


def make_optimizers(cfg: PretrainSettings, model: GPT, rt: runtime.Runtime) -> list:
    """The run's optimizers (``cfg.optimizer``), fused on CUDA, compiled when that pays for the run's length."""
    polar_dtype = polar_express_dtype(cfg, rt)
    if cfg.optimizer == "normuon_polar_express":
        log.info("Polar Express in %s (polar_express_dtype: %s)", polar_dtype, cfg.polar_express_dtype)
    return build_optimizers(
        model,
        **cfg.optimizer_kwargs(),
        fused=rt.device.type == "cuda",
        compile=compile_pays(cfg.compile, cfg.max_steps, rt.device, part="optimizer"),
        polar_dtype=polar_dtype,
    )


def resolve_horizon(cfg: PretrainSettings, counts: PlanCounts, world_size: int) -> tuple[PretrainSettings, Horizon]:
    """The run's settings with the derived batch, steps, LRs and weight decay in place, and the derivation
    (the plan's, from the model's numbers counted once: :func:`chatpipe.train.pretrain_plan.plan_counts`)."""
    horizon = horizon_for(cfg, counts, world_size)
    log.info(
        "horizon: %d steps x %d tokens | %d scaling params | LR scale %.4f (%s) | weight decay %.6g",
        horizon.num_iterations,
        horizon.total_batch_size,
        horizon.scaling_params,
        horizon.batch_lr_scale,
        "applied" if horizon.lr_scaled else "off",
        horizon.weight_decay,
    )
    return apply_horizon(cfg, horizon), horizon


def log_samples(model: GPT, tok: Tokenizer, rt: runtime.Runtime, run: tracking.StageRun, step: int) -> None:
    """Greedy continuations of a few prompts, logged and saved to MLflow as text (by rank 0; the others skip)."""
    if not rt.is_main:
        return
    engine = Engine(model, tok)
    lines = []
    with plain_linears(model):  # FP8 layers back to Linear: decoding shapes are not FP8's multiples of 16
        for prompt in SAMPLE_PROMPTS:
            ids = tok.encode(prompt, prepend=tok.bos_id)
            seqs, _ = engine.generate_batch(ids, num_samples=1, max_tokens=24, temperature=0.0)
            lines.append(tok.decode(seqs[0][1:]))
    log.info("samples at step %d:\n  %s", step, "\n  ".join(lines))
    run.log_text("\n".join(lines), f"samples/step_{step:06d}.txt")


def log_code_paths(
    cfg: PretrainSettings, rt: runtime.Runtime, model: GPT, step_model: torch.nn.Module, total_steps: int
) -> None:
    """One line naming the precision, compile, FP8 and distributed paths this run really takes, read
    from the objects themselves: what a CPU rehearsal of the GPU paths (profile rehearsal_gpu) checks."""
    log.info(
        "code paths: autocast %s | compiled model %s, optimizer %s | %d Float8Linear layers | world size %d (%s)",
        "off" if rt.dtype == torch.float32 else str(rt.dtype).removeprefix("torch."),
        hasattr(step_model, "_orig_mod"),  # what torch.compile wraps the module in
        compile_pays(cfg.compile, total_steps, rt.device, part="optimizer"),
        len(float8_layers(model)),
        rt.world_size,
        torch.distributed.get_backend() if torch.distributed.is_initialized() else "no process group",
    )


if __name__ == "__main__":
    main()
