"""What RL samples and replays: the train and held-out problems, which of them each rank samples at
each step (filter_solved's pool), and the chat-stage rows replayed beside every optimizer step.

    train, held_out = load_rl_problems(cfg, rt, user_verifier(cfg))
    test = load_test_problems(cfg, rt, user_verifier(cfg))    # the split nothing was tuned on
    idx = step_indices(cfg, prompts, len(train), step, rt.rank, rt.world_size)

The picks are a function of the settings, the step and the pool only, so the asynchronous rollout
role (chatpipe/rl/async_role.py) picks the same prompts as the trainer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from chatpipe import runtime
from chatpipe.data.packing import ConversationLoader, pack
from chatpipe.data.tasks import build_mixture
from chatpipe.io import fingerprint
from chatpipe.model.gpt import GPT
from chatpipe.rl.rollout import Problem, load_problems, rank_indices
from chatpipe.rl.verifier import Verifier
from chatpipe.tokenizer import Tokenizer

if TYPE_CHECKING:
    from chatpipe.settings import RLSettings

log = logging.getLogger("rl")


@dataclass
class Prompts:
    """RL's own sampling state, carried across a resume through the loop's ``stage_state``: per step
    every rank's prompt indices, and filter_solved's prompts solved so far and the pool sampled since
    ``pool_start``."""

    log: list = field(default_factory=list)
    solved: list[int] = field(default_factory=list)
    pool: list[int] | None = None
    pool_start: int = 0

    @classmethod
    def resumed(cls, meta: dict) -> Prompts:
        """The state a checkpoint's ``meta`` saved (chatpipe.rl.step.rl_state), or a fresh one for ``{}``."""
        return cls(list(meta.get("prompt_indices", [])), **meta.get("filter", {}))


def load_rl_problems(
    cfg: RLSettings, rt: runtime.Runtime, verifier: Verifier | None = None
) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out) problems: every rank samples its own train prompts from the whole pool and
    evaluates its share of the held-out ones; ``verifier`` (:func:`user_verifier`) scores them all."""
    task_kw = {"verifier": verifier, "path": cfg.task_path or None}
    train_problems = load_problems(
        cfg.task, "train", cfg.num_train_problems, cfg.seed, cfg.reward.verifier, cfg.task_source, **task_kw
    )
    for keep in cfg.keep_tasks:  # skills RL must not wear away: their prompts join the training pool
        n = keep.limit or cfg.num_train_problems
        train_problems += load_problems(
            keep.task, "train", n, cfg.seed, source=keep.source or "", words=keep.words, path=keep.path
        )
    eval_problems = load_problems(
        cfg.task, cfg.eval_split, cfg.eval_problems, cfg.seed, cfg.reward.verifier, cfg.task_source, **task_kw
    )
    return train_problems, eval_problems[rt.rank :: rt.world_size]


def evaluates_test_split(cfg: RLSettings) -> bool:
    """Whether the stage measures pass@k on ``test_split`` beside ``eval_split``: not when it is
    ``none``, nor when it is ``eval_split`` itself (the speedrun profile's ``test``: measured once,
    under ``eval/``). The same on every rank, so every rank joins the same evaluations."""
    return cfg.test_split not in ("none", cfg.eval_split)


def load_test_problems(cfg: RLSettings, rt: runtime.Runtime, verifier: Verifier | None = None) -> list[Problem]:
    """This rank's share of the ``test_split`` problems (as many as ``eval_problems``), the split
    no setting was tuned on; none when it is not measured apart (:func:`evaluates_test_split`). A
    task with no problems in that split stops the stage here, naming the key."""
    if not evaluates_test_split(cfg):
        return []
    task_kw = {"verifier": verifier, "path": cfg.task_path or None}
    problems = load_problems(
        cfg.task, cfg.test_split, cfg.eval_problems, cfg.seed, cfg.reward.verifier, cfg.task_source, **task_kw
    )
    if not problems:
        raise ValueError(
            f"rl.test_split = {cfg.test_split!r}: task {cfg.task!r} has no problems in that split; "
            "pick another of val, test, or none"
        )
    return problems[rt.rank :: rt.world_size]


def eval_identity(cfg: RLSettings) -> str:
    """A hash of what the stage's pass@k measures: splits, problems, samples, temperature. The stage
    keeps it among the run's inputs, so a rerun that changes any of them starts at step 0 rather than
    resuming a run whose first pass@k was measured otherwise (it would report the old run's first
    figure beside a new final one). When it is measured (``eval_every``) stays resume-neutral."""
    keys = ("eval_split", "eval_problems", "eval_samples", "eval_temperature")
    measured = {k: getattr(cfg, k) for k in keys}
    return fingerprint(measured | {"test_split": cfg.test_split if evaluates_test_split(cfg) else "none"})


def user_verifier(cfg: RLSettings) -> Verifier | None:
    """``reward: custom``: the user's own verifier (docs/own-data.md), loaded and checked before training."""
    if cfg.reward.verifier != "custom":
        return None
    return Verifier(
        cfg.reward.verifier_file,
        cfg.reward.verifier_function,
        sandbox=cfg.reward.verifier_sandbox,
        timeout_s=cfg.reward.verifier_timeout_s,
    )


