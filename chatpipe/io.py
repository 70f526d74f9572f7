"""Small file helpers every layer uses: content hashes, all-or-nothing writes, torch saves that name
the file and the free space when the disk fills up, YAML reads through libyaml."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

# libyaml's parser (PyYAML built with it, as the wheels are) reads dvc.lock and params.yaml ~10x faster
# than the pure-Python one: dvc.lock is read once per stage by the report and the flow, params.yaml
# by every settings load. Same safe schema, same error marks (file line and column).
_SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` through libyaml when PyYAML has it."""
    return yaml.load(text, Loader=_SAFE_LOADER)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fingerprint(obj: Any) -> str:
    """Short stable hash of a JSON-able object (settings + input hashes)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON to a temp file beside ``path`` and rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished temp dir to ``final``, replacing any old one with no window where neither exists."""
    if final.exists():
        old = final.with_name(f".{final.name}.old{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def free_space(path: Path) -> str:
    """How much room is left on ``path``'s filesystem, for the message of a failed write."""
    try:
        return f"{shutil.disk_usage(path).free / 2**20:.1f} MiB free on {path}"
    except OSError:
        return f"free space on {path} unknown"


def save_torch(path: Path, obj: Any) -> None:
    """torch.save that turns a failed write into an OSError naming the file (torch raises a
    RuntimeError from its zip writer, ``inline_container.cc``, when the disk fills up)."""
    import torch  # here, not at the top: the flow imports this module and needs no torch

    try:
        torch.save(obj, path)
    except (OSError, RuntimeError) as e:
        reason = getattr(e, "strerror", None) or str(e).splitlines()[0]
        raise OSError(
            getattr(e, "errno", None) or 28, f"could not write {path}: {reason}; {free_space(path.parent)}"
        ) from e


@contextlib.contextmanager
def env_set(**overrides: str) -> Iterator[None]:
    """Environment variables set inside the block and put back as they were after (unset ones unset).

    For settings that read the environment (``CHATPIPE_PROFILE``) or libraries' switches
    (``HF_HUB_OFFLINE``): set for good, they would leak into everything the process starts later.
    """
    saved = {k: os.environ.get(k) for k in overrides}
    os.environ.update(overrides)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
