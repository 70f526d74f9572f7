"""The pipeline's stages, in order, read from dvc.yaml: the one list of stages.

dvc.yaml decides what runs and in which order, so everything else that needs the list (the launcher,
the flows, sweeps, the report) asks here rather than keep a copy that could drift. The file is read
when first asked, never at import: MLflow's packaged copy of the library has no dvc.yaml and never asks.
"""

from __future__ import annotations

import functools
from pathlib import Path

import yaml

from chatpipe.settings.errors import ParamsError

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
