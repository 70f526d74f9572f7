"""PPO critic: a value head on a copy of the policy's transformer trunk.

    critic = ValueModel.from_policy(policy)     # deep copy of the trunk, zero-initialised head
    critic = ValueModel.from_reward_model(rm)   # or a copy of a reward model's trunk and head
    values = critic(inputs)                     # [B, T]: V of the state before predicting targets[:, t]
    optimizers = build_optimizers(critic, ...)  # same Muon/AdamW split as the policy

The copy's ``lm_head`` is unused and frozen (DDP and the optimizers skip it); the scalar head
reads the same normed hidden states the policy's ``lm_head`` reads.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from chatpipe.model.gpt import GPT


class ValueModel(nn.Module):
    """Scalar value per position from a GPT trunk."""

    def __init__(self, trunk: GPT) -> None:
        super().__init__()
        self.trunk = trunk
        self.trunk.lm_head.requires_grad_(False)
        self.head = nn.Linear(trunk.config.n_embd, 1, bias=False)
        # a zero head starts every value at 0: no random baseline noise in the first advantages
        nn.init.zeros_(self.head.weight)

    @classmethod
    def from_policy(cls, policy: GPT) -> ValueModel:
        """A critic whose trunk starts as a copy of the policy's weights."""
        trunk = copy.deepcopy(policy)
        trunk.requires_grad_(True)
        return cls(trunk).to(next(policy.parameters()).device)

    @classmethod
    def from_reward_model(cls, rm: nn.Module) -> ValueModel:
        """A critic that starts as a copy of a reward model (trunk and scalar head), as torchtune's
        PPO recipe starts its value model: the first values already estimate the final score. RL reads
        the reward model's normalised scores, so the head is divided by their std (``score_std``) to
        start on the same scale."""
        critic = cls.from_policy(rm.trunk)
        with torch.no_grad():
            critic.head.weight.copy_(rm.head.weight / getattr(rm, "score_std", 1.0))
        return critic

    @property
    def config(self):
        """The trunk's GPTConfig (build_optimizers scales AdamW lrs by n_embd)."""
        return self.trunk.config

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Values [B, T] (float32)."""
        return self.head(self.trunk.hidden(idx)).squeeze(-1).float()

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """Trainable parameters by optimizer: Muon matrices, embedding and the head (AdamW)."""
        return {
            "matrix": [p for p in self.trunk.blocks.parameters() if p.dim() == 2],
            "embedding": [self.trunk.wte.weight],
            "lm_head": [self.head.weight],
        }


def token_values(critic: nn.Module, inputs: torch.Tensor, micro_batch: int = 0) -> torch.Tensor:
    """``critic(inputs)`` in row chunks of ``micro_batch`` (0: all at once)."""
    step = micro_batch if micro_batch > 0 else inputs.size(0)
    return torch.cat([critic(inputs[i : i + step]) for i in range(0, inputs.size(0), step)])
