"""The pretraining token store: memory-mapped token shards written atomically, one set per text shard.

Layout of ``out_dir`` (a work directory, see :func:`tokenize_shards`)::

    train_00000.tokens.npy    flat token ids of the shard, every document starting with <|bos|>
    train_00000.offsets.npy   int64 document starts, ``len = n_docs + 1``, last = number of tokens
    train.index.npy           int64 ``[n_docs, 3]``: (shard, start, length) of every non-empty doc
    manifest.json             written last: fingerprint, format, shards, token counts, vocab size,
                              and per shard (``checks``) its document count, largest id, the sha256
                              of its offsets and the crc32 of its tokens

Every file is a plain ``.npy`` read with ``np.load(mmap_mode="r")``: a rank maps the files and the
operating system pages in only the tokens it reads, shared between the ranks of a node through the
page cache, so a rank's private memory does not grow with the corpus. Every file is written to a
temp name and renamed into place, and the manifest comes last, so a killed tokenizing run leaves
no file that looks finished but is not; the next run starts over.

Nothing read is trusted unchecked: :class:`TokenDocs` checks at open each shard's header against the
manifest, that its offsets rise and that the index stays inside them (cheap: no token is read), and
every document it hands out for ids beyond the vocabulary (streamed). :func:`verify_store` checks
every token against the crc32 recorded at write time; a cached store that fails it is rebuilt.
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import chain
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from chatpipe.io import atomic_write, sha256_file, write_json_atomic

TOKEN_MANIFEST = "manifest.json"
# Bumped when the layout changes, so a cache in an older layout is rebuilt, not misread.
STORE_FORMAT = 3


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every token id."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """``np.save`` to a temp file beside ``path``, then rename: readers see all or nothing.

    No fsync: the rename already protects against a killed process, and the manifest (written
    last, with fsync) is what marks the store complete; a per-file fsync made the tiny pipeline's
    tokenization measurably slower than before the store.
    """
    with atomic_write(path, "wb", fsync=False) as f:
        np.save(f, array)


log = logging.getLogger(__name__)


def read_manifest(manifest_path: Path) -> dict:
    """The store's manifest; one that is not a JSON object raises ValueError naming the file."""
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except ValueError as e:
        raise ValueError(
            f"{manifest_path}: corrupt token store manifest ({e}); delete it and re-run the stage"
        ) from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{manifest_path}: corrupt token store manifest (not a JSON object)")
    _check_types(manifest_path, manifest)
    return manifest


CHECK_TYPES = {"docs": int, "dtype": str, "max_id": int, "offsets_sha256": str, "tokens_crc32": int}


def _check_types(manifest_path: Path, manifest: dict) -> None:
    """The fields readers compare with are of the type written (a JSON edit can leave a null or a
    string where a count was): else ValueError naming the file and the field."""

    def wrong(value: object, kind: type) -> bool:
        return not isinstance(value, kind) or (kind is int and isinstance(value, bool))

    bad = []
    if manifest.get("vocab_size") is not None and wrong(manifest["vocab_size"], int):
        bad.append("vocab_size")
    checks = manifest.get("checks")
    if isinstance(checks, dict):
        for stem, check in checks.items():
            if isinstance(check, dict):
                bad += [f"checks.{stem}.{k}" for k, kind in CHECK_TYPES.items() if k in check and wrong(check[k], kind)]
    if bad:
        raise ValueError(
            f"{manifest_path}: corrupt token store manifest ({', '.join(bad)} not of the type written); "
            "delete the store and re-run the stage"
        )


def _is_current(manifest_path: Path, fingerprint: str) -> dict | None:
    """The manifest when the store holds this fingerprint's tokens, whole; None to (re)build it."""
    if not manifest_path.exists():
        return None
    try:
        manifest = read_manifest(manifest_path)
        if manifest.get("fingerprint") != fingerprint or manifest.get("format") != STORE_FORMAT:
            return None
        verify_store(manifest_path.parent, manifest)
    except ValueError as e:
        log.warning("rebuilding the token store: %s", e)
        return None
    return manifest


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            crc = zlib.crc32(block, crc)
    return crc


def _shard_checks(out_dir: Path, stem: str) -> dict:
    """What the manifest records of one shard, for the checks at open (cheap) and in :func:`verify_store`."""
    tokens, offsets = _load(out_dir / f"{stem}.tokens.npy"), _load(out_dir / f"{stem}.offsets.npy")
    return {
        "docs": len(offsets) - 1,
        "dtype": tokens.dtype.str,
        "max_id": int(tokens.max()) if len(tokens) else -1,
        "offsets_sha256": sha256_file(out_dir / f"{stem}.offsets.npy"),
        "tokens_crc32": _crc32(out_dir / f"{stem}.tokens.npy"),
    }


