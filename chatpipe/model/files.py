"""A model directory: the final model a stage hands on (``artifacts/<name>/``) and how to load it.

Layout: ``model.pt`` (the GPT's state dict) and ``meta.json`` (``model_config``, ``stage``,
``step``, ... and ``files``, the sha256 of every file beside it). Written all or nothing by
:func:`save_model_dir`; :func:`load_model` refuses a directory whose files do not match their
recorded checksums.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from chatpipe.io import replace_dir, save_torch, sha256_file, write_json_atomic


def save_model_dir(out_dir: Path, model: torch.nn.Module, meta: dict[str, Any]) -> None:
    """Atomically write a stage's final model (``model.pt`` + ``meta.json``) to ``out_dir``."""
    for stale in out_dir.parent.glob(f".{out_dir.name}.*"):  # left by a killed save
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        save_torch(tmp / "model.pt", model.state_dict())
        write_json_atomic(tmp / "meta.json", {**meta, "files": {"model.pt": sha256_file(tmp / "model.pt")}})
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, out_dir)


def read_meta(model_dir: Path) -> dict[str, Any]:
    """The meta.json of a stage output, with a clear error when the stage has not run."""
    path = model_dir / "meta.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run the stage that produces {model_dir} first")
    return json.loads(path.read_text())


def verify_model_dir(model_dir: Path, meta: dict[str, Any] | None = None) -> None:
    """Raise ValueError naming the file when a file of a stage output does not match the sha256
    recorded in its meta.json (a bit flip, a truncated copy, a hand-edited file)."""
    meta = read_meta(model_dir) if meta is None else meta
    recorded = meta.get("files")
    if not recorded:
        raise ValueError(
            f"{model_dir / 'meta.json'}: no 'files' sha256 record; re-run the stage that wrote {model_dir}"
        )
    for name, digest in recorded.items():
        path = model_dir / name
        if not path.exists():
            raise ValueError(f"{path}: missing (listed in {model_dir / 'meta.json'})")
        actual = sha256_file(path)
        if actual != digest:
            raise ValueError(
                f"{path}: sha256 {actual[:12]}... does not match {digest[:12]}... recorded in "
                f"{model_dir / 'meta.json'} (corrupted or modified); re-run the stage that wrote it"
            )


def load_model(model_dir: Path | str, device: str | torch.device = "cpu"):
    """Load a stage's final GPT from ``model_dir`` (e.g. ``artifacts/base``); returns (model, meta)."""
    from chatpipe.model.gpt import GPT, GPTConfig  # local import keeps this module light for the flow

    model_dir = Path(model_dir)
    meta = read_meta(model_dir)
    verify_model_dir(model_dir, meta)
    # Built on the target device (not "meta") so non-persistent buffers such as rotary tables exist.
    with torch.device(device):
        model = GPT(GPTConfig.from_dict(meta["model_config"]))
    state = torch.load(model_dir / "model.pt", map_location=device, weights_only=True)
    model.load_state_dict(state)
    model.eval()
    return model, meta
