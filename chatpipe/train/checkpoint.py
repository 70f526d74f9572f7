"""Checkpoints: in-progress training state and the final model each stage hands on.

Layout of an in-progress checkpoint (``checkpoints/<stage>/step_000100/``)::

    model.pt       model state dict                (rank 0)
    optim.pt       list of optimizer state dicts   (rank 0; plain DDP keeps them identical)
    rank0.pt ...   RNG states of every rank, as tensors, numbers and lists
    meta.json      step, settings, fingerprint, loop state, sha256 of every file above

Every file is read with ``torch.load(..., weights_only=True)``: data only, never code. A checksum
in ``meta.json`` says a file is the one written, not that it is safe (whoever replaces a file can
rewrite its hash), so a file that needs unpickling to load (planted, or a ``rank*.pt`` of an older
chatpipe, which kept numpy's RNG state as an array) is refused: a bad ``optim.pt`` skips the
checkpoint, a ``rank*.pt`` of the old form resumes with the RNG re-seeded and a warning.

Every checkpoint is written into a hidden temp dir and renamed into place only when complete,
so a killed run never leaves a half-written ``step_*`` dir. ``meta.json`` carries checksums:
a checkpoint truncated on disk later is detected and the previous one is used, with a warning.

A stage's final output (``artifacts/<name>/``: ``model.pt`` + ``meta.json``) is written and loaded
by :mod:`chatpipe.model.files`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chatpipe.io import atomic_dir, free_space, save_torch, sha256_file, write_json_atomic

log = logging.getLogger(__name__)

STEP_PREFIX = "step_"


# --------------------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    """Every RNG a training step can touch, for exact resume, in types ``weights_only`` loads:
    tensors, numbers, strings, lists and dicts."""
    version, words, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": [version, list(words), gauss],
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos)},
    }
    state["numpy"] |= {"has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    torch.set_rng_state(state["torch"])
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words), gauss))
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --------------------------------------------------------------------------- in-progress checkpoints


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def save_checkpoint(
    work_dir: Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizers: list,
    meta: dict[str, Any],
    rank: int = 0,
    keep: int = 2,
) -> Path | None:
    """Collectively write ``work_dir/step_<step>``: every rank must call this.

    Rank 0 writes model and optimizer state and ``meta.json``; each rank writes its RNG state.
    A write that fails (full disk, quota) removes the temp dir and raises :class:`OSError` naming
    the file and the free space left. Then rank 0 prunes by :func:`prune_checkpoints`.
    Returns the final path on rank 0.
    """
    final = work_dir / f"{STEP_PREFIX}{step:06d}"
    if rank == 0:
        sweep_temps(work_dir)  # leftovers of a save a kill interrupted; runs of a stage never overlap
        work_dir.mkdir(parents=True, exist_ok=True)
    # rank 0 owns the temp dir (removed if its part fails); every rank writes its RNG file into it
    with atomic_dir(final) if rank == 0 else contextlib.nullcontext() as mine:
        tmp = _rank0_path(mine)
        save_torch(tmp / f"rank{rank}.pt", rng_state())
        if rank == 0:
            save_torch(tmp / "model.pt", model.state_dict())
            save_torch(tmp / "optim.pt", [opt.state_dict() for opt in optimizers])
        _barrier()
        if rank == 0:
            try:
                files = {p.name: sha256_file(p) for p in sorted(tmp.glob("*.pt"))}
                write_json_atomic(tmp / "meta.json", {**meta, "step": step, "files": files})
            except OSError as e:
                raise OSError(e.errno, f"could not write {tmp / 'meta.json'}: {e}; {free_space(work_dir)}") from e
    if rank == 0:
        prune_checkpoints(work_dir, keep, meta.get("fingerprint"), newest=final)
    _barrier()
    return final if rank == 0 else None


def _rank0_path(path: Path | None) -> Path:
    """Rank 0's ``path``, on every rank (one broadcast; the path itself in a single process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return path
    box = [str(path) if path is not None else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return Path(box[0])


def sweep_temps(work_dir: Path) -> list[Path]:
    """Remove hidden temp entries (``.step_*.tmp``, ``.<name>.tmp<pid>``, ``.<name>.old<pid>``) that a
    killed save left in ``work_dir``; returns what was removed.

    Safe only while no other process writes into ``work_dir``: DVC's lock keeps one run per stage.
    """
    removed = []
    if not work_dir.exists():
        return removed
    for p in work_dir.iterdir():
        if p.name.startswith(".") and (".tmp" in p.name or ".old" in p.name):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def _step_of(path: Path) -> int:
    try:
        return int(path.name[len(STEP_PREFIX) :])
    except ValueError:
        return -1


def _fingerprint_of(path: Path) -> str | None:
    try:
        return json.loads((path / "meta.json").read_text()).get("fingerprint")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def list_checkpoints(work_dir: Path, fingerprint_: str | None = None) -> list[Path]:
    """Step dirs in ``work_dir`` (only those of run ``fingerprint_`` when given), highest step first.

    Ordered by the step number, not the name, so ``step_1000000`` comes before ``step_999999``.
    """
    if not work_dir.exists():
        return []
    found = [p for p in work_dir.glob(f"{STEP_PREFIX}*") if p.is_dir() and _step_of(p) >= 0]
    if fingerprint_ is not None:
        found = [p for p in found if _fingerprint_of(p) == fingerprint_]
    return sorted(found, key=_step_of, reverse=True)


def prune_checkpoints(work_dir: Path, keep: int, fingerprint_: str | None = None, newest: Path | None = None) -> None:
    """Keep the ``keep`` newest checkpoints of run ``fingerprint_`` ending at ``newest`` (just written).

    The rule, applied by rank 0 after each save (``newest`` verified by its writer):

    * the current run (same fingerprint): ``newest`` and the ``keep - 1`` next lower steps stay;
      same-run steps above ``newest`` are dropped: resume skipped them, so they failed verification;
    * other runs (another fingerprint, or an unreadable meta.json): dropped, since the current run
      now has a valid checkpoint of its own. Their final models live on in ``artifacts/`` and
      the DVC cache; only their mid-run resume points go.

    Without ``fingerprint_``, every run's checkpoints count alike (newest ``keep`` steps stay).
    """
    keep = max(1, keep)
    if fingerprint_ is None:
        for old in list_checkpoints(work_dir)[keep:]:
            shutil.rmtree(old, ignore_errors=True)
        return
    ours = list_checkpoints(work_dir, fingerprint_)
    top = _step_of(newest) if newest is not None else (_step_of(ours[0]) if ours else -1)
    kept = [p for p in ours if _step_of(p) <= top][:keep]
    for path in list_checkpoints(work_dir):
        if path not in kept:
            shutil.rmtree(path, ignore_errors=True)


def _read_meta(path: Path) -> dict[str, Any]:
    """A checkpoint's meta.json; ValueError naming the file when it is unreadable or not what save wrote."""
    meta_path = path / "meta.json"
    try:
        meta = json.loads(meta_path.read_bytes())
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{meta_path}: unreadable ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path}: not a JSON object")
    step = meta.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step != _step_of(path):
        raise ValueError(f"{meta_path}: step = {step!r}, but the directory is {path.name}")
    files = meta.get("files")
    if not isinstance(files, dict) or "model.pt" not in files or "optim.pt" not in files:
        # an empty record would verify nothing: the files a resume loads must be listed
        raise ValueError(f"{meta_path}: 'files' must list the sha256 of model.pt and optim.pt, got {files!r}")
    return meta


