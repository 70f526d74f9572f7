"""Typed settings: one pydantic-settings model per section of params.yaml.

Resolution order, lowest to highest priority:

1. the section in ``params.yaml`` (path from ``CHATPIPE_PARAMS``, default ``./params.yaml``),
2. the active profile's overlay ``<profile>.<section>`` of ``profiles.yaml`` (beside params.yaml,
   or ``$CHATPIPE_PROFILES``; profile from ``CHATPIPE_PROFILE`` or params.yaml's ``profile`` key).
   Keeping the overlays out of params.yaml keeps them out of DVC's params (``dvc exp show``);
   DVC sees the active profile's resolved overlay through ``profile/<section>.yaml``, written by
   :func:`write_overlays` (the ``profile`` stage of dvc.yaml),
3. environment variables ``CHATPIPE_<SECTION>__<KEY>`` (e.g. ``CHATPIPE_PRETRAIN__DEPTH=12``),
4. command-line overrides ``--key=value`` / ``key=value`` given to a stage.

Unknown keys, wrong types and out-of-range values raise :class:`ParamsError` naming the
file, the key, the bad value and what is allowed, before any work starts.

    from chatpipe.settings import load_section, PretrainSettings
    cfg = load_section(PretrainSettings, cli=["--depth=6"])

The package, in reading order: ``params`` (params.yaml, profiles.yaml, the active profile),
``pipeline`` (the stages, read from dvc.yaml), ``base`` (model stage names, :class:`StageSettings`, the :data:`SECTIONS` registry), the section models
in ``sections`` (data, tokenizer, eval, report, export, launch, tracking, chat, serve) and
``training`` (pretrain, midtrain, sft, rl), ``cli`` (``--key=value`` flags, error messages) and
``load`` (:func:`load_section`, :func:`validate_all`, :func:`write_overlays`). Import from here.
"""

from __future__ import annotations

from chatpipe.settings.base import (
    MAX_SEED,
    MODEL_STAGES,
    SECTIONS,
    ModelStage,
    StageSettings,
    math_settings,
    resume_neutral,
    snapshot,
)
from chatpipe.settings.cli import format_error, parse_cli
from chatpipe.settings.load import (
    OVERLAYS_DIR,
    check_env_sections,
    load_section,
    validate_all,
    write_overlays,
    write_profile,
)
from chatpipe.settings.params import (
    ParamsError,
    active_profile,
    deep_merge,
    params_path,
    profile_overlay,
    profiles_path,
    read_profiles,
    resolve_params,
)
from chatpipe.settings.pipeline import (
    PROFILE_STAGE,
    check_env_keeps_stages,
    dvc_stages,
    pipeline_stages,
    reward_model_unread,
    stages_before,
)
from chatpipe.settings.sections import (
    ChatSettings,
    DataSettings,
    EvalSettings,
    ExportSettings,
    LaunchSettings,
    ReportSettings,
    ServeSettings,
    TokenizerSettings,
    TrackingSettings,
)
from chatpipe.settings.training import (
    RL_EXCHANGE_ENV,
    RL_ROLE_ENV,
    RL_STORE_ENV,
    RL_THREADS_AFTER_ENV,
    RL_WORKER_ENV,
    RL_WORKER_OFFSET_ENV,
    ChatTrainSettings,
    MidtrainSettings,
    MixItem,
    PretrainSettings,
    RewardModelSettings,
    RLSettings,
    RunSettings,
    SFTSettings,
    TaskName,
    TrainSettings,
)
from chatpipe.settings.yamlfile import read_settings_yaml

__all__ = [
    "PROFILE_STAGE",
    "check_env_keeps_stages",
    "reward_model_unread",
    "dvc_stages",
    "pipeline_stages",
    "stages_before",
    "MAX_SEED",
    "MODEL_STAGES",
    "OVERLAYS_DIR",
    "SECTIONS",
    "ChatSettings",
    "ChatTrainSettings",
    "DataSettings",
    "EvalSettings",
    "ExportSettings",
    "LaunchSettings",
    "MidtrainSettings",
    "MixItem",
    "ModelStage",
    "ParamsError",
    "PretrainSettings",
    "RLSettings",
    "RL_EXCHANGE_ENV",
    "RL_ROLE_ENV",
    "RL_STORE_ENV",
    "RL_THREADS_AFTER_ENV",
    "RL_WORKER_ENV",
    "RL_WORKER_OFFSET_ENV",
    "RewardModelSettings",
    "ReportSettings",
    "RunSettings",
    "SFTSettings",
    "ServeSettings",
    "StageSettings",
    "TaskName",
    "TokenizerSettings",
    "TrackingSettings",
    "TrainSettings",
    "deep_merge",
    "active_profile",
    "check_env_sections",
    "format_error",
    "load_section",
    "math_settings",
    "params_path",
    "parse_cli",
    "profile_overlay",
    "profiles_path",
    "read_profiles",
    "read_settings_yaml",
    "resolve_params",
    "resume_neutral",
    "snapshot",
    "validate_all",
    "write_overlays",
    "write_profile",
]
