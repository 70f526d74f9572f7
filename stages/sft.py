"""SFT stage: supervised fine-tuning of the midtrained model on a task mixture, then a chat check.

    python -m stages.sft                                        # one process
    torchrun --nproc_per_node=2 -m stages.sft                   # DDP
    python -m chatpipe.launch sft -- --max_steps=20             # through torchx, as DVC does

Starts from ``artifacts/mid``; trains on ``sft.mixture`` exactly as midtrain does (best-fit packed
conversations, assistant-only loss, flat-then-decay LR). In-progress checkpoints go to
``checkpoints/sft/``, the final model to ``artifacts/sft/``. At the end it samples replies to
held-out tiny-world prompts (fraction that end with ``<|assistant_end|>``) and scores held-out
tool-use arithmetic for the sft model and, as a baseline, the base model; all go to MLflow and to
``summary`` in ``artifacts/sft/meta.json``.
"""

from __future__ import annotations

import logging
import math
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from chatpipe import runtime, tracking
from chatpipe.chateval import end_token_rate, evaluate_loss_bpb, task_accuracy
from chatpipe.checkpoint import (ARTIFACTS, WORK, fingerprint, latest_checkpoint, load_checkpoint, load_model,
                                 save_checkpoint, save_model_dir, sha256_file)
from chatpipe.optim import apply_schedules, build_optimizers, lr_multiplier, muon_momentum
from chatpipe.packing import ConversationLoader, fill_ratio, pack_rows, render_all
from chatpipe.settings import SFTSettings, TrackingSettings, active_profile, load_section, snapshot, validate_all
from chatpipe.tasks import build_mixture, build_task
from chatpipe.tokenizer import Tokenizer
from chatpipe.trainloop import OBSERVABILITY_KEYS, fixed_batches, grad_accum_steps, train_step

log = logging.getLogger("sft")
STAGE, INIT_DIR, OUT_DIR = "sft", ARTIFACTS / "mid", ARTIFACTS / "sft"
# end-of-stage checks only read the model: they never change the weights, so resume ignores them
EVAL_KEYS = {"eval_prompts", "eval_arith", "eval_max_tokens", "eval_temperature", "eval_baseline"}


def main(argv: list[str] | None = None) -> None:
    # --- settings
    cfg = load_section(SFTSettings, sys.argv[1:] if argv is None else argv)
    validate_all()
    rt = runtime.init(cfg.device, cfg.dtype)
    try:
        train(cfg, rt)
    finally:
        runtime.shutdown()


