"""One RL step, in the order the pipeline runs it: pick prompts -> sample (or take the rollout role's
batch) -> score -> update -> publish the weights; and what the loop around it saves and reports.

    run = RLRun(cfg, rt, models, engine, train_problems, eval_problems, kl_ctl, replay_loader, ...)
    out = rl_step(run, step)        # the loop's step function: a StepOut with the step's metrics
    pass_at_k(run)                  # pass@k on val (tuning) and test (held out), every eval_every steps

Each part is a plain function over :class:`RLRun`, the stage's state built before the loop starts.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from chatpipe import runtime
from chatpipe.data.packing import ConversationLoader
from chatpipe.inference.engine import Engine
from chatpipe.rl import losses
from chatpipe.rl.async_role import take_rollouts
from chatpipe.rl.exchange import Exchange
from chatpipe.rl.guard import RewardGuard
from chatpipe.rl.problems import Prompts, evaluates_test_split, step_indices
from chatpipe.rl.roles import Models
from chatpipe.rl.rollout import Problem, Rollouts, evaluate_problems, keep_best
from chatpipe.rl.sampling import model_ranked, sample_batch
from chatpipe.rl.scoring import score_rollouts, verifier_summary
from chatpipe.rl.totals import RolloutTotals
from chatpipe.rl.update import GRPOConfig, Learners, PPOConfig, policy_update
from chatpipe.rl.verifier import Verifier
from chatpipe.train.checkpoint import carried_over
from chatpipe.train.loop import LoopState, StepOut

if TYPE_CHECKING:
    from chatpipe.rl.core_loan import CoreLoan
    from chatpipe.settings import RLSettings


@dataclass
class RLRun:
    """What the loop works with, all built before it starts."""

    cfg: RLSettings
    rt: runtime.Runtime
    models: Models
    engine: Engine
    train_problems: list[Problem]
    eval_problems: list[Problem]
    kl_ctl: losses.KLController
    algorithm: GRPOConfig | PPOConfig  # the chosen algorithm's config (chatpipe.rl.update.algorithm_config)
    replay_loader: ConversationLoader | None
    train_policy: torch.nn.Module  # the policy, DDP-wrapped when there are several ranks
    train_critic: torch.nn.Module | None
    value_norm: losses.ValueNorm | None = None  # PPO's running moments of the returns (rl.value_norm)
    prompts: Prompts = field(default_factory=Prompts)  # RL's own sampling state
    guard: RewardGuard | None = None  # reward.source model|both: the reward-hacking guard
    exchange: Exchange | None = None  # rollout_role: where the rollout role leaves each step's batch
    # rollout_role: (the step, the trainer's own threads) the first take_rollouts starts the role at
    rollout_start: tuple[int, int] | None = None
    core_loan: CoreLoan | None = None  # rollout_role: its cores, the trainer's while it waits for weights
    rollout_dtype: torch.dtype | None = None  # the rollouts' linear layers (rl.rollout.dtype, resolved once)
    test_problems: list[Problem] = field(default_factory=list)  # rl.test_split's: held out, nothing tuned on them


def rl_step(run: RLRun, step: int) -> StepOut:
    """One rollout-and-update step (its LR already set by the loop): sample and score this rank's
    prompts, update on them; returns the policy's gradient norm and, as the stage's own metrics for the
    loop's step row, the rollouts' means over every rank and the update's stats."""
    t0 = time.perf_counter()
    batch, reward_stats = sample_rollouts(run, step)
    t_gen = time.perf_counter() - t0
    t1 = time.perf_counter()
    stats = update(run, batch, step)
    if run.core_loan is not None:  # the role samples again once the weights are out: its cores go back first
        run.core_loan.give_back()
    if run.exchange is not None:  # the rollout role may sample the next steps with these weights
        run.exchange.publish(step + 1, run.models.policy.state_dict())
    t_train = time.perf_counter() - t1
    totals = RolloutTotals.of(batch, kl_sum=stats.pop("kl_sum", 0.0)).summed_over_ranks(run.rt.device)
    grad_norm = stats.pop("train/grad_norm", None)  # the loop's step_row logs it; absent: no optimizer step
    row = {
        **totals.means(),
        "rollout/tokens_per_s": totals.tokens / max(t_gen, 1e-9),  # ranks sample in parallel
        "time/gen_share": t_gen / (t_gen + t_train),
        "kl/coef": run.kl_ctl.value,
        **{f"tools/{k}": float(v) for k, v in run.engine.tool_stats.items()},  # running totals, this rank
        **stats,
        **reward_stats,
        **(run.guard.close_if_due(step + 1, functools.partial(sum_over_ranks, run.rt)) if run.guard else {}),
    }
    # "gen_tokens", not "tokens": the loop's tokens_per_s and MFU are for trained tokens
    role_gen = {}
    if run.exchange is not None:  # the trainer's gen time is its wait; the role's own time samples
        row["async/trainer_idle"] = row["async/trainer_wait_seconds"] / (t_gen + t_train)
        role_gen = {"role_gen_seconds": row["async/rollout_gen_seconds"]}
    return StepOut(grad_norm, metrics=row, totals={"gen_seconds": t_gen, "gen_tokens": int(totals.tokens), **role_gen})


