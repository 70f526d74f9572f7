"""What every params.yaml section model shares: the stage names, the base class and its registry.

A section model subclasses :class:`StageSettings` and sets ``section``; defining it registers it in
:data:`SECTIONS`, which :func:`chatpipe.settings.load.validate_all` checks as a whole.
"""

from __future__ import annotations

import re
import types
from contextlib import suppress
from contextvars import ContextVar
from typing import Any, ClassVar, Literal, Union, get_args, get_origin

from pydantic import BaseModel, Field, ValidationError, ValidationInfo, field_validator
from pydantic_core.core_schema import ValidatorFunctionWrapHandler
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from chatpipe.settings.params import ParamsError, params_path, resolve_params

# The model each training stage hands on: artifacts/<model stage>/, made by its training stage.
# (The stages themselves, in run order, are dvc.yaml's: chatpipe.settings.pipeline reads them.)
MODEL_STAGES = {"base": "pretrain", "mid": "midtrain", "sft": "sft", "rl": "rl"}
ModelStage = Literal[tuple(MODEL_STAGES)]

# The largest seed: torch.manual_seed and numpy take at most a signed 64-bit integer; a bigger one
# passed validation before and failed later, at generation.
MAX_SEED = 2**63 - 1

_INT_TEXT = re.compile(r"[+-]?[0-9]+")
_TYPE_ERRORS = {"int_type", "float_type", "bool_type"}  # pydantic's strict-mode refusals of a scalar


def _scalar_kinds(annotation: Any) -> set[type]:
    """The plain scalar types (bool, int, float) a field's annotation admits, unions included."""
    if get_origin(annotation) in (Union, types.UnionType):
        return set().union(*(_scalar_kinds(arg) for arg in get_args(annotation)))
    return {annotation} if annotation in (bool, int, float) else set()


def _read_text(text: str, kinds: set[type]) -> Any:
    """A command-line or environment value (always text) as the scalar it spells, else the text itself.

    Hand-made because strict mode refuses ``"8"`` for an integer, and these sources have no other
    way to say 8: ``true`` / ``false`` for booleans, decimal digits for integers, a float for floats.
    """
    word = text.strip()
    if bool in kinds and word.lower() in ("true", "false"):
        return word.lower() == "true"
    if int in kinds and _INT_TEXT.fullmatch(word):
        return int(word)
    if float in kinds:
        with suppress(ValueError):
            return float(word)
    return text


def _exact(value: int) -> bool:
    try:
        return float(value) == value
    except OverflowError:
        return False


def _described(value: Any) -> str:
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()} (YAML reads yes/no/on/off as booleans)"
    kind = "text" if isinstance(value, str) else "float" if isinstance(value, float) else "number"
    return f"the {kind} {value!r}" if isinstance(value, str | int | float) else repr(value)


class StrictScalars(BaseModel):
    """Booleans, integers and floats taken only as what they say: pydantic's strict mode refuses a boolean
    for a number (YAML 1.1 reads ``no``/``off`` as false, which lax mode made 0), a number for a boolean,
    a float for an integer (``50.0``); an integer is a float only if the float holds it exactly. Text from
    the command line or the environment is read first (:func:`_read_text`); a refusal says what was
    expected and what came. Floats must be finite: a NaN learning rate passes every ``gt``/``le`` bound.
    """

    model_config = {"strict": True, "allow_inf_nan": False}

    @field_validator("*", mode="wrap")
    @classmethod
    def _strict_scalars(cls, value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        kinds = _scalar_kinds(field.annotation) if field else set()
        value = _read_text(value, kinds) if kinds and isinstance(value, str) else value
        if type(value) is int and kinds == {float} and not _exact(value):
            raise ValueError(f"an integer of {len(str(abs(value)))} digits: a float would not hold it exactly")
        try:
            return handler(value)
        except ValidationError as e:
            if not kinds or not any(err["type"] in _TYPE_ERRORS for err in e.errors()):
                raise
            want = "true or false" if kinds == {bool} else "an integer" if float not in kinds else "a number"
            raise ValueError(f"expected {want}, got {_described(value)}") from None


class Subsection(StrictScalars):
    """One concern's keys nested in a section (``rl.guard.every``): strict scalars, unknown keys refused.
    Set on the command line as ``--guard.every=5`` and in the environment as ``CHATPIPE_RL__GUARD__EVERY=5``."""

    model_config = {"extra": "forbid"}


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


# Set while a section is validated from values given whole (another profile's, see validate_profile):
# the params file then adds nothing, and is not read again for every section of every profile.
FILE_VALUES_GIVEN: ContextVar[bool] = ContextVar("FILE_VALUES_GIVEN", default=False)


class _ParamsFileSource(PydanticBaseSettingsSource):
    """Feeds one section of the resolved params.yaml into a settings model."""

    def __call__(self) -> dict[str, Any]:
        if FILE_VALUES_GIVEN.get():
            return {}
        section = self.settings_cls.section
        values = resolve_params().get(section, {}) or {}
        if not isinstance(values, dict):
            raise ParamsError(f"{params_path()}: section {section!r} must be a mapping, got {values!r}")
        return values

    def get_field_value(self, field, field_name):  # pragma: no cover - required by the ABC
        return None, field_name, False


class StageSettings(BaseSettings, StrictScalars):
    """Base for a params.yaml section: forbids unknown keys, strict scalars, reads env and the params file."""

    section: ClassVar[str] = ""
    # keys this section used to have -> what replaced them; a params file that still sets one fails with it
    removed: ClassVar[dict[str, str]] = {}
    model_config = SettingsConfigDict(extra="forbid", env_nested_delimiter="__", validate_default=True)

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ):
        # Env values stay text, read by StrictScalars as the command line's are: under strict mode
        # pydantic-settings would first coerce them itself, laxly ("yes" to true, "8.0" to 8).
        env_settings.config = {**env_settings.config, "strict": False}
        # CLI overrides arrive as init kwargs; they beat env, which beats the file.
        return init_settings, env_settings, _ParamsFileSource(settings_cls)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.section:
            cls.model_config = {**cls.model_config, "env_prefix": f"CHATPIPE_{cls.section.upper()}__"}
            SECTIONS[cls.section] = cls  # every section model is validated by validate_all


# section name -> settings model, filled as the section modules (sections.py, training.py) define them
SECTIONS: dict[str, type[StageSettings]] = {}
