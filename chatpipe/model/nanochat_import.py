"""``chatpipe import-nanochat``: turn a nanochat checkpoint into a chatpipe model directory.

Accepted inputs (a file or the directory holding it):

- nanochat's own checkpoint: ``model_<step>.pt`` + ``meta_<step>.json`` (the newest step when a
  directory holds several; ``--step`` picks one). ``meta["model_config"]`` gives the shape;
- the reference vectors' layout: ``model.pt`` + ``config.json`` (the shape at the top level).

The output (``--out``, default ``artifacts/imported``) is what
:func:`chatpipe.model.files.save_model_dir` writes: ``model.pt`` (chatpipe parameter names)
and ``meta.json`` (``model_config``, ``stage``, ``step``, ``settings`` with the learning rates RL
scales, and a ``nanochat`` record of where it came from). :func:`chatpipe.model.files.load_model`,
every stage's ``init_dir`` and ``chatpipe chat/serve --model DIR`` accept it.

Tokenizer: a reference checkpoint has none. ``--tokenizer DIR`` copies a chatpipe tokenizer
directory, or converts nanochat's ``tokenizer.pkl`` (a pickled tiktoken encoding with the same
nine special tokens; only unpickle files you trust). Without it a *byte fallback* tokenizer is
written to ``DIR/tokenizer/``: the 256 bytes, filler ids that decode to U+FFFD, and the special
tokens as the last nine ids, so it has exactly the model's vocab and ``chatpipe chat`` runs. Its
text is only meaningful for a model trained on raw bytes; for any other model pass the real one.

nanochat's 2026 ``GPT`` (value embeddings, lambdas, smear, backout, rotary base 100000, q/k scale
1.2, quarter windows, vocab padded to 64) is recognised by its parameters (``resid_lambdas``);
an older checkpoint without them loads with the original options.

    python -m chatpipe.cli import-nanochat ~/.cache/nanochat/base_checkpoints/d24 --out artifacts/base
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from chatpipe.io import sha256_file
from chatpipe.model.files import save_model_dir
from chatpipe.model.gpt import GPT, GPTConfig, nanochat_options
from chatpipe.tokenizer import SPECIAL_TOKENS, SPLIT_PATTERN, Tokenizer

log = logging.getLogger(__name__)

SHAPE_KEYS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "window_pattern")
# nanochat's setup_optimizer defaults: RL and chat stages scale the init model's learning rates
NANOCHAT_LRS = {"matrix_lr": 0.02, "embedding_lr": 0.3, "unembedding_lr": 0.008}
STAGE_BY_DIR = {"base": "pretrain", "mid": "midtrain", "sft": "sft", "rl": "rl"}


def find_checkpoint(source: Path, step: int | None = None) -> tuple[Path, dict[str, Any]]:
    """(weights file, nanochat meta dict with ``model_config``) for a file or directory ``source``."""
    source = Path(source)
    if not source.exists():
        raise FileNotFoundError(f"{source}: no such file or directory")
    folder = source.parent if source.is_file() else source
    if (folder / "config.json").exists() and (source.is_dir() or source.name == "model.pt"):
        weights = folder / "model.pt"
        if not weights.exists():
            raise FileNotFoundError(f"{weights}: missing (config.json found beside it)")
        return weights, {"model_config": json.loads((folder / "config.json").read_text())}
    if source.is_file():
        m = re.fullmatch(r"model_(\d+)\.pt", source.name)
        if not m:
            raise ValueError(f"{source}: expected model_<step>.pt (nanochat) or model.pt beside config.json")
        step = int(m.group(1))
    steps = sorted(
        int(m.group(1)) for p in folder.glob("model_*.pt") if (m := re.fullmatch(r"model_(\d+)\.pt", p.name))
    )
    if not steps:
        raise FileNotFoundError(f"{folder}: no model_<step>.pt + meta_<step>.json and no model.pt + config.json")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise FileNotFoundError(f"{folder}: no model_{step:06d}.pt; steps present: {steps}")
    weights = next(p for p in folder.glob("model_*.pt") if int(p.stem.split("_")[1]) == step)
    meta_path = folder / f"meta_{weights.stem.split('_')[1]}.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{meta_path}: missing (nanochat writes it beside {weights.name})")
    meta = json.loads(meta_path.read_text())
    if "model_config" not in meta:
        raise ValueError(f"{meta_path}: no 'model_config' key")
    meta.setdefault("step", step)
    return weights, meta


def convert_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """nanochat parameter names -> chatpipe's, every floating tensor in fp32."""
    out = {}
    for name, tensor in state.items():
        name = name.removeprefix("_orig_mod.")  # saved from a torch.compile'd module
        name = re.sub(r"^transformer\.wte\.", "wte.", name)
        name = re.sub(r"^transformer\.h\.", "blocks.", name)
        out[name] = tensor.float() if tensor.is_floating_point() else tensor
    return out


def config_for(shape: dict[str, Any], state: dict[str, torch.Tensor]) -> GPTConfig:
    """The GPTConfig that computes what nanochat computes for this shape and these parameters."""
    missing = [k for k in SHAPE_KEYS if k not in shape and k != "window_pattern"]
    if missing:
        raise ValueError(f"nanochat model_config lacks {missing}; has {sorted(shape)}")
    base = {k: shape[k] for k in SHAPE_KEYS if k in shape}
    if "resid_lambdas" in state:  # nanochat 2026: every option on
        return GPTConfig(**base, **nanochat_options(base["sequence_len"]))
    rows = state["wte.weight"].shape[0]
    pad = 64 if rows != base["vocab_size"] and rows % 64 == 0 else 1
    return GPTConfig(**base, pad_vocab_to=pad)


