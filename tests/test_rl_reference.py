"""The thin RL stage takes the updates of the stage it replaced (0c53efd, where ``stages/rl.py`` held
the roles and the step): the same batch through the stage's update step (GRPO with the KL loss and the
replay; PPO with a critic, GAE and the KL controller), two steps each, gives the losses, statistics
and weights a fixture from 0c53efd's code holds, in float32. The fixture was written by this file's
``cases()`` run against 0c53efd's tree:

    PYTHONPATH=<0c53efd's tree> python tests/test_rl_reference.py > tests/data/rl_update_0c53efd.json

So the moves of the refactor (the algorithm's typed configs, the roles' wiring, the step's order of
shaping, replay and reference EMA) are held to the old numbers, not only to the new code's own.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

FIXTURE = Path(__file__).with_name("data") / "rl_update_0c53efd.json"
# float32 on two CPU kinds: the fixture was written on an AMD kind; Intel AVX-512's kernels sum in another
# order, and ppo/1's kl_sum (a sum of near-cancelling per-token KLs, after a step of SGD) lands 4.5e-6
# away relative, every other number within 5e-7. The bound is ten times that, far below what a moved
# part of the update changes (replay_coef 1% off: 1e-2; one PPO minibatch for two: 0.55).
RTOL = 5e-5
SETTINGS = {  # beside RLSettings' defaults: a small batch, and every part of each update on
    "grpo": dict(group_size=4, prompts_per_step=2, device_batch_size=3, kl_loss_coef=0.1, replay_coef=0.5),
    "ppo": dict(algorithm="ppo", group_size=4, prompts_per_step=2, device_batch_size=3, num_minibatches=2),
}


def batch(seed: int):
    """A fixed batch of 8 rows (2 prompts x 4 samples) with mixed scores and lengths."""
    from chatpipe.rl.rollout import Rollouts

    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(1, 250, (8, 12), generator=g)
    targets = torch.cat([inputs[:, 1:], torch.randint(1, 250, (8, 1), generator=g)], 1)
    lengths = torch.tensor([6, 3, 8, 5, 7, 2, 4, 8])
    mask = (torch.arange(12)[None, :] >= 12 - lengths[:, None]).float()
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    ended = torch.tensor([True, True, False, True, True, True, True, False])
    return Rollouts(inputs, targets, mask, scores, ended, lengths, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))


class Replay:
    """A replay loader's stand-in: the same two chat rows every step."""

    def next_batch(self):
        g = torch.Generator().manual_seed(5)
        ids = torch.randint(1, 250, (2, 13), generator=g)
        return ids[:, :-1], ids[:, 1:]


def settings(cls, flat: dict):
    """``flat`` keys as the settings model takes them: nested in ``ppo``/``grpo`` (0c53efd: flat)."""
    if "ppo" not in cls.model_fields:  # 0c53efd
        return cls.model_construct(**flat)
    ppo, grpo = (cls.model_fields[k].annotation for k in ("ppo", "grpo"))
    top = {k: v for k, v in flat.items() if k in cls.model_fields}
    return cls.model_construct(
        **top,
        ppo=ppo(**{k: v for k, v in flat.items() if k in ppo.model_fields}),
        grpo=grpo(**{k: v for k, v in flat.items() if k in grpo.model_fields}),
    )


def run_parts(algorithm: str):
    """The stage's per-run state as both trees' ``update(run, batch, step)`` read it."""
    from chatpipe import runtime
    from chatpipe.rl import losses
    from chatpipe.rl.value import ValueModel
    from chatpipe.settings import RLSettings
    from tests.test_engine import random_model

    cfg = settings(RLSettings, SETTINGS[algorithm])
    policy = random_model(3)
    ref = copy.deepcopy(policy).requires_grad_(False)
    critic = ValueModel.from_policy(policy) if algorithm == "ppo" else None
    sgd = [torch.optim.SGD(policy.parameters(), lr=0.05)]
    models = SimpleNamespace(
        policy=policy, ref=ref, critic=critic, policy_opts=sgd, critic_opts=[] if critic is None else
        [torch.optim.SGD(critic.parameters(), lr=0.05)],
    )  # fmt: skip
    rt = runtime.Runtime(0, 0, 1, torch.device("cpu"), torch.float32)
    kl_ctl = losses.KLController(0.1, adaptive=False, target=6.0, horizon=10000)  # RLSettings' defaults
    parts = SimpleNamespace(
        cfg=cfg, rt=rt, models=models, kl_ctl=kl_ctl, replay_loader=Replay(), train_policy=policy,
        train_critic=critic, value_norm=None,
    )  # fmt: skip
    try:  # the thin stage's typed algorithm config
        from chatpipe.rl.update import algorithm_config

        parts.algorithm = algorithm_config(cfg)
    except ImportError:  # 0c53efd: the stage read PPOConfig from the settings itself
        from chatpipe.rl.update import PPOConfig

        parts.ppo_config = PPOConfig.from_settings(cfg)
    return parts


def the_update():
    try:
        from chatpipe.rl.step import update
    except ImportError:  # 0c53efd
        from stages.rl import update
    return update


def cases() -> dict[str, dict[str, float]]:
    """Two update steps of each algorithm: every stat, and the policy's (and critic's) weights summed."""
    update = the_update()
    out = {}
    for algorithm in SETTINGS:
        parts = run_parts(algorithm)
        for step in range(2):
            stats = update(parts, batch(step), step)
            out[f"{algorithm}/{step}"] = {k: float(v) for k, v in sorted(stats.items())}
        models = parts.models
        out[f"{algorithm}/weights"] = {
            "policy": sum(p.double().abs().sum().item() for p in models.policy.parameters()),
            "ref": sum(p.double().abs().sum().item() for p in models.ref.parameters()),
            "critic": sum(p.double().abs().sum().item() for p in models.critic.parameters()) if models.critic else 0.0,
            "kl_coef": parts.kl_ctl.value,
        }
    return out


def test_the_thin_stage_updates_as_the_stage_it_replaced():
    want = json.loads(FIXTURE.read_text())
    got = cases()
    assert set(got) == set(want)
    for case, numbers in want.items():
        assert set(got[case]) == set(numbers), case
        for k, v in numbers.items():
            assert abs(got[case][k] - v) <= RTOL * max(1.0, abs(v)), (case, k, got[case][k], v)


if __name__ == "__main__":
    torch.set_num_threads(1)
    json.dump(cases(), sys.stdout, indent=1)
    print()
