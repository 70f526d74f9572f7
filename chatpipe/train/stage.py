"""The start and end every training stage shares: resume-or-fresh, its MLflow run, the model handed on.

pretrain, the chat stages (midtrain and sft through :mod:`chatpipe.train.chat`) and rl each
resume with :func:`resume_or_fresh` once model and optimizers exist, open their MLflow run with
:func:`chatpipe.tracking.tracked_run` (as every stage does) and end their loop with :func:`finish_stage`::

    run_fp, meta = resume_or_fresh(work, cfg, inputs, model=model, optimizers=optimizers, rt=rt)
    with tracked_run("pretrain", params, rt) as run:
        ...  # the loop: eval, checkpoint, train step, log
        finish_stage(ARTIFACTS / "base", model, checkpoint_meta(), summary, step=step, run=run,
                     metrics=metrics, rt=rt, final={"final/val_bpb": bpb})

They are plain functions, not a base class: each stage still reads top to bottom (settings, data,
model, optimizer) and hands its step to the one training loop (chatpipe.train.loop).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from chatpipe.io import fingerprint
from chatpipe.model.files import save_model_dir
from chatpipe.paths import ARTIFACTS
from chatpipe.runtime import Runtime
from chatpipe.settings import RunSettings, math_settings, snapshot
from chatpipe.stage_metrics import Curves, write_metrics
from chatpipe.tracking import StageRun
from chatpipe.train.checkpoint import resume_latest, save_checkpoint
from chatpipe.train.step import due


def resume_or_fresh(
    work: Path, cfg: BaseModel, inputs: dict[str, Any], *, model: torch.nn.Module, optimizers: list, rt: Runtime
) -> tuple[str, dict[str, Any]]:
    """The run's fingerprint and the meta of its newest valid checkpoint, or ``{}`` for a fresh start.

    The fingerprint covers the settings that change the math (resume-neutral ones left out) and
    ``inputs`` (hashes of the init model, tokenizer, data); only checkpoints with the same one are
    resumed, loaded into ``model`` and ``optimizers`` with this rank's RNG state.
    """
    run_fp = fingerprint({"settings": math_settings(cfg), "inputs": inputs})
    meta = resume_latest(work, run_fp, model=model, optimizers=optimizers, rank=rt.rank, world_size=rt.world_size)
    return run_fp, meta or {}


def run_meta(
    stage: str, run_fp: str, cfg: BaseModel, inputs: dict[str, Any], rt: Runtime, model_config: Any
) -> dict[str, Any]:
    """What identifies a stage run in its checkpoints and final ``meta.json``: stage, fingerprint,
    world size, model config, settings and input hashes; each stage adds its loop state."""
    return {
        "stage": stage,
        "fingerprint": run_fp,
        "world_size": rt.world_size,
        "model_config": model_config.to_dict(),
        "settings": snapshot(cfg),
        "inputs": inputs,
    }


@dataclass
class Checkpointer:
    """A stage's resumable checkpoints in ``work``: every ``cfg.checkpoint_every`` steps and at the
    last one, keeping the newest ``cfg.keep_checkpoints``; ``meta()`` builds the loop state when one is due."""

    work: Path
    cfg: RunSettings
    model: torch.nn.Module
    optimizers: list
    meta: Callable[[], dict[str, Any]]
    rt: Runtime
    start_step: int = 0

    def save_if_due(self, step: int, *, last: bool) -> None:
        """Collectively save step ``step`` when due (every rank calls it). The step the run started
        or resumed from is never saved again: it is the fresh model or the checkpoint just loaded."""
        if step > self.start_step and (last or due(step, self.cfg.checkpoint_every)):
            save_checkpoint(
                self.work,
                step,
                model=self.model,
                optimizers=self.optimizers,
                meta=self.meta(),
                rank=self.rt.rank,
                keep=self.cfg.keep_checkpoints,
            )


def finish_stage(
    out_dir: Path,
    model: torch.nn.Module,
    meta: dict[str, Any],
    summary: dict[str, float],
    *,
    step: int,
    run: StageRun,
    metrics: Curves,
    rt: Runtime,
    tokenizer_dir: Path = ARTIFACTS / "tokenizer",
    final: dict[str, float] | None = None,
) -> None:
    """Log ``final`` at ``step``, flush the step metrics, then on rank 0 save and report the model.

    ``meta`` is the stage's checkpoint meta (``stage``, settings, inputs, loop state, and under
    ``carried`` the MLflow run ids that trained the model). Rank 0 writes ``out_dir`` (``model.pt`` +
    ``meta.json``: ``meta`` plus the step, the summary, the stage and the newest of those run ids;
    ``tokenizer/``: a copy of ``tokenizer_dir``, the pipeline's tokenizer that every training stage
    trains with), logs the summary as ``summary/<key>`` metrics of ``run`` and writes ``metrics/<stage>.json``.
    Every rank calls it; only rank 0 writes (its buffers are the only ones that hold metrics).
    """
    stage, run_ids = meta["stage"], meta["carried"]["mlflow_run_ids"]
    if final:
        metrics.log(final, step)
    metrics.flush()
    if not rt.is_main:
        return
    save_model_dir(
        out_dir,
        model,
        {
            **meta,
            "step": step,
            "summary": summary,
            "source_stage": stage,
            "mlflow_run_id": run_ids[-1] if run_ids else None,
        },
        tokenizer_dir=tokenizer_dir,
    )
    run.log_metrics({f"summary/{k}": float(v) for k, v in summary.items()})
    write_metrics(stage, summary)
    logging.getLogger(stage).info("saved %s | %s", out_dir, " | ".join(_fmt(k, v) for k, v in summary.items()))


def _fmt(key: str, value: float) -> str:
    # counts (steps, tokens) read best whole; rates and losses with four decimals
    return f"{key} {value}" if isinstance(value, int) else f"{key} {value:.4f}"