def verify_checkpoint(path: Path) -> str | None:
    """Return None if meta.json is sound and every file matches its checksum, else the reason (naming the file)."""
    try:
        meta = _read_meta(path)
    except ValueError as e:
        return str(e)
    for name, digest in meta["files"].items():
        f = path / str(name)
        if f.parent != path:
            return f"{path / 'meta.json'}: lists {name!r}, not a file of the checkpoint"
        if not f.is_file():
            return f"{f}: missing"
        if sha256_file(f) != digest:
            return f"{f}: checksum mismatch (truncated or corrupted)"
    return None


def latest_checkpoint(work_dir: Path, fingerprint_: str | None = None, skip: tuple[Path, ...] = ()) -> Path | None:
    """Newest checkpoint that verifies and (if given) matches ``fingerprint_``; warns on skipped ones."""
    for path in list_checkpoints(work_dir):
        if path in skip:
            continue
        problem = verify_checkpoint(path)
        if problem:
            log.warning("skipping checkpoint %s: %s", path, problem)
            continue
        meta = _read_meta(path)
        if fingerprint_ is not None and meta.get("fingerprint") != fingerprint_:
            log.warning(
                "skipping checkpoint %s: made with different settings or inputs (fingerprint %s, now %s)",
                path,
                meta.get("fingerprint"),
                fingerprint_,
            )
            continue
        return path
    return None