def train(cfg: SFTSettings, rt: runtime.Runtime) -> None:
    work, tok_dir = WORK / STAGE, ARTIFACTS / "tokenizer"

    # --- data: build, render and pack the mixtures first, so a malformed row stops us before training
    identity = {"model_name": cfg.model_name, "model_maker": cfg.model_maker}
    train_mix = build_mixture(cfg.mixture, "train", seed=cfg.seed, **identity)
    val_mix = build_mixture(cfg.mixture, "val", seed=cfg.seed, cap=cfg.val_limit, **identity)
    tok = Tokenizer.load(tok_dir)
    token_bytes = torch.load(tok_dir / "token_bytes.pt").to(rt.device)
    capacity = cfg.max_seq_len + 1   # inputs and targets are the row shifted by one
    train_data, val_data = render_all(train_mix, tok, capacity), render_all(val_mix, tok, capacity)
    train_rows, val_rows = pack_rows(train_data.lengths, capacity), pack_rows(val_data.lengths, capacity)
    fill = fill_ratio(train_rows, capacity)
    log.info("mixture: %d conversations -> %d rows of %d tokens, fill %.1f%% (val: %d conversations, %d rows)",
             len(train_mix), len(train_rows), capacity, 100 * fill, len(val_mix), len(val_rows))

    # --- model: the previous stage's weights
    model, init_meta = load_model(INIT_DIR, rt.device)
    model.train()
    model_config = model.config
    inputs = {"init": init_meta["files"]["model.pt"], "tokenizer": sha256_file(tok_dir / "tokenizer.json")}

    # --- batch math and schedule length (-1: one pass over the packed mixture)
    grad_accum = grad_accum_steps(cfg.total_batch_size, cfg.device_batch_size, cfg.max_seq_len, rt.world_size)
    rows_per_step = cfg.total_batch_size // cfg.max_seq_len
    total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(len(train_rows) / rows_per_step)
    log.info("%d steps x %d tokens (grad accum %d, world %d), %.2f passes over the mixture", total_steps,
             cfg.total_batch_size, grad_accum, rt.world_size, total_steps * rows_per_step / len(train_rows))

    # --- optimizer
    f = cfg.init_lr_frac
    optimizers = build_optimizers(model, matrix_lr=cfg.matrix_lr * f, embedding_lr=cfg.embedding_lr * f,
                                  unembedding_lr=cfg.unembedding_lr * f, weight_decay=cfg.weight_decay)

    # --- resume from the newest valid checkpoint made with the same settings and inputs
    ignored = OBSERVABILITY_KEYS | EVAL_KEYS
    run_fp = fingerprint({"settings": {k: v for k, v in snapshot(cfg).items() if k not in ignored}, "inputs": inputs})
    start_step, start_row = 0, 0
    ckpt = latest_checkpoint(work, run_fp)
    if ckpt is not None:
        meta = load_checkpoint(ckpt, model=model, optimizers=optimizers, rank=rt.rank, world_size=rt.world_size)
        start_step, start_row = meta["step"], meta["loader"]["row"]
        log.info("resuming from %s (step %d)", ckpt, start_step)

    loader_kw = dict(batch_size=cfg.device_batch_size, seq_len=cfg.max_seq_len, pad_id=tok.bos_id, rank=rt.rank,
                     world_size=rt.world_size, device=rt.device)
    train_loader = ConversationLoader(train_data, train_rows, start_row=start_row, **loader_kw)
    ddp_model = DDP(model) if rt.world_size > 1 else model
    step_model = torch.compile(ddp_model) if cfg.compile else ddp_model
    rows_per_eval = cfg.device_batch_size * rt.world_size
    eval_steps = max(1, min(cfg.eval_tokens // (rows_per_eval * cfg.max_seq_len),
                            math.ceil(len(val_rows) / rows_per_eval)))

    def val_metrics() -> tuple[float, float]:
        batches = list(fixed_batches(ConversationLoader(val_data, val_rows, **loader_kw).next_batch, eval_steps))
        return evaluate_loss_bpb(model, batches, token_bytes, rt)

    def checkpoint_meta() -> dict:
        return {"stage": STAGE, "fingerprint": run_fp, "world_size": rt.world_size,
                "model_config": model_config.to_dict(), "settings": snapshot(cfg), "inputs": inputs,
                "loader": train_loader.state(), "total_steps": total_steps}

    # --- loop
    params = {STAGE: snapshot(cfg), "model_config": model_config.to_dict(), "grad_accum": grad_accum,
              "world_size": rt.world_size, "total_steps": total_steps, "train_rows": len(train_rows),
              "train_conversations": len(train_mix)}
    with tracking.stage_run(STAGE, load_section(TrackingSettings), params, profile=active_profile(),
                            enabled=rt.is_main) as run:
        metrics = tracking.MetricBuffer(run)
        metrics.log({"packing/fill_ratio": fill}, 0)
        step, val_loss, bpb, t_train = start_step, float("nan"), float("nan"), 0.0
        while True:
            last = step == total_steps
            if last or (cfg.eval_every and step % cfg.eval_every == 0):
                val_loss, bpb = val_metrics()
                metrics.log({"val/loss": val_loss, "val/bpb": bpb}, step)
                log.info("step %d | val loss %.4f | val bpb %.4f", step, val_loss, bpb)
            if step > start_step and (last or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0)):
                save_checkpoint(work, step, model=model, optimizers=optimizers, meta=checkpoint_meta(),
                                rank=rt.rank, keep=cfg.keep_checkpoints)
            if last:
                break

            lr_mult = lr_multiplier(step, total_steps, warmup_steps=cfg.warmup_steps,
                                    warmdown_ratio=cfg.warmdown_ratio, final_lr_frac=cfg.final_lr_frac,
                                    schedule=cfg.schedule)
            apply_schedules(optimizers, lr_mult, muon_momentum(step, cfg.momentum_warmup_steps))
            t0 = time.perf_counter()
            loss = train_step(step_model, train_loader.next_batch, optimizers, grad_accum=grad_accum, rt=rt,
                              grad_clip=cfg.grad_clip)
            dt = time.perf_counter() - t0
            step += 1
            t_train += dt
            metrics.log({"train/loss": loss, "lr_mult": lr_mult, "tokens_per_s": cfg.total_batch_size / dt,
                         "epoch": train_loader.epoch}, step)
            if step % cfg.log_every == 0 or step == total_steps:
                log.info("step %d/%d | loss %.4f | lr x%.3f | %.0f tok/s", step, total_steps, loss, lr_mult,
                         cfg.total_batch_size / dt)

        # --- held-out chat checks (rank 0; generation is cheap next to training)
        summary = {"val_loss": val_loss, "val_bpb": bpb, "fill_ratio": fill, "train_seconds": t_train}
        if rt.is_main:
            summary.update(chat_checks(cfg, model, tok, rt, run))

        # --- save the final model for the next stage
        metrics.log({"final/val_loss": val_loss, "final/val_bpb": bpb}, step)
        metrics.flush()
        if rt.is_main:
            save_model_dir(OUT_DIR, model, {**checkpoint_meta(), "step": step, "summary": summary,
                                            "source_stage": STAGE})
            if run is not None:
                import mlflow
                mlflow.log_metrics({f"summary/{k}": float(v) for k, v in summary.items()})
            log.info("saved %s (val loss %.4f, bpb %.4f)", OUT_DIR, val_loss, bpb)
    runtime.barrier()


