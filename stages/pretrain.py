"""Pretrain stage: train the base GPT on the tokenized pretraining text.

    python -m stages.pretrain                                   # one process
    torchrun --nproc_per_node=2 -m stages.pretrain              # DDP (gloo on CPU, nccl on GPU)
    python -m chatpipe.launch pretrain -- --max_steps=50        # through torchx, as DVC does

Reads ``artifacts/data`` and ``artifacts/tokenizer``; writes in-progress checkpoints to
``checkpoints/pretrain/`` (kept across failed runs, so a re-run resumes) and the final model to
``artifacts/base/``. Logs loss, lr, tokens/s, val bpb (and MFU on GPU) to MLflow.
"""

from __future__ import annotations

import json
import logging

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from chatpipe import runtime, tracking
from chatpipe.data.loader import RowLoader, TokenDocs, tokenize_shards
from chatpipe.horizon import Horizon
from chatpipe.inference.engine import Engine
from chatpipe.io import fingerprint, sha256_file
from chatpipe.model.fp8 import check_fp8, enable_fp8, float8_layers, plain_linears
from chatpipe.model.gpt import GPT
from chatpipe.paths import ARTIFACTS, WORK
from chatpipe.progress import progress
from chatpipe.settings import PretrainSettings, snapshot
from chatpipe.stage_metrics import Curves
from chatpipe.tokenizer import Tokenizer
from chatpipe.train.checkpoint import producing_runs
from chatpipe.train.loop import (
    due,
    evaluate_bpb,
    fixed_batches,
    grad_accum_steps,
    peak_flops,
    report_step,
    scheduled_train_step,
)
from chatpipe.train.optim import build_optimizers
from chatpipe.train.pretrain_plan import (
    apply_horizon,
    check_memory_fits,
    compile_pays,
    estimate_memory_bytes,
    horizon_for,
    model_config_for,
    polar_express_dtype,
)
from chatpipe.train.stage import Checkpointer, finish_stage, resume_or_fresh, resume_point, run_meta, tracked_run

log = logging.getLogger("pretrain")
SAMPLE_PROMPTS = ["The capital of", "12 plus 7 is", "The word apple is spelled", "Once upon a time"]


def main(argv: list[str] | None = None) -> None:
    runtime.run_stage(PretrainSettings, train, argv)


