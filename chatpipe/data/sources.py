"""Pretraining text sources: write parquet text shards for the `data` stage and read them back.

``data.source`` picks where the text comes from:

- ``synthetic``: the tiny world (:func:`chatpipe.data.synthetic.pretrain_documents`), offline.
- ``hf``: the first ``hf_num_shards`` files ``shard_00000.parquet`` ... of a Hugging Face dataset
  repo (default FineWeb-Edu, reshuffled); the last downloaded shard is the val split.
- ``local``: a directory laid out like the hub files (``*.parquet``, ``*.jsonl`` with a ``text``
  field, or ``*.txt``); files with "val" in the name, else the last file in sorted order, are val.

Output (``out_dir``)::

    train_00000.parquet ...   one ``text`` column, one document per row
    val_00000.parquet
    manifest.json             the dict prepare_text returns

    manifest = prepare_text(Path("artifacts/data"), source="synthetic", seed=42, num_docs=4000, ...)
    for doc in iter_documents(Path("artifacts/data"), "val"): ...

The whole directory is written under a temp name and renamed into place, so a killed run never
leaves a half-written data dir.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from chatpipe.data import synthetic
from chatpipe.data.jsonl import iter_jsonl
from chatpipe.io import atomic_dir, write_json_atomic

SOURCES = ("synthetic", "hf", "local")
LOCAL_SUFFIXES = (".parquet", ".jsonl", ".txt")
TXT_DOC_CHARS = 2000  # .txt files are packed into documents of about this many chars
ROW_GROUP_DOCS = 1024  # small row groups let readers stream without loading a whole shard


class _ShardWriter:
    """Writes documents of one split as ``{split}_{i:05d}.parquet``, ``docs_per_shard`` rows each."""

    def __init__(self, out_dir: Path, split: str, docs_per_shard: int) -> None:
        self.out_dir, self.split, self.docs_per_shard = out_dir, split, docs_per_shard
        self.buffer: list[str] = []
        self.shards: list[str] = []
        self.num_docs = self.num_chars = 0

    def add(self, doc: str) -> None:
        self.buffer.append(doc)
        self.num_docs += 1
        self.num_chars += len(doc)
        if len(self.buffer) >= self.docs_per_shard:
            self.flush()

    def flush(self) -> None:
        if not self.buffer:
            return
        name = f"{self.split}_{len(self.shards):05d}.parquet"
        pq.write_table(  # page checksums: a flipped bit in a shard is an error at read, not other text
            pa.table({"text": pa.array(self.buffer, pa.string())}),
            self.out_dir / name,
            row_group_size=ROW_GROUP_DOCS,
            write_page_checksum=True,
        )
        self.shards.append(name)
        self.buffer = []


def prepare_text(
    out_dir: Path,
    *,
    source: str,
    seed: int = 42,
    num_docs: int = 4000,
    val_docs: int = 200,
    docs_per_shard: int = 2000,
    hf_repo: str = "karpathy/fineweb-edu-100b-shuffle",
    hf_num_shards: int = 2,
    hf_text_column: str = "text",
    local_dir: str | Path | None = None,
    cache_dir: str | Path = "data/cache",
) -> dict[str, Any]:
    """Write train/val parquet text shards into ``out_dir`` (atomically) and return the manifest.

    The keywords are the ``data`` settings' fields, named alike, so the stage passes its settings
    whole (``prepare_text(out_dir, **cfg.model_dump())``); ``local_dir`` "" means none, as in params.yaml.

    ``synthetic`` generates ``num_docs`` documents and holds the last ``val_docs`` out as val;
    ``local`` holds out ``val_docs`` documents only when the directory has a single file.
    ``hf_text_column`` names the text column of hub and local parquet/jsonl files.
    """
    if source not in SOURCES:
        raise ValueError(f"data.source = {source!r} is not supported; allowed: {', '.join(SOURCES)}")
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        if source == "synthetic":
            if not 0 < val_docs < num_docs:
                raise ValueError(f"synthetic: need 0 < val_docs ({val_docs}) < num_docs ({num_docs})")
            docs = synthetic.pretrain_documents(seed, num_docs)
            splits = {"train": docs[:-val_docs], "val": docs[-val_docs:]}
            manifest = _write_splits(tmp, splits, docs_per_shard) | {"seed": seed}
        elif source == "local":
            manifest = _prepare_local(tmp, local_dir, val_docs, docs_per_shard, hf_text_column)
        else:
            manifest = _prepare_hf(tmp, hf_repo, hf_num_shards, hf_text_column, Path(cache_dir))
        manifest["source"] = source
        write_json_atomic(tmp / "manifest.json", manifest)
    return manifest


def _write_splits(out_dir: Path, splits: dict[str, Iterable[str]], docs_per_shard: int) -> dict[str, Any]:
    writers = {}
    for split, docs in splits.items():
        writer = _ShardWriter(out_dir, split, docs_per_shard)
        for doc in docs:
            writer.add(doc)
        writer.flush()
        writers[split] = writer
    return {
        "shards": {s: w.shards for s, w in writers.items()},
        "num_docs": {s: w.num_docs for s, w in writers.items()},
        "num_chars": {s: w.num_chars for s, w in writers.items()},
    }


# ---------------------------------------------------------------------- local files


def _prepare_local(
    out_dir: Path, local_dir: Path | None, val_docs: int, docs_per_shard: int, column: str
) -> dict[str, Any]:
    if local_dir is None or not str(local_dir):
        raise ValueError("data.source = 'local' needs data.local_dir")
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise FileNotFoundError(f"{local_dir}: data.local_dir does not exist or is not a directory")
    files = sorted(p for p in local_dir.iterdir() if p.suffix in LOCAL_SUFFIXES and p.is_file())
    if not files:
        raise FileNotFoundError(f"{local_dir}: no {', '.join('*' + s for s in LOCAL_SUFFIXES)} files")
    if len(files) == 1:
        # One file: hold out its last documents (reading it twice beats holding it all in memory).
        total = sum(1 for _ in read_local_file(files[0], column))
        if not 0 < val_docs < total:
            raise ValueError(
                f"{files[0]}: only file in {local_dir} has {total} documents; cannot hold out val_docs={val_docs}"
            )
        docs = read_local_file(files[0], column)
        train = (d for i, d in zip(range(total - val_docs), docs))
        splits = {"train": train, "val": docs}  # val resumes the same iterator where train stopped
    else:
        val = [p for p in files if "val" in p.name.lower()] or files[-1:]
        train = [p for p in files if p not in val]
        if not train:
            raise ValueError(f"{local_dir}: every file looks like a val file; name train files without 'val'")
        splits = {"train": _chain(train, column), "val": _chain(val, column)}
    manifest = _write_splits(out_dir, splits, docs_per_shard)
    return manifest | {"local_dir": str(local_dir), "files": [p.name for p in files]}


def _chain(paths: list[Path], column: str) -> Iterator[str]:
    for path in paths:
        yield from read_local_file(path, column)


def read_local_file(path: Path, column: str = "text") -> Iterator[str]:
    """Documents of one ``.parquet`` / ``.jsonl`` / ``.txt`` file; errors name the path (and line)."""
    if path.suffix == ".parquet":
        yield from _read_parquet_column(path, column)
    elif path.suffix == ".jsonl":
        for lineno, row in iter_jsonl(path):
            if not isinstance(row, dict) or not isinstance(row.get(column), str):
                raise ValueError(f"{path}:{lineno}: expected an object with a string {column!r} field")
            yield row[column]
    elif path.suffix == ".txt":
        yield from _txt_documents(path.read_text(encoding="utf-8"))
    else:
        raise ValueError(f"{path}: unsupported file type; use {', '.join(LOCAL_SUFFIXES)}")


def _txt_documents(text: str, max_chars: int = TXT_DOC_CHARS) -> Iterator[str]:
    """Pack blank-line-separated paragraphs into documents of about ``max_chars``.

    A paragraph longer than that is cut at line boundaries, so a text with no blank lines becomes
    ~``max_chars`` documents; no line is ever split.
    """
    doc: list[str] = []
    size = 0
    for piece in _txt_pieces(text, max_chars):
        if doc and size + len(piece) > max_chars:
            yield "\n\n".join(doc)
            doc, size = [], 0
        doc.append(piece)
        size += len(piece) + 2
    if doc:
        yield "\n\n".join(doc)


def _txt_pieces(text: str, max_chars: int) -> Iterator[str]:
    """Paragraphs, with any longer than ``max_chars`` cut into runs of whole lines."""
    for para in text.split("\n\n"):
        para = para.strip("\n")
        if not para.strip():
            continue
        chunk: list[str] = []
        size = 0
        for line in para.split("\n"):
            if chunk and size + len(line) > max_chars:
                yield "\n".join(chunk)
                chunk, size = [], 0
            chunk.append(line)
            size += len(line) + 1
        yield "\n".join(chunk)


def _read_parquet_column(path: Path, column: str) -> Iterator[str]:
    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{path}: not a readable parquet file ({e})") from None
    if column not in pf.schema_arrow.names:
        raise ValueError(f"{path}: no column {column!r} (columns: {pf.schema_arrow.names})")
    kind = pf.schema_arrow.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(f"{path}: column {column!r} has type {kind}, expected string (data.hf_text_column)")
    for i in range(pf.num_row_groups):
        try:
            group = pf.read_row_group(i, columns=[column])
        except (pa.ArrowException, OSError) as e:
            raise ValueError(f"{path}: row group {i} is corrupt ({e})") from None
        yield from group.column(0).to_pylist()


# ---------------------------------------------------------------------- Hugging Face hub


def _prepare_hf(out_dir: Path, repo: str, num_shards: int, column: str, cache_dir: Path) -> dict[str, Any]:
    if num_shards < 2:
        raise ValueError(f"hf_num_shards = {num_shards}: need at least 2 (train + val)")
    from chatpipe.data import hub  # imported here: only the hf source needs the hub client

    names = [f"shard_{i:05d}.parquet" for i in range(num_shards)]
    fetched = hub.fetch_files(repo, names, cache_dir=Path(cache_dir), desc=f"{repo} shards")
    paths = [Path(f.path) for f in fetched]
    manifest: dict[str, Any] = {
        "shards": {"train": [], "val": []},
        "num_docs": {"train": 0, "val": 0},
        "num_chars": {"train": 0, "val": 0},
        "hf_repo": repo,
        "hub_files": [f.record() for f in fetched],  # repo, revision (commit), file, size, sha256
    }
    for i, src in enumerate(paths):
        split = "val" if i == len(paths) - 1 else "train"
        dst = out_dir / f"{split}_{len(manifest['shards'][split]):05d}.parquet"
        docs, chars = _link_or_rewrite(src, dst, column)
        manifest["shards"][split].append(dst.name)
        manifest["num_docs"][split] += docs
        manifest["num_chars"][split] += chars
    return manifest


def _link_or_rewrite(src: Path, dst: Path, column: str) -> tuple[int, int]:
    """Put ``src`` at ``dst`` with a single ``text`` column; returns (docs, chars)."""
    try:
        pf = pq.ParquetFile(src)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{src}: not a readable parquet file ({e}); delete it to download again") from None
    names = pf.schema_arrow.names
    if column not in names:
        raise ValueError(f"{src}: no column {column!r} (columns: {names}); set data.hf_text_column")
    if names == ["text"]:
        try:
            os.link(os.path.realpath(src), dst)  # a hard link (to the blob a hub cache links to): no copy
        except OSError:
            shutil.copy2(src, dst)
    else:
        with pq.ParquetWriter(dst, pa.schema([("text", pa.string())]), write_page_checksum=True) as writer:
            for i in range(pf.num_row_groups):
                col = pf.read_row_group(i, columns=[column]).column(0).cast(pa.string())
                writer.write_table(pa.table({"text": col}))
    chars = 0
    for i in range(pf.num_row_groups):
        chars += pc.sum(pc.utf8_length(pf.read_row_group(i, columns=[column]).column(0))).as_py() or 0
    return pf.metadata.num_rows, chars


# ---------------------------------------------------------------------- reading back


def corpus_name(data_dir: Path) -> str | None:
    """What the data stage wrote ``data_dir`` from, by name, when it is text of the user's: the local
    dir and its files, or the hub repo; None for the generated tiny world."""
    manifest_path = Path(data_dir) / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    if manifest.get("source") == "local":
        return f"data.local_dir {manifest['local_dir']} ({', '.join(manifest.get('files', []))})"
    if manifest.get("source") == "hf":
        return f"data.hf_repo {manifest.get('hf_repo', '')}"
    return None


def iter_documents(data_dir: Path, split: str) -> Iterator[str]:
    """Every document of ``split`` (``train`` or ``val``) in shard order, one row group at a time."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    shards = sorted(Path(data_dir).glob(f"{split}_*.parquet"))
    if not shards:
        raise FileNotFoundError(f"{data_dir}: no {split}_*.parquet shards; run the `data` stage first")
    for shard in shards:
        yield from _read_parquet_column(shard, "text")
