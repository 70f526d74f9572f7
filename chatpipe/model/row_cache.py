"""A KV cache whose rows hold unrelated sequences, each at its own position (continuous batching).

The scheduler (:mod:`chatpipe.inference.scheduler`) keeps one :class:`RowKVCache` for its running
batch: ``rows`` slots of ``context`` positions each, allocated once, so its memory is fixed
(``memory_bytes``). The live rows are always the first ``n``; a decode step feeds one token to
each of them, at its own position, so its rotary angles and its attention are those of the same
sequence decoded alone.

A row holds its sequence in one of two ways:

- **whole** (:meth:`RowKVCache.load`): its prompt and its reply, positions ``0 .. length - 1``;
- **shared prompt** (:meth:`RowKVCache.add_prompt`, then :meth:`RowKVCache.join` per sample): the
  samples of one prompt read its keys/values from one *prompt slot* (``rows // 2`` of them, each
  ``context`` positions: a shared prompt has at least two rows) and hold only their own replies.
  A decode step then reads each prompt once, not once per sample: an RL step's 8 samples of a
  30-token prompt read 30 + 8 x (reply) positions instead of 8 x (30 + reply). The attention
  (:meth:`RowKVCache.attend`) scores a row's query against its slot's prompt and its own reply
  together, in one softmax.

Usage::

    cache = RowKVCache.from_config(model.config, rows=16, context=256)
    cache.load(0, prompt_cache)        # a prompt prefilled alone (a KVCache of batch 1) joins as row 0
    cache.n = 1
    slot = cache.add_prompt(prompt_cache, source_row=0, length=12)
    cache.join(1, slot, prompt_cache); cache.join(2, slot, prompt_cache); cache.n = 3
    logits = model(next_tokens[:, None], kv_cache=cache)  # [n, 1, V]; each row advances by one
    cache.move(2, 1)                   # row 2's sequence now lives in row 1 (a row left: fill its gap)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class RowPlan:
    """What every layer of one decode step needs to attend (built once per step and window).

    ``own_mask`` [n, 1, 1, own_end]: a row's own keys it may attend. With shared prompts the rows
    sit in a grid of ``slots`` x ``width`` cells, a slot's rows side by side, so each prompt is
    read once for all its rows: ``grid_rows`` [slots * width] is the row in each cell (a cell no row
    holds repeats row 0; what it computes is never read back) and ``grid_cell`` [n] each row's cell.
    ``masked_out`` [n, 1, 1, prompt_end + own_end]: the keys, its slot's prompt's then its own, that a
    row may not attend (a row holding its sequence whole attends no prompt key), and ``whole_rows``
    [1, n, 1, 1] True for those rows (None when every row shares a prompt).
    """

    own_end: int
    own_mask: torch.Tensor
    prompt_end: int = 0
    slots: int = 0
    width: int = 0
    grid_rows: torch.Tensor | None = None
    grid_cell: torch.Tensor | None = None
    masked_out: torch.Tensor | None = None
    whole_rows: torch.Tensor | None = None


class RowKVCache:
    """Keys/values [n_layer, rows, n_kv_head, context, head_dim]; row ``r`` holds ``lengths[r]`` positions."""

    def __init__(self, rows: int, num_layers: int, num_kv_heads: int, head_dim: int, context: int, n_embd: int) -> None:
        self.rows, self.context = rows, context
        self.shape = (num_layers, rows, num_kv_heads, context, head_dim)
        self.prompt_shape = (num_layers, rows // 2, num_kv_heads, context, head_dim)
        self.n_embd = n_embd
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.pk: torch.Tensor | None = None  # the prompt slots, allocated when a first prompt is shared
        self.pv: torch.Tensor | None = None
        self._prev: torch.Tensor | None = None  # [rows, 1, n_embd]: each row's last embedding (smear)
        self.lengths = [0] * rows  # positions in the row's sequence (the next token's position)
        self.base = [0] * rows  # where its own keys start: 0 (whole), its prompt's length (shared)
        self.slot = [-1] * rows  # its prompt slot, or -1
        self.prompt_lengths = [0] * (rows // 2)
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

    def _own(self) -> list[int]:
        """Keys each live row holds itself (its whole sequence, or its reply after a shared prompt)."""
        return [self.lengths[r] - self.base[r] for r in range(self.n)]

    # ----------------------------------------------------------------------------- rows joining

    def load(self, row: int, source: Any, source_row: int = 0, length: int | None = None) -> None:
        """Copy the first ``length`` positions (all by default) of row ``source_row`` of a prefilled
        :class:`chatpipe.model.gpt.KVCache` (no left padding) into ``row``: the row holds it whole."""
        length = self._prompt_length(source, length)
        if source.key_mask is not None:
            raise ValueError("load a prompt prefilled alone: a left-padded row would shift its positions")
        if source.k is not None:
            self._allocate(source.k.dtype, source.k.device)
            self.k[:, row, :, :length] = source.k[:, source_row, :, :length]
            self.v[:, row, :, :length] = source.v[:, source_row, :, :length]
        self._copy_prev(row, source, source_row)
        self.lengths[row], self.base[row], self.slot[row] = length, 0, -1

    def add_prompt(self, source: Any, source_row: int = 0, length: int | None = None) -> int:
        """Copy a prefilled prompt (as :meth:`load`) into a free prompt slot; returns the slot, which
        stays taken while a live row :meth:`join` ed it."""
        length = self._prompt_length(source, length)
        slot = self.free_slot()
        if slot is None:
            raise ValueError(f"all {len(self.prompt_lengths)} prompt slots are taken (rows // 2 of {self.rows} rows)")
        if source.k is not None:
            if self.pk is None or self.pk.dtype != source.k.dtype or self.pk.device != source.k.device:
                self.pk = torch.zeros(self.prompt_shape, dtype=source.k.dtype, device=source.k.device)
                self.pv = torch.zeros(self.prompt_shape, dtype=source.k.dtype, device=source.k.device)
            self.pk[:, slot, :, :length] = source.k[:, source_row, :, :length]
            self.pv[:, slot, :, :length] = source.v[:, source_row, :, :length]
        self.prompt_lengths[slot] = length
        return slot

    def free_slot(self) -> int | None:
        """The first prompt slot no live row reads, or None. Samples of one prompt can end apart, so
        every slot may be held by a request with one row left while rows are free."""
        taken = {self.slot[r] for r in range(self.n)}
        return next((s for s in range(len(self.prompt_lengths)) if s not in taken), None)

    def join(self, row: int, slot: int, source: Any, source_row: int = 0) -> None:
        """``row`` continues the prompt in ``slot`` (``source``/``source_row``: where it was prefilled,
        for the smear's last embedding); it holds only the tokens it generates."""
        if source.k is not None:
            self._allocate(source.k.dtype, source.k.device)
        self._copy_prev(row, source, source_row)
        length = self.prompt_lengths[slot]
        self.lengths[row], self.base[row], self.slot[row] = length, length, slot

    def _prompt_length(self, source: Any, length: int | None) -> int:
        """``length`` (all of ``source``'s positions when None), refused when it cannot fit a row."""
        length = source.pos if length is None else length
        if length > self.context:
            raise ValueError(f"a prompt of {length} positions does not fit a row of {self.context}")
        return length

    def _copy_prev(self, row: int, source: Any, source_row: int) -> None:
        if source.prev_embed is not None:
            if self._prev is None:
                self.prev_embed = source.prev_embed[source_row : source_row + 1]
            self._prev[row] = source.prev_embed[source_row]

    def move(self, src: int, dst: int) -> None:
        """Row ``src``'s sequence moves to row ``dst`` (whose own is dropped)."""
        own = self.lengths[src] - self.base[src]
        if self.k is not None:
            self.k[:, dst, :, :own] = self.k[:, src, :, :own]
            self.v[:, dst, :, :own] = self.v[:, src, :, :own]
        if self._prev is not None:
            self._prev[dst] = self._prev[src]
        self.lengths[dst], self.base[dst], self.slot[dst] = self.lengths[src], self.base[src], self.slot[src]

    # ----------------------------------------------------------------------------- a decode step

    def plan(self, window: int | None, positions: torch.Tensor) -> RowPlan:
        """The masks and the prompt grid of this step for layers of sliding ``window`` (None: full)."""
        device = positions.device
        own = torch.tensor(self._own(), device=device)
        own_end = int(own.max()) + 1 if self.n else 1
        keys = torch.arange(own_end, device=device)[None]
        mask = keys <= own[:, None]
        if window is not None:  # a key at own index j sits at position base + j
            mask = mask & (own[:, None] - keys < window)
        plan = RowPlan(own_end, mask[:, None, None, :])
        shared = [r for r in range(self.n) if self.slot[r] >= 0]
        if shared:
            self._plan_prompts(plan, shared, window, positions)
        return plan

    def _plan_prompts(self, plan: RowPlan, shared: list[int], window: int | None, positions: torch.Tensor) -> None:
        """Fill ``plan``'s prompt part: the slot grid's cells and rows, and the step's key mask."""
        device = positions.device
        rank, counts = [], {}
        for r in shared:
            s = self.slot[r]
            rank.append(counts.get(s, 0))
            counts[s] = rank[-1] + 1
        plan.slots, plan.width = max(self.slot[r] for r in shared) + 1, max(counts.values())
        cells = [self.slot[r] * plan.width + k for r, k in zip(shared, rank)]
        grid_rows, grid_cell = [0] * (plan.slots * plan.width), [0] * self.n
        for r, cell in zip(shared, cells):
            grid_rows[cell], grid_cell[r] = r, cell
        plan.grid_rows = torch.tensor(grid_rows, device=device)
        plan.grid_cell = torch.tensor(grid_cell, device=device)
        lengths = torch.tensor([self.prompt_lengths[s] if s >= 0 else 0 for s in self.slot[: self.n]], device=device)
        plan.prompt_end = int(lengths.max())
        keys = torch.arange(plan.prompt_end, device=device)[None]
        mask = keys < lengths[:, None]
        if window is not None:
            mask = mask & (positions[:, None] - keys < window)
        plan.masked_out = ~torch.cat([mask[:, None, None, :], plan.own_mask], dim=-1)
        if len(shared) < self.n:
            plan.whole_rows = (lengths == 0)[None, :, None, None]

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write one position per live row (k/v [n, H, 1, D]) after the keys it holds itself."""
        if k.size(2) != 1 or k.size(0) != self.n:
            raise ValueError(f"a row cache takes one token per live row ({self.n}), got {tuple(k.shape)}")
        self._allocate(k.dtype, k.device)
        heads, dim = k.size(1), k.size(3)
        if self._index is None:  # once a step: where each (row, head)'s new position sits in a layer's storage
            own = self._own()
            if max(own, default=0) + 1 > self.context:
                raise ValueError(f"KV cache full: a row holds {max(own)} positions of its {self.context}")
            row_heads = torch.arange(self.n * heads, device=k.device).view(self.n, heads)
            self._index = (row_heads * self.context + torch.tensor(own, device=k.device)[:, None]).flatten()
        self.k[layer].view(-1, dim).index_copy_(0, self._index, k.reshape(-1, dim))
        self.v[layer].view(-1, dim).index_copy_(0, self._index, v.reshape(-1, dim))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RowPlan) -> torch.Tensor:
        """Store this step's keys/values (k/v [n, H_kv, 1, D]) and return each row's attention
        output [n, H, 1, D] for queries ``q`` [n, H, 1, D] over its prompt and its own keys."""
        self._write(layer, k, v)
        own_k, own_v = self.k[layer, : self.n, :, : plan.own_end], self.v[layer, : self.n, :, : plan.own_end]
        if plan.grid_rows is None:  # every row holds its whole sequence: one fused attention call
            gqa = q.size(1) != k.size(1)
            return F.scaled_dot_product_attention(q, own_k, own_v, attn_mask=plan.own_mask, enable_gqa=gqa)
        return self._attend_shared(layer, q, own_k, own_v, plan)

    def _attend_shared(
        self, layer: int, q: torch.Tensor, own_k: torch.Tensor, own_v: torch.Tensor, plan: RowPlan
    ) -> torch.Tensor:
        """One softmax over [prompt keys | own keys] per row; a slot's prompt is read once for its rows.

        Heads lead in the grid's layout ([Hkv, slots, width * g, ...]), so one ``index_select`` of
        the rows builds it and one reads each row's cell back: no zeroed grid to scatter into."""
        n, heads, _, dim = q.shape
        kv_heads, prompt_end, slots, width = own_k.size(1), plan.prompt_end, plan.slots, plan.width
        group = heads // kv_heads
        qg = q.view(n, kv_heads, group, dim) * dim**-0.5  # query heads grouped by their kv head
        own_scores = qg @ own_k.transpose(-1, -2)  # [n, Hkv, g, own_end]
        grid = qg.transpose(0, 1).index_select(1, plan.grid_rows).view(kv_heads, slots, width * group, dim)
        pk = self.pk[layer, :slots, :, :prompt_end].transpose(0, 1)  # [Hkv, slots, P, D]
        scores = (grid @ pk.transpose(-1, -2)).view(kv_heads, slots * width, group, prompt_end)
        prompt_scores = scores.index_select(1, plan.grid_cell).transpose(0, 1)  # [n, Hkv, g, P]
        both = torch.cat([prompt_scores, own_scores], dim=-1).masked_fill_(plan.masked_out, float("-inf"))
        probs = torch.softmax(both, dim=-1)
        out = probs[..., prompt_end:] @ own_v  # [n, Hkv, g, D]
        grid_p = probs[..., :prompt_end].transpose(0, 1).index_select(1, plan.grid_rows)
        pv = self.pv[layer, :slots, :, :prompt_end].transpose(0, 1)
        from_prompt = grid_p.view(kv_heads, slots, width * group, prompt_end) @ pv
        from_prompt = from_prompt.view(kv_heads, slots * width, group, dim).index_select(1, plan.grid_cell)
        if plan.whole_rows is not None:  # a whole row's cell is another row's: it adds nothing from it
            from_prompt = from_prompt.masked_fill(plan.whole_rows, 0.0)
        out += from_prompt.transpose(0, 1)
        return out.reshape(n, heads, 1, dim)

    def advance(self, t: int) -> None:
        """Each live row holds ``t`` more positions (called once per forward)."""
        for r in range(self.n):
            self.lengths[r] += t
        self._index = None
