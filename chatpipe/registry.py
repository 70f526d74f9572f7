"""The MLflow model registry side of the report: one version per distinct model, ``@latest`` and ``@champion``.

``@latest`` is MLflow's built-in alias for the highest version; ``@champion`` is set here.

    from chatpipe.registry import find_version, register, update_aliases
    version = find_version(client, "chatpipe", sha256)        # already registered? (by model.pt sha256)
    version = version or register(client, "chatpipe", model_uri, run_id, tags)
    update_aliases(client, "chatpipe", version)               # -> ["latest", "champion"] (those it holds)

A version carries its numbers as tags (``ChatCORE``, ``CORE``, ``bpb``, ...). The champion is the
version with the best numbers so far, compared on the first metric both versions have, in
:data:`SCORE_ORDER` (higher is better, except ``bpb``).
"""

from __future__ import annotations

import logging
import math
from typing import Any

log = logging.getLogger(__name__)

SHA_TAG = "model_sha256"
LATEST, CHAMPION = "latest", "champion"
# (version tag, higher is better): chat ability first, then base-model quality (the published DCLM
# CORE before our tiny-world CORE: they are different metrics), then bits per byte
SCORE_ORDER: list[tuple[str, bool]] = [
    ("ChatCORE", True),
    ("DCLM CORE", True),
    ("tiny-world CORE", True),
    ("bpb", False),
]


def _number(tags: dict[str, str], key: str) -> float | None:
    try:
        value = float(tags[key])
    except (KeyError, TypeError, ValueError):
        return None
    return None if math.isnan(value) else value


def find_version(client: Any, name: str, sha256: str) -> Any | None:
    """The registered version of ``name`` whose ``model_sha256`` tag is ``sha256``, or None."""
    if not sha256 or not client.search_registered_models(f"name = '{name}'"):
        return None
    for version in client.search_model_versions(f"name = '{name}'"):
        if version.tags.get(SHA_TAG) == sha256:
            return version
    return None


def register(client: Any, name: str, model_uri: str, run_id: str | None, tags: dict[str, str]) -> Any:
    """Create ``name`` if needed and a new version from ``model_uri`` with ``tags``; returns the version."""
    if not client.search_registered_models(f"name = '{name}'"):
        client.create_registered_model(name, description="chatpipe chat model (final stage of the pipeline)")
    return client.create_model_version(name, model_uri, run_id=run_id, tags=tags)


def beats(new: dict[str, str], old: dict[str, str]) -> tuple[bool, str]:
    """Whether numbers ``new`` beat ``old`` on the first metric both have; also says which metric decided."""
    for key, higher in SCORE_ORDER:
        a, b = _number(new, key), _number(old, key)
        if a is not None and b is not None:
            return (a > b if higher else a < b), f"{key} {a:.4f} vs {b:.4f}"
    return False, "no metric in common"


def alias_version(client: Any, name: str, alias: str) -> Any | None:
    """The version ``name@alias`` points at, or None."""
    try:
        return client.get_model_version_by_alias(name, alias)
    except Exception:  # MlflowException RESOURCE_DOES_NOT_EXIST when the alias is not set
        return None


def update_aliases(client: Any, name: str, version: Any) -> list[str]:
    """Point ``@champion`` at ``version`` when it beats the current champion; returns the aliases it holds.

    ``@latest`` is MLflow's own reserved alias for the highest version number (it cannot be set);
    because a model is registered only once per sha256, that is the newest distinct model.
    """
    version = client.get_model_version(name, version.version)  # with its tags
    champion = alias_version(client, name, CHAMPION)
    if champion is None:
        win, why = True, "no champion yet"
    elif str(champion.version) == str(version.version):
        win, why = True, "already champion"
    else:
        win, why = beats(version.tags, champion.tags)
    if win:
        client.set_registered_model_alias(name, CHAMPION, version.version)
    log.info("%s v%s: %s (%s)", name, version.version, "champion" if win else "champion unchanged", why)
    latest = alias_version(client, name, LATEST)
    return [
        a
        for a, v in ((LATEST, latest), (CHAMPION, version if win else None))
        if v is not None and str(v.version) == str(version.version)
    ]
