"""RL stage: GRPO-lite or PPO on verifiable rewards, starting from the SFT model.

    python -m stages.rl                                   # one process, params.yaml `rl` section
    python -m stages.rl --algorithm=ppo --max_steps=20
    torchrun --nproc_per_node=2 -m stages.rl              # each rank samples its own prompts
    python -m chatpipe.launch rl                          # through torchx, as DVC does

Per step every rank samples ``prompts_per_step / world_size`` problems x ``group_size`` responses
with the engine (calculator tool use on) and scores them with the verifier. GRPO-lite takes one
policy-gradient step with advantage = score - group mean. PPO adds a frozen reference policy (KL
penalty folded into the token rewards), a critic (GAE) and clipped updates over epochs x
minibatches; both updates are library functions (chatpipe/rl/update.py, unit-tested against
hand-computed values). With ``replay`` set, each optimizer step also follows the assistant-only LM
loss of a few packed chat-stage rows, so what RL does not reward (spelling, multiple choice) is not
worn away. Held-out pass@k (a pass is the task's own verdict, not the reward) every ``eval_every``
steps; resumable checkpoints (policy, critic, reference, optimizers, KL coefficient, value-norm
moments, filter_solved's prompt pool, step, replay cursor, RNG) in ``checkpoints/rl/``; the final
policy goes to ``artifacts/rl/``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import logging
import os
import re
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from chatpipe import runtime
from chatpipe.data.packing import ConversationLoader, pack
from chatpipe.data.tasks import build_mixture
from chatpipe.inference.engine import Engine
from chatpipe.io import sha256_file
from chatpipe.model.files import load_model
from chatpipe.model.gpt import GPT
from chatpipe.paths import ARTIFACTS, WORK
from chatpipe.rl import losses
from chatpipe.rl.exchange import Exchange, run_rollout_role
from chatpipe.rl.guard import RewardGuard
from chatpipe.rl.reward_model import (
    RewardModel,
    is_reward_model_dir,
    load_reward_model,
    refresh_loss,
    rollout_rows,
    rollout_scores,
)
from chatpipe.rl.rewards import combine_rewards, ensemble_rewards
from chatpipe.rl.rollout import (
    Problem,
    Rollouts,
    collect_rollouts,
    evaluate_problems,
    keep_best,
    load_problems,
    rank_indices,
)
from chatpipe.rl.totals import RolloutTotals
from chatpipe.rl.update import PPOConfig, grpo_update, ppo_update
from chatpipe.rl.value import ValueModel
from chatpipe.rl.verifier import Verifier
from chatpipe.settings import RL_EXCHANGE_ENV, RL_ROLE_ENV, RL_THREADS_AFTER_ENV, RLSettings, snapshot
from chatpipe.stage_metrics import Curves
from chatpipe.tokenizer import Tokenizer
from chatpipe.tracking import tracked_run
from chatpipe.train.checkpoint import carried_over
from chatpipe.train.loop import Every, Loop, LoopState, StepOut, run_loop
from chatpipe.train.optim import build_optimizers, init_lrs
from chatpipe.train.stage import finish_stage, resume_or_fresh, run_meta
from chatpipe.train.step import step_optimizers

log = logging.getLogger("rl")


def main(argv: list[str] | None = None) -> None:
    if os.environ.get(RL_ROLE_ENV) == "rollout":  # the second torchx role of asynchronous RL (rl.rollout_role)
        runtime.run_stage(RLSettings, rollout_role, argv)
    else:
        runtime.run_stage(RLSettings, train, argv, training=True)


@dataclass
class Models:
    """The policy RL trains, its frozen reference, PPO's critic (None otherwise), their optimizers and
    the reward model that scores responses under ``reward_source`` model|both (None otherwise): frozen,
    or with ``reward_model_lr_frac`` trained on as it goes (its optimizers then join the checkpoints)."""

    policy: GPT
    ref: GPT
    critic: ValueModel | None
    state: torch.nn.ModuleDict  # what a checkpoint holds: policy, ref and critic
    init_lrs: dict[str, float]  # the init model's LRs, which the RL LRs are fractions of
    policy_opts: list
    critic_opts: list
    reward_model: RewardModel | None = None
    reward_model_opts: list = field(default_factory=list)  # reward_model_lr_frac > 0: iterated RLHF
    ensemble: list[RewardModel] = field(default_factory=list)  # reward_model_ensemble: frozen, scored beside it

    @property
    def optimizers(self) -> list:
        return self.policy_opts + self.critic_opts + self.reward_model_opts


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
        """The state a checkpoint's ``meta`` saved (:func:`rl_state`), or a fresh one for ``{}``."""
        return cls(list(meta.get("prompt_indices", [])), **meta.get("filter", {}))


