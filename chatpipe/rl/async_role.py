"""Asynchronous RL's two roles, as the stage runs them (the shared directory itself:
chatpipe/rl/exchange.py).

    rollout_role(cfg, rt)                         # the second torchx role: samples ahead of the trainer
    with rollout_exchange(run, start_step): ...   # the trainer: publishes weights, takes batches
    batch, stats = take_rollouts(run, step, idx)

The role samples with the settings, the step and the prompts the trainer would use
(:func:`chatpipe.rl.sampling.sample_batch`), so a batch differs from a synchronous one only by the
weights that drew it, and the trainer checks its prompts and staleness before training on it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from chatpipe import runtime
from chatpipe.inference.engine import Engine
from chatpipe.model.files import load_model
from chatpipe.paths import ARTIFACTS
from chatpipe.rl.core_loan import CoreLoan
from chatpipe.rl.exchange import Exchange, claim, launch_dir, reap_dead_launches, run_rollout_role
from chatpipe.rl.problems import Prompts, load_rl_problems, step_indices, user_verifier
from chatpipe.rl.rollout import Rollouts
from chatpipe.rl.sampling import rollout_dtype, sample_batch
from chatpipe.rl.workers import rollout_worker, trainer_exchange
from chatpipe.settings import RL_EXCHANGE_ENV, RL_THREADS_AFTER_ENV, RL_WORKER_ENV, RL_WORKER_OFFSET_ENV
from chatpipe.tokenizer import Tokenizer

if TYPE_CHECKING:
    from chatpipe.settings import RLSettings

log = logging.getLogger("rl")


def exchange_dir(cfg: RLSettings) -> Path:
    """The roles' shared dir: the one chatpipe.launch chose for both roles (``CHATPIPE_RL_LAUNCH_DIR``),
    else, for a stage run without the launcher, :func:`launch_dir`'s ``default`` one for this project."""
    given = os.environ.get(RL_EXCHANGE_ENV)
    return Path(given) if given else launch_dir(cfg.rollout.exchange_dir)


@contextlib.contextmanager
def rollout_exchange(run, step: int) -> Iterator[None]:
    """With ``rollout_role``: open the roles' shared dir for a run starting at ``step`` (the policy's
    weights published as version ``step`` by the first :func:`take_rollouts`, the role's cores the
    trainer's until then) and tell the rollout role to stop when the run ends, however it ends. The
    dir is claimed for this trainer first (its owner record), and the dirs beside it whose trainer is
    provably dead go (:func:`reap_dead_launches`); a live launch's never does.
    ``run``: chatpipe.rl.step.RLRun; its ``exchange`` is set here."""
    cfg, rt = run.cfg, run.rt
    if not cfg.rollout.role:
        yield
        return
    if rt.world_size > 1:
        raise ValueError(f"rl.rollout.role samples for one trainer process; this run has {rt.world_size} ranks")
    root = exchange_dir(cfg)
    claim(root)
    for old in reap_dead_launches(root):
        log.info("rollout role: removed %s, left by a trainer that is gone", old)
    run.exchange = trainer_exchange(cfg, root, rt.device)  # with several workers, weights go over torch.distributed
    # the role samples nothing before the first weights, so they go out when the trainer first asks for
    # a batch (take_rollouts): the evaluation a fresh run begins with comes first, and runs on the
    # role's idle cores too (on one thread it took twice as long as on two, while the role waited)
    run.rollout_start = (step, torch.get_num_threads())
    if os.environ.get(RL_THREADS_AFTER_ENV):
        runtime.use_threads(int(os.environ[RL_THREADS_AFTER_ENV]), "the rollout role's cores, before its first step")
    log.info("rollout role: exchange %s, max_staleness %d", root, cfg.rollout.max_staleness)
    try:
        with run.exchange.heartbeat("trainer"):
            yield
    finally:
        end_core_loan(run)
        run.exchange.stop()


