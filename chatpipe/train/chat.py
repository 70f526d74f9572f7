"""Training loop shared by the chat stages (midtrain, sft): packed conversations, assistant-only loss.

The two stages differ only in their mixture, their starting model and what they check at the end,
so each stage script is settings plus one call to :func:`train_chat`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
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
from chatpipe.settings import ChatTrainSettings, snapshot
from chatpipe.stage_metrics import Curves
from chatpipe.tokenizer import Tokenizer
from chatpipe.tracking import tracked_run
from chatpipe.train.loop import Every, Loop, LoopState, StepOut, run_loop
from chatpipe.train.optim import build_optimizers
from chatpipe.train.stage import finish_stage, resume_or_fresh, run_meta
from chatpipe.train.step import evaluate_loss_bpb, fixed_batches, grad_accum_steps, train_schedule, train_step_stats

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
    tok, mixture = packed_mixture(cfg, tok_dir)
    token_bytes = torch.load(tok_dir / "token_bytes.pt", weights_only=True).to(rt.device)

    # --- model: the previous stage's weights; batch math and schedule length; optimizer
    model, init_meta = load_model(init_dir, rt.device)
    model.train()
    inputs = {"init": init_meta["files"]["model.pt"], "tokenizer": sha256_file(tok_dir / "tokenizer.json")}
    grad_accum = grad_accum_steps(cfg.total_batch_size, cfg.device_batch_size, cfg.max_seq_len, rt.world_size)
    total_steps = schedule_length(cfg, len(mixture.train_rows), grad_accum, rt)
    optimizers = build_optimizers(model, **cfg.lrs(cfg.init_lr_frac), weight_decay=cfg.weight_decay)

    # --- resume from the newest valid checkpoint made with the same settings and inputs
    run_fp, meta = resume_or_fresh(work, cfg, inputs, model=model, optimizers=optimizers, rt=rt)
    state = LoopState.resumed(meta, total_steps)

    loader_kw = dict(batch_size=cfg.device_batch_size, seq_len=cfg.max_seq_len, pad_id=tok.bos_id, **rt.shard)
    start_row = meta["loader"]["row"] if meta else 0
    train_loader = ConversationLoader(mixture.train_data, mixture.train_rows, start_row=start_row, **loader_kw)
    ddp_model = DDP(model) if rt.world_size > 1 else model
    step_model = runtime.compile(ddp_model) if cfg.compile else ddp_model
    eval_steps = val_steps(cfg, len(mixture.val_rows), rt)

    def val_metrics(step: int) -> dict[str, float]:
        loader = ConversationLoader(mixture.val_data, mixture.val_rows, **loader_kw)
        val_loss, bpb = evaluate_loss_bpb(model, list(fixed_batches(loader.next_batch, eval_steps)), token_bytes, rt)
        return {"val/loss": val_loss, "val/bpb": bpb}

    def one_step(step: int) -> StepOut:
        kw = dict(grad_accum=grad_accum, rt=rt, grad_clip=cfg.grad_clip)
        loss, grad_norm = train_step_stats(step_model, train_loader.next_batch, optimizers, **kw)
        return StepOut(grad_norm, loss, {"epoch": train_loader.epoch})

    # --- loop
    params = run_params(stage, cfg, model, mixture, grad_accum, total_steps, rt)
    with tracked_run(stage, params, rt) as run:
        metrics = Curves(run, stage, ["train/loss", "val/bpb"], enabled=rt.is_main)
        metrics.log({"packing/fill_ratio": mixture.fill}, 0)
        loop = Loop(
            stage,
            cfg,
            rt,
            work,
            model,
            optimizers,
            step=one_step,
            schedule=train_schedule(cfg, total_steps),
            hooks=[Every(val_metrics, cfg.eval_every)],
            identity=run_meta(stage, run_fp, cfg, inputs, rt, model.config),
            stage_state=lambda: {"loader": train_loader.state()},
        )
        run_loop(loop, state, run, metrics)

        # --- stage-specific checks, then save the final model for the next stage
        summary = chat_summary(state, mixture.fill)
        if rt.is_main and finish is not None:
            summary.update(finish(model, tok, run))
        final = {"final/val_loss": summary["val_loss"], "final/val_bpb": summary["val_bpb"]}
        finish_stage(
            out_dir, model, loop.meta(state), summary, step=state.step, run=run, metrics=metrics, rt=rt, final=final
        )
    runtime.barrier()


def chat_summary(state: LoopState, fill: float) -> dict[str, float]:
    """The final ``summary`` of ``meta.json`` (before the stage's own checks add to it)."""
    val_loss, bpb = (state.evals.get(k, float("nan")) for k in ("val/loss", "val/bpb"))
    return {"val_loss": val_loss, "val_bpb": bpb, "fill_ratio": fill, "train_seconds": state.total("train_seconds")}


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
