"""A model directory: the final model a stage hands on (``artifacts/<name>/``) and how to load it.

Layout: ``model.pt`` (the GPT's state dict), ``meta.json`` (``model_config``, ``stage``,
``step``, ``inputs`` (the hashes of what trained it, the tokenizer's ``tokenizer.json`` among them),
... and ``files``, the sha256 of ``model.pt``), ``tokenizer/`` (the tokenizer it was trained with,
so a copy of the directory loads anywhere) and ``manifest.json``: the sha256 of every file of the
directory, ``meta.json`` and ``tokenizer/`` included. Written all or nothing by
:func:`save_model_dir`; :func:`load_model` refuses a directory whose files do not match the
manifest, so a hand-edited ``meta.json`` (``rotary_base``, say) or a swapped tokenizer cannot
silently change the model. Directories written before models carried a tokenizer have none.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from chatpipe.io import atomic_dir, save_torch, sha256_file, write_json_atomic

MANIFEST = "manifest.json"
TOKENIZER = "tokenizer"  # the model's own tokenizer, a folder beside its weights


def _listed_files(model_dir: Path) -> list[Path]:
    """Every file under ``model_dir`` the manifest vouches for: all but itself and hidden temp files."""
    return sorted(
        p
        for p in model_dir.rglob("*")
        if p.is_file()
        and p.name != MANIFEST
        and not any(part.startswith(".") for part in p.relative_to(model_dir).parts)
    )


def write_manifest(model_dir: Path) -> Path:
    """(Re)write ``model_dir/manifest.json``: the sha256 of every file in the directory. Call it after
    adding files to a model dir (a ``tokenizer/`` beside the model) so that they are verified too."""
    digests = {p.relative_to(model_dir).as_posix(): sha256_file(p) for p in _listed_files(model_dir)}
    write_json_atomic(model_dir / MANIFEST, {"format": 1, "sha256": digests})
    return model_dir / MANIFEST


def save_model_dir(
    out_dir: Path, model: torch.nn.Module, meta: dict[str, Any], tokenizer_dir: Path | None = None
) -> None:
    """Atomically write a stage's final model (``model.pt`` + ``meta.json`` + ``manifest.json``) to ``out_dir``.

    ``tokenizer_dir``: the tokenizer the model was trained with, copied in as ``tokenizer/`` and listed
    in the manifest (None only for models made outside the pipeline: tests, benches).
    """
    for stale in out_dir.parent.glob(f".{out_dir.name}.*"):  # left by a killed save
        shutil.rmtree(stale, ignore_errors=True)
    with atomic_dir(out_dir) as tmp:
        save_torch(tmp / "model.pt", model.state_dict())
        write_json_atomic(tmp / "meta.json", {**meta, "files": {"model.pt": sha256_file(tmp / "model.pt")}})
        if tokenizer_dir is not None:
            copy_tokenizer(Path(tokenizer_dir), tmp / TOKENIZER, meta)
        write_manifest(tmp)


def copy_tokenizer(src: Path, dst: Path, meta: dict[str, Any]) -> None:
    """The files :meth:`chatpipe.tokenizer.Tokenizer.load` reads, from ``src`` into the new folder ``dst``.

    It must be the tokenizer ``meta`` records in ``inputs.tokenizer`` (when it records one): a
    tokenizer retrained while the stage ran would otherwise travel with weights it never trained.
    """
    from chatpipe.tokenizer import CONFIG_FILE, RANKS_FILE, TOKEN_BYTES_FILE

    dst.mkdir()
    for name in (CONFIG_FILE, RANKS_FILE, TOKEN_BYTES_FILE):
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
        elif name != TOKEN_BYTES_FILE:  # bits-per-byte only: a tokenizer loads without it
            raise FileNotFoundError(f"{src / name}: tokenizer file missing; run the `tokenizer` stage first")
    inputs = meta.get("inputs")
    recorded = inputs.get("tokenizer") if isinstance(inputs, dict) else None
    if recorded is not None and sha256_file(dst / CONFIG_FILE) != recorded:
        raise ValueError(
            f"{src / CONFIG_FILE}: not the tokenizer the model was trained with (sha256 {str(recorded)[:12]}... "
            "in its meta inputs): it changed while the stage ran; re-run the stage"
        )


def read_json(path: Path, what: str) -> dict[str, Any]:
    """A JSON object from ``path``; unreadable, not JSON, or not an object: ValueError naming the file."""
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ValueError(f"{path}: corrupt {what} ({e}); re-run the stage that wrote it") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: corrupt {what} (a JSON object expected, got {type(data).__name__})")
    return data


def read_meta(model_dir: Path) -> dict[str, Any]:
    """The meta.json of a stage output, with a clear error when the stage has not run."""
    path = model_dir / "meta.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: run the stage that produces {model_dir} first")
    return read_json(path, "model meta")


def _check_digest(path: Path, digest: Any, record: Path) -> None:
    if not path.is_file():
        raise ValueError(f"{path}: missing (listed in {record})")
    actual = sha256_file(path)
    if actual != digest:
        raise ValueError(
            f"{path}: sha256 {actual[:12]}... does not match {str(digest)[:12]}... recorded in "
            f"{record} (corrupted or modified); re-run the stage that wrote it"
        )


def verify_manifest(model_dir: Path) -> None:
    """Every file of ``model_dir`` matches ``manifest.json``, which lists model.pt and meta.json at least."""
    path = model_dir / MANIFEST
    if not path.exists():
        raise ValueError(
            f"{path}: missing, so {model_dir}'s files (meta.json included) cannot be checked; re-run the stage "
            "that wrote it, or vouch for the files as they are with chatpipe.model.files.write_manifest"
        )
    digests = read_json(path, "model manifest").get("sha256")
    if not isinstance(digests, dict) or not {"model.pt", "meta.json"} <= set(digests):
        raise ValueError(f"{path}: corrupt model manifest (no sha256 of model.pt and meta.json)")
    for name, digest in digests.items():
        target = (model_dir / name).resolve()
        if not str(name) or model_dir.resolve() not in target.parents:
            raise ValueError(f"{path}: lists {name!r}, which is not a file inside {model_dir}")
        _check_digest(target, digest, path)


def verify_model_dir(model_dir: Path, meta: dict[str, Any] | None = None) -> None:
    """Raise ValueError naming the file when a file of a stage output does not match the sha256
    recorded in its manifest or its meta.json (a bit flip, a truncated copy, a hand-edited file)."""
    verify_manifest(model_dir)
    meta = read_meta(model_dir) if meta is None else meta
    recorded = meta.get("files")
    if not isinstance(recorded, dict) or not recorded:
        raise ValueError(
            f"{model_dir / 'meta.json'}: no 'files' sha256 record; re-run the stage that wrote {model_dir}"
        )
    for name, digest in recorded.items():
        _check_digest(model_dir / name, digest, model_dir / "meta.json")


def load_model(model_dir: Path | str, device: str | torch.device = "cpu"):
    """Load a stage's final GPT from ``model_dir`` (e.g. ``artifacts/base``); returns (model, meta)."""
    from chatpipe.model.gpt import GPT, GPTConfig  # local import keeps this module light for the flow

    model_dir = Path(model_dir)
    meta = read_meta(model_dir)
    verify_model_dir(model_dir, meta)
    # Built on the target device (not "meta") so non-persistent buffers such as rotary tables exist.
    try:
        with torch.device(device):
            model = GPT(GPTConfig.from_dict(meta["model_config"]))
    except (KeyError, TypeError, ValueError, ZeroDivisionError, AssertionError) as e:
        raise ValueError(f"{model_dir / 'meta.json'}: bad model_config ({e!r})") from None
    try:
        state = torch.load(model_dir / "model.pt", map_location=device, weights_only=True)
        model.load_state_dict(state)
    except (RuntimeError, ValueError, EOFError, OSError) as e:
        raise ValueError(f"{model_dir / 'model.pt'}: not the weights meta.json describes ({e})") from None
    model.eval()
    return model, meta
