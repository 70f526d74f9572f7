"""Learned reward model: a scalar head on a GPT trunk, trained on preference pairs (Bradley-Terry).

    rm = RewardModel.from_policy(sft_model)              # copy of the trunk, zero-initialised head
    r = rm(ids, last)                                    # [B] score of each row at its index ``last``
    loss = bradley_terry_loss(r_chosen, r_rejected)      # -log sigmoid(r_chosen - r_rejected - margin)
    pair_metrics(r_chosen, r_rejected)                   # accuracy, margin mean and quantiles
    save_reward_model(out_dir, rm, meta); rm, meta = load_reward_model(out_dir)
    rm.normalized(r)                                     # (r - mean) / std of its scores, from meta.json

A response is scored at its last token, as the PPO recipes that train against a reward model do
(``pool`` "last": the hidden state there has read the prompt and the whole response), or by the
mean of the head over the response's tokens (``pool`` "mean"). The head has the same shape as the
critic's (:class:`chatpipe.rl.value.ValueModel`), so a critic can start from a reward model.

Raw scores have no fixed scale (Bradley-Terry fixes only their differences), so the stage saves
the mean and standard deviation of its scores on the init model's own samples (``score_norm`` in
``meta.json``) and RL reads normalised scores: a KL coefficient or a reward clip then means the
same whichever reward model is plugged in.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from chatpipe.model.files import read_meta, save_model_dir, verify_model_dir
from chatpipe.model.gpt import GPT, GPTConfig
from chatpipe.paths import REWARD_MODEL_NOT_READ

MODEL_KIND = "reward_model"  # meta.json "kind" of a reward model dir (a GPT dir has none)
MARGIN_QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


POOLS = ("last", "mean")


class RewardModel(nn.Module):
    """Scalar score per position from a GPT trunk. A sequence's reward is the score at its last token
    (``pool`` "last"), or the mean of the scores of its response's tokens (``pool`` "mean"): those
    after its last ``response_start`` token (``<|assistant_start|>``), up to its last token."""

    def __init__(self, trunk: GPT, pool: str = "last", response_start: int | None = None) -> None:
        super().__init__()
        if pool not in POOLS or (pool == "mean" and response_start is None):
            raise ValueError(f"pool must be one of {POOLS} ('mean' needs the response_start token id), got {pool!r}")
        self.pool, self.response_start = pool, response_start
        self.trunk = trunk
        self.trunk.lm_head.requires_grad_(False)  # unused: DDP and the optimizers skip it
        self.head = nn.Linear(trunk.config.n_embd, 1, bias=False)
        nn.init.zeros_(self.head.weight)  # every score starts at 0: the first loss is log 2
        self.score_mean, self.score_std = 0.0, 1.0  # set from meta.json's score_norm on load

    def normalized(self, scores: torch.Tensor) -> torch.Tensor:
        """Raw scores as (score - mean) / std of the stage's reference scores (``score_norm``)."""
        return (scores - self.score_mean) / self.score_std

    @classmethod
    def from_policy(cls, policy: GPT, pool: str = "last", response_start: int | None = None) -> RewardModel:
        """A reward model whose trunk starts as a copy of ``policy``'s weights."""
        trunk = copy.deepcopy(policy).requires_grad_(True)
        return cls(trunk, pool, response_start).to(next(policy.parameters()).device)

    @property
    def config(self) -> GPTConfig:
        """The trunk's GPTConfig (build_optimizers scales AdamW lrs by n_embd)."""
        return self.trunk.config

    def token_scores(self, idx: torch.Tensor) -> torch.Tensor:
        """Scores [B, T] (float32) at every position."""
        return self.head(self.trunk.hidden(idx)).squeeze(-1).float()

    def forward(self, idx: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """Scores [B] of right-padded rows ``idx`` [B, T] whose last real token is at ``last`` [B]."""
        scores = self.token_scores(idx)
        if self.pool == "last":
            return scores.gather(1, last.view(-1, 1)).squeeze(1)
        # "mean": every response token's score counts, so a mistake can be scored where it is made
        # (a calculator operand that is not in the question) instead of being carried to the end
        pos = torch.arange(idx.size(1), device=idx.device).expand_as(idx)
        upto = pos <= last.view(-1, 1)
        start = torch.where((idx == self.response_start) & upto, pos, torch.full_like(pos, -1)).amax(1)
        inside = (pos > start.view(-1, 1)) & upto
        return (scores * inside).sum(1) / inside.sum(1).clamp(min=1)

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """Trainable parameters by optimizer: Muon matrices, embedding and the head (AdamW)."""
        return {
            "matrix": [p for p in self.trunk.blocks.parameters() if p.dim() == 2],
            "embedding": [self.trunk.wte.weight],
            "lm_head": [self.head.weight],
        }


def verifier_pairs(scores: torch.Tensor, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen rows, rejected rows) [P]: every pair of replies to one prompt (rows of one ``groups`` id)
    that the verifier's ``scores`` [B] rank, the higher-scored chosen (with a 0/1 verifier: a right and
    a wrong reply)."""
    same = groups[:, None] == groups[None, :]
    pairs = (same & (scores[:, None] > scores[None, :])).nonzero()
    return pairs[:, 0], pairs[:, 1]


def refresh_loss(
    rm: RewardModel, ids: torch.Tensor, last: torch.Tensor, scores: torch.Tensor, groups: torch.Tensor,
    margin: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """Iterated RLHF: the Bradley-Terry loss of the policy's fresh replies, paired by the verifier's
    ``scores`` (:func:`verifier_pairs`), on rows ``ids`` [B, T] scored at ``last`` [B]. Returns (loss, stats:
    ``reward_model/refresh_pairs`` and ``reward_model/refresh_accuracy``, the share ranked right
    *before* this step, which the model has not trained on yet). Without pairs the loss is 0 with
    gradients still flowing (every rank of a run takes part in the gradient all-reduce)."""
    chosen, rejected = verifier_pairs(scores, groups)
    model = rm(ids, last)
    if chosen.numel() == 0:
        return model.sum() * 0.0, {"reward_model/refresh_pairs": 0.0}
    loss = bradley_terry_loss(model[chosen], model[rejected], margin)
    accuracy = (model[chosen] > model[rejected]).float().mean().item()
    return loss, {"reward_model/refresh_pairs": float(chosen.numel()), "reward_model/refresh_accuracy": accuracy}


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """Mean of -log sigmoid(r_chosen - r_rejected - margin): the negative log-likelihood that chosen
    wins by at least ``margin`` (0: plain Bradley-Terry; > 0 keeps pushing pairs already ranked right
    until their scores are ``margin`` apart)."""
    return -F.logsigmoid(chosen - rejected - margin).mean()


def score_norm(scores: torch.Tensor) -> dict[str, float]:
    """``{"mean", "std", "rows"}`` of reference scores, saved as ``score_norm`` in ``meta.json``."""
    scores = scores.double()
    std = scores.std().item() if scores.numel() > 1 else 1.0
    return {"mean": scores.mean().item(), "std": max(std, 1e-6), "rows": int(scores.numel())}


def pair_metrics(chosen: torch.Tensor, rejected: torch.Tensor) -> dict[str, float]:
    """Pair accuracy (chosen scored strictly higher), mean margin and margin quantiles (``margin/q50``...)."""
    margin = (chosen - rejected).double().cpu()
    if margin.numel() == 0:
        return {}
    out = {
        "pair_accuracy": (margin > 0).double().mean().item(),
        "margin/mean": margin.mean().item(),
        "loss": bradley_terry_loss(chosen.double().cpu(), rejected.double().cpu()).item(),
    }
    qs = torch.quantile(margin, torch.tensor(MARGIN_QUANTILES, dtype=torch.float64))
    out.update({f"margin/q{round(q * 100):02d}": v.item() for q, v in zip(MARGIN_QUANTILES, qs)})
    return out


def pad_rows(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and each row's last index [B]."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return ids, torch.tensor([len(r) - 1 for r in rows], dtype=torch.long)


def unique_rows(rows: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    """The distinct rows of ``rows`` in first-seen order, and for each row the index of its copy
    there: a batch whose pairs share a chosen reply scores it once."""
    first: dict[tuple[int, ...], int] = {}
    where = [first.setdefault(tuple(r), len(first)) for r in rows]
    distinct = [None] * len(first)
    for r, i in zip(rows, where):
        distinct[i] = r
    return distinct, torch.tensor(where, dtype=torch.long)


@torch.no_grad()
def score_rows(rm: RewardModel, rows: list[list[int]], pad_id: int, micro_batch: int = 32) -> torch.Tensor:
    """Scores [len(rows)] of token sequences (each scored at its last token), ``micro_batch`` rows a pass."""
    device = next(rm.parameters()).device
    out = []
    for i in range(0, len(rows), micro_batch):
        ids, last = pad_rows(rows[i : i + micro_batch], pad_id)
        out.append(rm(ids.to(device), last.to(device)).cpu())
    return torch.cat(out) if out else torch.zeros(0)


def save_reward_model(out_dir: Path, rm: RewardModel, meta: dict[str, Any]) -> None:
    """Write ``out_dir`` (``model.pt`` with ``trunk.*`` and ``head.weight``, ``meta.json`` with kind)."""
    save_model_dir(out_dir, rm, {**meta, **scoring_meta(rm), "kind": MODEL_KIND, "model_config": rm.config.to_dict()})


def scoring_meta(rm: RewardModel) -> dict[str, Any]:
    """How ``rm`` reads a sequence, for its ``meta.json``: ``pool`` and the ``response_start`` token id."""
    return {"pool": rm.pool, "response_start": rm.response_start}


def is_reward_model_dir(model_dir: Path | str) -> bool:
    """Whether ``model_dir`` holds a reward model (else a plain GPT)."""
    return read_meta(Path(model_dir)).get("kind") == MODEL_KIND


def load_reward_model(model_dir: Path | str, device: str | torch.device = "cpu") -> tuple[RewardModel, dict]:
    """The reward model saved in ``model_dir`` (checksums verified) and its meta, in eval mode."""
    model_dir = Path(model_dir)
    marker = model_dir / REWARD_MODEL_NOT_READ
    if marker.is_file():  # the stage ran while RL read none: a profile switched reward.source since
        why = json.loads(marker.read_text()).get("why", "")
        raise ValueError(
            f"{model_dir} holds no reward model: the reward_model stage wrote {marker} instead ({why}); "
            "train it (dvc repro --force reward_model, with rl.reward.source: model | both in params.yaml)"
        )
    meta = read_meta(model_dir)
    if meta.get("kind") != MODEL_KIND:
        raise ValueError(
            f"{model_dir} holds a {meta.get('stage', 'GPT')!r} model, not a reward model (meta.json kind "
            f"{meta.get('kind')!r}); point it at the reward_model stage's output, e.g. artifacts/reward_model"
        )
    verify_model_dir(model_dir, meta)
    with torch.device(device):  # reward models saved before pooling read the last token
        rm = RewardModel(
            GPT(GPTConfig.from_dict(meta["model_config"])), meta.get("pool", "last"), meta.get("response_start")
        )
    rm.load_state_dict(torch.load(model_dir / "model.pt", map_location=device, weights_only=True))
    norm = meta.get("score_norm") or {}  # reward models saved before normalisation: raw scores
    rm.score_mean, rm.score_std = float(norm.get("mean", 0.0)), float(norm.get("std", 1.0))
    return rm.eval(), meta


def last_action_index(mask: torch.Tensor) -> torch.Tensor:
    """Per row of a next-token ``mask`` [B, T] (1 = sampled token), the index in ``ids = [inputs[:, :1],
    targets]`` of the last sampled token: where the reward model reads a response (0-based, [B])."""
    positions = torch.arange(mask.size(1), device=mask.device).expand_as(mask)
    last_target = torch.where(mask > 0, positions, torch.zeros_like(positions)).amax(dim=1)
    return last_target + 1


@torch.no_grad()
def rollout_scores(
    rm: RewardModel, inputs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, micro_batch: int = 0
) -> torch.Tensor:
    """Normalised reward-model scores [B] (:meth:`RewardModel.normalized`) of rollout rows (prompt +
    response), each row ending at its last sampled token and read as the model's ``pool`` says."""
    ids, last = rollout_rows(inputs, targets, mask)
    step = micro_batch if micro_batch > 0 else ids.size(0)
    out = [rm(ids[i : i + step], last[i : i + step]) for i in range(0, ids.size(0), step)]
    return rm.normalized(torch.cat(out).float())


def rollout_rows(inputs: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, T + 1], last [B]): rollout rows as the reward model reads them, each ending at its last
    sampled token."""
    return torch.cat([inputs[:, :1], targets], dim=1), last_action_index(mask)