def sample_rollouts(run: RLRun, step: int) -> tuple[Rollouts, dict[str, float]]:
    """This rank's prompts x ``group_size`` responses for step ``step`` (sampled here, or with
    ``rollout_role`` the role's batch), scored by :func:`score_rollouts`; every rank records who
    sampled what in ``run.prompts.log`` (tests check no overlap). With ``generation_size`` and a
    learned reward, the ``group_size`` best by that reward are kept here; filter_solved counts a
    response solved by the verifier's verdict, or with ``reward.source: model`` by its normalised
    reward-model score reaching ``solved_score`` (:meth:`Rollouts.solved`)."""
    cfg, rt, prompts = run.cfg, run.rt, run.prompts
    idx = step_indices(cfg, prompts, len(run.train_problems), step, rt.rank, rt.world_size)
    prompts.log.append(gather(idx, rt))
    if run.exchange is not None:
        batch, async_stats = take_rollouts(run, step, idx)
    else:
        run.models.policy.eval()  # the engine samples in eval mode; the update trains
        problems = [run.train_problems[i] for i in idx]
        batch = sample_batch(cfg, run.engine, problems, step, rt.rank, rt.world_size, run.rollout_dtype)
        run.models.policy.train()
        async_stats = {}
    batch, reward_stats = score_rollouts(run, batch)
    if model_ranked(cfg):
        batch = keep_best(batch, cfg.group_size)
    if cfg.filter_solved > 0:
        rates = losses.group_solve_rates(batch.solved(solved_threshold(cfg)), batch.groups)
        solved = [idx[g] for g, rate in rates.items() if rate >= cfg.filter_solved]
        prompts.solved = sorted(set(prompts.solved).union(*gather(solved, rt)))
    return batch, reward_stats | async_stats


def solved_threshold(cfg: RLSettings) -> float | None:
    """``solved_score`` where the reward model alone trains the policy (it then decides what is solved:
    the verifier never decides what a model-scored run trains on); None: the task's verdict."""
    return cfg.solved_score if cfg.reward.source == "model" else None


def update(run: RLRun, batch: Rollouts, step: int) -> dict[str, float]:
    """One update of the chosen algorithm on ``batch`` with shaped scores, with the replay's loss
    beside it; then the reference moves towards the policy by ``ppo.ref_ema`` (0, a frozen reference,
    unless PPO sets it). Returns the update's stats."""
    cfg, models = run.cfg, run.models
    scores = losses.final_scores(batch.scores, batch.ended, batch.lengths, cfg.reward)
    if cfg.mask_too_long:
        batch = batch.without_unfinished()
    replay = (lambda model: cfg.replay_coef * model(*run.replay_loader.next_batch())) if run.replay_loader else None
    learners = Learners(
        run.train_policy,
        models.ref,
        run.train_critic,
        models.policy_opts,
        models.critic_opts,
        run.kl_ctl,
        run.value_norm,
    )
    stats = policy_update(run.algorithm, learners, batch, scores, step=step, autocast=run.rt.autocast, replay=replay)
    losses.ema_update(models.ref, models.policy, cfg.ppo.ref_ema)
    return stats


def pass_at_k(run: RLRun) -> dict[str, float]:
    """pass@1 and pass@eval_samples over every rank's share of the ``eval_split`` problems (the
    tuning split: ``eval/``) and, unless ``test_split`` is none or the same split, of the
    ``test_split`` ones (held out: ``eval_test/``). Each evaluation seeds its own sampling, so the
    test one moves neither the val figures nor the training's random streams."""
    found = split_pass_at_k(run, run.eval_problems, "eval")
    if evaluates_test_split(run.cfg):
        found |= split_pass_at_k(run, run.test_problems, "eval_test")
    return found


def split_pass_at_k(run: RLRun, problems: list[Problem], prefix: str) -> dict[str, float]:
    """``<prefix>/pass_at_<k>`` of the policy on this rank's ``problems``, summed over every rank."""
    cfg, rt, policy = run.cfg, run.rt, run.models.policy
    policy.eval()
    correct = evaluate_problems(
        run.engine,
        problems,
        num_samples=cfg.eval_samples,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.eval_temperature,
        top_k=cfg.top_k or None,
        seed=cfg.seed + 10_000 * rt.rank,
    )
    policy.train()
    ks = sorted({1, cfg.eval_samples})
    # summed over ranks: [problems, pass@k x problems for each k]
    sums = torch.tensor(
        [len(correct)] + [losses.mean_pass_at_k(correct, k) * len(correct) if correct else 0.0 for k in ks],
        dtype=torch.float64,
        device=rt.device,
    )
    runtime.all_reduce_sum(sums)
    return {f"{prefix}/pass_at_{k}": (sums[i + 1] / sums[0].clamp(min=1)).item() for i, k in enumerate(ks)}