@dataclass
class Parts:
    """What the loop works with, all built before it starts."""

    cfg: RLSettings
    rt: runtime.Runtime
    models: Models
    engine: Engine
    train_problems: list[Problem]
    eval_problems: list[Problem]
    kl_ctl: losses.KLController
    ppo_config: PPOConfig
    replay_loader: ConversationLoader | None
    train_policy: torch.nn.Module  # the policy, DDP-wrapped when there are several ranks
    train_critic: torch.nn.Module | None
    value_norm: losses.ValueNorm | None = None  # PPO's running moments of the returns (rl.value_norm)
    prompts: Prompts = field(default_factory=Prompts)  # RL's own sampling state
    guard: RewardGuard | None = None  # reward_source model|both: the reward-hacking guard
    exchange: Exchange | None = None  # rollout_role: where the rollout role leaves each step's batch
    rollout_dtype: torch.dtype | None = None  # the rollouts' linear layers (rl.rollout_dtype, resolved once)


def rl_state(parts: Parts) -> dict:
    """What a checkpoint carries of RL beside the loop's state: the KL coefficient, the prompt log,
    the replay cursor, value_norm's moments and filter_solved's pool."""
    prompts = parts.prompts
    return {
        "kl_coef": parts.kl_ctl.value,
        "init_dir": str(Path(parts.cfg.init_dir)),
        "prompt_indices": prompts.log,
        "replay": parts.replay_loader.state() if parts.replay_loader else None,
        "value_norm": parts.value_norm.state() if parts.value_norm else None,
        "filter": {"solved": prompts.solved, "pool": prompts.pool, "pool_start": prompts.pool_start},
        "guard": parts.guard.state() if parts.guard else None,
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


def summary(state: LoopState, guard: RewardGuard | None = None, verifier: Verifier | None = None) -> dict[str, float]:
    """The final ``summary`` of ``meta.json``: steps, time and throughput, first and final pass@k, the
    reward-hacking guard's trips and its first and last windows (the report card shows them), and the
    user's verifier's calls and failures (this rank's)."""
    gen_seconds = state.total("gen_seconds")
    return {
        **(guard.summary() if guard else {}),
        **(verifier.summary() if verifier else {}),
        "steps": state.step,
        "gen_seconds": gen_seconds,
        "train_seconds": state.total("train_seconds") - gen_seconds,
        "rollout_tokens_per_s": state.total("gen_tokens") / max(state.total("role_gen_seconds") or gen_seconds, 1e-9),
        **{f"first_{k}": v for k, v in state.first_evals.items()},
        **{f"final_{k}": v for k, v in state.evals.items()},
    }


def train(cfg: RLSettings, rt: runtime.Runtime) -> None:
    work, init_dir = WORK / "rl", Path(cfg.init_dir)
    if cfg.prompts_per_step % rt.world_size:
        raise ValueError(
            f"rl.prompts_per_step = {cfg.prompts_per_step} must be a multiple of the {rt.world_size} ranks"
        )
    check_minibatches(cfg, rt.world_size)

    # --- models: policy from the init stage, a frozen reference copy, a critic for PPO; their optimizers
    tok = Tokenizer.load(ARTIFACTS / "tokenizer")
    models = load_models(cfg, rt)
    kl_ctl = losses.KLController(
        cfg.kl_coef, adaptive=cfg.kl_ctl == "adaptive", target=cfg.kl_target, horizon=cfg.kl_horizon
    )
    ppo_config = PPOConfig.from_settings(cfg)

    # --- data: RL prompts, and the chat-stage rows replayed with every optimizer step
    train_problems, eval_problems = load_rl_problems(cfg, rt, verifier := user_verifier(cfg))
    replay_seq_len, replay_pack = replay_rows(cfg, tok, models.policy)

    # --- resume from the newest checkpoint made with the same settings and init model
    inputs = {
        "init": sha256_file(init_dir / "model.pt"),
        "tokenizer": sha256_file(ARTIFACTS / "tokenizer" / "tokenizer.json"),
        **role_inputs(cfg),
    }
    run_fp, meta = resume_or_fresh(work, cfg, inputs, model=models.state, optimizers=models.optimizers, rt=rt)
    meta = loop_meta(meta)
    state = LoopState.resumed(meta, cfg.max_steps)
    value_norm = losses.ValueNorm(cfg.value_norm_beta) if cfg.value_norm and models.critic else None
    if meta:
        kl_ctl.value = meta["kl_coef"]
        if value_norm is not None:
            value_norm.load(meta["value_norm"])
    replay_loader = resumed_replay(cfg, tok, replay_seq_len, replay_pack, meta, rt)
    train_policy = distributed(models.policy, rt)
    train_critic = distributed(models.critic, rt) if models.critic else None
    problems = (train_problems, eval_problems)
    engine = Engine(models.policy, tok)
    parts = Parts(cfg, rt, models, engine, *problems, kl_ctl, ppo_config, replay_loader, train_policy, train_critic)
    parts.rollout_dtype = rollout_dtype(cfg, rt)
    parts.value_norm, parts.prompts, parts.guard = value_norm, Prompts.resumed(meta), reward_guard(cfg, meta)
    loop = Loop(
        "rl",
        cfg,
        rt,
        work,
        models.state,
        models.optimizers,
        step=functools.partial(rl_step, parts),
        schedule=lambda step: (1.0 - step / cfg.max_steps, None),  # the RL LRs decay linearly to 0
        hooks=[Every(lambda step: pass_at_k(parts), cfg.eval_every, at_start=True)],
        identity=run_meta("rl", run_fp, cfg, inputs, rt, models.policy.config),
        stage_state=functools.partial(rl_state, parts),
        headline="reward/mean",
    )

    # --- loop
    params = {
        "rl": snapshot(cfg),
        "model_config": models.policy.config.to_dict(),
        "world_size": rt.world_size,
        "init_lrs": models.init_lrs,
    }
    with tracked_run("rl", params, rt) as run, rollout_exchange(parts, state.step):
        metrics = Curves(run, "rl", ["reward/mean", "response/length", "kl/mean", "eval/pass_at_1"], enabled=rt.is_main)
        run_loop(loop, state, run, metrics)
        # --- save the final policy for eval and chat
        out_dir = ARTIFACTS / "rl"
        finish_stage(
            out_dir,
            models.policy,
            loop.meta(state),
            summary(state, parts.guard, verifier),
            step=state.step,
            run=run,
            metrics=metrics,
            rt=rt,
        )
    runtime.barrier()


# --------------------------------------------------------------------------- asynchronous RL's two roles


LAUNCH_DIR = re.compile(r"[0-9a-f]{12}|default")  # the names exchange_dir gives a launch's dir


def exchange_dir(cfg: RLSettings) -> Path:
    """The roles' shared dir: ``exchange_dir``, else shared memory on this host; one dir per launch
    (``CHATPIPE_RL_EXCHANGE_ID``, set by chatpipe.launch for both roles), under one per project."""
    project = hashlib.sha256(str(Path.cwd().resolve()).encode()).hexdigest()[:12]
    shm = Path("/dev/shm")
    if cfg.exchange_dir:
        base = Path(cfg.exchange_dir)
    elif shm.is_dir():
        base = shm / f"chatpipe-rl-{project}"
    else:  # no shared memory (macOS): the run's checkpoints dir
        base = WORK / "rl" / "exchange"
    return base / os.environ.get(RL_EXCHANGE_ENV, "default")


@contextlib.contextmanager
def rollout_exchange(parts: Parts, step: int) -> Iterator[None]:
    """With ``rollout_role``: open the roles' shared dir for a run starting at ``step`` (the policy's
    weights published as version ``step``) and tell the rollout role to stop when the run ends, however
    it ends. The dirs of earlier launches in this project go: only one RL run uses a project's
    checkpoints at a time."""
    cfg, rt = parts.cfg, parts.rt
    if not cfg.rollout_role:
        yield
        return
    if rt.world_size > 1:
        raise ValueError(f"rl.rollout_role samples for one trainer process; this run has {rt.world_size} ranks")
    root = exchange_dir(cfg)
    clear_earlier_launches(root)
    parts.exchange = Exchange(root, cfg.heartbeat_timeout_s)
    parts.exchange.start(step, parts.models.policy.state_dict())
    log.info("rollout role: exchange %s, max_staleness %d", root, cfg.max_staleness)
    try:
        with parts.exchange.heartbeat("trainer"):
            yield
    finally:
        parts.exchange.stop()


def clear_earlier_launches(root: Path) -> None:
    """Remove the dirs earlier launches left beside ``root`` (a killed trainer cannot): only names
    :func:`exchange_dir` gives, so nothing else in a user's ``exchange_dir`` is touched."""
    for old in root.parent.glob("*") if root.parent.is_dir() else []:
        if old != root and old.is_dir() and LAUNCH_DIR.fullmatch(old.name):
            shutil.rmtree(old, ignore_errors=True)


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

    ex = Exchange(exchange_dir(cfg), cfg.heartbeat_timeout_s)
    log.info("rollout role: waiting for the trainer at %s", ex.root)
    with ex.heartbeat("rollout"):
        written = run_rollout_role(
            ex,
            policy,
            sample_step,
            max_steps=cfg.max_steps,
            max_staleness=cfg.max_staleness,
            timeout_s=cfg.rollout_timeout_s,
        )
    log.info("rollout role: done, %d batches", written)


def take_rollouts(parts: Parts, step: int, idx: list[int]) -> tuple[Rollouts, dict[str, float]]:
    """Step ``step``'s batch from the rollout role, checked against the trainer's own prompt picks and
    the staleness bound; its stats: staleness, the role's sampling and idle seconds, tokens/s."""
    cfg = parts.cfg
    t0 = time.perf_counter()
    ex = parts.exchange
    payload = ex.take_rollouts(step, cfg.rollout_timeout_s, alive=lambda: ex.check_alive("rollout") or True)
    waited = time.perf_counter() - t0
    staleness = step - int(payload["version"])
    if payload["idx"] != idx or not 0 <= staleness <= cfg.max_staleness:
        raise RuntimeError(
            f"rollout role's batch for step {step} does not fit: prompts {payload['idx']} (want {idx}), "
            f"sampled by version {payload['version']} (max_staleness {cfg.max_staleness})"
        )
    batch = Rollouts.from_dict(payload)
    if step == cfg.max_steps - 1 and os.environ.get(RL_THREADS_AFTER_ENV):  # the role has no more to sample:
        runtime.use_threads(int(os.environ[RL_THREADS_AFTER_ENV]), "the rollout role's cores, after its last step")
    if staleness == 0:  # sampled by the weights this step updates: the behaviour policy is the proximal one
        batch = dataclasses.replace(batch, behav_logp=None)
    parts.engine.tool_stats = dict(payload["tools"])  # the role's running totals
    gen, idle = float(payload["gen_seconds"]), float(payload["idle_seconds"])
    stats = {
        "async/staleness": float(staleness),
        "async/trainer_wait_seconds": waited,
        "async/rollout_gen_seconds": gen,
        "async/rollout_idle": idle / max(idle + gen, 1e-9),
        "rollout/tokens_per_s": batch.num_tokens / max(gen, 1e-9),
    }
    return batch, stats


def reward_guard(cfg: RLSettings, meta: dict) -> RewardGuard | None:
    """The reward-hacking guard of a run trained on the reward model's scores (None otherwise, or
    with ``guard: off``), its windows where the checkpoint ``meta`` left them."""
    if cfg.reward_source == "verifier" or cfg.guard == "off":
        return None
    guard = RewardGuard(cfg.guard_every, cfg.guard_drop, cfg.guard, cfg.guard_min_accuracy)
    if meta.get("guard"):
        guard.load(meta["guard"])
    return guard


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


def load_models(cfg: RLSettings, rt: runtime.Runtime) -> Models:
    """The init model as policy; the reference (``ref_dir``, else a frozen copy of the policy); PPO's
    critic (:func:`load_critic`); the reward model for ``reward_source`` model|both; optimizers whose
    LRs are fractions of the init model's (decayed linearly to 0 by the loop)."""
    policy, init_meta = load_model(Path(cfg.init_dir), rt.device)
    policy.train()
    ref = load_role(cfg.ref_dir, "ref_dir", policy, rt) if cfg.ref_dir else copy.deepcopy(policy)
    ref.requires_grad_(False).eval()
    rm = None
    if cfg.reward_source != "verifier":
        rm = load_scorer(cfg, "reward_model_dir", cfg.reward_model_dir, policy, rt)
    ensemble = [
        load_scorer(cfg, f"reward_model_ensemble[{i}]", d, policy, rt) for i, d in enumerate(cfg.reward_model_ensemble)
    ]
    critic = load_critic(cfg, policy, rm, rt) if cfg.algorithm == "ppo" and not cfg.disable_value else None
    state = torch.nn.ModuleDict({"policy": policy, "ref": ref, **({"critic": critic} if critic else {})})
    lrs = init_lrs(init_meta)
    embedding_frac = cfg.lr_frac if cfg.embedding_lr_frac is None else cfg.embedding_lr_frac
    policy_frac = {"matrix_lr": cfg.lr_frac, "embedding_lr": embedding_frac, "unembedding_lr": embedding_frac}
    policy_opts = build_optimizers(
        policy, **{k: v * policy_frac[k] for k, v in lrs.items()}, weight_decay=cfg.weight_decay
    )
    critic_opts = (
        build_optimizers(critic, **{k: v * cfg.value_lr_frac for k, v in lrs.items()}, weight_decay=cfg.weight_decay)
        if critic
        else []
    )
    rm_opts = reward_model_optimizers(cfg, rm, lrs)
    if rm_opts:  # the reward model changes as RL goes: checkpoints hold it
        state["reward_model"] = rm
    return Models(policy, ref, critic, state, lrs, policy_opts, critic_opts, rm, rm_opts, ensemble)


def load_scorer(cfg: RLSettings, key: str, model_dir: str, policy: GPT, rt: runtime.Runtime) -> RewardModel:
    """A frozen reward model from ``model_dir`` (setting ``rl.<key>``), refused unless it reads what the
    policy writes (:func:`check_reward_model`, :func:`check_same_shape`)."""
    rm, rm_meta = load_reward_model(Path(model_dir), rt.device)
    check_reward_model(cfg, rm_meta, policy, f"rl.{key} = {model_dir}")
    check_same_shape(rm.trunk, policy, f"rl.{key} = {model_dir}")
    return rm.requires_grad_(False)


def reward_model_optimizers(cfg: RLSettings, rm: RewardModel | None, lrs: dict[str, float]) -> list:
    """Iterated RLHF (``reward_model_lr_frac`` > 0): the reward model's optimizers at that fraction of
    the init model's LRs ``lrs``, decayed with the policy's by the loop; none when it stays frozen."""
    if rm is None or cfg.reward_model_lr_frac <= 0:
        return []
    rm.requires_grad_(True)
    rm.trunk.lm_head.requires_grad_(False)  # unused by a reward model
    frac = cfg.reward_model_lr_frac
    return build_optimizers(rm, **{k: v * frac for k, v in lrs.items()}, weight_decay=cfg.weight_decay)


def critic_source(cfg: RLSettings) -> str:
    """The dir PPO's critic starts from: ``critic_init_dir``, else the reward model when it scores
    (torchtune's PPO starts its value model from the reward model), else the init model."""
    if cfg.critic_init_dir:
        return cfg.critic_init_dir
    return cfg.reward_model_dir if cfg.reward_source != "verifier" else cfg.init_dir


def load_critic(cfg: RLSettings, policy: GPT, rm: RewardModel | None, rt: runtime.Runtime) -> ValueModel:
    """PPO's critic from :func:`critic_source`: a reward model dir gives trunk and head, a GPT dir the
    trunk with a zero head (the init model's: today's critic)."""
    source = critic_source(cfg)
    if source == cfg.init_dir and not cfg.critic_init_dir:
        return ValueModel.from_policy(policy)
    if rm is not None and source == cfg.reward_model_dir:
        return ValueModel.from_reward_model(rm)
    if is_reward_model_dir(source):
        other, _ = load_reward_model(Path(source), rt.device)
        check_same_shape(other.trunk, policy, f"rl.critic_init_dir = {source}")
        return ValueModel.from_reward_model(other)
    return ValueModel.from_policy(load_role(source, "critic_init_dir", policy, rt))


def load_role(model_dir: str, key: str, policy: GPT, rt: runtime.Runtime) -> GPT:
    """The GPT in ``model_dir`` (a role's own checkpoint), checked to match the policy's shape."""
    model, _ = load_model(Path(model_dir), rt.device)
    check_same_shape(model, policy, f"rl.{key} = {model_dir}")
    return model


def check_reward_model(cfg: RLSettings, rm_meta: dict, policy: GPT, where: str) -> None:
    """A reward model must read what the policy writes: the tokenizer it was trained with is the
    policy's (by hash), and the conversations it was trained on were as long as the policy's context.
    ``where`` names the setting in errors (``rl.reward_model_dir = ...``)."""
    tok_file = ARTIFACTS / "tokenizer" / "tokenizer.json"
    ours, theirs = sha256_file(tok_file), rm_meta.get("inputs", {}).get("tokenizer")
    if theirs is not None and theirs != ours:
        raise ValueError(
            f"{where}: the reward model was trained with another tokenizer (sha256 {theirs[:12]}...) than the "
            f"policy's {tok_file} (sha256 {ours[:12]}...); retrain it on this tokenizer (dvc repro reward_model)"
        )
    trained = rm_meta.get("settings", {}).get("max_seq_len", rm_meta["model_config"]["sequence_len"])
    context = min(trained, rm_meta["model_config"]["sequence_len"])
    if context < policy.config.sequence_len:
        raise ValueError(
            f"{where}: the reward model's context is {context} tokens (reward_model.max_seq_len) but the "
            f"policy's (rl.init_dir = {cfg.init_dir}) is {policy.config.sequence_len}: it would score rollouts "
            "longer than any it was trained on; retrain it with max_seq_len "
            f"= {policy.config.sequence_len}"
        )


def check_same_shape(model: GPT, policy: GPT, what: str) -> None:
    """A role model must read the policy's tokens: the same vocabulary and sequence length."""
    a, b = model.config, policy.config
    if (a.vocab_size, a.sequence_len) != (b.vocab_size, b.sequence_len):
        raise ValueError(
            f"{what}: vocab_size {a.vocab_size} / sequence_len {a.sequence_len} differ from the policy's "
            f"{b.vocab_size} / {b.sequence_len} (rl.init_dir); every role must share the policy's tokenizer and context"
        )


def role_inputs(cfg: RLSettings) -> dict[str, str]:
    """Hashes of the role models other than the policy, so a resume never mixes checkpoints of others."""
    dirs = {"ref": cfg.ref_dir, "critic_init": cfg.critic_init_dir if cfg.algorithm == "ppo" else ""}
    if cfg.reward_source != "verifier":
        dirs["reward_model"] = cfg.reward_model_dir
        dirs |= {f"reward_model_ensemble_{i}": d for i, d in enumerate(cfg.reward_model_ensemble)}
    hashes = {k: sha256_file(Path(d) / "model.pt") for k, d in dirs.items() if d}
    if cfg.reward == "custom":  # an edited verifier starts afresh, never from a checkpoint the old one scored
        hashes["verifier"] = sha256_file(Path(cfg.verifier_file))
    return hashes


def score_rollouts(parts: Parts, batch: Rollouts) -> tuple[Rollouts, dict[str, float]]:
    """``batch`` with the scores ``reward_source`` trains on (the verifier's stay in the stats), and
    the mean verifier and (normalised) reward-model scores of this rank's rows; the guard counts them."""
    cfg, rm = parts.cfg, parts.models.reward_model
    if rm is None:
        return batch, {}
    scorers = [rm, *parts.models.ensemble]
    with parts.rt.autocast(), torch.no_grad():
        each = [rollout_scores(m, batch.inputs, batch.targets, batch.mask, cfg.device_batch_size) for m in scorers]
    stds = [m.score_std for m in scorers]
    normalized = ensemble_rewards(each, stds, batch.groups, win_rate=False)
    if parts.guard is not None:
        parts.guard.add(normalized, batch.scores, batch.groups)
    stats = {"reward/verifier_mean": batch.scores.mean().item(), "reward/model_mean": normalized.mean().item()}
    if parts.models.reward_model_opts:  # the step's rewards are already read: the model learns from its replies
        stats |= refresh_reward_model(parts, batch)
    # win rates from the scores read above; the guard above still reads the normalised scores
    model = ensemble_rewards(each, stds, batch.groups) if cfg.reward_model_scores == "win_rate" else normalized
    return dataclasses.replace(batch, scores=combine_rewards(cfg.reward_source, batch.scores, model)), stats


def refresh_reward_model(parts: Parts, batch: Rollouts) -> dict[str, float]:
    """Iterated RLHF: one optimizer step of the reward model on this step's replies, paired by the
    verifier's scores (a right and a wrong reply to one prompt), gradients averaged over ranks. The
    policy never sees the verifier: it trains on the model's scores alone, and the model keeps up
    with what the policy now writes instead of being exploited where it was never trained."""
    rm, rt = parts.models.reward_model, parts.rt
    ids, last = rollout_rows(batch.inputs, batch.targets, batch.mask)
    with rt.autocast():  # batch.scores are still the verifier's here
        loss, stats = refresh_loss(rm, ids, last, batch.scores, batch.groups)
    loss.backward()
    for p in rm.parameters():
        if p.grad is not None and rt.world_size > 1:
            runtime.all_reduce_sum(p.grad).div_(rt.world_size)
    step_optimizers(rm, parts.models.reward_model_opts, parts.cfg.grad_clip)
    return stats


def load_rl_problems(
    cfg: RLSettings, rt: runtime.Runtime, verifier: Verifier | None = None
) -> tuple[list[Problem], list[Problem]]:
    """(train, held-out) problems: every rank samples its own train prompts from the whole pool and
    evaluates its share of the held-out ones; ``verifier`` (:func:`user_verifier`) scores them all."""
    task_kw = {"verifier": verifier, "path": cfg.task_path or None}
    train_problems = load_problems(
        cfg.task, "train", cfg.num_train_problems, cfg.seed, cfg.reward, cfg.task_source, **task_kw
    )
    for keep in cfg.keep_tasks:  # skills RL must not wear away: their prompts join the training pool
        n = keep.limit or cfg.num_train_problems
        train_problems += load_problems(
            keep.task, "train", n, cfg.seed, source=keep.source or "", words=keep.words, path=keep.path
        )
    eval_problems = load_problems(
        cfg.task, cfg.eval_split, cfg.eval_problems, cfg.seed, cfg.reward, cfg.task_source, **task_kw
    )
    return train_problems, eval_problems[rt.rank :: rt.world_size]


def user_verifier(cfg: RLSettings) -> Verifier | None:
    """``reward: custom``: the user's own verifier (docs/own-data.md), loaded and checked before training."""
    if cfg.reward != "custom":
        return None
    return Verifier(
        cfg.verifier_file, cfg.verifier_function, sandbox=cfg.verifier_sandbox, timeout_s=cfg.verifier_timeout_s
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


def rl_step(parts: Parts, step: int) -> StepOut:
    """One rollout-and-update step (its LR already set by the loop): sample and score this rank's
    prompts, update on them; returns the policy's gradient norm and, as the stage's own metrics for the
    loop's step row, the rollouts' means over every rank and the update's stats."""
    t0 = time.perf_counter()
    batch, reward_stats = sample_rollouts(parts, step)
    t_gen = time.perf_counter() - t0
    t1 = time.perf_counter()
    stats = update(parts, batch, step)
    if parts.exchange is not None:  # the rollout role may sample the next steps with these weights
        parts.exchange.publish(step + 1, parts.models.policy.state_dict())
    t_train = time.perf_counter() - t1
    totals = RolloutTotals.of(batch, kl_sum=stats.pop("kl_sum", 0.0)).summed_over_ranks(parts.rt.device)
    grad_norm = stats.pop("train/grad_norm", None)  # the loop's step_row logs it; absent: no optimizer step
    row = {
        **totals.means(),
        "rollout/tokens_per_s": totals.tokens / max(t_gen, 1e-9),  # ranks sample in parallel
        "time/gen_share": t_gen / (t_gen + t_train),
        "kl/coef": parts.kl_ctl.value,
        **{f"tools/{k}": float(v) for k, v in parts.engine.tool_stats.items()},  # running totals, this rank
        **stats,
        **reward_stats,
        **(parts.guard.close_if_due(step + 1, functools.partial(sum_over_ranks, parts.rt)) if parts.guard else {}),
    }
    # "gen_tokens", not "tokens": the loop's tokens_per_s and MFU are for trained tokens
    if parts.exchange is not None:  # the trainer's gen time is its wait; the role's own time samples
        row["async/trainer_idle"] = row["async/trainer_wait_seconds"] / (t_gen + t_train)
    role_gen = {"role_gen_seconds": row["async/rollout_gen_seconds"]} if parts.exchange is not None else {}
    return StepOut(grad_norm, metrics=row, totals={"gen_seconds": t_gen, "gen_tokens": int(totals.tokens), **role_gen})


def check_minibatches(cfg: RLSettings, world_size: int) -> None:
    """Each rank's rows per step must split into PPO's minibatches: checked before any rollout."""
    rows = cfg.prompts_per_step // world_size * cfg.group_size
    if cfg.algorithm == "ppo" and rows % cfg.num_minibatches:
        raise ValueError(
            f"rl: {cfg.prompts_per_step} prompts_per_step / {world_size} ranks x group_size {cfg.group_size} = "
            f"{rows} rows per rank per step do not split into num_minibatches = {cfg.num_minibatches}"
        )


def sample_rollouts(parts: Parts, step: int) -> tuple[Rollouts, dict[str, float]]:
    """This rank's prompts x ``group_size`` responses for step ``step`` (:func:`sample_batch`, or with
    ``rollout_role`` the role's batch: :func:`take_rollouts`), scored by :func:`score_rollouts`; every
    rank records who sampled what in ``parts.prompts.log`` (tests check no overlap). With
    ``generation_size`` and a learned reward, the ``group_size`` best by that reward are kept here;
    filter_solved counts a response solved by the verifier's verdict, or with ``reward_source: model``
    by its reward-model score reaching ``solved_score``."""
    cfg, rt, prompts = parts.cfg, parts.rt, parts.prompts
    idx = step_indices(cfg, prompts, len(parts.train_problems), step, rt.rank, rt.world_size)
    prompts.log.append(gather(idx, rt))
    if parts.exchange is not None:
        batch, async_stats = take_rollouts(parts, step, idx)
    else:
        parts.models.policy.eval()
        problems = [parts.train_problems[i] for i in idx]
        batch = sample_batch(cfg, parts.engine, problems, step, rt.rank, rt.world_size, parts.rollout_dtype)
        parts.models.policy.train()
        async_stats = {}
    batch, reward_stats = score_rollouts(parts, batch)
    if cfg.generation_size > cfg.group_size and cfg.reward_source != "verifier":
        batch = keep_best(batch, cfg.group_size)
    if cfg.filter_solved > 0:
        solved_rows = batch.scores >= cfg.solved_score if cfg.reward_source == "model" else batch.correct
        rates = losses.group_solve_rates(solved_rows, batch.groups)
        solved = [idx[g] for g, rate in rates.items() if rate >= cfg.filter_solved]
        prompts.solved = sorted(set(prompts.solved).union(*gather(solved, rt)))
    return batch, reward_stats | async_stats


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


def rollout_dtype(cfg: RLSettings, rt: runtime.Runtime) -> torch.dtype:
    """``rl.rollout_dtype``, logged; ``auto`` is the dtype the trainer trains in, in the rollout role too
    (whose own runtime, not a training one, computes in float32 on CPU). Each role resolves it once."""
    dtype = runtime.compute_dtype(
        cfg.dtype if cfg.rollout_dtype == "auto" else cfg.rollout_dtype, rt.device.type == "cuda", training=True
    )
    log.info("rollouts: linear layers in %s (rl.rollout_dtype: %s)", dtype, cfg.rollout_dtype)
    return dtype


def sample_batch(
    cfg: RLSettings,
    engine: Engine,
    problems: list[Problem],
    step: int,
    rank: int,
    world_size: int,
    matmul_dtype: torch.dtype | None = None,
) -> Rollouts:
    """``problems`` x ``group_size`` responses, seeded by (seed, step, rank), the linear layers in
    ``matmul_dtype`` (:func:`rollout_dtype`). The verifier ranks best-of-n inside collect_rollouts; a
    learned reward ranks after scoring (all ``generation_size`` samples come back). The rollout role
    keeps each token's sampling log-prob, for the decoupled loss."""
    per_rank = cfg.prompts_per_step // world_size
    model_ranked = cfg.generation_size > cfg.group_size and cfg.reward_source != "verifier"
    return collect_rollouts(
        engine,
        problems,
        group_size=cfg.generation_size if model_ranked else cfg.group_size,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_k=cfg.top_k or None,
        device=next(engine.model.parameters()).device,
        seed=((cfg.seed * 1_000_003 + step) * world_size + rank) * per_rank,
        generation_size=0 if model_ranked else cfg.generation_size,
        behaviour_logprobs=cfg.rollout_role,
        matmul_dtype=matmul_dtype,
    )


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


def update(parts: Parts, batch: Rollouts, step: int) -> dict[str, float]:
    """One GRPO-lite or PPO update on ``batch`` with shaped scores (PPO then moves the reference
    towards the policy by ``ref_ema``); returns the update's stats."""
    cfg, models = parts.cfg, parts.models
    scores = losses.final_scores(batch.scores, batch.ended, batch.lengths, cfg)
    if cfg.mask_too_long:
        batch = batch.without_unfinished()
    replay = (lambda model: cfg.replay_coef * model(*parts.replay_loader.next_batch())) if parts.replay_loader else None
    if cfg.algorithm == "grpo":
        return grpo_update(
            parts.train_policy,
            models.policy_opts,
            batch,
            scores,
            group_size=cfg.group_size,
            normalize_std=cfg.normalize_std,
            micro_batch=cfg.device_batch_size,
            autocast=parts.rt.autocast,
            replay=replay,
            temperature=cfg.temperature,
            grad_clip=cfg.grad_clip,
            ref=models.ref,
            kl_loss_coef=cfg.kl_loss_coef,
            behav_weight_cap=cfg.behav_weight_cap,
        )
    stats = ppo_update(
        parts.train_policy,
        models.ref,
        parts.train_critic,
        models.policy_opts,
        models.critic_opts,
        batch,
        scores,
        parts.kl_ctl,
        parts.ppo_config,
        step=step,
        autocast=parts.rt.autocast,
        replay=replay,
        value_norm=parts.value_norm,
        behav_weight_cap=cfg.behav_weight_cap,
    )
    losses.ema_update(models.ref, models.policy, cfg.ref_ema)
    return stats


def pass_at_k(parts: Parts) -> dict[str, float]:
    """Held-out pass@1 and pass@eval_samples over every rank's share of the eval problems."""
    cfg, rt, policy = parts.cfg, parts.rt, parts.models.policy
    policy.eval()
    correct = evaluate_problems(
        parts.engine,
        parts.eval_problems,
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
    return {f"eval/pass_at_{k}": (sums[i + 1] / sums[0].clamp(min=1)).item() for i, k in enumerate(ks)}


def distributed(module: torch.nn.Module, rt: runtime.Runtime) -> torch.nn.Module:
    """``module`` wrapped in DDP when there are several ranks (gradients averaged in backward)."""
    return DDP(module) if rt.world_size > 1 else module


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


if __name__ == "__main__":
    main()