def verify_store(token_dir: Path, manifest: dict | None = None) -> None:
    """Every token file of the store against the crc32 its manifest records (reads every token once)."""
    manifest = manifest or read_manifest(token_dir / TOKEN_MANIFEST)
    checks = manifest.get("checks")
    if not isinstance(checks, dict) or not checks or not all(isinstance(c, dict) for c in checks.values()):
        raise ValueError(f"{token_dir / TOKEN_MANIFEST}: corrupt token store manifest (no per-shard checks)")
    for stem, check in checks.items():
        path = token_dir / f"{stem}.tokens.npy"
        if not path.is_file() or _crc32(path) != check.get("tokens_crc32"):
            raise ValueError(f"{path}: missing or changed since written (crc32 differs from {TOKEN_MANIFEST})")


def tokenize_shards(
    text_dir: Path,
    tokenizer,
    out_dir: Path,
    *,
    fingerprint: str,
    rank: int = 0,
    world_size: int = 1,
    batch_docs: int = 1024,
) -> dict:
    """Tokenize every ``*.parquet`` text shard in ``text_dir`` into the store ``out_dir`` (collective call).

    Ranks split the shards; rank 0 then writes each split's document index and the manifest. Skips
    all work if the manifest already records the same fingerprint and format. The store lives in
    the stage's work dir rather than being a DVC out: it is a cache derived from two DVC outs
    (data + tokenizer) keyed by their hashes, rebuilt by whoever needs it, and as a DVC out it
    would be copied into the DVC cache (twice the disk at speedrun size, ~12 GB) for no gain.
    """
    manifest_path = out_dir / TOKEN_MANIFEST
    if (manifest := _is_current(manifest_path, fingerprint)) is not None:
        return manifest
    shards = sorted(text_dir.glob("*.parquet"))
    if not shards:
        raise FileNotFoundError(f"{text_dir}: no *.parquet text shards; run the `data` stage first")
    out_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        manifest_path.unlink(missing_ok=True)  # from here on the store is in flux
        for stale in out_dir.glob(".*.tmp*"):  # temp files of a killed run
            stale.unlink(missing_ok=True)
    _barrier()  # no rank writes a temp file before rank 0 has swept the stale ones
    dtype = token_dtype(tokenizer.vocab_size)
    for i, shard in enumerate(shards):
        if i % world_size == rank:
            tokens, offsets = _tokenize_shard(shard, tokenizer, dtype, batch_docs)
            if len(tokens) and int(tokens.max()) >= tokenizer.vocab_size:  # checked once, where ids are made
                raise ValueError(f"{shard}: tokenizer produced id {int(tokens.max())} >= vocab {tokenizer.vocab_size}")
            save_shard(out_dir, shard.stem, tokens, offsets)
    _barrier()
    if rank == 0:
        counts = {s.stem: int(_load(out_dir / f"{s.stem}.offsets.npy")[-1]) for s in shards}
        for split in sorted({s.stem.rsplit("_", 1)[0] for s in shards}):
            write_index(out_dir, split)
        manifest = {"fingerprint": fingerprint, "format": STORE_FORMAT, "shards": [s.stem for s in shards]}
        manifest |= {
            "vocab_size": tokenizer.vocab_size,
            "checks": {s.stem: _shard_checks(out_dir, s.stem) for s in shards},
        }
        write_json_atomic(manifest_path, manifest | {"tokens": counts})
    _barrier()
    return json.loads(manifest_path.read_text())


