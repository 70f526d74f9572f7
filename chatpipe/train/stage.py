"""The end that every training stage shares: final metrics, the model handed on, the summary.

pretrain, the chat stages (midtrain and sft through :mod:`chatpipe.train.chat`) and rl each end
their loop with one call to :func:`finish_stage`::

    finish_stage("pretrain", ARTIFACTS / "base", model, checkpoint_meta(step), summary,
                 step=step, run=run, run_ids=run_ids, metrics=metrics, rt=rt, final={"final/val_bpb": bpb})

It is a plain function, not a base class: each stage still reads top to bottom (settings, data,
model, loop) and only hands its finished model and numbers over here.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from chatpipe.runtime import Runtime
from chatpipe.stage_metrics import Curves, write_metrics
from chatpipe.tracking import StageRun
from chatpipe.train.checkpoint import save_model_dir


def finish_stage(
    stage: str,
    out_dir: Path,
    model: torch.nn.Module,
    meta: dict[str, Any],
    summary: dict[str, float],
    *,
    step: int,
    run: StageRun,
    run_ids: list[str],
    metrics: Curves,
    rt: Runtime,
    final: dict[str, float] | None = None,
) -> None:
    """Log ``final`` at ``step``, flush the step metrics, then on rank 0 save and report the model.

    Rank 0 writes ``out_dir`` (``model.pt`` + ``meta.json``: ``meta`` plus the step, the summary,
    the stage and the newest of ``run_ids``, the MLflow runs that trained it), logs the summary as
    ``summary/<key>`` metrics of ``run`` and writes ``metrics/<stage>.json``. Every rank calls it;
    only rank 0 writes (its buffers are the only ones that hold metrics).
    """
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
