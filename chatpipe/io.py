"""Small file helpers every layer uses: content hashes, all-or-nothing writes (:func:`atomic_write`,
the one place that renames a temp file into place), torch saves that name the file and the free space
when the disk fills up, YAML reads through libyaml."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

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


def _beside(path: Path, kind: str) -> Path:
    """A hidden name next to ``path`` (same directory, so same filesystem: the rename is atomic), unique
    to this process and call (two threads or ranks writing the same file never share a temp name)."""
    return path.with_name(f".{path.name}.{kind}{os.getpid()}-{secrets.token_hex(4)}")


@contextlib.contextmanager
def atomic_write(path: str | Path, mode: str = "w", *, fsync: bool = True, **open_kw: Any) -> Iterator[IO]:
    """Open a temp file beside ``path`` for writing; on a clean exit flush, fsync and ``os.replace`` it
    onto ``path``; on an error remove it. Readers (and a process killed mid-write) see the old file
    or the whole new one, never a part.

    ``mode`` is ``"w"`` or ``"wb"``; ``open_kw`` goes to ``open`` (``encoding``, ``newline``).
    ``fsync=False`` skips the fsync for files whose completeness a later fsynced file vouches for
    (the token store's shards: its manifest is written last).

        with atomic_write(path) as f:
            f.write(text)
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write mode {mode!r}: allowed 'w', 'wb'")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _beside(path, "tmp")
    try:
        with open(tmp, mode.replace("w", "x"), **open_kw) as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str, **open_kw: Any) -> None:
    """``path.write_text(text)`` through :func:`atomic_write`."""
    with atomic_write(path, **open_kw) as f:
        f.write(text)


def write_bytes_atomic(path: str | Path, data: bytes, *, fsync: bool = True) -> None:
    """``path.write_bytes(data)`` through :func:`atomic_write`."""
    with atomic_write(path, "wb", fsync=fsync) as f:
        f.write(data)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON through :func:`atomic_write`."""
    with atomic_write(path) as f:
        json.dump(obj, f, indent=2, sort_keys=True, default=str)


def _temp_dir_beside(final: Path) -> Path:
    """A new empty hidden directory beside ``final``, to fill and then move in with :func:`_replace_dir`."""
    tmp = _beside(final, "tmp")
    tmp.mkdir(parents=True)
    return tmp


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """A temp directory beside ``final`` that replaces ``final`` on a clean exit and is removed on an error."""
    tmp = _temp_dir_beside(final)
    try:
        yield tmp
        _replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished temp dir to ``final``, replacing any old one with no window where neither exists."""
    if final.exists():
        old = _beside(final, "old")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


def move_into_place(src: Path, dest: Path) -> None:
    """Rename a finished file or directory (made elsewhere on the same filesystem) to ``dest``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(src, dest)


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
