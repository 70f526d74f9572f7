"""Checkpoints: in-progress training state and the final model each stage hands on.

Layout of an in-progress checkpoint (``checkpoints/<stage>/step_000100/``)::

    model.pt       model state dict                (rank 0)
    optim.pt       list of optimizer state dicts   (rank 0; plain DDP keeps them identical)
    rank0.pt ...   RNG states of every rank
    meta.json      step, settings, fingerprint, loop state, sha256 of every file above

Every checkpoint is written into a hidden temp dir and renamed into place only when complete,
so a killed run never leaves a half-written ``step_*`` dir. ``meta.json`` carries checksums:
a checkpoint truncated on disk later is detected and the previous one is used, with a warning.

A stage's final output (``artifacts/<name>/``: ``model.pt`` + ``meta.json``) is what the next
stage loads with :func:`load_model`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from chatpipe.io import replace_dir, sha256_file, write_json_atomic

log = logging.getLogger(__name__)

ARTIFACTS = Path("artifacts")  # DVC-tracked stage outputs
WORK = Path("checkpoints")  # in-progress checkpoints; not DVC outs, so they survive a failed run
STEP_PREFIX = "step_"


# --------------------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    """Every RNG a training step can touch, for exact resume."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
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
    Returns the final path on rank 0.
    """
    name = f"{STEP_PREFIX}{step:06d}"
    tmp = work_dir / f".{name}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    torch.save(rng_state(), tmp / f"rank{rank}.pt")
    if rank == 0:
        torch.save(model.state_dict(), tmp / "model.pt")
        torch.save([opt.state_dict() for opt in optimizers], tmp / "optim.pt")
    _barrier()
    final = work_dir / name
    if rank == 0:
        files = {p.name: sha256_file(p) for p in sorted(tmp.glob("*.pt"))}
        write_json_atomic(tmp / "meta.json", {**meta, "step": step, "files": files})
        replace_dir(tmp, final)
        prune_checkpoints(work_dir, keep)
    _barrier()
    return final if rank == 0 else None


def list_checkpoints(work_dir: Path) -> list[Path]:
    """Step dirs in ``work_dir``, newest first."""
    if not work_dir.exists():
        return []
    return sorted(work_dir.glob(f"{STEP_PREFIX}*"), reverse=True)


def prune_checkpoints(work_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints."""
    for old in list_checkpoints(work_dir)[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def verify_checkpoint(path: Path) -> str | None:
    """Return None if every file matches its checksum in meta.json, else the reason it does not."""
    meta_path = path / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return f"{meta_path}: unreadable ({e})"
    for name, digest in meta.get("files", {}).items():
        f = path / name
        if not f.exists():
            return f"{f}: missing"
        if sha256_file(f) != digest:
            return f"{f}: checksum mismatch (truncated or corrupted)"
    return None


def latest_checkpoint(work_dir: Path, fingerprint_: str | None = None) -> Path | None:
    """Newest checkpoint that verifies and (if given) matches ``fingerprint_``; warns on skipped ones."""
    for path in list_checkpoints(work_dir):
        problem = verify_checkpoint(path)
        if problem:
            log.warning("skipping checkpoint %s: %s", path, problem)
            continue
        meta = json.loads((path / "meta.json").read_text())
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


def load_checkpoint(
    path: Path, *, model: torch.nn.Module, optimizers: list, rank: int = 0, world_size: int = 1
) -> dict[str, Any]:
    """Load model, optimizer and this rank's RNG state from ``path``; return its meta dict."""
    meta = json.loads((path / "meta.json").read_text())
    model.load_state_dict(torch.load(path / "model.pt", map_location="cpu", weights_only=True))
    for opt, state in zip(optimizers, torch.load(path / "optim.pt", map_location="cpu", weights_only=False)):
        opt.load_state_dict(state)
    rank_file = path / f"rank{rank}.pt"
    if meta.get("world_size") == world_size and rank_file.exists():
        set_rng_state(torch.load(rank_file, map_location="cpu", weights_only=False))
    else:
        log.warning(
            "checkpoint %s was written by %s ranks, now %s: RNG states re-seeded, model and optimizer restored",
            path,
            meta.get("world_size"),
            world_size,
        )
    return meta


# --------------------------------------------------------------------------- stage outputs


def save_model_dir(out_dir: Path, model: torch.nn.Module, meta: dict[str, Any]) -> None:
    """Atomically write a stage's final model (``model.pt`` + ``meta.json``) to ``out_dir``."""
    tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(model.state_dict(), tmp / "model.pt")
    write_json_atomic(tmp / "meta.json", {**meta, "files": {"model.pt": sha256_file(tmp / "model.pt")}})
    replace_dir(tmp, out_dir)


def read_meta(model_dir: Path) -> dict[str, Any]:
    """The meta.json of a stage output, with a clear error when the stage has not run."""
    path = model_dir / "meta.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run the stage that produces {model_dir} first")
    return json.loads(path.read_text())


def load_model(model_dir: Path | str, device: str | torch.device = "cpu"):
    """Load a stage's final GPT from ``model_dir`` (e.g. ``artifacts/base``); returns (model, meta)."""
    from chatpipe.model.gpt import GPT, GPTConfig  # local import keeps this module light for the flow

    model_dir = Path(model_dir)
    meta = read_meta(model_dir)
    # Built on the target device (not "meta") so non-persistent buffers such as rotary tables exist.
    with torch.device(device):
        model = GPT(GPTConfig.from_dict(meta["model_config"]))
    state = torch.load(model_dir / "model.pt", map_location=device, weights_only=True)
    model.load_state_dict(state)
    model.eval()
    return model, meta