def train(cfg: PretrainSettings, rt: runtime.Runtime) -> None:
    if cfg.fp8:
        check_fp8(rt.device)  # before any work: names the missing gpu extra, or the GPU that cannot
    work, out_dir = WORK / "pretrain", ARTIFACTS / "base"
    tok_dir, data_dir = ARTIFACTS / "tokenizer", ARTIFACTS / "data"

    # --- data: tokenize the text shards once into the memory-mapped store (ranks split the shards)
    tok = Tokenizer.load(tok_dir)
    token_bytes = torch.load(tok_dir / "token_bytes.pt").to(rt.device)
    inputs = {
        "tokenizer": sha256_file(tok_dir / "tokenizer.json"),
        "data": json.loads((data_dir / "manifest.json").read_text()),
    }
    tokenize_shards(
        data_dir, tok, work / "tokens", fingerprint=fingerprint(inputs), rank=rt.rank, world_size=rt.world_size
    )
    train_docs, val_docs = TokenDocs(work / "tokens", "train"), TokenDocs(work / "tokens", "val")

    # --- model
    torch.manual_seed(cfg.seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
    model_config = model_config_for(cfg, tok.vocab_size)
    with torch.device(rt.device):
        model = GPT(model_config)
    model.init_weights()
    if cfg.fp8:
        enable_fp8(model)  # block matrices only; eval, samples and saved weights go through plain Linear
    num_params, flops_per_token = model.num_params(), model.flops_per_token()
    check_memory_fits(
        estimate_memory_bytes(
            num_params,
            model.num_embedding_params(),
            model_config.n_layer,
            model_config.n_embd,
            tok.vocab_size,
            cfg.device_batch_size,
            cfg.sequence_len,
        ),
        rt.device,
        cfg.device_batch_size,
    )

    # --- batch math, schedule length, LR and weight-decay scaling (chatpipe.horizon; `chatpipe plan` shows the same)
    cfg, horizon = resolve_horizon(cfg, model, rt.world_size)  # cfg now holds the batch, steps, LRs and decay
    total_steps = cfg.max_steps
    grad_accum = grad_accum_steps(cfg.total_batch_size, cfg.device_batch_size, cfg.sequence_len, rt.world_size)
    use_compile = compile_pays(cfg.compile, total_steps, rt.device)
    log.info(
        "model %s | %.2fM params | %.3g FLOPs/token | %d steps x %d tokens (grad accum %d, world %d)",
        model_config,
        num_params / 1e6,
        flops_per_token,
        total_steps,
        cfg.total_batch_size,
        grad_accum,
        rt.world_size,
    )

    # --- optimizer
    polar_dtype = polar_express_dtype(cfg, rt)
    if cfg.optimizer == "normuon_polar_express":
        log.info("Polar Express in %s (polar_express_dtype: %s)", polar_dtype, cfg.polar_express_dtype)
    optimizers = build_optimizers(
        model,
        **cfg.optimizer_kwargs(),
        fused=rt.device.type == "cuda",
        compile=compile_pays(cfg.compile, total_steps, rt.device, part="optimizer"),
        polar_dtype=polar_dtype,
    )

    # --- resume from the newest valid checkpoint made with the same settings and inputs
    run_fp, meta = resume_or_fresh(work, cfg, inputs, model=model, optimizers=optimizers, rt=rt)
    start_step, _, carried = resume_point(meta)

    loader_kw = dict(batch_size=cfg.device_batch_size, seq_len=cfg.sequence_len, **rt.shard)
    # the checkpoint's loader state holds the packer cursor: resuming costs the same at any step;
    # the next batch is built in a background thread while the current step runs
    train_loader = RowLoader(train_docs, state=meta.get("loader"), prefetch=True, **loader_kw)
    ddp_model = DDP(model) if rt.world_size > 1 else model
    step_model = torch.compile(ddp_model) if use_compile else ddp_model
    eval_model = torch.compile(model) if use_compile else model
    log_code_paths(cfg, rt, model, step_model, total_steps)
    eval_steps = max(1, cfg.eval_tokens // (cfg.device_batch_size * cfg.sequence_len * rt.world_size))

    def val_bpb() -> float:
        loader = RowLoader(val_docs, **loader_kw)  # a fresh pass over the same val rows each time
        with plain_linears(model):  # evaluate in the precision the model will be used in, as nanochat does
            return evaluate_bpb(eval_model, fixed_batches(loader.next_batch, eval_steps), token_bytes, rt)

    def checkpoint_meta() -> dict:
        return {
            **run_meta("pretrain", run_fp, cfg, inputs, rt, model_config),
            "loader": train_loader.state(),
            "total_steps": total_steps,
            "carried": {"train_seconds": t_train, "tokens": tokens_seen, "mlflow_run_ids": run_ids},
        }

    checkpoints = Checkpointer(work, cfg, model, optimizers, meta=checkpoint_meta, rt=rt, start_step=start_step)

    # --- loop
    params = {
        "pretrain": snapshot(cfg),
        "model_config": model_config.to_dict(),
        "num_params": num_params,
        "grad_accum": grad_accum,
        "world_size": rt.world_size,
        "total_steps": total_steps,
        "horizon": horizon.as_params(),
    }
    with tracked_run("pretrain", params, rt) as run:
        metrics = Curves(run, "pretrain", ["train/loss", "val/bpb"], enabled=rt.is_main)
        bar = progress(total_steps, "pretrain", initial=start_step, unit="step")
        peak = peak_flops(rt.device) * rt.world_size
        step, bpb = start_step, float("nan")
        # totals and run ids continue from the checkpoint, so a resume from the final one
        # rewrites the same summary (and the same artifact hash) as the run that trained it
        t_train, tokens_seen = carried.get("train_seconds", 0.0), carried.get("tokens", 0)
        run_ids = producing_runs(carried, run.id, trains=start_step < total_steps)
        while True:
            last = step == total_steps
            if last or due(step, cfg.eval_every):
                bpb = val_bpb()
                metrics.log({"val/bpb": bpb}, step)
                log.info("step %d | val bpb %.4f", step, bpb)
            if rt.is_main and cfg.sample_every and (last or step % cfg.sample_every == 0) and step > 0:
                log_samples(model, tok, rt, run, step)
            checkpoints.save_if_due(step, last=last)
            if last:
                break

            loss, lr_mult, dt = scheduled_train_step(
                step, total_steps, cfg, step_model, train_loader.next_batch, optimizers, grad_accum=grad_accum, rt=rt
            )
            step += 1
            t_train += dt
            tokens_seen += cfg.total_batch_size
            tok_per_s = cfg.total_batch_size / dt
            mfu = {"mfu": flops_per_token * tok_per_s / peak} if peak else {}
            report_step(log, metrics, bar, step, total_steps, cfg.log_every, loss, lr_mult, tok_per_s, **mfu)

        # --- save the final model for the next stage
        bar.close()
        train_loader.close()
        tokens_per_s = tokens_seen / max(t_train, 1e-9)
        summary = {"val_bpb": bpb, "train_seconds": t_train, "tokens": tokens_seen, "tokens_per_s": tokens_per_s}
        final = {"final/val_bpb": bpb}
        finish_stage(
            out_dir, model, checkpoint_meta(), summary, step=step, run=run, metrics=metrics, rt=rt, final=final
        )
    runtime.barrier()


def resolve_horizon(cfg: PretrainSettings, model: GPT, world_size: int) -> tuple[PretrainSettings, Horizon]:
    """The run's settings with the derived batch, steps, LRs and weight decay in place, and the derivation."""
    horizon = horizon_for(cfg, model, world_size)
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
    """Greedy continuations of a few prompts, logged and saved to MLflow as text."""
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
