"""The start and end every training stage shares: resume-or-fresh, its MLflow run, the model handed on.

pretrain, the chat stages (midtrain and sft through :mod:`chatpipe.train.chat`) and rl each
resume with :func:`resume_or_fresh` once model and optimizers exist, open their MLflow run with
:func:`tracked_run` and end their loop with :func:`finish_stage`::

    run_fp, meta = resume_or_fresh(work, cfg, inputs, model=model, optimizers=optimizers, rt=rt)
    with tracked_run("pretrain", params, rt) as run:
        ...  # the loop: eval, checkpoint, train step, log
        finish_stage(ARTIFACTS / "base", model, checkpoint_meta(), summary, step=step, run=run,
                     metrics=metrics, rt=rt, final={"final/val_bpb": bpb})

They are plain functions, not a base class: each stage still reads top to bottom (settings, data,
model, optimizer, loop) and keeps its own loop state.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from chatpipe.io import fingerprint
from chatpipe.runtime import Runtime
from chatpipe.settings import TrackingSettings, active_profile, load_section, math_settings
from chatpipe.stage_metrics import Curves, write_metrics
from chatpipe.tracking import StageRun, stage_run
from chatpipe.train.checkpoint import resume_latest, save_model_dir


@contextmanager
def tracked_run(stage: str, params: dict[str, Any], rt: Runtime) -> Iterator[StageRun]:
    """The stage's MLflow run (:func:`chatpipe.tracking.stage_run`) with the tracking settings and
    profile of params.yaml; a no-op run on ranks other than 0."""
    with stage_run(stage, load_section(TrackingSettings), params, profile=active_profile(), enabled=rt.is_main) as run:
        yield run


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
    final: dict[str, float] | None = None,
) -> None:
    """Log ``final`` at ``step``, flush the step metrics, then on rank 0 save and report the model.

    ``meta`` is the stage's checkpoint meta (``stage``, settings, inputs, loop state, and under
    ``carried`` the MLflow run ids that trained the model). Rank 0 writes ``out_dir`` (``model.pt`` +
    ``meta.json``: ``meta`` plus the step, the summary, the stage and the newest of those run ids),
    logs the summary as ``summary/<key>`` metrics of ``run`` and writes ``metrics/<stage>.json``.
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
    )
    run.log_metrics({f"summary/{k}": float(v) for k, v in summary.items()})
    write_metrics(stage, summary)
    logging.getLogger(stage).info("saved %s | %s", out_dir, " | ".join(_fmt(k, v) for k, v in summary.items()))


def _fmt(key: str, value: float) -> str:
    # counts (steps, tokens) read best whole; rates and losses with four decimals
    return f"{key} {value}" if isinstance(value, int) else f"{key} {value:.4f}"
