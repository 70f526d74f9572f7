"""One validated section from params.yaml + profile + env + CLI; every section at once; DVC's overlay files."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from chatpipe.io import write_text_atomic
from chatpipe.settings.base import FILE_VALUES_GIVEN, SECTIONS, StageSettings, Subsection
from chatpipe.settings.cli import format_error, parse_cli
from chatpipe.settings.params import (
    ParamsError,
    deep_merge,
    params_path,
    profile_overlay,
    profiles_path,
    read_profiles,
    read_yaml,
    resolve_params,
)


def check_env_sections() -> None:
    """Reject ``CHATPIPE_<SECTION>__<KEY>`` variables whose section does not exist (a typo such as
    ``CHATPIPE_PRETRAINN__DEPTH`` would otherwise be ignored without a word)."""
    for name in os.environ:
        upper = name.upper()
        if upper.startswith("CHATPIPE_") and "__" in name:
            section = upper[len("CHATPIPE_") :].split("__")[0].lower()
            if section not in SECTIONS:
                raise ParamsError(
                    f"environment variable {name}: unknown section {section!r}; "
                    f"allowed: {', '.join(sorted(SECTIONS))} (as CHATPIPE_<SECTION>__<KEY>)"
                )


def _check_env(cls: type[StageSettings]) -> None:
    """Every ``CHATPIPE_<SECTION>__...`` variable names a key of the section, one level deep, or one key of
    a nested section (``CHATPIPE_RL__GUARD__EVERY``): a deeper name (``CHATPIPE_EVAL__CHATCORE_TASKS__MMLU``)
    is refused rather than read for some fields and silently dropped for others; a list or mapping is
    set whole, as JSON."""
    prefix = f"CHATPIPE_{cls.section.upper()}__"
    for name in os.environ:
        key = name[len(prefix) :].lower() if name.upper().startswith(prefix) else None
        if not key:
            continue
        top = key.split("__")[0]
        if top not in cls.model_fields:
            raise ParamsError(
                f"environment {name}: unknown key {cls.section}.{key}; allowed keys: {', '.join(cls.model_fields)}"
            )
        nested = _subsection(cls, top)
        if nested is not None and key.count("__") == 1:  # CHATPIPE_RL__GUARD__EVERY: one key of rl.guard
            sub = key.split("__")[1]
            if sub not in nested.model_fields:
                raise ParamsError(
                    f"environment {name}: unknown key {cls.section}.{top}.{sub}; allowed keys: "
                    f"{', '.join(nested.model_fields)}"
                )
        elif "__" in key:
            raise ParamsError(
                f"environment variable {name}: nested keys below {cls.section}.{top} are not read; set the "
                f"whole value as JSON instead, e.g. {prefix}{top.upper()}='{{...}}' or '[...]'"
            )


def _subsection(cls: type[StageSettings], key: str) -> type[Subsection] | None:
    """The nested section model of field ``key`` (``rl.guard``), or None for a plain field."""
    annotation = cls.model_fields[key].annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, Subsection) else None


def load_section(cls: type[StageSettings], cli: list[str] | dict[str, Any] | None = None) -> StageSettings:
    """Build one section's settings from params.yaml, profile, env and CLI overrides."""
    from pydantic_settings import SettingsError

    overrides = parse_cli(cli) if isinstance(cli, list) else dict(cli or {})
    _check_env(cls)
    try:
        return cls(**overrides)
    except ValidationError as err:
        raise ParamsError(format_error(cls, err, overrides)) from None
    except SettingsError as err:  # an env value for a list/dict field that is not JSON
        prefix = f"CHATPIPE_{cls.section.upper()}__"
        bad = [f"{n} = {v!r}" for n, v in os.environ.items() if n.upper().startswith(prefix)]
        raise ParamsError(
            f"environment variable {' / '.join(bad) or prefix + '*'}: not valid JSON for a list or mapping "
            f'field (e.g. \'["base", "sft"]\'): {err.__cause__ or err}'
        ) from None


