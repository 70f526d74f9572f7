"""A KV cache whose rows hold unrelated sequences, each at its own position (continuous batching).

The scheduler (:mod:`chatpipe.inference.scheduler`) keeps one :class:`RowKVCache` for its running
batch: ``rows`` slots of ``context`` positions each, allocated once, so its memory is fixed
(``memory_bytes``). The live rows are always the first ``n``; a decode step feeds one token to
each of them. A row's keys sit at its true positions ``0 .. length - 1``, so its rotary angles and
its attention are those of the same sequence decoded alone; the slots after its length are masked.

Usage::

    cache = RowKVCache.from_config(model.config, rows=16, context=256)
    cache.load(0, prompt_cache)        # a prompt prefilled alone (a KVCache of batch 1) joins as row 0
    cache.n = 1
    logits = model(next_tokens[:, None], kv_cache=cache)  # [n, 1, V]; each row advances by one
    cache.move(3, 1)                   # row 3's sequence now lives in row 1 (a row left: fill its gap)
"""

from __future__ import annotations

from typing import Any

import torch


class RowKVCache:
    """Keys/values [n_layer, rows, n_kv_head, context, head_dim]; row ``r`` holds ``lengths[r]`` positions."""

    def __init__(self, rows: int, num_layers: int, num_kv_heads: int, head_dim: int, context: int, n_embd: int) -> None:
        self.rows, self.context = rows, context
        self.shape = (num_layers, rows, num_kv_heads, context, head_dim)
        self.n_embd = n_embd
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self._prev: torch.Tensor | None = None  # [rows, 1, n_embd]: each row's last embedding (smear)
        self.lengths = [0] * rows  # positions filled per row (the next token's position)
        self.n = 0  # live rows: 0 .. n - 1
        self.key_mask = None  # rows are never left-padded
        self._index: torch.Tensor | None = None

    @classmethod
    def from_config(cls, config: Any, rows: int, context: int) -> RowKVCache:
        """A cache shaped for a model with ``config`` (a :class:`chatpipe.model.gpt.GPTConfig`)."""
        return cls(rows, config.n_layer, config.n_kv_head, config.n_embd // config.n_head, context, config.n_embd)

    @staticmethod
    def bytes_for(config: Any, rows: int, context: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes the keys and values of ``rows`` x ``context`` positions take for ``config``."""
        per = config.n_layer * config.n_kv_head * (config.n_embd // config.n_head) * 2
        return per * rows * context * torch.tensor([], dtype=dtype).element_size()

    @property
    def pos(self) -> int:
        """The longest live row (positions the model's range checks and smear look at)."""
        return max(self.lengths[: self.n], default=0)

    @property
    def prev_embed(self) -> torch.Tensor | None:
        return None if self._prev is None else self._prev[: self.n]

    @prev_embed.setter
    def prev_embed(self, value: torch.Tensor) -> None:
        if self._prev is None or self._prev.dtype != value.dtype:
            self._prev = torch.zeros(self.rows, 1, self.n_embd, dtype=value.dtype, device=value.device)
        self._prev[: value.size(0)] = value

    def _allocate(self, dtype: torch.dtype, device: torch.device) -> None:
        if self.k is None or self.k.dtype != dtype or self.k.device != device:
            self.k = torch.zeros(self.shape, dtype=dtype, device=device)
            self.v = torch.zeros(self.shape, dtype=dtype, device=device)

    def positions(self, device: torch.device) -> torch.Tensor:
        """[n] long: the position each live row's next token takes."""
        return torch.tensor(self.lengths[: self.n], dtype=torch.long, device=device)

    def attention_mask(self, window: int | None, positions: torch.Tensor) -> torch.Tensor:
        """[n, 1, 1, pos + 1]: True where a row's next token may attend (its own keys, within ``window``)."""
        keys = torch.arange(self.pos + 1, device=positions.device).unsqueeze(0)
        q = positions.unsqueeze(1)
        mask = keys <= q
        if window is not None:
            mask = mask & (q - keys < window)
        return mask[:, None, None, :]

    def insert(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one position per live row (k/v [n, H, 1, D]) at its length; return keys/values [n, H, pos + 1, D]."""
        if k.size(2) != 1 or k.size(0) != self.n:
            raise ValueError(f"a row cache takes one token per live row ({self.n}), got {tuple(k.shape)}")
        if self.pos + 1 > self.context:
            raise ValueError(f"KV cache full: a row holds {self.pos} positions of its {self.context}")
        self._allocate(k.dtype, k.device)
        heads, dim = k.size(1), k.size(3)
        if self._index is None:  # where each (row, head)'s new position sits in a layer's flattened storage
            row_heads = torch.arange(self.n * heads, device=k.device).view(self.n, heads)
            self._index = (row_heads * self.context + self.positions(k.device)[:, None]).flatten()
        self.k[layer].view(-1, dim).index_copy_(0, self._index, k.reshape(-1, dim))
        self.v[layer].view(-1, dim).index_copy_(0, self._index, v.reshape(-1, dim))
        end = self.pos + 1
        return self.k[layer, : self.n, :, :end], self.v[layer, : self.n, :, :end]

    def advance(self, t: int) -> None:
        """Each live row holds ``t`` more positions (called once per forward)."""
        for r in range(self.n):
            self.lengths[r] += t
        self._index = None

    def load(self, row: int, source: Any, source_row: int = 0, length: int | None = None) -> None:
        """Copy the first ``length`` positions (all by default) of row ``source_row`` of a prefilled
        :class:`chatpipe.model.gpt.KVCache` (no left padding) into ``row``."""
        length = source.pos if length is None else length
        if length > self.context:
            raise ValueError(f"a prompt of {length} positions does not fit a row of {self.context}")
        if source.key_mask is not None:
            raise ValueError("load a prompt prefilled alone: a left-padded row would shift its positions")
        if source.k is not None:
            self._allocate(source.k.dtype, source.k.device)
            self.k[:, row, :, :length] = source.k[:, source_row, :, :length]
            self.v[:, row, :, :length] = source.v[:, source_row, :, :length]
        if source.prev_embed is not None:
            if self._prev is None:
                self.prev_embed = source.prev_embed[source_row : source_row + 1]
            self._prev[row] = source.prev_embed[source_row]
        self.lengths[row] = length

    def move(self, src: int, dst: int) -> None:
        """Row ``src``'s sequence moves to row ``dst`` (whose own is dropped)."""
        length = self.lengths[src]
        if self.k is not None:
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
            self.v[:, dst, :, :length] = self.v[:, src, :, :length]
        if self._prev is not None:
            self._prev[dst] = self._prev[src]
        self.lengths[dst] = length
