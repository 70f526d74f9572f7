"""RL's model roles, loaded before the loop: the policy, its frozen reference, PPO's critic and the
reward model(s), with their optimizers.

    models = load_models(cfg, rt)      # cfg: the `rl` section's settings
    models.policy, models.ref, models.critic, models.reward_model, models.optimizers

Every role reads the policy's tokens, so each one is checked against the policy (vocabulary,
context, the tokenizer a reward model was trained with) before any rollout. Unit tests:
tests/test_reward_model.py.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from chatpipe import runtime
from chatpipe.io import sha256_file
from chatpipe.model.files import load_model
from chatpipe.model.gpt import GPT
from chatpipe.paths import ARTIFACTS
from chatpipe.rl.problems import eval_identity
from chatpipe.rl.reward_model import RewardModel, is_reward_model_dir, load_reward_model
from chatpipe.rl.scoring import verifier_in_reward
from chatpipe.rl.update import uses_critic, uses_critic_init
from chatpipe.rl.value import ValueModel
from chatpipe.train.optim import build_optimizers, init_lrs

if TYPE_CHECKING:
    from chatpipe.settings import RLSettings

log = logging.getLogger("rl")


@dataclass
class Models:
    """The policy RL trains, its frozen reference, PPO's critic (None otherwise), their optimizers and
    the reward model that scores responses under ``reward.source`` model|both (None otherwise): frozen,
    or with ``reward.model_lr_frac`` trained on as it goes (its optimizers then join the checkpoints)."""

    policy: GPT
    ref: GPT
    critic: ValueModel | None
    state: torch.nn.ModuleDict  # what a checkpoint holds: policy, ref and critic
    init_lrs: dict[str, float]  # the init model's LRs, which the RL LRs are fractions of
    policy_opts: list
    critic_opts: list
    reward_model: RewardModel | None = None
    reward_model_opts: list = field(default_factory=list)  # reward.model_lr_frac > 0: iterated RLHF
    ensemble: list[RewardModel] = field(default_factory=list)  # reward.model_ensemble: frozen, scored beside it

    @property
    def optimizers(self) -> list:
        return self.policy_opts + self.critic_opts + self.reward_model_opts


def load_models(cfg: RLSettings, rt: runtime.Runtime) -> Models:
    """The init model as policy; the reference (``ref_dir``, else a frozen copy of the policy); PPO's
    critic (:func:`load_critic`); the reward model for ``reward.source`` model|both; optimizers whose
    LRs are fractions of the init model's (decayed linearly to 0 by the loop)."""
    policy, init_meta = load_model(Path(cfg.init_dir), rt.device)
    policy.train()
    ref = load_role(cfg.ref_dir, "ref_dir", policy, rt) if cfg.ref_dir else copy.deepcopy(policy)
    ref.requires_grad_(False).eval()
    rm = load_scorer(cfg, "reward.model_dir", cfg.reward.model_dir, policy, rt) if reads_model(cfg) else None
    ensemble = [
        load_scorer(cfg, f"reward.model_ensemble[{i}]", d, policy, rt) for i, d in enumerate(cfg.reward.model_ensemble)
    ]
    critic = load_critic(cfg, policy, rm, rt) if uses_critic(cfg) else None
    state = torch.nn.ModuleDict({"policy": policy, "ref": ref, **({"critic": critic} if critic else {})})
    lrs = init_lrs(init_meta)
    policy_opts, critic_opts = role_optimizers(cfg, policy, critic, lrs)
    rm_opts = reward_model_optimizers(cfg, rm, lrs)
    if rm_opts:  # the reward model changes as RL goes: checkpoints hold it
        state["reward_model"] = rm
    return Models(policy, ref, critic, state, lrs, policy_opts, critic_opts, rm, rm_opts, ensemble)


def reads_model(cfg: RLSettings) -> bool:
    """Whether a reward model scores the rollouts (``reward.source`` model|both)."""
    return cfg.reward.source != "verifier"


def role_optimizers(cfg: RLSettings, policy: GPT, critic: ValueModel | None, lrs: dict[str, float]) -> tuple:
    """(policy's, critic's) optimizers at fractions of the init model's LRs ``lrs``. The embedding and
    lm_head get ``embedding_lr_frac`` (None: ``lr_frac``): Adam moves every row RL touches by about its
    LR whatever the gradient, so a smaller fraction keeps the words other skills share."""
    embedding_frac = cfg.lr_frac if cfg.embedding_lr_frac is None else cfg.embedding_lr_frac
    policy_frac = {"matrix_lr": cfg.lr_frac, "embedding_lr": embedding_frac, "unembedding_lr": embedding_frac}
    policy_opts = build_optimizers(
        policy, **{k: v * policy_frac[k] for k, v in lrs.items()}, weight_decay=cfg.weight_decay
    )
    if critic is None:
        return policy_opts, []
    critic_lrs = {k: v * cfg.ppo.value_lr_frac for k, v in lrs.items()}
    return policy_opts, build_optimizers(critic, **critic_lrs, weight_decay=cfg.weight_decay)