def replay_rows(cfg: RLSettings, tok: Tokenizer, policy: GPT) -> tuple[int, tuple | None]:
    """(row length, packed rows) of the chat-stage conversations whose LM loss joins every optimizer
    step (``rl.replay``); no rows when replay is off. Rows longer than the model stop the stage here."""
    replay_seq_len = cfg.replay_seq_len or policy.config.sequence_len
    if cfg.replay and replay_seq_len > policy.config.sequence_len:
        raise ValueError(
            f"rl.replay_seq_len = {replay_seq_len} is longer than the model's sequence_len "
            f"{policy.config.sequence_len} ({Path(cfg.init_dir)}); set it to at most that, or null for the model's"
        )
    replay_pack = pack(build_mixture(cfg.replay, "train", seed=cfg.seed), tok, replay_seq_len) if cfg.replay else None
    return replay_seq_len, replay_pack


def resumed_replay(
    cfg: RLSettings, tok: Tokenizer, seq_len: int, rows: tuple | None, meta: dict, rt: runtime.Runtime
) -> ConversationLoader | None:
    """The loader of the replayed chat-stage ``rows`` (None when replay is off), its cursor where the
    checkpoint ``meta`` left it."""
    if not rows:
        return None
    start_row = meta["replay"]["row"] if meta else 0
    return ConversationLoader(
        *rows, batch_size=cfg.replay_rows, seq_len=seq_len, pad_id=tok.bos_id, start_row=start_row, **rt.shard
    )


def step_indices(
    cfg: RLSettings, prompts: Prompts, num_problems: int, step: int, rank: int, world_size: int
) -> list[int]:
    """The train prompts rank ``rank`` samples at ``step``: a function of the settings, the step and
    filter_solved's pool only, so the rollout role picks the same ones as the trainer."""
    pool = prompt_pool(cfg, num_problems, prompts, step)
    seed = cfg.seed + prompts.pool_start  # pool_start is 0 unless filter_solved re-pooled
    picks = rank_indices(
        len(pool), step - prompts.pool_start, cfg.prompts_per_step // world_size, rank, world_size, seed
    )
    return [pool[i] for i in picks]


def prompt_pool(cfg: RLSettings, num_problems: int, prompts: Prompts, step: int) -> list[int]:
    """The train prompts sampled from at ``step``: all of them, or with ``filter_solved`` those not
    solved as of the end of the pool's last epoch (AReaL filters its dataset once per epoch). A pool
    too small for one step stays as it was."""
    everything = range(num_problems)
    if cfg.filter_solved <= 0:
        return list(everything)
    pool = prompts.pool if prompts.pool is not None else list(everything)
    if step - prompts.pool_start >= len(pool) // cfg.prompts_per_step:  # the pool's epoch is over
        solved = set(prompts.solved)
        fresh = [i for i in everything if i not in solved]
        if len(fresh) >= cfg.prompts_per_step:
            pool, prompts.pool_start = fresh, step
            log.info("step %d | filter_solved: %d of %d prompts left", step, len(pool), len(everything))
    prompts.pool = pool
    return pool