def validate_all(path: Path | None = None) -> dict[str, StageSettings]:
    """Validate every section of params.yaml, and every profile of profiles.yaml (used before any
    stage does work, and before switching profile)."""
    path = path or params_path()
    raw = read_yaml(path)
    check_env_sections()
    top_level_keys = {"profile", "profiles", *SECTIONS}
    unknown = set(raw) - top_level_keys
    if unknown:
        raise ParamsError(f"{path}: unknown top-level key(s) {sorted(unknown)}; allowed: {sorted(top_level_keys)}")
    profiles = read_profiles(path, raw)
    for name, overlay in profiles.items():
        if not isinstance(overlay, dict):
            raise ParamsError(f"{profiles_path(path)}: profile {name!r} must be a mapping of sections")
        bad = set(overlay or {}) - set(SECTIONS) - {"extends"}
        if bad:
            raise ParamsError(
                f"{profiles_path(path)}: {name} has unknown section(s) {sorted(bad)}; allowed: {sorted(SECTIONS)}"
            )
    loaded = {name: load_section(cls) for name, cls in SECTIONS.items()}
    base = {k: v for k, v in raw.items() if k != "profiles"}
    for name in profiles:
        validate_profile(name, path, base, profiles)
    return loaded


def validate_profile(name: str, path: Path, base: dict[str, Any], profiles: dict[str, Any]) -> None:
    """Every section of params.yaml (``base``) under profile ``name``, without env or command line: a
    profile that is not the active one is checked as well, so switching to it cannot meet a bad value."""
    where = profiles_path(path)
    overlay = profile_overlay(profiles, name, where)
    resolved = deep_merge(base, overlay)
    for section, cls in SECTIONS.items():
        values = resolved.get(section) or {}
        source = f"{where} (profile {name})"
        if not isinstance(values, dict):
            raise ParamsError(f"{source}: section {section!r} must be a mapping, got {values!r}")
        token = FILE_VALUES_GIVEN.set(True)
        try:
            cls(**{str(k): v for k, v in values.items()})
        except ValidationError as err:
            mine = overlay.get(section) if isinstance(overlay.get(section), dict) else {}
            lines = []
            for e in err.errors():
                key = ".".join(str(p) for p in e["loc"])
                origin = "" if key.split(".")[0] in mine else f" (from {path})"
                why = "unknown key" if e["type"] == "extra_forbidden" else e["msg"].removeprefix("Value error, ")
                lines.append(f"{section}.{key} = {e.get('input')!r}{origin}: {why}")
            raise ParamsError(f"{source}: invalid settings\n  " + "\n  ".join(lines)) from None
        finally:
            FILE_VALUES_GIVEN.reset(token)


OVERLAYS_DIR = Path("profile")


def write_overlays(
    sections: list[str] | None = None, out_dir: Path = OVERLAYS_DIR, path: Path | None = None
) -> list[Path]:
    """Write the active profile's resolved overlay of each section (default: all) to ``out_dir/<section>.yaml``.

    A stage of dvc.yaml depends on its section's file, so DVC re-runs it exactly when the active
    profile's values for that section change (switching profile, or editing that profile or one
    it extends), and not for edits to other profiles. Files are rewritten only when they change.
    """
    path = path or params_path()
    raw = read_yaml(path)
    chosen = os.environ.get("CHATPIPE_PROFILE") or raw.get("profile", "tiny")
    resolve_params(path, chosen)  # raises if the profile is not defined
    overlay = profile_overlay(read_profiles(path, raw), chosen, profiles_path(path))
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    unknown = set(sections or []) - set(SECTIONS)
    if unknown:
        raise ParamsError(f"unknown section(s) {sorted(unknown)}; allowed: {', '.join(SECTIONS)}")
    for section in sections or SECTIONS:
        text = f"# generated by `python -m chatpipe.settings` (the dvc.yaml profile stage): {chosen}.{section}\n"
        text += yaml.safe_dump(overlay.get(section) or {}, sort_keys=True)
        target = out_dir / f"{section}.yaml"
        if not target.exists() or target.read_text() != text:
            write_text_atomic(target, text)
        written.append(target)
    return written


def write_profile(name: str, path: Path | None = None) -> None:
    """Set the top-level ``profile:`` of params.yaml (atomically), so DVC sees the change."""
    path = path or params_path()
    resolve_params(path, name)  # raises if the profile is not defined
    validate_all(path)  # a bad value in any profile stops here, before params.yaml changes
    text = path.read_text()
    new, n = re.subn(r"(?m)^profile:.*$", f"profile: {name}", text, count=1)
    if n == 0:
        new = f"profile: {name}\n" + text
    if new != text:
        write_text_atomic(path, new)