def load_scorer(cfg: RLSettings, key: str, model_dir: str, policy: GPT, rt: runtime.Runtime) -> RewardModel:
    """A frozen reward model from ``model_dir`` (setting ``rl.<key>``), refused unless it reads what the
    policy writes (:func:`check_reward_model`, :func:`check_same_shape`)."""
    rm, rm_meta = load_reward_model(Path(model_dir), rt.device)
    check_reward_model(cfg, rm_meta, policy, f"rl.{key} = {model_dir}")
    check_same_shape(rm.trunk, policy, f"rl.{key} = {model_dir}")
    return rm.requires_grad_(False)


def reward_model_optimizers(cfg: RLSettings, rm: RewardModel | None, lrs: dict[str, float]) -> list:
    """Iterated RLHF (``reward.model_lr_frac`` > 0): the reward model's optimizers at that fraction of
    the init model's LRs ``lrs``, decayed with the policy's by the loop; none when it stays frozen."""
    if rm is None or cfg.reward.model_lr_frac <= 0:
        return []
    log.warning("iterated RLHF uses the verifier: %s", verifier_in_reward(cfg))
    rm.requires_grad_(True)
    rm.trunk.lm_head.requires_grad_(False)  # unused by a reward model
    frac = cfg.reward.model_lr_frac
    return build_optimizers(rm, **{k: v * frac for k, v in lrs.items()}, weight_decay=cfg.weight_decay)


def critic_source(cfg: RLSettings) -> str:
    """The dir PPO's critic starts from: ``ppo.critic_init_dir``, else the reward model when it scores
    (torchtune's PPO starts its value model from the reward model), else the init model."""
    if cfg.ppo.critic_init_dir:
        return cfg.ppo.critic_init_dir
    return cfg.reward.model_dir if reads_model(cfg) else cfg.init_dir


def load_critic(cfg: RLSettings, policy: GPT, rm: RewardModel | None, rt: runtime.Runtime) -> ValueModel:
    """PPO's critic from :func:`critic_source`: a reward model dir gives trunk and head, a GPT dir the
    trunk with a zero head (the init model's: today's critic)."""
    source = critic_source(cfg)
    if source == cfg.init_dir and not cfg.ppo.critic_init_dir:
        return ValueModel.from_policy(policy)
    if rm is not None and source == cfg.reward.model_dir:
        return ValueModel.from_reward_model(rm)
    if is_reward_model_dir(source):
        other, _ = load_reward_model(Path(source), rt.device)
        check_same_shape(other.trunk, policy, f"rl.ppo.critic_init_dir = {source}")
        return ValueModel.from_reward_model(other)
    return ValueModel.from_policy(load_role(source, "ppo.critic_init_dir", policy, rt))


def load_role(model_dir: str, key: str, policy: GPT, rt: runtime.Runtime) -> GPT:
    """The GPT in ``model_dir`` (a role's own checkpoint), checked to match the policy's shape."""
    model, _ = load_model(Path(model_dir), rt.device)
    check_same_shape(model, policy, f"rl.{key} = {model_dir}")
    return model


def check_reward_model(cfg: RLSettings, rm_meta: dict, policy: GPT, where: str) -> None:
    """A reward model must read what the policy writes: the tokenizer it was trained with is the
    policy's (by hash), and the conversations it was trained on were as long as the policy's context.
    ``where`` names the setting in errors (``rl.reward.model_dir = ...``)."""
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


def run_inputs(cfg: RLSettings) -> dict[str, str]:
    """Hashes of what a run starts from, which a checkpoint must share to be resumed: the init model,
    the tokenizer, the other role models, and the evals (so a run's first and final pass@k are always
    measured alike)."""
    return {
        "init": sha256_file(Path(cfg.init_dir) / "model.pt"),
        "tokenizer": sha256_file(ARTIFACTS / "tokenizer" / "tokenizer.json"),
        **role_inputs(cfg),
        "evals": eval_identity(cfg),
    }


def role_inputs(cfg: RLSettings) -> dict[str, str]:
    """Hashes of the role models other than the policy, so a resume never mixes checkpoints of others."""
    dirs = {"ref": cfg.ref_dir, "critic_init": cfg.ppo.critic_init_dir if uses_critic_init(cfg) else ""}
    if reads_model(cfg):
        dirs["reward_model"] = cfg.reward.model_dir
        dirs |= {f"reward_model_ensemble_{i}": d for i, d in enumerate(cfg.reward.model_ensemble)}
    hashes = {k: sha256_file(Path(d) / "model.pt") for k, d in dirs.items() if d}
    if cfg.reward.verifier == "custom":  # an edited verifier starts afresh, never from a checkpoint the old one scored
        hashes["verifier"] = sha256_file(Path(cfg.reward.verifier_file))
    return hashes