def _tokenize_shard(shard: Path, tokenizer, dtype: np.dtype, batch_docs: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, offsets) of one text shard, a BOS before every document."""
    pieces: list[np.ndarray] = []
    lengths: list[np.ndarray] = []

    # Arrays straight from the tokenizer where it can (chatpipe's Tokenizer), int lists otherwise.
    encode = getattr(tokenizer, "encode_arrays", tokenizer.encode)

    def flatten(ids: list) -> None:
        # Encoded without the BOS, which numpy inserts: no per-document list copy or array,
        # which is what kept the old path well below the tokenizer's own speed.
        n = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        if ids and isinstance(ids[0], np.ndarray):
            body = np.concatenate(ids).astype(dtype, copy=False)
        else:
            body = np.fromiter(chain.from_iterable(ids), dtype=dtype, count=int(n.sum()))
        starts = np.zeros(len(n), dtype=np.int64)
        np.cumsum(n[:-1], out=starts[1:])
        pieces.append(np.insert(body, starts, np.asarray(tokenizer.bos_id, dtype=dtype)))
        lengths.append(n + 1)

    # A pipeline: the tokenizer (native, GIL released) encodes batch k+1 in a thread while this
    # thread reads the next parquet batch and flattens batch k, instead of one after the other.
    with ThreadPoolExecutor(1, thread_name_prefix="tokenize") as pool:
        pending: Future | None = None
        for texts in _shard_texts(shard, batch_docs):
            encoding = pool.submit(encode, texts)
            if pending is not None:
                flatten(pending.result())
            pending = encoding
        if pending is not None:
            flatten(pending.result())
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    offsets = np.zeros(len(all_lengths) + 1, dtype=np.int64)
    np.cumsum(all_lengths, out=offsets[1:])
    return (np.concatenate(pieces) if pieces else np.zeros(0, dtype)), offsets


def save_shard(out_dir: Path, stem: str, tokens: np.ndarray, offsets: np.ndarray) -> None:
    """Write one shard's token and offset files (each atomically; the tokens first, so offsets
    that exist always belong to complete tokens)."""
    save_npy_atomic(out_dir / f"{stem}.tokens.npy", tokens)
    save_npy_atomic(out_dir / f"{stem}.offsets.npy", offsets)


def write_index(out_dir: Path, split: str) -> None:
    """``{split}.index.npy``: (shard, start, length) of every non-empty document of the split, in order."""
    parts = []
    for s, path in enumerate(sorted(out_dir.glob(f"{split}_*.offsets.npy"))):
        off = _load(path)
        keep = off[1:] > off[:-1]  # an empty text still has its BOS; this only guards odd inputs
        parts.append(np.stack([np.full(int(keep.sum()), s), off[:-1][keep], (off[1:] - off[:-1])[keep]], axis=1))
    save_npy_atomic(out_dir / f"{split}.index.npy", np.concatenate(parts).astype(np.int64))


def _load(path: Path) -> np.ndarray:
    """Memory-map one store file; a truncated or corrupt file raises ValueError naming it."""
    try:
        # A plain ndarray view of the mapping: np.memmap's Python-level __getitem__ made every
        # scalar lookup of the loader (a document's start, shard, length) several times slower.
        return np.load(path, mmap_mode="r", allow_pickle=False).view(np.ndarray)
    except FileNotFoundError:
        raise
    except Exception as e:  # noqa: BLE001 - numpy's header parser raises ValueError, SyntaxError, TokenError...
        raise ValueError(f"{path}: corrupt or truncated token file ({e}); delete it and re-run the stage") from None


def _shard_texts(shard: Path, batch_docs: int) -> Iterator[list[str]]:
    """Batches of the ``text`` column of one parquet shard; a corrupt file or a column that is not
    text raises ValueError naming the shard (pyarrow's own errors name no file)."""
    import pyarrow as pa

    try:
        # pages written with a checksum (the data stage writes them) are checked as they are read
        table = pq.ParquetFile(shard, page_checksum_verification=True)
        field = table.schema_arrow.field("text")
    except KeyError:
        raise ValueError(f"{shard}: no 'text' column; re-run the `data` stage") from None
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"{shard}: not a readable parquet file ({e}); delete it and re-run the `data` stage") from None
    if not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)):
        raise ValueError(f"{shard}: column 'text' has type {field.type}, expected string")
    try:
        for batch in table.iter_batches(batch_size=batch_docs, columns=["text"]):
            yield batch.column(0).to_pylist()
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"{shard}: corrupt parquet data ({e}); delete it and re-run the `data` stage") from None


