"""Stage command-line overrides, and the error message that names each bad key, its value and its source."""

from __future__ import annotations

import os
from typing import Any

from pydantic import ValidationError

from chatpipe.settings.base import StageSettings
from chatpipe.settings.params import ParamsError, params_path, profile_overlay, profiles_path, read_profiles, read_yaml


def parse_cli(args: list[str]) -> dict[str, Any]:
    """Turn ``--key=value``, ``--key value`` or ``key=value`` arguments into a dict (``--a.b=1``: ``{a: {b: 1}}``)."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        key, eq, value = arg.lstrip("-").partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ParamsError(f"command line: {arg!r} has no value; use --key=value")
            value, i = args[i + 1], i + 1
        *outer, last = key.replace("-", "_").split(".")  # --guard.every=5: a key of a nested section
        into = out
        for name in outer:
            into = into.setdefault(name, {})
            if not isinstance(into, dict):
                raise ParamsError(f"command line: {arg!r} sets a key below {name}, which is set whole before")
        into[last] = value
        i += 1
    return out


def _source(cls: type[StageSettings], key: str, overrides: dict[str, Any]) -> str:
    """Where the value of ``key`` came from: the command line, an env var, or the params file."""
    top = key.split(".")[0]
    if top in overrides:  # a nested section's key (--guard.every) is named whole
        return f"command line --{key if isinstance(overrides[top], dict) else top}"
    for env in (
        f"CHATPIPE_{cls.section.upper()}__{key.upper().replace('.', '__')}",
        f"CHATPIPE_{cls.section.upper()}__{top.upper()}",
    ):
        if any(name.upper() == env for name in os.environ):
            return f"environment variable {env}"
    return _profile_source(cls.section, top) or str(params_path())


def _profile_source(section: str, key: str) -> str | None:
    """profiles.yaml (and the profile) when the active profile sets ``section.key``, else None."""
    path = params_path()
    try:
        raw = read_yaml(path)
        profiles = read_profiles(path, raw)
        chosen = os.environ.get("CHATPIPE_PROFILE") or raw.get("profile", "tiny")
        overlay = profile_overlay(profiles, chosen, profiles_path(path))
    except ParamsError:
        return None
    values = overlay.get(section)
    if not isinstance(values, dict) or key not in values:
        return None
    legacy = isinstance(raw.get("profiles"), dict) and chosen in raw["profiles"]
    return f"{path if legacy else profiles_path(path)} (profile {chosen})"


def _nested_keys(cls: type[StageSettings], loc: tuple) -> str:
    """The allowed keys of the nested section a bad key sits in (``rl.guard.evry``), '' at the top."""
    field = cls.model_fields.get(str(loc[0])) if len(loc) == 2 else None
    fields = getattr(field.annotation, "model_fields", None) if field else None
    return ", ".join(fields) if isinstance(fields, dict) else ""


def format_error(cls: type[StageSettings], err: ValidationError, overrides: dict[str, Any] | None = None) -> str:
    """One line per bad key: section.key = value, where it came from unless the params file, and why."""
    lines = []
    allowed = ", ".join(cls.model_fields)
    sources = set()
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        value = e.get("input")
        source = _source(cls, key, overrides or {})
        sources.add(source)
        where = "" if source == str(params_path()) else f" (from {source})"
        if e["type"] == "extra_forbidden" and key in cls.removed:
            why = f"this key was removed: {cls.removed[key]}; allowed keys: {allowed}"
            lines.append(f"{cls.section}.{key} = {value!r}{where}: {why}")
        elif e["type"] == "extra_forbidden":
            keys = _nested_keys(cls, e["loc"]) or allowed
            lines.append(f"{cls.section}.{key} = {value!r}{where}: unknown key; allowed keys: {keys}")
        else:
            lines.append(f"{cls.section}.{key} = {value!r}{where}: {e['msg'].removeprefix('Value error, ')}")
    head = sources.pop() if len(sources) == 1 else "settings"
    return f"{head}: invalid settings\n  " + "\n  ".join(lines)
