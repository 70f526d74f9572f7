"""What every params.yaml section model shares: the stage names, the base class and its registry.

A section model subclasses :class:`StageSettings` and sets ``section``; defining it registers it in
:data:`SECTIONS`, which :func:`chatpipe.settings.load.validate_all` checks as a whole.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from chatpipe.settings.params import ParamsError, params_path, resolve_params

# The pipeline's stages in run order (dvc.yaml lists the same, in the same order; a test checks it),
# and the model each training stage hands on: artifacts/<model stage>/, made by its training stage.
STAGES = ("data", "tokenizer", "pretrain", "midtrain", "sft", "reward_model", "rl", "eval", "report", "export")
MODEL_STAGES = {"base": "pretrain", "mid": "midtrain", "sft": "sft", "rl": "rl"}
ModelStage = Literal[tuple(MODEL_STAGES)]


def snapshot(settings: BaseModel) -> dict[str, Any]:
    """Plain-JSON dict of resolved settings, for checkpoints and MLflow params."""
    return settings.model_dump(mode="json")


def resume_neutral(default: Any, **kwargs: Any) -> Any:
    """A field that only changes what is observed (logging, evals, checkpoint cadence), never the weights.

    Such a setting may differ between a run and its resume: it is left out of the run's fingerprint
    (see :func:`math_settings`), so changing it keeps the in-progress checkpoints.
    """
    return Field(default, json_schema_extra={"resume_neutral": True}, **kwargs)


def math_settings(settings: BaseModel) -> dict[str, Any]:
    """The settings that decide the trained weights: everything but the :func:`resume_neutral` fields."""
    neutral = {
        name
        for name, f in type(settings).model_fields.items()
        if isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("resume_neutral")
    }
    return {k: v for k, v in snapshot(settings).items() if k not in neutral}


class _ParamsFileSource(PydanticBaseSettingsSource):
    """Feeds one section of the resolved params.yaml into a settings model."""

    def __call__(self) -> dict[str, Any]:
        section = self.settings_cls.section
        values = resolve_params().get(section, {}) or {}
        if not isinstance(values, dict):
            raise ParamsError(f"{params_path()}: section {section!r} must be a mapping, got {values!r}")
        return values

    def get_field_value(self, field, field_name):  # pragma: no cover - required by the ABC
        return None, field_name, False


class StageSettings(BaseSettings):
    """Base for a params.yaml section: forbids unknown keys, reads env and the params file."""

    section: ClassVar[str] = ""
    # keys this section used to have -> what replaced them; a params file that still sets one fails with it
    removed: ClassVar[dict[str, str]] = {}
    model_config = SettingsConfigDict(extra="forbid", env_nested_delimiter="__", validate_default=True)

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ):
        # CLI overrides arrive as init kwargs; they beat env, which beats the file.
        return init_settings, env_settings, _ParamsFileSource(settings_cls)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.section:
            cls.model_config = {**cls.model_config, "env_prefix": f"CHATPIPE_{cls.section.upper()}__"}
            SECTIONS[cls.section] = cls  # every section model is validated by validate_all


# section name -> settings model, filled as the section modules (sections.py, training.py) define them
SECTIONS: dict[str, type[StageSettings]] = {}
