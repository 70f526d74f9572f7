"""Pretraining data: tokenized shards and a distributed, BOS-aligned row loader.

Two steps:

1. :func:`tokenize_shards` turns the text shards of the `data` stage into token shards
   (``tokens`` + document ``offsets`` per shard, every document starting with ``<|bos|>``).
   Ranks split the shards between them; results are cached by fingerprint.
2. :class:`RowLoader` packs documents into rows of ``seq_len + 1`` tokens by best fit: every row
   starts at a document start (BOS-aligned), whole documents are placed largest-first into the
   space left, and when none fits a document is cropped to fill the row exactly (no padding).

The packing depends only on document lengths, so every rank computes the same global stream of
rows and keeps its own slice of each micro-batch. Step ``s`` therefore sees the same rows whether
it runs on 2 ranks or on 1 rank with 2 gradient-accumulation micro-steps, and the loader state is
a single integer (the global row cursor), which makes resume exact.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from chatpipe.io import write_json_atomic

TOKEN_MANIFEST = "manifest.json"


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every token id."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


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
    """Tokenize every ``*.parquet`` text shard in ``text_dir`` into ``out_dir`` (collective call).

    Skips all work if ``out_dir`` already holds shards with the same fingerprint.
    """
    manifest_path = out_dir / TOKEN_MANIFEST
    if manifest_path.exists() and json.loads(manifest_path.read_text()).get("fingerprint") == fingerprint:
        return json.loads(manifest_path.read_text())
    shards = sorted(text_dir.glob("*.parquet"))
    if not shards:
        raise FileNotFoundError(f"{text_dir}: no *.parquet text shards; run the `data` stage first")
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    for i, shard in enumerate(shards):
        if i % world_size != rank:
            continue
        pieces: list[np.ndarray] = []
        lengths: list[int] = []
        for texts in _shard_texts(shard, batch_docs):
            for ids in tokenizer.encode(texts, prepend=tokenizer.bos_id):
                pieces.append(np.asarray(ids, dtype=dtype))
                lengths.append(len(ids))
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tmp = out_dir / f".{shard.stem}.tmp{rank}.npz"
        with open(tmp, "wb") as f:
            np.savez(f, tokens=np.concatenate(pieces) if pieces else np.zeros(0, dtype), offsets=offsets)
        tmp.replace(out_dir / f"{shard.stem}.npz")
    _barrier()
    manifest = {"fingerprint": fingerprint, "shards": [s.stem for s in shards]}
    if rank == 0:
        counts = {s.stem: int(np.load(out_dir / f"{s.stem}.npz")["offsets"][-1]) for s in shards}
        manifest["tokens"] = counts
        write_json_atomic(manifest_path, manifest)
    _barrier()
    return json.loads(manifest_path.read_text())


def _shard_texts(shard: Path, batch_docs: int) -> Iterator[list[str]]:
    """Batches of the ``text`` column of one parquet shard; a corrupt file or a column that is not
    text raises ValueError naming the shard (pyarrow's own errors name no file)."""
    import pyarrow as pa

    try:
        table = pq.ParquetFile(shard)
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
    """All documents of one split (``train`` or ``val``) as views into token arrays."""

    def __init__(self, token_dir: Path, split: str) -> None:
        files = sorted(token_dir.glob(f"{split}_*.npz"))
        if not files:
            raise FileNotFoundError(f"{token_dir}: no {split}_*.npz token shards")
        self.tokens: list[np.ndarray] = []
        shard_ids, starts, lens = [], [], []
        for s, path in enumerate(files):
            data = np.load(path)
            self.tokens.append(data["tokens"])
            off = data["offsets"]
            keep = off[1:] > off[:-1]
            shard_ids.append(np.full(int(keep.sum()), s, dtype=np.int32))
            starts.append(off[:-1][keep])
            lens.append((off[1:] - off[:-1])[keep])
        # Flat arrays rather than tuples: a speedrun split has millions of documents.
        self.shard, self.start, self.lengths = (np.concatenate(x) for x in (shard_ids, starts, lens))
        if len(self.lengths) == 0:
            raise ValueError(f"{token_dir}: the {split} split has no documents")

    def slice(self, doc: int, n: int) -> np.ndarray:
        """The first ``n`` tokens of document ``doc``."""
        a = int(self.start[doc])
        return self.tokens[self.shard[doc]][a : a + n]


def pack_rows(lengths: list[int], capacity: int, buffer_size: int = 64) -> Iterator[list[tuple[int, int]]]:
    """Yield rows forever as lists of (doc, n_tokens), best-fit packed to exactly ``capacity``.

    Documents are taken in order, epoch after epoch; a row always starts with a whole document's
    first token (BOS). Pure function of ``lengths``: every rank gets the same stream.
    """
    n_docs = len(lengths)
    next_doc = 0
    buffer: list[int] = []
    while True:
        row: list[tuple[int, int]] = []
        space = capacity
        while space > 0:
            while len(buffer) < buffer_size:
                buffer.append(next_doc)
                next_doc = (next_doc + 1) % n_docs
            best = -1
            for j, doc in enumerate(buffer):
                if lengths[doc] <= space and (best < 0 or lengths[doc] > lengths[buffer[best]]):
                    best = j
            if best < 0:
                # Nothing fits whole: crop the shortest buffered document to fill the row exactly.
                best = min(range(len(buffer)), key=lambda j: lengths[buffer[j]])
            doc = buffer.pop(best)
            take = min(lengths[doc], space)
            row.append((doc, take))
            space -= take
        yield row


class RowLoader:
    """Batches of (inputs, targets) for one rank from the global packed row stream."""

    def __init__(
        self,
        docs: TokenDocs,
        *,
        batch_size: int,
        seq_len: int,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
        start_row: int = 0,
    ) -> None:
        self.docs, self.batch_size, self.seq_len = docs, batch_size, seq_len
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.rows = pack_rows(docs.lengths.tolist(), seq_len + 1)
        self.row = 0  # global cursor: rows consumed by all ranks together
        for _ in range(start_row):  # fast-forward on lengths only; cheap compared with a step
            next(self.rows)
        self.row = start_row

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next ``batch_size`` rows; advances the global cursor by all ranks' rows."""
        mine = np.empty((self.batch_size, self.seq_len + 1), dtype=np.int64)
        for k in range(self.batch_size * self.world_size):
            row = next(self.rows)
            owner, i = divmod(k, self.batch_size)
            if owner == self.rank:
                mine[i] = np.concatenate([self.docs.slice(doc, n) for doc, n in row])
        self.row += self.batch_size * self.world_size
        batch = torch.from_numpy(mine)
        if self.device.type == "cuda":
            batch = batch.pin_memory().to(self.device, non_blocking=True)
        return batch[:, :-1], batch[:, 1:]

    def state(self) -> dict:
        """What a checkpoint needs to restart this loader exactly."""
        return {"row": self.row}