def _read_states(path: Path, rank: int) -> tuple[dict[str, Any], Any, Any, Any]:
    """Everything a resume needs from ``path``, read before any of it is applied: a file that fails to
    load then leaves the model and optimizers untouched, and the caller can fall back."""
    meta = _read_meta(path)
    model_state = torch.load(path / "model.pt", map_location="cpu", weights_only=True)
    optim_states = torch.load(path / "optim.pt", map_location="cpu", weights_only=True)
    if not isinstance(optim_states, list):
        raise ValueError(f"{path / 'optim.pt'}: not a list of optimizer states")
    return meta, model_state, optim_states, _read_rng(path / f"rank{rank}.pt")


def _read_rng(rank_file: Path) -> dict[str, Any] | None:
    """A rank's RNG states, or None (the caller re-seeds) when the file is missing or would need
    unpickling: an older chatpipe kept numpy's state as an array, and a planted file runs code."""
    if not rank_file.exists():
        return None
    try:
        state = torch.load(rank_file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        log.warning(
            "%s: not loaded, it needs unpickling (%s); an older chatpipe wrote RNG states this way: the run "
            "resumes with its model and optimizers and a re-seeded RNG, so it is no longer bitwise the "
            "uninterrupted run",
            rank_file,
            str(e).splitlines()[0][:200],
        )
        return None
    return state if isinstance(state, dict) and isinstance(state.get("python"), list) else None


def load_checkpoint(
    path: Path, *, model: torch.nn.Module, optimizers: list, rank: int = 0, world_size: int = 1
) -> dict[str, Any]:
    """Load model, optimizer and this rank's RNG state from ``path``; return its meta dict."""
    meta, model_state, optim_states, rng = _read_states(path, rank)
    if len(optim_states) != len(optimizers):
        raise ValueError(f"{path / 'optim.pt'}: {len(optim_states)} optimizer states for {len(optimizers)} optimizers")
    model.load_state_dict(model_state)
    for opt, state in zip(optimizers, optim_states):
        opt.load_state_dict(state)
    if meta.get("world_size") == world_size and rng is not None:
        set_rng_state(rng)
    elif meta.get("world_size") != world_size:
        log.warning(
            "checkpoint %s was written by %s ranks, now %s: RNG states re-seeded, model and optimizer restored",
            path,
            meta.get("world_size"),
            world_size,
        )
    return meta


def resume_latest(
    work_dir: Path, fingerprint_: str, *, model: torch.nn.Module, optimizers: list, rank: int = 0, world_size: int = 1
) -> dict[str, Any] | None:
    """Load the newest valid checkpoint of the run ``fingerprint_`` into model and optimizers.

    A checkpoint that verifies but still fails to load (a file torch cannot read, a state of the
    wrong shape) is skipped with a warning, like one that fails verification, and the one before it
    is tried. Returns its meta dict, or None when the run has no usable checkpoint (a fresh start).
    """
    tried: tuple[Path, ...] = ()
    while (ckpt := latest_checkpoint(work_dir, fingerprint_, skip=tried)) is not None:
        try:
            meta = load_checkpoint(ckpt, model=model, optimizers=optimizers, rank=rank, world_size=world_size)
        except (OSError, RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError) as e:
            log.warning("skipping checkpoint %s: it does not load (%s)", ckpt, str(e).splitlines()[0] if str(e) else e)
            tried += (ckpt,)
            continue
        log.info("resuming from %s (step %d)", ckpt, meta["step"])
        return meta
    return None


def carried_over(meta: dict[str, Any] | None) -> dict[str, Any]:
    """What a resumed run continues from its checkpoint's ``carried`` record: running totals
    (train seconds, tokens) and the MLflow run ids that trained the steps so far."""
    return dict((meta or {}).get("carried") or {})


def producing_runs(carried: dict[str, Any], run_id: str | None, *, trains: bool) -> list[str]:
    """MLflow run ids that trained this model: those carried over, plus ``run_id`` if it trains a step.

    A resume from the final checkpoint trains nothing, so it adds nothing and the stage output
    (its meta.json included) comes out byte-identical to the one the training run wrote.
    ``run_id`` is None when tracking is off.
    """
    ids = list(carried.get("mlflow_run_ids") or [])
    if trains and run_id is not None:
        ids.append(run_id)
    return ids
