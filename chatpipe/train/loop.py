"""The one training loop: pretrain, midtrain, SFT, the reward model and RL (its rollout-and-update step) all run it.

A stage builds its data, model and optimizers, then hands :func:`run_loop` a :class:`Loop` holding
only what differs between stages: its step function, its LR/momentum schedule, its evals and
samples (:class:`Every`), and its own resume state (a loader cursor)::

    state = LoopState.resumed(meta, total_steps)          # meta: resume_or_fresh's checkpoint meta, {} when fresh
    loop = Loop("pretrain", cfg, rt, work, model, optimizers, step=one_step,
                schedule=train_schedule(cfg, total_steps), hooks=[Every(val_bpb, cfg.eval_every)],
                identity=run_meta(...), stage_state=lambda: {"loader": loader.state()})
    with tracked_run("pretrain", params, rt) as run:
        metrics = Curves(run, "pretrain", ["train/loss", "val/bpb"], enabled=rt.is_main)
        run_loop(loop, state, run, metrics)
        finish_stage(out_dir, model, loop.meta(state), summary, step=state.step, ...)

The loop owns the rest, once for every stage: counting steps and stopping at the last, setting the
schedule before each step, the hooks' cadence, the checkpoint cadence and what a checkpoint carries
(:meth:`Loop.meta`, read back by :meth:`LoopState.resumed`), the running totals, the progress bar
and the per-step metrics and log line. Every stage's step row is built by one function,
:func:`step_row`, from what its step returns (:class:`StepOut`: loss, gradient norm, the stage's own
metrics) and what the loop measured (LR multiplier, seconds): a per-step metric for every training
stage is one edit there.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from chatpipe.progress import progress
from chatpipe.runtime import Runtime
from chatpipe.settings import RunSettings
from chatpipe.stage_metrics import Curves
from chatpipe.tracking import StageRun
from chatpipe.train.checkpoint import carried_over, producing_runs
from chatpipe.train.optim import apply_schedules
from chatpipe.train.stage import Checkpointer
from chatpipe.train.step import due, peak_flops

# the keys :func:`step_row` owns: a step's own metrics may not set them (the row would then be the stage's)
STEP_ROW_KEYS = ("train/loss", "train/grad_norm", "lr_mult", "tokens_per_s", "mfu")


@dataclass
class StepOut:
    """What one training step hands back to the loop; :func:`step_row` turns it into the logged row."""

    # total gradient norm before any clipping, the same on every rank (RL: the policy's); None when
    # the step took no optimizer step (RL: a batch of solved groups and no replay)
    grad_norm: float | None
    loss: float | None = None  # the training loss, mean over ranks; None: RL, whose losses are its own metrics
    metrics: dict[str, float] = field(default_factory=dict)  # the stage's own: "epoch", RL's reward, ...
    # added to the running totals a checkpoint carries: "tokens" (the loop then logs tokens_per_s and MFU),
    # RL's generated tokens and generation seconds; the loop itself adds the step's "train_seconds"
    totals: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Every:
    """A hook the loop runs before a step (evals, samples) at its cadence: every ``every``-th step
    (0: never by cadence), the last step when ``at_last``, the step a run starts or resumes from when
    ``at_start``; never before ``from_step``. ``fn(step)`` returns metrics to log (or None)."""

    fn: Callable[[int], dict[str, float] | None]
    every: int
    at_last: bool = True
    at_start: bool = False
    from_step: int = 0

    def due(self, step: int, *, start: int, last: bool) -> bool:
        if step < self.from_step:
            return False
        return (last and self.at_last) or (self.at_start and step == start) or due(step, self.every)


@dataclass
class LoopState:
    """What the loop carries from step to step, and, through :meth:`meta`, across a resume.

    Totals, first evals and run ids continue from the checkpoint, so a resume from the final one
    rewrites the same summary (and the same artifact hash) as the run that trained it."""

    total_steps: int
    step: int = 0
    start_step: int = 0
    totals: dict[str, float] = field(default_factory=dict)  # over every run: train_seconds, tokens, ...
    run_ids: list[str] = field(default_factory=list)  # the MLflow runs that trained these steps
    evals: dict[str, float] = field(default_factory=dict)  # the newest hook results
    first_evals: dict[str, float] = field(default_factory=dict)  # the first hook results of the first run

    @classmethod
    def resumed(cls, meta: dict[str, Any], total_steps: int) -> LoopState:
        """The state a checkpoint's ``meta`` saved (:meth:`meta`), or a fresh one for ``{}``."""
        if not meta:
            return cls(total_steps)
        carried = carried_over(meta)
        run_ids, first_evals = carried.pop("mlflow_run_ids", []), carried.pop("first_evals", {})
        return cls(
            total_steps,
            step=meta["step"],
            start_step=meta["step"],
            totals=carried,  # what is left: checkpoints written before the loop was shared hold just these
            run_ids=list(run_ids),
            first_evals=dict(first_evals),
        )

    def meta(self) -> dict[str, Any]:
        """All a checkpoint carries of the loop (``step`` is added by the checkpoint itself): the
        totals flat beside the run ids and first evals under ``carried``."""
        carried = {**self.totals, "first_evals": self.first_evals, "mlflow_run_ids": self.run_ids}
        return {"total_steps": self.total_steps, "carried": carried}

    def total(self, key: str, default: float = 0.0) -> float:
        return self.totals.get(key, default)

    def add(self, amounts: dict[str, float]) -> None:
        for key, value in amounts.items():
            self.totals[key] = self.totals.get(key, 0) + value


