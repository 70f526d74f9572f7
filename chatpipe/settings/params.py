"""params.yaml and profiles.yaml: read them, apply the active profile's overlay, switch profile.

The section models (:mod:`chatpipe.settings.base`) read their values from :func:`resolve_params`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from chatpipe.settings.errors import ParamsError
from chatpipe.settings.yamlfile import read_settings_yaml


def params_path() -> Path:
    """The params file in use: ``$CHATPIPE_PARAMS`` or ``./params.yaml``."""
    return Path(os.environ.get("CHATPIPE_PARAMS", "params.yaml"))


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ParamsError(f"{path}: params file not found (set CHATPIPE_PARAMS or run from the repo root)")
    data = read_settings_yaml(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ParamsError(f"{path}: expected a mapping of sections at the top level")
    return data


def deep_merge(base: dict, overlay: dict) -> dict:
    """``base`` with ``overlay`` laid over it, nested mappings merged key by key (neither is changed):
    how a profile overlays params.yaml and a sweep point overlays its profile."""
    out = dict(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def profiles_path(params: Path | None = None) -> Path:
    """The profile overlays file: ``$CHATPIPE_PROFILES`` or ``profiles.yaml`` beside the params file."""
    env = os.environ.get("CHATPIPE_PROFILES")
    return Path(env) if env else (params or params_path()).with_name("profiles.yaml")


def read_profiles(params: Path | None = None, raw: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every profile overlay: profiles.yaml's top-level entries (plus a legacy ``profiles:`` of params.yaml)."""
    params = params or params_path()
    legacy = (raw if raw is not None else read_yaml(params)).get("profiles") or {}
    path = profiles_path(params)
    own = read_yaml(path) if path.exists() else {}
    clash = set(legacy) & set(own)
    if clash:
        raise ParamsError(f"{params}: profiles {sorted(clash)} are defined both here and in {path}; keep one")
    return {**legacy, **own}


def resolve_params(path: Path | None = None, profile: str | None = None) -> dict[str, Any]:
    """Return params.yaml with the active profile's overlay applied (no env/CLI)."""
    path = path or params_path()
    raw = read_yaml(path)
    profiles = read_profiles(path, raw)
    raw.pop("profiles", None)
    chosen = profile or os.environ.get("CHATPIPE_PROFILE") or raw.get("profile", "tiny")
    allowed = ["tiny", *profiles.keys()]
    if chosen not in allowed:
        raise ParamsError(f"{path}: profile = {chosen!r} is not defined; allowed: {', '.join(allowed)}")
    raw["profile"] = chosen
    return deep_merge(raw, profile_overlay(profiles, chosen, path))


def profile_overlay(profiles: dict[str, Any], name: str, path: Path, seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """The overlay of profile ``name``, with ``extends: <parent>`` profiles merged in beneath it."""
    if name in seen:
        raise ParamsError(f"{path}: profiles.{name}.extends forms a cycle: {' -> '.join((*seen, name))}")
    overlay = dict(profiles.get(name) or {})
    parent = overlay.pop("extends", None)
    if parent is None:
        return overlay
    if parent not in profiles:
        raise ParamsError(
            f"{path}: profiles.{name}.extends = {parent!r} is not defined; allowed: {', '.join(profiles)}"
        )
    return deep_merge(profile_overlay(profiles, parent, path, (*seen, name)), overlay)


def active_profile() -> str:
    """Name of the profile in force (``CHATPIPE_PROFILE`` or params.yaml's ``profile``)."""
    return resolve_params()["profile"]