def byte_fallback_tokenizer(vocab_size: int) -> Tokenizer:
    """A tokenizer with exactly ``vocab_size`` ids: 256 bytes, fillers, then the special tokens.

    Fillers are ``0xFF`` + two bytes: 0xFF never occurs in UTF-8, so encoding text never yields
    them and decoding them gives U+FFFD.
    """
    fillers = vocab_size - 256 - len(SPECIAL_TOKENS)
    if fillers < 0:
        raise ValueError(
            f"vocab_size {vocab_size} < 256 bytes + {len(SPECIAL_TOKENS)} special tokens: "
            "a byte tokenizer does not fit; pass --tokenizer"
        )
    ranks = {bytes([i]): i for i in range(256)}
    ranks.update({b"\xff" + i.to_bytes(2, "big"): 256 + i for i in range(fillers)})
    return Tokenizer.from_ranks(ranks, SPLIT_PATTERN)


def load_tokenizer(path: Path) -> Tokenizer:
    """A chatpipe tokenizer directory, or nanochat's ``tokenizer.pkl`` (file or its directory)."""
    path = Path(path)
    if path.is_dir() and (path / "tokenizer.json").exists():
        return Tokenizer.load(path)
    pkl = path / "tokenizer.pkl" if path.is_dir() else path
    if not pkl.exists():
        raise FileNotFoundError(
            f"{path}: neither a chatpipe tokenizer dir (tokenizer.json) nor nanochat's tokenizer.pkl"
        )
    import pickle

    with open(pkl, "rb") as f:
        enc = pickle.load(f)  # nanochat pickles its tiktoken.Encoding; trusted input only
    return Tokenizer(enc)


def import_nanochat(
    source: Path, out: Path, *, tokenizer: Path | None = None, step: int | None = None, stage: str | None = None
) -> Path:
    """Convert ``source`` (see the module docstring) into a chatpipe model dir at ``out``; returns ``out``."""
    weights, nano_meta = find_checkpoint(Path(source), step)
    state = convert_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    config = config_for(nano_meta["model_config"], state)
    model = GPT(config)
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"{weights}: parameters do not match a chatpipe GPT of {config}: "
            f"missing {result.missing_keys}, unexpected {result.unexpected_keys}"
        )
    if stage is None:  # nanochat's folders: base_checkpoints, mid_checkpoints, chatsft_checkpoints, chatrl_...
        parent = weights.parent.parent.name
        stage = next(
            (s for k, s in STAGE_BY_DIR.items() if parent.startswith(k) or parent == f"chat{k}_checkpoints"), "pretrain"
        )
    user = nano_meta.get("user_config", {}) or {}
    settings = {k: user.get(k, v) for k, v in NANOCHAT_LRS.items()}
    meta = {
        "stage": stage,
        "source_stage": "nanochat",
        "step": nano_meta.get("step"),
        "model_config": config.to_dict(),
        "settings": settings,
        "nanochat": {
            "source": str(weights.resolve()),
            "sha256": sha256_file(weights),
            "meta": {k: v for k, v in nano_meta.items() if k in ("step", "val_bpb", "model_config", "user_config")},
        },
    }
    out = Path(out)
    tok = load_tokenizer(tokenizer) if tokenizer is not None else None
    if tok is None:
        tok = byte_fallback_tokenizer(config.vocab_size)
        meta["tokenizer"] = "byte fallback (no tokenizer given)"
        log.warning("no --tokenizer: wrote a byte fallback tokenizer; replies are bytes, not nanochat's tokens")
    elif tok.vocab_size > config.vocab_size:
        raise ValueError(f"{tokenizer}: {tok.vocab_size} ids but the model has only {config.vocab_size}")
    with tempfile.TemporaryDirectory() as tmp:  # saved apart, then copied in with the model, all or nothing
        tok.save(Path(tmp) / "tokenizer")
        save_model_dir(out, model, meta, tokenizer_dir=Path(tmp) / "tokenizer")
    log.info("imported %s -> %s (%s)", weights, out, config)
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI: ``chatpipe import-nanochat CHECKPOINT_DIR_OR_FILE [--out DIR] [--tokenizer DIR] [--step N]``."""
    p = argparse.ArgumentParser(prog="chatpipe import-nanochat", description=__doc__.splitlines()[0])
    p.add_argument("source", type=Path, help="nanochat checkpoint dir or model_<step>.pt, or model.pt + config.json")
    p.add_argument("--out", type=Path, default=Path("artifacts/imported"), help="model dir to write")
    p.add_argument("--tokenizer", type=Path, help="chatpipe tokenizer dir or nanochat tokenizer.pkl")
    p.add_argument("--step", type=int, help="which model_<step>.pt (default: the newest)")
    p.add_argument(
        "--stage", choices=sorted(set(STAGE_BY_DIR.values())), help="recorded stage (default: from the path)"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = import_nanochat(args.source, args.out, tokenizer=args.tokenizer, step=args.step, stage=args.stage)
    print(f"wrote {out} (chatpipe chat --model {out})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
