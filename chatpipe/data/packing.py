"""Conversation packing for the chat stages: BOS-aligned best-fit rows with padding.

1. :func:`render_all` renders every conversation of a task (mixture) once into flat token and
   mask arrays (mask 1 = an assistant token the model is trained to produce).
2. :func:`pack_rows` plans rows of ``capacity = max_seq_len + 1`` tokens: every row starts at a
   conversation's ``<|bos|>``; whole conversations are placed largest-first into the space left
   (best fit over a window of pending conversations); when none fits, the row is padded rather
   than a conversation cropped (a cut-off answer would teach the model to stop mid-reply). Only a
   conversation longer than a whole row is cropped.
3. :class:`ConversationLoader` turns planned rows into (inputs, targets) batches: targets are -1
   (ignored by the loss) on padding and on every non-assistant token.

The plan is a pure function of the conversation lengths, so every rank computes the same global
row list and takes its own rows of each step; the loader state is one integer, the global row
cursor, which makes resume exact. Rows repeat (same order) if training runs past one pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class Rendered:
    """Every conversation of a task as flat arrays: tokens, masks and start offsets."""

    ids: np.ndarray  # int32 [total tokens]
    mask: np.ndarray  # uint8 [total tokens]
    offsets: np.ndarray  # int64 [n + 1]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1


def render_all(task: Sequence[dict[str, Any]], tokenizer, max_tokens: int) -> Rendered:
    """Render every conversation of ``task`` (ids + assistant mask), each cropped to ``max_tokens``.

    A malformed conversation raises ``ValueError`` naming its index and task.
    """
    # numpy pieces, not Python int lists: a speedrun mixture holds hundreds of millions of tokens
    ids: list[np.ndarray] = []
    mask: list[np.ndarray] = []
    lengths = np.zeros(len(task), dtype=np.int64)
    for i in range(len(task)):
        try:
            conv_ids, conv_mask = tokenizer.render_conversation(task[i], max_tokens=max_tokens)
        except ValueError as e:
            raise ValueError(f"{getattr(task, 'name', 'task')} example {i}: {e}") from None
        ids.append(np.asarray(conv_ids, dtype=np.int32))
        mask.append(np.asarray(conv_mask, dtype=np.uint8))
        lengths[i] = len(conv_ids)
    offsets = np.zeros(len(task) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return Rendered(
        np.concatenate(ids) if ids else np.zeros(0, np.int32),
        np.concatenate(mask) if mask else np.zeros(0, np.uint8),
        offsets,
    )


def pack_rows(lengths: Sequence[int], capacity: int, window: int = 128) -> list[list[tuple[int, int]]]:
    """Plan rows: each a list of ``(conversation, n_tokens)`` filling at most ``capacity`` tokens.

    Conversations enter a window in order; each row takes the longest one that still fits until
    none does. Every conversation appears exactly once (cropped only if longer than ``capacity``).
    """
    lengths = [int(n) for n in lengths]  # plain ints: the scan below is hot
    rows: list[list[tuple[int, int]]] = []
    pending: list[int] = []
    nxt = 0
    while nxt < len(lengths) or pending:
        while len(pending) < window and nxt < len(lengths):
            pending.append(nxt)
            nxt += 1
        row: list[tuple[int, int]] = []
        space = capacity
        while pending:
            best = -1
            for j, c in enumerate(pending):
                if lengths[c] <= space and (best < 0 or lengths[c] > lengths[pending[best]]):
                    best = j
            if best < 0:
                if row:  # nothing fits: pad the rest of this row
                    break
                best = 0  # longer than a whole row: crop it
            c = pending.pop(best)
            take = min(int(lengths[c]), space)
            row.append((c, take))
            space -= take
            if space == 0:
                break
        rows.append(row)
    return rows


def pack(task: Sequence[dict[str, Any]], tokenizer, seq_len: int) -> tuple[Rendered, list[list[tuple[int, int]]]]:
    """Render ``task`` and plan its rows for a loader of ``seq_len`` tokens per row (steps 1 and 2 above)."""
    capacity = seq_len + 1  # inputs and targets are the row shifted by one
    data = render_all(task, tokenizer, capacity)
    return data, pack_rows(data.lengths, capacity)


def fill_ratio(rows: list[list[tuple[int, int]]], capacity: int) -> float:
    """Fraction of row tokens that are real (not padding)."""
    used = sum(n for row in rows for _, n in row)
    return used / max(1, len(rows) * capacity)


class ConversationLoader:
    """(inputs, targets) batches for one rank from the planned rows; targets -1 where not trained."""

    def __init__(
        self,
        data: Rendered,
        rows: list[list[tuple[int, int]]],
        *,
        batch_size: int,
        seq_len: int,
        pad_id: int,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
        start_row: int = 0,
    ) -> None:
        if not rows:
            raise ValueError("no rows to train on: the task mixture is empty")
        self.data, self.rows = data, rows
        self.batch_size, self.seq_len, self.pad_id = batch_size, seq_len, pad_id
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.row = start_row  # global cursor over all ranks' rows

    def _row_arrays(self, row: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        ids = np.full(self.seq_len + 1, self.pad_id, dtype=np.int64)
        mask = np.zeros(self.seq_len + 1, dtype=np.uint8)
        pos = 0
        for c, n in row:
            a = int(self.data.offsets[c])
            ids[pos : pos + n] = self.data.ids[a : a + n]
            mask[pos : pos + n] = self.data.mask[a : a + n]
            pos += n
        return ids, mask

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's next ``batch_size`` rows; advances the cursor by all ranks' rows."""
        x = np.empty((self.batch_size, self.seq_len), dtype=np.int64)
        y = np.empty((self.batch_size, self.seq_len), dtype=np.int64)
        for i in range(self.batch_size):
            k = self.row + self.rank * self.batch_size + i
            ids, mask = self._row_arrays(self.rows[k % len(self.rows)])
            x[i] = ids[:-1]
            y[i] = np.where(mask[1:] == 1, ids[1:], -1)
        self.row += self.batch_size * self.world_size
        xb, yb = torch.from_numpy(x), torch.from_numpy(y)
        if self.device.type == "cuda":
            xb, yb = (t.pin_memory().to(self.device, non_blocking=True) for t in (xb, yb))
        return xb, yb

    @property
    def epoch(self) -> float:
        """Passes over the planned rows so far (fractional)."""
        return self.row / len(self.rows)

    def state(self) -> dict:
        """What a checkpoint needs to restart this loader exactly."""
        return {"row": self.row}