# --------------------------------------------------------------------------- what the loop saves and reports


def ppo_state(cfg: RLSettings, critic, meta: dict) -> tuple[losses.KLController, losses.ValueNorm | None]:
    """PPO's KL controller (``kl_ctl``, unused by GRPO) and the critic's value-norm moments (``value_norm``;
    None without), both where the checkpoint ``meta`` left them (``{}``: fresh)."""
    ppo = cfg.ppo
    kl_ctl = losses.KLController(
        ppo.kl_coef, adaptive=ppo.kl_ctl == "adaptive", target=ppo.kl_target, horizon=ppo.kl_horizon
    )
    value_norm = losses.ValueNorm(ppo.value_norm_beta) if ppo.value_norm and critic else None
    if meta:
        kl_ctl.value = meta["kl_coef"]
        if value_norm is not None:
            value_norm.load(meta["value_norm"])
    return kl_ctl, value_norm


def rl_state(run: RLRun) -> dict:
    """What a checkpoint carries of RL beside the loop's state: the KL coefficient, the prompt log,
    the replay cursor, value_norm's moments and filter_solved's pool."""
    prompts = run.prompts
    return {
        "kl_coef": run.kl_ctl.value,
        "init_dir": str(Path(run.cfg.init_dir)),
        "prompt_indices": prompts.log,
        "replay": run.replay_loader.state() if run.replay_loader else None,
        "value_norm": run.value_norm.state() if run.value_norm else None,
        "filter": {"solved": prompts.solved, "pool": prompts.pool, "pool_start": prompts.pool_start},
        "guard": run.guard.state() if run.guard else None,
    }


def loop_meta(meta: dict) -> dict:
    """``meta`` as :meth:`LoopState.resumed` reads it. A checkpoint written before RL ran the shared
    loop holds ``first_eval`` beside ``carried`` and counts ``train_seconds`` without generation; it
    resumes with both moved to the shared loop's meaning."""
    if "first_eval" not in meta:
        return meta
    carried = carried_over(meta)
    carried["train_seconds"] = carried.get("train_seconds", 0.0) + carried.get("gen_seconds", 0.0)
    carried["first_evals"] = meta["first_eval"] or {}
    return {**meta, "carried": carried}


def summary(
    state: LoopState, guard: RewardGuard | None = None, verifier: Verifier | None = None, cfg: RLSettings | None = None
) -> dict[str, float]:
    """The final ``summary`` of ``meta.json``: steps, time and throughput, first and final pass@k, the
    reward-hacking guard's trips and its first and last windows (the report card shows them), the
    user's verifier's calls and failures (this rank's), and for a model-scored run whether its reward
    carried the verifier (:func:`chatpipe.rl.scoring.verifier_summary`)."""
    gen_seconds, gen_tokens = state.total("gen_seconds"), state.total("gen_tokens")
    return {
        **(verifier_summary(cfg) if cfg is not None else {}),
        **(guard.summary() if guard else {}),
        **(verifier.summary() if verifier else {}),
        "steps": state.step,
        "gen_seconds": gen_seconds,
        "train_seconds": state.total("train_seconds") - gen_seconds,
        "rollout_tokens": gen_tokens,
        "rollout_tokens_per_s": gen_tokens / max(state.total("role_gen_seconds") or gen_seconds, 1e-9),
        **{f"first_{k}": v for k, v in state.first_evals.items()},
        **{f"final_{k}": v for k, v in state.evals.items()},
    }


# --------------------------------------------------------------------------- ranks


def distributed(module: torch.nn.Module | None, rt: runtime.Runtime) -> torch.nn.Module | None:
    """``module`` wrapped in DDP when there are several ranks (gradients averaged in backward)."""
    return DDP(module) if module is not None and rt.world_size > 1 else module


def sum_over_ranks(rt: runtime.Runtime, numbers: list[float]) -> list[float]:
    """``numbers`` summed over every rank (float64)."""
    sums = torch.tensor(numbers, dtype=torch.float64, device=rt.device)
    runtime.all_reduce_sum(sums)
    return sums.tolist()


def gather(obj, rt: runtime.Runtime) -> list:
    """Every rank's ``obj``, in rank order (on every rank)."""
    if rt.world_size == 1:
        return [obj]
    out = [None] * rt.world_size
    torch.distributed.all_gather_object(out, obj)
    return out