def rollout_role(cfg: RLSettings, rt: runtime.Runtime) -> None:
    """The rollout role: the policy (its weights the trainer's newest the bound allows), the engine
    and the train prompts, sampling each step's batch as the trainer would (:func:`sample_batch`)."""
    tok = Tokenizer.load(ARTIFACTS / "tokenizer")
    policy, _ = load_model(cfg.init_dir, rt.device)
    policy.eval()
    engine = Engine(policy, tok)
    train_problems, _ = load_rl_problems(cfg, rt, user_verifier(cfg))
    matmul_dtype = rollout_dtype(cfg, rt)

    def sample_step(step: int) -> dict:
        idx = step_indices(cfg, Prompts(), len(train_problems), step, rank=0, world_size=1)
        batch = sample_batch(cfg, engine, [train_problems[i] for i in idx], step, 0, 1, matmul_dtype)
        return {**batch.to_dict(), "idx": idx, "tools": dict(engine.tool_stats)}

    if cfg.rollout.workers > 1:  # one of several replicas: weights come over torch.distributed
        worker = int(os.environ.get(RL_WORKER_ENV, "0")) + int(os.environ.get(RL_WORKER_OFFSET_ENV, "0"))
        written = rollout_worker(cfg, exchange_dir(cfg), policy, sample_step, rt.device, worker)
        log.info("rollout worker %d: done, %d batches", worker, written)
        return
    ex = Exchange(exchange_dir(cfg), cfg.rollout.heartbeat_timeout_s)
    log.info("rollout role: waiting for the trainer at %s", ex.root)
    with ex.heartbeat("rollout"):
        written = run_rollout_role(
            ex,
            policy,
            sample_step,
            max_steps=cfg.max_steps,
            max_staleness=cfg.rollout.max_staleness,
            timeout_s=cfg.rollout.timeout_s,
        )
    log.info("rollout role: done, %d batches", written)


def core_loan(cfg: RLSettings, ex: Exchange, own: int) -> CoreLoan | None:
    """The rollout role's cores lent to the trainer while it waits for weights (:class:`CoreLoan`),
    where one role shares the trainer's host (the launcher then says how many cores the two have:
    ``CHATPIPE_RL_THREADS_AFTER_ROLE``) and ``rl.rollout.lend_cores`` is on; else None."""
    every = int(os.environ.get(RL_THREADS_AFTER_ENV) or 0)
    if not cfg.rollout.lend_cores or cfg.rollout.workers > 1 or every <= own:
        return None
    if threading.current_thread() is not threading.main_thread():  # only the main thread runs signal handlers
        log.info("rollout role: the trainer runs outside the main thread, so the role's cores are not lent")
        return None
    log.info("rollout role: its %d core(s) are the trainer's while it waits for weights", every - own)
    return CoreLoan(ex, cfg.rollout.max_staleness, own, every)


def end_core_loan(run) -> None:
    """Give the role's cores back for good (its last batch is in, or the run ends) and stop watching."""
    if run.core_loan is not None:
        run.core_loan.close()
        run.core_loan = None


def take_rollouts(run, step: int, idx: list[int]) -> tuple[Rollouts, dict[str, float]]:
    """Step ``step``'s batch from the rollout role, checked against the trainer's own prompt picks and
    the staleness bound; its stats: staleness, the role's sampling and idle seconds, tokens/s."""
    cfg, ex = run.cfg, run.exchange
    if run.rollout_start is not None:  # the first batch asked for: the role starts now, on its own cores
        start, threads = run.rollout_start
        runtime.use_threads(threads, "the trainer's own cores, while the rollout role samples")
        ex.start(start, run.models.policy.state_dict())
        run.rollout_start = None
        run.core_loan = core_loan(cfg, ex, threads)
    lent = run.core_loan.take_lent_seconds() if run.core_loan is not None else 0.0  # in the update before
    t0 = time.perf_counter()
    payload = ex.take_rollouts(step, cfg.rollout.timeout_s, alive=lambda: ex.check_alive("rollout") or True)
    waited = time.perf_counter() - t0
    staleness = step - int(payload["version"])
    if payload["idx"] != idx or not 0 <= staleness <= cfg.rollout.max_staleness:
        raise RuntimeError(
            f"rollout role's batch for step {step} does not fit: prompts {payload['idx']} (want {idx}), "
            f"sampled by version {payload['version']} (max_staleness {cfg.rollout.max_staleness})"
        )
    batch = Rollouts.from_dict(payload)
    if step < cfg.max_steps - 1:
        if run.core_loan is not None:  # the role samples on, then waits for this update's weights
            run.core_loan.updating(step)
    else:  # the last batch: the role has no more to sample, so its cores are the trainer's from here
        end_core_loan(run)
        if os.environ.get(RL_THREADS_AFTER_ENV):
            runtime.use_threads(int(os.environ[RL_THREADS_AFTER_ENV]), "the rollout role's cores, after its last step")
    # at staleness 0 too the sampler's log-probs stay: the role's engine and dtype are not the trainer's,
    # so the update measures and corrects the gap (chatpipe.rl.sampling.sampler_is_trainer)
    run.engine.tool_stats = dict(payload["tools"])  # the role's running totals
    gen, idle = float(payload["gen_seconds"]), float(payload["idle_seconds"])
    stats = {
        "async/staleness": float(staleness),
        "async/trainer_wait_seconds": waited,
        "async/lent_seconds": lent,
        "async/rollout_gen_seconds": gen,
        "async/rollout_idle": idle / max(idle + gen, 1e-9),
        "rollout/tokens_per_s": batch.num_tokens / max(gen, 1e-9),
    }
    return batch, stats
