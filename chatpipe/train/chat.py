"""Training loop shared by the chat stages (midtrain, sft): packed conversations, assistant-only loss.

The two stages differ only in their mixture, their starting model and what they check at the end,
so each stage script is settings plus one call to :func:`train_chat`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from chatpipe import runtime, tracking
from chatpipe.data.packing import ConversationLoader, Rendered, fill_ratio, pack
from chatpipe.data.tasks import build_mixture
from chatpipe.io import sha256_file
from chatpipe.model.files import load_model
from chatpipe.paths import ARTIFACTS, WORK
from chatpipe.progress import progress
from chatpipe.settings import ChatTrainSettings, snapshot
from chatpipe.stage_metrics import Curves
from chatpipe.tokenizer import Tokenizer
from chatpipe.tracking import tracked_run
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
from chatpipe.train.stage import Checkpointer, finish_stage, resume_or_fresh, resume_point, run_meta

log = logging.getLogger("chattrain")
# rank 0's end-of-training hook: (model, tokenizer, the stage's run) -> extra summary metrics
Finish = Callable[[torch.nn.Module, Tokenizer, tracking.StageRun], dict[str, float]]


@dataclass
class LoopState:
    """What the loop carries from step to step; the training time continues from the checkpoint, so
    a resume from the final one writes the same summary."""

    start_step: int
    carried: dict
    step: int = 0
    val_loss: float = float("nan")
    bpb: float = float("nan")
    train_seconds: float = 0.0
    run_ids: list[str] = field(default_factory=list)

    @classmethod
    def resumed(cls, start_step: int, carried: dict) -> LoopState:
        """The state at ``start_step`` with the totals a checkpoint carried (``{}`` for a fresh start)."""
        return cls(start_step, carried, step=start_step, train_seconds=carried.get("train_seconds", 0.0))

    def summary(self, fill: float) -> dict[str, float]:
        """The final ``summary`` of ``meta.json`` (before the stage's own checks add to it)."""
        return {"val_loss": self.val_loss, "val_bpb": self.bpb, "fill_ratio": fill, "train_seconds": self.train_seconds}


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
    tok, mixture = packed_mixture(cfg, tok_dir)
    token_bytes = torch.load(tok_dir / "token_bytes.pt").to(rt.device)

    # --- model: the previous stage's weights; batch math and schedule length; optimizer
    model, init_meta = load_model(init_dir, rt.device)
    model.train()
    inputs = {"init": init_meta["files"]["model.pt"], "tokenizer": sha256_file(tok_dir / "tokenizer.json")}
    grad_accum = grad_accum_steps(cfg.total_batch_size, cfg.device_batch_size, cfg.max_seq_len, rt.world_size)
    total_steps = schedule_length(cfg, len(mixture.train_rows), grad_accum, rt)
    optimizers = build_optimizers(model, **cfg.lrs(cfg.init_lr_frac), weight_decay=cfg.weight_decay)

    # --- resume from the newest valid checkpoint made with the same settings and inputs
    run_fp, meta = resume_or_fresh(work, cfg, inputs, model=model, optimizers=optimizers, rt=rt)
    start_step, start_row, carried = resume_point(meta)
    state = LoopState.resumed(start_step, carried)

    loader_kw = dict(batch_size=cfg.device_batch_size, seq_len=cfg.max_seq_len, pad_id=tok.bos_id, **rt.shard)
    train_loader = ConversationLoader(mixture.train_data, mixture.train_rows, start_row=start_row, **loader_kw)
    ddp_model = DDP(model) if rt.world_size > 1 else model
    step_model = runtime.compile(ddp_model) if cfg.compile else ddp_model
    eval_steps = val_steps(cfg, len(mixture.val_rows), rt)

    def val_metrics() -> tuple[float, float]:
        loader = ConversationLoader(mixture.val_data, mixture.val_rows, **loader_kw)
        batches = list(fixed_batches(loader.next_batch, eval_steps))
        return evaluate_loss_bpb(model, batches, token_bytes, rt)

    def train_step(step: int) -> tuple[float, float, float]:
        next_batch = train_loader.next_batch
        return scheduled_train_step(
            step, total_steps, cfg, step_model, next_batch, optimizers, grad_accum=grad_accum, rt=rt
        )

    def checkpoint_meta() -> dict:
        return {
            **run_meta(stage, run_fp, cfg, inputs, rt, model.config),
            "loader": train_loader.state(),
            "total_steps": total_steps,
            "carried": {"train_seconds": state.train_seconds, "mlflow_run_ids": state.run_ids},
        }

    checkpoints = Checkpointer(work, cfg, model, optimizers, meta=checkpoint_meta, rt=rt, start_step=start_step)

    # --- loop
    params = run_params(stage, cfg, model, mixture, grad_accum, total_steps, rt)
    with tracked_run(stage, params, rt) as run:
        metrics = Curves(run, stage, ["train/loss", "val/bpb"], enabled=rt.is_main)
        metrics.log({"packing/fill_ratio": mixture.fill}, 0)
        state.run_ids = producing_runs(carried, run.id, trains=start_step < total_steps)
        run_loop(
            cfg, stage, state, total_steps, val_metrics, train_step, lambda: train_loader.epoch, checkpoints, metrics
        )

        # --- stage-specific checks, then save the final model for the next stage
        summary, final = state.summary(mixture.fill), {"final/val_loss": state.val_loss, "final/val_bpb": state.bpb}
        if rt.is_main and finish is not None:
            summary.update(finish(model, tok, run))
        finish_stage(
            out_dir, model, checkpoint_meta(), summary, step=state.step, run=run, metrics=metrics, rt=rt, final=final
        )
    runtime.barrier()


class Mixture(NamedTuple):
    """``cfg.mixture`` rendered and best-fit packed into rows, for train and val."""

    conversations: int  # train conversations
    train_data: Rendered
    train_rows: list[list[tuple[int, int]]]  # per row, (conversation, n_tokens) of what fills it
    val_data: Rendered
    val_rows: list[list[tuple[int, int]]]
    fill: float  # share of the train rows' token slots that hold conversation tokens


def packed_mixture(cfg: ChatTrainSettings, tok_dir: Path) -> tuple[Tokenizer, Mixture]:
    """(tokenizer, packed mixture). The mixture is built before the tokenizer loads, so a malformed
    row is reported even where no tokenizer exists yet."""
    identity = {"model_name": cfg.model_name, "model_maker": cfg.model_maker}
    train_mix = build_mixture(cfg.mixture, "train", seed=cfg.seed, **identity)
    val_mix = build_mixture(cfg.mixture, "val", seed=cfg.seed, cap=cfg.val_limit, **identity)
    tok = Tokenizer.load(tok_dir)
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
    return tok, Mixture(len(train_mix), train_data, train_rows, val_data, val_rows, fill)


def run_params(
    stage: str, cfg: ChatTrainSettings, model, mixture: Mixture, grad_accum: int, total_steps: int, rt: runtime.Runtime
) -> dict[str, object]:
    """The MLflow params of the run: settings, model shape, batch math and the packed mixture's size."""
    return {
        stage: snapshot(cfg),
        "model_config": model.config.to_dict(),
        "grad_accum": grad_accum,
        "world_size": rt.world_size,
        "total_steps": total_steps,
        "train_rows": len(mixture.train_rows),
        "train_conversations": mixture.conversations,
    }


def schedule_length(cfg: ChatTrainSettings, train_rows: int, grad_accum: int, rt: runtime.Runtime) -> int:
    """``cfg.max_steps``, or with -1 the steps of one pass over the packed mixture's ``train_rows``."""
    rows_per_step = cfg.total_batch_size // cfg.max_seq_len
    total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(train_rows / rows_per_step)
    log.info(
        "%d steps x %d tokens (grad accum %d, world %d), %.2f passes over the mixture",
        total_steps,
        cfg.total_batch_size,
        grad_accum,
        rt.world_size,
        total_steps * rows_per_step / train_rows,
    )
    return total_steps


def val_steps(cfg: ChatTrainSettings, val_rows: int, rt: runtime.Runtime) -> int:
    """Batches per evaluation: ``cfg.eval_tokens`` worth, at most one pass over the val rows, at least one."""
    rows_per_eval = cfg.device_batch_size * rt.world_size
    return max(1, min(cfg.eval_tokens // (rows_per_eval * cfg.max_seq_len), math.ceil(val_rows / rows_per_eval)))


def run_loop(
    cfg: ChatTrainSettings,
    stage: str,
    state: LoopState,
    total_steps: int,
    val_metrics: Callable[[], tuple[float, float]],
    train_step: Callable[[int], tuple[float, float, float]],
    epoch: Callable[[], int],
    checkpoints: Checkpointer,
    metrics: Curves,
) -> None:
    """Train from ``state.step`` to ``total_steps``: val loss and bpb every ``eval_every`` steps and
    at the last, checkpoints when due, one optimizer step in between."""
    bar = progress(total_steps, stage, initial=state.start_step, unit="step")
    while True:
        last = state.step == total_steps
        if last or due(state.step, cfg.eval_every):
            state.val_loss, state.bpb = val_metrics()
            metrics.log({"val/loss": state.val_loss, "val/bpb": state.bpb}, state.step)
            log.info("step %d | val loss %.4f | val bpb %.4f", state.step, state.val_loss, state.bpb)
        checkpoints.save_if_due(state.step, last=last)
        if last:
            bar.close()
            return

        loss, lr_mult, dt = train_step(state.step)
        state.step += 1
        state.train_seconds += dt
        tok_per_s = cfg.total_batch_size / dt
        report_step(log, metrics, bar, state.step, total_steps, cfg.log_every, loss, lr_mult, tok_per_s, epoch=epoch())
