"""The pipeline's stages, in order, read from dvc.yaml: the one list of stages; and the one test of
whether the reward_model stage has work, which dvc.yaml's command and the flow both go by.

dvc.yaml decides what runs and in which order, so everything else that needs the list (the launcher,
the flows, sweeps, the report) asks here rather than keep a copy that could drift. The file is read
when first asked, never at import: MLflow's packaged copy of the library has no dvc.yaml and never asks.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from chatpipe.settings.errors import ParamsError

if TYPE_CHECKING:
    from chatpipe.settings.training import RewardModelSettings, RLSettings

DVC_YAML = Path(__file__).resolve().parents[2] / "dvc.yaml"  # beside chatpipe/, at the repository root
PROFILE_STAGE = "profile"  # the dvc stage that writes profile/<section>.yaml; nothing launches it


@functools.cache
def dvc_stages(dvc_yaml: Path = DVC_YAML) -> tuple[str, ...]:
    """Every stage name in dvc.yaml, in its order (the pipeline's order), ``profile`` included."""
    try:
        stages = (yaml.safe_load(dvc_yaml.read_text()) or {}).get("stages")
    except FileNotFoundError:
        raise ParamsError(f"{dvc_yaml}: missing; the list of stages is read from it") from None
    if not isinstance(stages, dict) or not stages:
        raise ParamsError(f"{dvc_yaml}: no `stages:` mapping; the list of stages is read from it")
    return tuple(stages)


def pipeline_stages(dvc_yaml: Path = DVC_YAML) -> tuple[str, ...]:
    """The stages a person launches, in pipeline order: dvc.yaml's, without its bookkeeping stage."""
    return tuple(s for s in dvc_stages(dvc_yaml) if s != PROFILE_STAGE)


def stages_before(stage: str) -> tuple[str, ...]:
    """The pipeline's stages that run before ``stage`` (those a report describes, for ``report``)."""
    stages = pipeline_stages()
    return stages[: stages.index(stage)]


# what decides whether the reward_model stage trains (reward_model_unread): DVC sees these only in
# params.yaml (the stage's params) and profile/, never in the environment
STAGE_SHAPING_KEYS = (("rl", "reward.source"), ("rl", "reward"), ("reward_model", "train_when"))  # rl.reward: as JSON


def reward_model_unread(rl: RLSettings, reward_model: RewardModelSettings) -> str:
    """Why the reward_model stage has nothing to train ("" when it trains): RL reads no reward model
    (``rl.reward.source: verifier``, its default) and ``reward_model.train_when`` is ``read``. dvc.yaml's
    command (``python -m chatpipe.launch reward_model --if-read``) then writes a marker instead of a
    model, and the flow says so; an ensemble or iterated RLHF needs ``reward.source`` model|both anyway."""
    if reward_model.train_when == "always" or rl.reward.source != "verifier":
        return ""
    return (
        "rl.reward.source = verifier reads no reward model; to train it set rl.reward.source: model | both, "
        "or reward_model.train_when: always, in params.yaml"
    )


def check_env_keeps_stages() -> None:
    """Refuse an environment override that changes whether the reward_model stage trains: DVC decides
    what is stale from params.yaml and profile/, so a run under such a variable would train (or skip)
    what DVC then records under other values. The error names the variable and where to set the key."""
    from chatpipe.settings.load import load_section
    from chatpipe.settings.training import RewardModelSettings, RLSettings

    set_now = {n.upper() for n in os.environ}
    names = {
        f"CHATPIPE_{section}__{key.replace('.', '__')}".upper(): f"{section}.{key}"
        for section, key in STAGE_SHAPING_KEYS
    }
    given = {name: key for name, key in names.items() if name in set_now}
    if not given:
        return
    with_env = reward_model_unread(load_section(RLSettings), load_section(RewardModelSettings))
    no_env = "CHATPIPE_FILE_ONLY__"  # a prefix no variable has: the params file and profile alone
    from_file = reward_model_unread(RLSettings(_env_prefix=no_env), RewardModelSettings(_env_prefix=no_env))
    if bool(with_env) != bool(from_file):
        names, keys = " / ".join(given), " / ".join(given.values())
        raise ParamsError(
            f"environment variable {names}: it changes whether the reward_model stage trains "
            f"({'it would not' if with_env else 'it would'}, where params.yaml says "
            f"{'it would not' if from_file else 'it would'}), which DVC cannot see; set {keys} in params.yaml "
            "instead (or run the stage itself, python -m stages.<stage>, outside the pipeline)"
        )