def chat_checks(cfg: SFTSettings, model, tok: Tokenizer, rt: runtime.Runtime, run) -> dict[str, float]:
    """End-token rate on sampled held-out prompts; tool-use arithmetic accuracy of sft vs base."""
    out: dict[str, float] = {}
    model.eval()
    t0 = time.perf_counter()
    if cfg.eval_prompts:
        # held-out (test split) prompts of every tiny-world kind, interleaved
        kinds = [build_task(name, "test", limit=cfg.eval_prompts) for name in
                 ("tinyworld_chat", "tinyworld_arith", "tinyworld_mc")]
        prompts = [kinds[i % len(kinds)][i // len(kinds)] for i in range(cfg.eval_prompts)]
        out["end_token_rate"] = end_token_rate(model, tok, prompts, max_tokens=cfg.eval_max_tokens,
                                               temperature=cfg.eval_temperature, seed=cfg.seed)
    if cfg.eval_arith:
        arith = build_task("tinyworld_arith", "test", limit=cfg.eval_arith)
        samples: list = []
        out["arith_accuracy"] = task_accuracy(model, tok, arith, max_tokens=cfg.eval_max_tokens, samples=samples)
        if cfg.eval_baseline:
            base, _ = load_model(ARTIFACTS / "base", rt.device)
            out["arith_accuracy_base"] = task_accuracy(base, tok, arith, max_tokens=cfg.eval_max_tokens)
        lines = [f"{'OK ' if ok else 'BAD'} {q!r} -> {reply!r}" for q, reply, ok in samples[:20]]
        log.info("arithmetic samples:\n  %s", "\n  ".join(lines))
        if run is not None:
            import mlflow
            mlflow.log_text("\n".join(lines), "samples/arithmetic.txt")
    model.train()
    log.info("chat checks (%.1f s): %s", time.perf_counter() - t0, out)
    if run is not None:
        import mlflow
        mlflow.log_metrics({f"eval/{k}": v for k, v in out.items()})
    return out


if __name__ == "__main__":
    main()