@dataclass
class Loop:
    """What a stage hands :func:`run_loop`: the parts that differ between stages."""

    stage: str  # names the progress bar, the log and the checkpoints' owner
    cfg: RunSettings  # log_every, checkpoint_every, keep_checkpoints
    rt: Runtime
    work: Path  # checkpoints/<stage>
    model: torch.nn.Module  # what a checkpoint saves (RL: policy, reference and critic in one ModuleDict)
    optimizers: list
    step: Callable[[int], StepOut]  # trains step ``n`` (its schedule already set); every rank calls it
    schedule: Callable[[int], tuple[float, float | None]]  # step -> (LR multiplier, Muon momentum or None)
    hooks: list[Every]
    identity: dict[str, Any]  # what identifies the run (chatpipe.train.stage.run_meta)
    # the stage's own resume state, JSON: its loader cursor; RL's KL coefficient and prompt log
    stage_state: Callable[[], dict[str, Any]] = dict
    headline: str = "train/loss"  # the metric the progress bar shows
    flops_per_token: float = 0.0  # for MFU on GPUs with a known peak; 0: no MFU

    def meta(self, state: LoopState) -> dict[str, Any]:
        """A checkpoint's meta (and the final ``meta.json``'s): run identity, stage state, loop state."""
        return {**self.identity, **self.stage_state(), **state.meta()}


def run_loop(loop: Loop, state: LoopState, run: StageRun, metrics: Curves) -> None:
    """Train from ``state.step`` to ``state.total_steps``. At each step and after the last: the hooks
    that are due, then a checkpoint when due; between them one step, with its schedule set before it,
    its time and totals added and its metrics logged after it. Every rank calls it."""
    state.run_ids = producing_runs({"mlflow_run_ids": state.run_ids}, run.id, trains=state.step < state.total_steps)
    checkpoints = Checkpointer(
        loop.work,
        loop.cfg,
        loop.model,
        loop.optimizers,
        meta=functools.partial(loop.meta, state),
        rt=loop.rt,
        start_step=state.start_step,
    )
    log = logging.getLogger(loop.stage)
    peak = peak_flops(loop.rt.device) * loop.rt.world_size
    with progress(state.total_steps, loop.stage, initial=state.start_step, unit="step") as bar:
        while True:
            last = state.step == state.total_steps  # the one stop condition
            run_hooks(loop, state, metrics, last=last)
            checkpoints.save_if_due(state.step, last=last)
            if last:
                return
            row = timed_step(loop, state, peak)
            metrics.log(row, state.step)
            bar.update(**{loop.headline.rsplit("/", 1)[-1]: row[loop.headline]})
            if state.step % loop.cfg.log_every == 0 or state.step == state.total_steps:
                log.info("step %d/%d | %s", state.step, state.total_steps, format_row(row))


def run_hooks(loop: Loop, state: LoopState, metrics: Curves, *, last: bool) -> None:
    """Run the hooks due at ``state.step``; log what they return and keep it in ``state.evals``."""
    for hook in loop.hooks:
        if not hook.due(state.step, start=state.start_step, last=last):
            continue
        found = hook.fn(state.step)
        if not found:
            continue
        state.evals.update(found)
        state.first_evals = state.first_evals or dict(found)
        metrics.log(found, state.step)
        logging.getLogger(loop.stage).info("step %d | %s", state.step, format_row(found))


def timed_step(loop: Loop, state: LoopState, peak: float) -> dict[str, float]:
    """Set step ``state.step``'s schedule, run it, count it; returns its metrics row."""
    lr_mult, momentum = loop.schedule(state.step)
    apply_schedules(loop.optimizers, lr_mult, momentum)
    t0 = time.perf_counter()
    out = loop.step(state.step)
    if loop.rt.device.type == "cuda":
        torch.cuda.synchronize()  # the step's kernels inside its time
    seconds = time.perf_counter() - t0
    state.step += 1
    state.add({"train_seconds": seconds, **out.totals})
    return step_row(out, lr_mult=lr_mult, seconds=seconds, peak=peak, flops_per_token=loop.flops_per_token)


def step_row(
    out: StepOut, *, lr_mult: float, seconds: float, peak: float = 0.0, flops_per_token: float = 0.0
) -> dict[str, float]:
    """The metrics row of one step, for every training stage (pretrain, midtrain, SFT, the reward
    model, RL): ``train/loss`` (where the stage has one), ``train/grad_norm`` (where it stepped),
    the stage's own metrics, ``lr_mult``, and, where the step counts trained tokens, ``tokens_per_s``
    and ``mfu`` (``peak``: the world's peak FLOP/s, 0 when unknown). A per-step metric every stage
    logs goes here, once."""
    owned = sorted(set(out.metrics) & set(STEP_ROW_KEYS))
    if owned:
        raise ValueError(f"a step's own metrics set {owned}; the loop's step_row builds those (StepOut fields)")
    row: dict[str, float] = {}
    if out.loss is not None:
        row["train/loss"] = out.loss
    if out.grad_norm is not None:
        row["train/grad_norm"] = out.grad_norm
    row.update(out.metrics)
    row["lr_mult"] = lr_mult
    if "tokens" in out.totals:
        row["tokens_per_s"] = out.totals["tokens"] / seconds
        if peak and flops_per_token:
            row["mfu"] = flops_per_token * row["tokens_per_s"] / peak
    return row


def format_row(row: dict[str, float]) -> str:
    """``train/loss 2.345 | lr_mult 1 | tokens_per_s 1.2e+04``: four significant digits a value."""
    return " | ".join(
        f"{k} {v:.4g}" if isinstance(v, float) and math.isfinite(v) else f"{k} {v}" for k, v in row.items()
    )
