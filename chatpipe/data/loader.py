"""Pretraining data: a distributed, BOS-aligned row loader over the memory-mapped token store.

1. :func:`~chatpipe.data.tokenstore.tokenize_shards` turns the text shards of the `data` stage into
   the token store (re-exported here with :class:`~chatpipe.data.tokenstore.TokenDocs`).
2. :class:`Packer` packs documents into rows of ``seq_len + 1`` tokens by best fit: every row
   starts at a document start (BOS-aligned), whole documents are placed largest-first into the
   space left, and when none fits a document is cropped to fill the row exactly (no padding).
3. :class:`RowLoader` hands each rank its rows of each step, prepared in a background thread.

The packing depends only on document lengths, so every rank computes the same global stream of
rows (on lengths alone, cheap) and reads the tokens of its own rows only. Step ``s`` therefore sees
the same rows whether it runs on 2 ranks or on 1 rank with 2 gradient-accumulation micro-steps.
The packer's whole state is a small cursor (next document + the buffer of pending ones), saved
with the global row count in every checkpoint, so a resume at any step restores it in O(1)
instead of replaying the stream, and continues with exactly the rows of an uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from chatpipe.data.tokenstore import TOKEN_MANIFEST, TokenDocs, token_dtype, tokenize_shards

__all__ = ["TOKEN_MANIFEST", "Packer", "RowLoader", "TokenDocs", "pack_rows", "token_dtype", "tokenize_shards"]


class Packer:
    """Best-fit packing of documents (taken in order, epoch after epoch) into rows of ``capacity``.

    ``cursor()`` is the complete state between rows; ``Packer(..., cursor=c)`` continues exactly
    where the packer that produced ``c`` was. ``lengths`` may be a memory-mapped array: each
    document's length is read once, when it enters the buffer.
    """

    def __init__(self, lengths: Sequence[int], capacity: int, buffer_size: int = 64, cursor=None) -> None:
        self.lengths, self.capacity, self.buffer_size = lengths, capacity, buffer_size
        self.n_docs = len(lengths)
        cursor = cursor or [0]
        self.next_doc, self.buffer = int(cursor[0]), [int(d) for d in cursor[1:]]
        # The buffer's lengths as plain ints beside it: the best-fit scan below is the hot loop.
        self.lens = [int(lengths[d]) for d in self.buffer]

    def cursor(self) -> list[int]:
        """The state between two rows: ``[next document, *buffered documents]``."""
        return [self.next_doc, *self.buffer]

    def next_row(self) -> list[tuple[int, int]]:
        """The next row as ``(doc, n_tokens)`` pieces summing to exactly ``capacity``."""
        buffer, lens = self.buffer, self.lens
        row: list[tuple[int, int]] = []
        space = self.capacity
        while space > 0:
            while len(buffer) < self.buffer_size:
                buffer.append(self.next_doc)
                lens.append(int(self.lengths[self.next_doc]))
                self.next_doc = (self.next_doc + 1) % self.n_docs
            # The longest buffered document that fits whole; the first one on ties (list.index).
            best_len = max((n for n in lens if n <= space), default=-1)
            # Nothing fits whole: crop the shortest buffered document to fill the row exactly.
            j = lens.index(best_len if best_len >= 0 else min(lens))
            doc, n = buffer.pop(j), lens.pop(j)
            take = min(n, space)
            row.append((doc, take))
            space -= take
        return row


def pack_rows(lengths: Sequence[int], capacity: int, buffer_size: int = 64) -> Iterator[list[tuple[int, int]]]:
    """Yield rows forever as lists of (doc, n_tokens), best-fit packed to exactly ``capacity``.

    Pure function of ``lengths``: every rank gets the same stream (see :class:`Packer`).
    """
    packer = Packer(lengths, capacity, buffer_size)
    while True:
        yield packer.next_row()


class RowLoader:
    """Batches of (inputs, targets) for one rank from the global packed row stream.

    ``state`` (from :meth:`state`, as saved in a checkpoint) resumes in O(1); a state without a
    packer cursor (checkpoints from before the cursor existed) or a bare ``start_row`` replays the
    packing from row 0. With ``prefetch`` the next batch is built in a background thread while the
    caller trains on the current one; the batches are the same either way.
    """

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
        state: dict | None = None,
        prefetch: bool = False,
    ) -> None:
        self.docs, self.batch_size, self.seq_len = docs, batch_size, seq_len
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        cursor = (state or {}).get("cursor")
        self.row = int(state["row"]) if state else start_row  # global cursor: rows consumed by all ranks
        self.packer = Packer(docs.lengths, seq_len + 1, cursor=cursor)
        if cursor is None:
            for _ in range(self.row):  # no stored cursor: replay the lengths-only packing
                self.packer.next_row()
        self.cursor = self.packer.cursor()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rowloader") if prefetch else None
        self._next: Future | None = None

    def _build(self) -> tuple[np.ndarray, list[int]]:
        """Pack all ranks' rows of one step, read the tokens of this rank's rows only."""
        mine = np.empty((self.batch_size, self.seq_len + 1), dtype=np.int64)
        for k in range(self.batch_size * self.world_size):
            row = self.packer.next_row()
            owner, i = divmod(k, self.batch_size)
            if owner == self.rank:
                pos = 0
                for doc, n in row:
                    mine[i, pos : pos + n] = self.docs.slice(doc, n)
                    pos += n
        return mine, self.packer.cursor()

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next ``batch_size`` rows; advances the global cursor by all ranks' rows."""
        if self._pool is None:
            mine, cursor = self._build()
        else:
            mine, cursor = (self._next or self._pool.submit(self._build)).result()
        self.row += self.batch_size * self.world_size
        self.cursor = cursor  # the state after the batches handed out, not after the prefetched one
        batch = torch.from_numpy(mine)
        if self.device.type == "cuda":
            batch = batch.pin_memory().to(self.device, non_blocking=True)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        if self._pool is not None:
            # Start the next build after the last torch call here: torch calls release the GIL,
            # and the woken worker would then hold it for its whole build while this call waits.
            # Only one build is ever in flight, so the packer is never used by two threads at once.
            self._next = self._pool.submit(self._build)
        return inputs, targets

    def close(self) -> None:
        """Stop the prefetch thread (after the batch in flight, if any)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool, self._next = None, None

    def state(self) -> dict:
        """What a checkpoint needs to restart this loader exactly, in O(1)."""
        return {"row": self.row, "cursor": list(self.cursor)}
