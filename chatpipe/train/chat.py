"""Training loop shared by the chat stages (midtrain, sft): packed conversations, assistant-only loss.

The two stages differ only in their mixture, their starting model and what they check at the end,
so each stage script is settings plus one call to :func:`train_chat`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from chatpipe import runtime, tracking
from chatpipe.data.packing import ConversationLoader, fill_ratio, pack
from chatpipe.data.tasks import build_mixture
from chatpipe.io import sha256_file
from chatpipe.model.files import load_model
from chatpipe.paths import ARTIFACTS, WORK
from chatpipe.progress import progress
from chatpipe.settings import ChatTrainSettings, snapshot
from chatpipe.stage_metrics import Curves
from chatpipe.tokenizer import Tokenizer
from chatpipe.train.checkpoint import producing_runs
from chatpipe.train.loop import (
    due,
    evaluate_loss_bpb,
    fixed_batches,
    grad_accum_steps,
    report_step,
    scheduled_train_step,
)
from chatpipe.train.optim import build_optimizers
from chatpipe.train.stage import Checkpointer, finish_stage, resume_or_fresh, resume_point, run_meta, tracked_run

log = logging.getLogger("chattrain")
# rank 0's end-of-training hook: (model, tokenizer, the stage's run) -> extra summary metrics
Finish = Callable[[torch.nn.Module, Tokenizer, tracking.StageRun], dict[str, float]]


def train_chat(
    cfg: ChatTrainSettings,
    rt: runtime.Runtime,
    *,
    stage: str,
    init_dir: Path,
    out_dir: Path,
    finish: Finish | None = None,
) -> None:
    """Fine-tune the model in ``init_dir`` on ``cfg.mixture`` and save it to ``out_dir``.

    Best-fit packed conversations, assistant-only loss, flat-then-decay LR, Muon momentum ramp,
    val loss/bpb, resumable checkpoints in ``checkpoints/<stage>/``, an MLflow run named ``stage``.
    ``finish(model, tokenizer, run)`` runs on rank 0 after training and adds to the summary;
    Settings marked resume-neutral (like those ``finish`` reads) may change without invalidating checkpoints.
    """
    work, tok_dir = WORK / stage, ARTIFACTS / "tokenizer"

    # --- data: build, render and pack the mixtures first, so a malformed row stops us before training
    identity = {"model_name": cfg.model_name, "model_maker": cfg.model_maker}
    train_mix = build_mixture(cfg.mixture, "train", seed=cfg.seed, **identity)
    val_mix = build_mixture(cfg.mixture, "val", seed=cfg.seed, cap=cfg.val_limit, **identity)
    tok = Tokenizer.load(tok_dir)
    token_bytes = torch.load(tok_dir / "token_bytes.pt").to(rt.device)
    (train_data, train_rows), (val_data, val_rows) = (pack(m, tok, cfg.max_seq_len) for m in (train_mix, val_mix))
    capacity = cfg.max_seq_len + 1
    fill = fill_ratio(train_rows, capacity)
    log.info(
        "mixture: %d conversations -> %d rows of %d tokens, fill %.1f%% (val: %d conversations, %d rows)",
        len(train_mix),
        len(train_rows),
        capacity,
        100 * fill,
        len(val_mix),
        len(val_rows),
    )

    # --- model: the previous stage's weights
    model, init_meta = load_model(init_dir, rt.device)
    model.train()
    model_config = model.config
    inputs = {"init": init_meta["files"]["model.pt"], "tokenizer": sha256_file(tok_dir / "tokenizer.json")}

    # --- batch math and schedule length (-1: one pass over the packed mixture)
    grad_accum = grad_accum_steps(cfg.total_batch_size, cfg.device_batch_size, cfg.max_seq_len, rt.world_size)
    rows_per_step = cfg.total_batch_size // cfg.max_seq_len
    total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(len(train_rows) / rows_per_step)
    log.info(
        "%d steps x %d tokens (grad accum %d, world %d), %.2f passes over the mixture",
        total_steps,
        cfg.total_batch_size,
        grad_accum,
        rt.world_size,
        total_steps * rows_per_step / len(train_rows),
    )

    # --- optimizer
    optimizers = build_optimizers(model, **cfg.lrs(cfg.init_lr_frac), weight_decay=cfg.weight_decay)

    # --- resume from the newest valid checkpoint made with the same settings and inputs
    run_fp, meta = resume_or_fresh(work, cfg, inputs, model=model, optimizers=optimizers, rt=rt)
    start_step, start_row, carried = resume_point(meta)

    loader_kw = dict(batch_size=cfg.device_batch_size, seq_len=cfg.max_seq_len, pad_id=tok.bos_id, **rt.shard)
    train_loader = ConversationLoader(train_data, train_rows, start_row=start_row, **loader_kw)
    ddp_model = DDP(model) if rt.world_size > 1 else model
    step_model = torch.compile(ddp_model) if cfg.compile else ddp_model
    rows_per_eval = cfg.device_batch_size * rt.world_size
    eval_steps = max(
        1, min(cfg.eval_tokens // (rows_per_eval * cfg.max_seq_len), math.ceil(len(val_rows) / rows_per_eval))
    )

    def val_metrics() -> tuple[float, float]:
        batches = list(fixed_batches(ConversationLoader(val_data, val_rows, **loader_kw).next_batch, eval_steps))
        return evaluate_loss_bpb(model, batches, token_bytes, rt)

    def checkpoint_meta() -> dict:
        return {
            **run_meta(stage, run_fp, cfg, inputs, rt, model_config),
            "loader": train_loader.state(),
            "total_steps": total_steps,
            "carried": {"train_seconds": t_train, "mlflow_run_ids": run_ids},
        }

    checkpoints = Checkpointer(work, cfg, model, optimizers, meta=checkpoint_meta, rt=rt, start_step=start_step)

    # --- loop
    params = {
        stage: snapshot(cfg),
        "model_config": model_config.to_dict(),
        "grad_accum": grad_accum,
        "world_size": rt.world_size,
        "total_steps": total_steps,
        "train_rows": len(train_rows),
        "train_conversations": len(train_mix),
    }
    with tracked_run(stage, params, rt) as run:
        metrics = Curves(run, stage, ["train/loss", "val/bpb"], enabled=rt.is_main)
        bar = progress(total_steps, stage, initial=start_step, unit="step")
        metrics.log({"packing/fill_ratio": fill}, 0)
        step, val_loss, bpb = start_step, float("nan"), float("nan")
        t_train = carried.get("train_seconds", 0.0)  # resume from the final checkpoint: same summary
        run_ids = producing_runs(carried, run.id, trains=start_step < total_steps)
        while True:
            last = step == total_steps
            if last or due(step, cfg.eval_every):
                val_loss, bpb = val_metrics()
                metrics.log({"val/loss": val_loss, "val/bpb": bpb}, step)
                log.info("step %d | val loss %.4f | val bpb %.4f", step, val_loss, bpb)
            checkpoints.save_if_due(step, last=last)
            if last:
                break

            loss, lr_mult, dt = scheduled_train_step(
                step, total_steps, cfg, step_model, train_loader.next_batch, optimizers, grad_accum=grad_accum, rt=rt
            )
            step += 1
            t_train += dt
            tok_per_s, epoch = cfg.total_batch_size / dt, train_loader.epoch
            report_step(log, metrics, bar, step, total_steps, cfg.log_every, loss, lr_mult, tok_per_s, epoch=epoch)

        # --- stage-specific checks, then save the final model for the next stage
        bar.close()
        summary = {"val_loss": val_loss, "val_bpb": bpb, "fill_ratio": fill, "train_seconds": t_train}
        if rt.is_main and finish is not None:
            summary.update(finish(model, tok, run))
        final = {"final/val_loss": val_loss, "final/val_bpb": bpb}
        finish_stage(
            out_dir, model, checkpoint_meta(), summary, step=step, run=run, metrics=metrics, rt=rt, final=final
        )
    runtime.barrier()