class TokenDocs:
    """All documents of one split (``train`` or ``val``), memory-mapped from the store.

    ``lengths[d]`` is document ``d``'s token count and :meth:`slice` its tokens; nothing is read
    into memory up front beyond the checks of each file's header, offsets and the index (see the
    module docstring). ``vocab_size`` defaults to the manifest's; without either, ids go unchecked.
    """

    def __init__(self, token_dir: Path, split: str, vocab_size: int | None = None) -> None:
        files = sorted(token_dir.glob(f"{split}_*.tokens.npy"))
        if not files:
            raise FileNotFoundError(f"{token_dir}: no {split}_*.tokens.npy token shards")
        manifest_path = token_dir / TOKEN_MANIFEST
        manifest = read_manifest(manifest_path) if manifest_path.exists() else {}
        checks = manifest.get("checks") or {}
        if not isinstance(checks, dict) or not all(isinstance(c, dict) for c in checks.values()):
            raise ValueError(f"{manifest_path}: corrupt token store manifest ('checks' is not a mapping of shards)")
        self.vocab_size = vocab_size if vocab_size is not None else manifest.get("vocab_size")
        self.tokens: list[np.ndarray] = []
        self.files = files
        all_offsets = []
        for path in files:
            tokens, offsets = _open_shard(path)
            all_offsets.append(offsets)
            check = checks.get(path.name.removesuffix(".tokens.npy"))
            if check is not None:
                _check_against_manifest(path, tokens, offsets, check, self.vocab_size)
            self.tokens.append(tokens)
        index_path = token_dir / f"{split}.index.npy"
        index = _load(index_path)
        _check_index(index_path, index, all_offsets)
        # Columns of the mapped index: views, so they stay on disk too.
        self.shard, self.start, self.lengths = index[:, 0], index[:, 1], index[:, 2]
        if len(self.lengths) == 0:
            raise ValueError(f"{token_dir}: the {split} split has no documents")

    def slice(self, doc: int, n: int) -> np.ndarray:
        """The first ``n`` tokens of document ``doc`` (an id beyond the vocabulary raises, naming the file)."""
        a, s = int(self.start[doc]), int(self.shard[doc])
        piece = self.tokens[s][a : a + n]
        if self.vocab_size is not None and len(piece) and int(piece.max()) >= self.vocab_size:
            raise ValueError(
                f"{self.files[s]}: document {doc} holds token id {int(piece.max())}, beyond the vocabulary "
                f"({self.vocab_size} ids); the store is damaged: delete it and re-run the stage"
            )
        return piece


def _open_shard(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """A shard's tokens and offsets, mapped; offsets that do not rise from 0 to the token count raise."""
    tokens = _load(path)
    off_path = path.with_name(path.name.replace(".tokens.npy", ".offsets.npy"))
    offsets = _load(off_path)
    if tokens.ndim != 1 or offsets.ndim != 1 or len(offsets) == 0 or tokens.dtype.kind != "u":
        raise ValueError(f"{path}: not a flat token array with offsets; delete it and re-run the stage")
    if offsets.dtype != np.int64:
        raise ValueError(f"{off_path}: offsets of dtype {offsets.dtype}, expected int64; delete the store")
    if offsets[0] != 0 or offsets[-1] != len(tokens):
        raise ValueError(
            f"{path}: holds {len(tokens)} tokens but {off_path.name} ends at {offsets[-1]} "
            "(truncated or mismatched); delete the store and re-run the stage"
        )
    if len(offsets) > 1 and bool((np.diff(offsets) < 0).any()):
        raise ValueError(f"{off_path}: offsets go backwards (shifted or scrambled); delete the store and re-run")
    return tokens, offsets


def _check_against_manifest(path: Path, tokens: np.ndarray, offsets: np.ndarray, check: dict, vocab) -> None:
    """The cheap checks of one shard against the manifest: dtype, counts, offsets' checksum, largest id."""
    off_path = path.with_name(path.name.replace(".tokens.npy", ".offsets.npy"))
    if tokens.dtype.str != check.get("dtype") or len(offsets) - 1 != check.get("docs"):
        raise ValueError(f"{path}: dtype or document count differs from {TOKEN_MANIFEST}; delete the store")
    if sha256_file(off_path) != check.get("offsets_sha256"):
        raise ValueError(f"{off_path}: changed since written (sha256 differs from {TOKEN_MANIFEST}); delete the store")
    if vocab is not None and int(check.get("max_id", -1)) >= vocab:
        raise ValueError(f"{path}: {TOKEN_MANIFEST} records id {check.get('max_id')} >= vocab {vocab}")


def _check_index(index_path: Path, index: np.ndarray, offsets: list[np.ndarray]) -> None:
    """The index is exactly what :func:`write_index` derives from the offsets: (shard, start, length) of
    every non-empty document, in order. Compared shard by shard, so memory stays one shard's worth."""
    if index.ndim != 2 or index.shape[1] != 3 or index.dtype != np.int64:
        raise ValueError(f"{index_path}: corrupt document index; delete the store and re-run the stage")
    pos = 0
    for s, off in enumerate(offsets):
        keep = off[1:] > off[:-1]
        n = int(keep.sum())
        rows = index[pos : pos + n]
        ok = len(rows) == n and (rows[:, 0] == s).all()
        ok = ok and np.array_equal(rows[:, 1], off[:-1][keep]) and np.array_equal(rows[:, 2], np.diff(off)[keep])
        if not ok:
            raise ValueError(
                f"{index_path}: document index does not match shard {s}'s offsets (shifted or scrambled); "
                "delete the store and re-run the stage"
            )
        pos += n
    if pos != len(index):
        raise ValueError(f"{index_path}: document index has {len(index) - pos} rows beyond the shards' documents")
