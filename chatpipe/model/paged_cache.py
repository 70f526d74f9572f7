"""Paged KV memory: every sequence's keys/values live in fixed-size blocks of one shared pool.

A :class:`BlockPool` holds ``num_blocks`` blocks of ``block_size`` positions for every layer,
allocated once (on the first write, in the dtype and on the device of the keys): that is all the KV
memory generation ever uses, beside the scratch buffers (:meth:`BlockPool.scratch`) that a forward
gathers its rows' keys into, at most twice the largest such gather. A :class:`Sequence` owns a list
of blocks (its block table), so memory follows the tokens a sequence really holds, not a worst-case
row of the whole context.

**Prefix cache.** A block that fills up is registered under the key (its parent block's key, its
tokens): a chain, so a key names the whole prefix up to the block's end, as vLLM's block hashes
do. A later sequence whose prompt starts with the same tokens shares those blocks (their reference
count goes up) and prefills only the rest: a chat's next turn, whose prompt is the whole history,
recomputes only the new messages. A block no sequence holds any more keeps its contents while
memory allows: it is evicted, least recently released first, only when a new block is needed.

**A forward over the pool.** :class:`PagedBatch` is what the model's forward gets as its
``kv_cache``: rows of sequences that each add ``chunk`` tokens (a decode step adds 1, a prefill
chunk many), right-padded to one length. Each layer writes the new keys/values into their slots
and gathers every row's keys in position order for one masked attention call; padding writes go
to a scratch slot and no real query attends them. A step that decodes some rows and prefills others
runs them as one :class:`PackedBatch`: one row of tokens, no padding in the matmuls.
"""

from __future__ import annotations

import array
import itertools
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from chatpipe.model import cpu_kernel

_FORKS = itertools.count()  # fork ids (Sequence.fork_key)


@dataclass(eq=False)
class Sequence:
    """One sequence's tokens and its blocks: ``length`` of its ``tokens`` have keys/values stored."""

    tokens: list[int]
    blocks: list[int] = field(default_factory=list)
    length: int = 0
    keys: list[Any] = field(default_factory=list)  # the prefix key of each full block registered so far
    # (fork id, positions): sequences forked together hold the same keys/values up to there, the last
    # block's too (each holds a copy), so a forward reads that part once for all of them
    fork_key: tuple[int, int] | None = None

    def capacity(self, block_size: int) -> int:
        return len(self.blocks) * block_size


class BlockPool:
    """``num_blocks`` KV blocks of ``block_size`` positions, shared by sequences, with a prefix cache."""

    def __init__(self, config: Any, num_blocks: int, block_size: int = 16) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        head_dim = config.n_embd // config.n_head
        self.slots = num_blocks * block_size  # the first slot of the scratch block: padding writes there
        # one more block than the pool holds: the scratch block, which pads block tables too
        # heads before blocks: a row's gathered blocks are then one run of keys per head, [heads, positions,
        # dim], so a decode step is one matmul per (head, row) over all its keys rather than one per block
        self.shape = (config.n_layer, config.n_kv_head, num_blocks + 1, block_size, head_dim)
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.refs = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))  # blocks holding nothing worth keeping
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks no sequence holds, oldest first
        self.cached: dict[Any, int] = {}  # prefix key -> block
        self.block_key: list[Any] = [None] * num_blocks
        self.hit_tokens = 0  # prompt tokens found in the cache, and looked up, since the pool was made
        self.query_tokens = 0
        self._scratch: dict[int, torch.Tensor] = {}

    @staticmethod
    def bytes_for(config: Any, num_blocks: int, block_size: int, dtype: torch.dtype = torch.float32) -> int:
        """Bytes the keys and values of ``num_blocks`` blocks take for a model with ``config``."""
        per = config.n_layer * config.n_kv_head * (config.n_embd // config.n_head) * 2
        return per * num_blocks * block_size * torch.tensor([], dtype=dtype).element_size()

    @property
    def available(self) -> int:
        """Blocks a new sequence can get: the free ones and the cached ones no sequence holds."""
        return len(self.free) + len(self.evictable)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self.free) - len(self.evictable)

    def blocks_for(self, positions: int) -> int:
        return -(-positions // self.block_size)

    def storage(self, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the pool in ``dtype`` on ``device``; a change of either forgets the prefix cache."""
        if self.k is not None and self.k.dtype == dtype and self.k.device == device:
            return
        stored = self.k is not None  # blocks hold keys of another dtype or device: none can be reused
        if stored and any(self.refs):
            raise ValueError(f"the KV pool holds live sequences in {self.k.dtype}: it cannot switch to {dtype}")
        self.k = torch.zeros(self.shape, dtype=dtype, device=device)
        self.v = torch.zeros(self.shape, dtype=dtype, device=device)
        if not stored:
            return
        self.cached.clear()
        self.evictable.clear()
        self.block_key = [None] * self.num_blocks
        self.free = deque(range(self.num_blocks))

    def scratch(self, which: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer of ``shape`` for gathered blocks, kept across layers and forwards: a fresh tensor of
        megabytes per layer, or per decode step, costs page faults that take longer than the copy itself.
        It grows to the largest gather asked for, which each forward would allocate anyway, at least
        doubling: a decode step's gather is one position longer than the last one's."""
        need = math.prod(shape)
        buf = self._scratch.get(which)
        if buf is None or buf.numel() < need or buf.dtype != dtype or buf.device != device:
            grown = 2 * buf.numel() if buf is not None and buf.dtype == dtype and buf.device == device else 0
            buf = self._scratch[which] = torch.empty(max(need, grown), dtype=dtype, device=device)
        return buf[:need].view(shape)

    # ------------------------------------------------------------------------ blocks

    def _take(self) -> int | None:
        if self.free:
            block = self.free.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.block_key[block]]
            self.block_key[block] = None
        else:
            return None
        self.refs[block] = 1
        return block

    def _hold(self, block: int) -> None:
        if self.refs[block] == 0:
            self.evictable.pop(block, None)
        self.refs[block] += 1

    def _release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if self.block_key[block] is not None:
                self.evictable[block] = None  # kept for a later prefix hit until memory is needed
            else:
                self.free.append(block)

    def reserve(self, seq: Sequence, positions: int) -> bool:
        """Give ``seq`` blocks for ``positions`` positions in all; False (nothing taken) when too few are left."""
        need = self.blocks_for(positions) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.available:
            return False
        seq.blocks.extend(self._take() for _ in range(need))
        return True

    def free_sequence(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (its full ones stay cached for later prefix hits)."""
        for block in seq.blocks:
            self._release(block)
        seq.blocks, seq.length, seq.keys, seq.fork_key = [], 0, [], None

    # ------------------------------------------------------------------------ the prefix cache

    def _key(self, seq: Sequence, index: int) -> Any:
        """The prefix key of ``seq``'s full block ``index``: its parent's key and its own tokens."""
        parent = seq.keys[index - 1] if index else None
        start = index * self.block_size
        return (hash(parent), tuple(seq.tokens[start : start + self.block_size]))

    def lookup(self, seq: Sequence) -> int:
        """Share the cached blocks that hold a prefix of ``seq``'s tokens; returns the positions found.

        At least the last token is always left to compute: its logits start the reply."""
        assert not seq.blocks, "look a prefix up before the sequence holds blocks"
        usable = (len(seq.tokens) - 1) // self.block_size
        for index in range(usable):
            block = self.cached.get(self._key(seq, index))
            if block is None:
                break
            seq.keys.append(self.block_key[block])
            self._hold(block)
            seq.blocks.append(block)
        seq.length = len(seq.blocks) * self.block_size
        self.hit_tokens += seq.length
        self.query_tokens += len(seq.tokens)
        return seq.length

    def commit(self, seq: Sequence, count: int) -> None:
        """``count`` more positions of ``seq`` hold their keys/values; register the blocks that filled."""
        seq.length += count
        while len(seq.keys) < seq.length // self.block_size:
            index = len(seq.keys)
            key = self._key(seq, index)
            seq.keys.append(key)
            block = seq.blocks[index]
            if key not in self.cached and self.block_key[block] is None:
                self.cached[key] = block
                self.block_key[block] = key

    def fork(self, seq: Sequence) -> Sequence | None:
        """A copy of ``seq`` that shares its full blocks and copies its last, partly filled one
        (each copy writes there next); None when no block is left for that copy."""
        if seq.fork_key is None or seq.fork_key[1] != seq.length:
            seq.fork_key = (next(_FORKS), seq.length)
        child = Sequence(list(seq.tokens), length=seq.length, keys=list(seq.keys), fork_key=seq.fork_key)
        full = seq.length // self.block_size
        if full < len(seq.blocks):
            block = self._take()
            if block is None:
                return None
            if self.k is not None:
                self.k[:, :, block] = self.k[:, :, seq.blocks[full]]
                self.v[:, :, block] = self.v[:, :, seq.blocks[full]]
            tail = [block]
        else:
            tail = []
        for b in seq.blocks[:full]:
            self._hold(b)
        child.blocks = seq.blocks[:full] + tail
        return child


@dataclass
class PagedPlan:
    """One layer window's attention for a :class:`PagedBatch`: which keys each query may attend
    (``mask`` [rows, 1, T, keys], keys laid out as the batch's shared prefix blocks, then own blocks).
    A :class:`PackedBatch`'s plan has no mask of its own but one plan per part (``parts``)."""

    mask: torch.Tensor | None
    parts: tuple[PagedPlan, ...] = ()
    hidden: torch.Tensor | None = None  # ~mask, made once per forward where the scores are masked by hand
    window: int | None = None  # a decode step in the C kernel (no mask): the keys each query attends


@dataclass
class SharedPrefixes:
    """Rows of one forward that start with the same full blocks (the samples of one prompt, or prompts
    found in the prefix cache): each such prefix is read once for all its rows, as a grid of
    ``groups`` x ``width`` cells. ``tables`` [H_kv * groups * keys]: each prefix's slots, ``keys``
    positions each (:meth:`PagedBatch._slots`; a shorter prefix is padded); ``cell_rows`` [groups *
    width]: the row in each cell (an empty cell repeats row 0, whose result there is never read);
    ``row_cell`` [rows]: each row's cell; ``grouped`` [rows, 1, 1]: 1.0 for rows in a group, 0.0 for
    the others. ``in_order``: every row is in a group and the cells
    are the rows in order (a step of rollouts, each prompt's samples side by side): the grid is the
    batch itself, and neither index is applied."""

    groups: int
    width: int
    keys: int
    tables: torch.Tensor
    cell_rows: torch.Tensor
    row_cell: torch.Tensor
    grouped: torch.Tensor
    in_order: bool = False


@dataclass
class LongRows:
    """The rows of one forward that hold many more keys of their own than most: a decode batch that
    admits prompts as others finish holds rows from none to ``max_tokens`` generated keys, and
    padding every row to the longest gathered three times the keys there are (pass@k sampling). So
    every row's own keys are gathered up to ``split``, and only these rows' keys past it in a second
    gather (:func:`split_point` chooses where). ``rows`` [L]: which rows; ``slots`` [H_kv * L * (own
    keys - split)]: their slots, as :meth:`PagedBatch._slots` lays them out."""

    split: int
    rows: torch.Tensor
    slots: torch.Tensor


def split_point(own: list[int], least_saved: int = 1024) -> int | None:
    """Where to split rows' own keys (:class:`LongRows`) so that the two gathers read the fewest key
    positions, or None when that saves under a quarter of what padding every row to the longest reads,
    or under ``least_saved`` positions (the split's extra small ops cost about that much gathering)."""
    ordered, rows = sorted(own), len(own)
    longest = ordered[-1]
    padded = best = rows * longest
    split = None
    for i, keys in enumerate(ordered):  # split at ``keys``: the rows past index i hold more
        if not keys or (i + 1 < rows and ordered[i + 1] == keys):
            continue
        cost = rows * keys + (rows - i - 1) * (longest - keys)
        if cost < best:
            best, split = cost, keys
    if split is None or padded - best < max(padded // 4, least_saved):
        return None
    return split


class PagedBatch:
    """The ``kv_cache`` of one forward: row ``i`` of the input continues ``seqs[i]`` with ``chunks[i]``
    tokens (the rest of the row is padding). The model calls :meth:`plan` once per window,
    :meth:`attend` in every layer and :meth:`advance` at the end, which commits the positions.

    Each layer gathers a row's blocks from the head-major pool ([H_kv, blocks, block_size, D]) into
    one run of keys per head, [H_kv, rows, keys, D], and attends with one matmul per (head, row); a
    prefix several rows share is read once for all of them (:class:`SharedPrefixes`), and the keys of
    rows far longer than the rest past a split apart (:class:`LongRows`)."""

    key_mask = None

    def __init__(
        self, pool: BlockPool, seqs: list[Sequence], chunks: list[int], device: torch.device, kernel: bool = True
    ) -> None:
        self.pool, self.seqs, self.chunks, self.device = pool, seqs, chunks, device
        self.prev_embed: torch.Tensor | None = None  # set by the model (the smear) before the first layer
        # a decode step in float32 on CPU attends in the C kernel (chatpipe.model.cpu_kernel), which reads
        # the blocks in place: it needs only each row's block table and length
        self.kernel = kernel and max(chunks) == 1 and self._kernel_fits()
        if self.kernel:
            self._kernel_tables()
            return
        # every index table is built in Python and made a tensor in one call (_Tables): a forward's
        # dozen small tensor ops or torch.tensor calls cost more than its attention on a decode step
        size, width, scratch = pool.block_size, max(chunks), pool.num_blocks * pool.block_size
        if width == 1:  # a decode step: one token a row, no padding
            positions = [s.length for s in seqs]
            slots = [s.blocks[p // size] * size + p % size for s, p in zip(seqs, positions)]
        else:
            positions, slots = [], []  # [rows, T]; a row's padding repeats its last position, and
            for s, c in zip(seqs, chunks):  # writes to the scratch block
                row = [s.length + min(t, c - 1) for t in range(width)]
                positions += row
                slots += [s.blocks[p // size] * size + p % size for p in row[:c]] + [scratch] * (width - c)
        self.start = max(s.length for s in seqs)
        groups, prefix = self._share_prefixes()
        # each row's own keys: its positions past its group's prefix, through this forward's chunk
        own_keys = [s.length + c - n for s, c, n in zip(seqs, chunks, prefix)]
        self.own_keys, blocks = max(own_keys), max(len(s.blocks) for s in seqs)
        tables = _Tables(device)
        positions_at, write_at = tables.add(positions), tables.add(slots)
        blocks_at = tables.add(_padded([s.blocks for s in seqs], blocks, pool.num_blocks))
        n_own_at, n_prefix_at = tables.add(own_keys), tables.add(prefix)
        last_at = tables.add([r * width + c - 1 for r, c in enumerate(chunks)])  # each row's last real token
        grid = self._grid(groups, tables) if groups else None
        split = split_point(own_keys)
        if split is not None:
            long_at = tables.add([r for r, n in enumerate(own_keys) if n > split])
        made = tables.make()
        self._positions, self.write = made[positions_at].view(len(seqs), width), made[write_at]
        n_prefix, n_own = made[n_prefix_at][:, None], made[n_own_at][:, None]
        block_tables = made[blocks_at].view(len(seqs), blocks)
        self.own_slots = self._slots(block_tables, n_prefix, self.own_keys if split is None else split)
        self.long: LongRows | None = None
        if split is not None:
            rows = made[long_at]
            slots = self._slots(block_tables[rows], n_prefix[rows] + split, self.own_keys - split)
            self.long = LongRows(split, rows, slots)
        self.last = made[last_at]
        self.shared = grid(made, n_prefix) if grid else None
        self._key_layout(n_prefix, n_own)

    def _kernel_fits(self) -> bool:
        """Whether this decode step can attend in the C kernel: no autograd, float32 keys (the pool's,
        stored by the prefill before it), on a CPU where the kernel builds."""
        stored = self.pool.k
        if torch.is_grad_enabled() or (stored is not None and stored.dtype != torch.float32):
            return False
        return cpu_kernel.available(self.device)

    def _kernel_tables(self) -> None:
        """What the kernel reads: each row's block table and key count (its length with the new token),
        the new tokens' positions and slots, and where each row's logits are."""
        size, seqs = self.pool.block_size, self.seqs
        positions = [s.length for s in seqs]
        blocks = max(len(s.blocks) for s in seqs)
        slots = [s.blocks[p // size] * size + p % size for s, p in zip(seqs, positions)]
        block_table = _padded([s.blocks for s in seqs], blocks, self.pool.num_blocks)
        tables = _Tables(self.device)
        at = [tables.add(values) for values in (positions, slots, block_table, list(range(len(seqs))))]
        made = tables.make()
        self._positions, self.write = made[at[0]].view(len(seqs), 1), made[at[1]]
        self.block_tables, self.last = made[at[2]].view(len(seqs), blocks), made[at[3]]
        self.lengths = self._positions[:, 0] + 1
        self.max_length = max(positions) + 1
        self.start, self.shared, self.long = max(positions), None, None

    def _share_prefixes(self) -> tuple[list[tuple[list[int], int, list[int]]], list[int]]:
        """Group rows by the prefix they hold alike: the full blocks they share, and for samples forked
        together (:attr:`Sequence.fork_key`) the rest of the prompt, in each one's copy of its last
        block. Returns the groups of two rows or more (the blocks that hold the prefix, its positions,
        the rows) and each row's prefix positions (0 if in no group)."""
        size, refs = self.pool.block_size, self.pool.refs
        found: dict[tuple, list[int]] = {}
        for i, s in enumerate(self.seqs):
            blocks, n = s.blocks, 0
            full = min(len(blocks), s.length // size)
            while n < full and refs[blocks[n]] > 1:
                n += 1
            forked = s.fork_key is not None and n == s.fork_key[1] // size and s.fork_key[1] <= s.length
            key = (tuple(blocks[:n]), s.fork_key if forked else None)
            if n or forked:
                found.setdefault(key, []).append(i)
        groups, prefix = [], [0] * len(self.seqs)
        for (shared, fork_key), rows in found.items():
            if len(rows) < 2:
                continue
            keys = fork_key[1] if fork_key else len(shared) * size
            tail = [self.seqs[rows[0]].blocks[len(shared)]] if keys > len(shared) * size else []
            groups.append((list(shared) + tail, keys, rows))  # a tail is read from the first row's copy
            for r in rows:
                prefix[r] = keys
        return groups, prefix

    def _grid(self, groups: list[tuple[list[int], int, list[int]]], tables: _Tables) -> Any:
        """Add the grid's tables (:class:`SharedPrefixes`) to ``tables``; returns what makes the grid
        from the made tensors."""
        width, keys = max(len(r) for *_, r in groups), max(k for _, k, _ in groups)
        blocks = max(len(b) for b, *_ in groups)
        cell_rows, row_cell = [0] * (len(groups) * width), [0] * len(self.seqs)
        for g, (*_, rows) in enumerate(groups):
            for w, r in enumerate(rows):
                cell_rows[g * width + w], row_cell[r] = r, g * width + w
        in_order = cell_rows == list(range(len(self.seqs)))
        at = [tables.add(_padded([b for b, *_ in groups], blocks, self.pool.num_blocks))]
        at += [tables.add(cell_rows), tables.add(row_cell)]

        def grid(made: list[torch.Tensor], n_prefix: torch.Tensor) -> SharedPrefixes:
            slots = self._slots(made[at[0]].view(len(groups), blocks), None, keys)
            grouped = (n_prefix > 0).float()[:, :, None]  # [rows, 1, 1]
            return SharedPrefixes(len(groups), width, keys, slots, made[at[1]], made[at[2]], grouped, in_order)

        return grid

    def _slots(self, tables: torch.Tensor, start: torch.Tensor | None, keys: int) -> torch.Tensor:
        """Positions ``start`` (per row, [rows, 1]; None: 0) to ``start + keys`` of each row of block
        ``tables`` [rows, blocks] as slots of a layer seen as [H_kv * slots, D], every head's in turn:
        what a gather reads. Rows are gathered to the last key they hold, not their last block's end (a
        decode row's last block is half empty on average, and every row is padded to the longest);
        positions past a row's blocks read the scratch block, and no query attends them."""
        size, heads = self.pool.block_size, self.pool.shape[1]
        at = torch.arange(keys, device=self.device)[None]
        at = (at if start is None else at + start).clamp(max=tables.size(1) * size - 1).expand(tables.size(0), -1)
        # each row's block table as a table of slots, [rows, blocks * size], read at the positions
        in_block = torch.arange(size, device=self.device)
        slots = (tables[:, :, None] * size + in_block).view(tables.size(0), -1).gather(1, at)
        per_head = (self.pool.num_blocks + 1) * size
        return (torch.arange(0, heads * per_head, per_head, device=self.device)[:, None, None] + slots).flatten()

    def _key_layout(self, n_prefix: torch.Tensor, n_own: torch.Tensor) -> None:
        """Each row's key positions, its group's prefix first, then its own, and which are real
        (``n_prefix``, ``n_own`` [rows, 1]: each row's prefix and own keys)."""
        ahead = torch.arange(self.own_keys, device=self.device)[None]
        if not self.shared:  # every row's keys are its own, from position 0
            self.key_pos, self.key_real = ahead, ahead < n_own
            return
        pre = torch.arange(self.shared.keys, device=self.device)[None].expand(len(self.seqs), -1)
        self.key_pos = torch.cat([pre, n_prefix + ahead], dim=1)
        self.key_real = torch.cat([pre < n_prefix, ahead < n_own], dim=1)

    @property
    def pos(self) -> int:
        """Positions before this forward's first token, of the row that holds the most (the smear's test)."""
        return self.start

    def positions(self) -> torch.Tensor:
        """[rows, T]: each input token's position in its sequence."""
        return self._positions

    def previous_tokens(self) -> list[int | None]:
        """The token before each row's chunk (whose embedding the smear mixes in), or None at position 0."""
        return [s.tokens[s.length - 1] if s.length else None for s in self.seqs]

    def previous(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, T, C]: the embedding before each input position (the smear's), ``prev_embed`` first."""
        return torch.cat([self.prev_embed.to(x.dtype), x[:, :-1]], dim=1)

    def last_index(self) -> torch.Tensor:
        """[rows]: where each row's last real token sits in the input flattened to [rows * T]."""
        return self.last

    def plan(self, window: int | None) -> PagedPlan:
        if self.kernel:
            return PagedPlan(None, window=window)
        query, keys = self._positions[:, :, None], self.key_pos[:, None, :]  # [rows, T, 1], [rows, 1, K]
        mask = self.key_real[:, None, :] & (keys <= query)
        if window is not None:
            mask = mask & (query - keys < window)
        by_hand = self.shared is not None or self.long is not None  # scores masked by hand, not by SDPA
        return PagedPlan(mask[:, None], hidden=~mask[None, :, None] if by_hand else None)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PagedPlan) -> torch.Tensor:
        """Store the new keys/values (k/v [rows, H_kv, T, D]) and attend each query over its row's keys:
        one softmax over [shared prefix keys | own keys]. Work is laid out head-major, [H_kv, rows, ...]."""
        rows, kv_heads, width, dim = k.shape
        group = q.size(1) // kv_heads
        if self.kernel and (k.dtype != torch.float32 or torch.is_grad_enabled()):  # not what the kernel reads
            self._torch_tables_instead()
        if not self.kernel and plan.mask is None:  # a plan made for the kernel, before that switch
            plan = self.plan(plan.window)
        self.pool.storage(k.dtype, k.device)
        pk, pv = self.pool.k[layer], self.pool.v[layer]
        slots = pk.view(kv_heads, -1, dim), pv.view(kv_heads, -1, dim)  # [H_kv, all slots, D]
        slots[0].index_copy_(1, self.write, k.transpose(0, 1).reshape(kv_heads, rows * width, dim))
        slots[1].index_copy_(1, self.write, v.transpose(0, 1).reshape(kv_heads, rows * width, dim))
        if self.kernel:
            out = cpu_kernel.decode_attention(
                q[:, :, 0], pk, pv, self.block_tables, self.lengths, self.max_length, plan.window
            )
            return out[:, :, None]
        # query heads grouped by their kv head: [H_kv, rows, g*T, D]
        qg = q.reshape(rows, kv_heads, group * width, dim).transpose(0, 1)
        if self.shared is None and self.long is None:  # one fused call: no [.., keys] scores in memory
            own_k = self._gather(0, pk, self.own_slots, rows)
            own_v = self._gather(1, pv, self.own_slots, rows)
            mask = plan.mask.expand(rows, group, width, -1).reshape(1, rows, group * width, -1)
            out = F.scaled_dot_product_attention(qg, own_k, own_v, attn_mask=mask, scale=dim**-0.5)
            return out.transpose(0, 1).reshape(rows, q.size(1), width, dim)
        qg = qg * dim**-0.5
        scores = self._own_scores(qg, pk)  # [H_kv, rows, g*T, own keys]
        if self.shared is not None:
            scores = torch.cat([self._prefix_scores(qg, pk), scores], dim=-1)
        keys = scores.size(-1)
        scores = scores.view(kv_heads, rows, group, width, keys).masked_fill_(plan.hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1).view(kv_heads, rows, group * width, keys)
        prefix = keys - self.own_keys
        out = self._own_values(probs[..., prefix:], pv)  # [H_kv, rows, g*T, D]
        if self.shared is None:
            return out.transpose(0, 1).reshape(rows, q.size(1), width, dim)
        from_prefix = self._prefix_values(probs[..., :prefix], pv)
        # a row in no group reads another row's cell there: its prefix part is zeroed (x 0.0), exactly
        out = out + from_prefix if self.shared.in_order else torch.addcmul(out, from_prefix, self.shared.grouped)
        return out.transpose(0, 1).reshape(rows, q.size(1), width, dim)

    def _own_scores(self, qg: torch.Tensor, pk: torch.Tensor) -> torch.Tensor:
        """[H_kv, rows, g*T, own keys]: each row's scores on its own keys; with :class:`LongRows`, the
        long rows' keys past the split scored apart and laid in (the others' places there are masked)."""
        kv_heads, rows, gt, _ = qg.shape
        keys = self._gather(0, pk, self.own_slots, rows)
        scores = qg @ keys.transpose(-1, -2)
        if self.long is None:
            return scores
        lr = self.long
        keys = self._gather(4, pk, lr.slots, len(lr.rows))
        past = qg.index_select(1, lr.rows) @ keys.transpose(-1, -2)  # [H_kv, L, g*T, own keys - split]
        rest = scores.new_zeros(kv_heads, rows, gt, past.size(-1)).index_copy_(1, lr.rows, past)
        return torch.cat([scores, rest], dim=-1)

    def _own_values(self, probs: torch.Tensor, pv: torch.Tensor) -> torch.Tensor:
        """[H_kv, rows, g*T, D]: each row's probabilities on its own keys times their values."""
        values = self._gather(1, pv, self.own_slots, probs.size(1))
        if self.long is None:
            return probs @ values
        lr = self.long
        out = probs[..., : lr.split] @ values
        values = self._gather(5, pv, lr.slots, len(lr.rows))
        return out.index_add_(1, lr.rows, probs[..., lr.split :].index_select(1, lr.rows) @ values)

    def _prefix_scores(self, qg: torch.Tensor, pk: torch.Tensor) -> torch.Tensor:
        """[H_kv, rows, g*T, prefix keys]: each row's scores on its group's prefix, computed on the grid
        (a group's queries side by side against its prefix, read once)."""
        sh, (kv_heads, _, gt, dim) = self.shared, qg.shape
        keys = self._gather(2, pk, sh.tables, sh.groups)
        grid = qg if sh.in_order else qg.index_select(1, sh.cell_rows)
        scores = grid.reshape(kv_heads, sh.groups, sh.width * gt, dim) @ keys.transpose(-1, -2)
        scores = scores.view(kv_heads, sh.groups * sh.width, gt, -1)  # [H_kv, cells, g*T, prefix keys]
        return scores if sh.in_order else scores.index_select(1, sh.row_cell)

    def _prefix_values(self, probs: torch.Tensor, pv: torch.Tensor) -> torch.Tensor:
        """[H_kv, rows, g*T, D]: the prefix probabilities (per row) times the group's prefix values."""
        sh, (kv_heads, _, gt, keys) = self.shared, probs.shape
        values = self._gather(3, pv, sh.tables, sh.groups)
        grid = probs if sh.in_order else probs.index_select(1, sh.cell_rows)
        out = grid.reshape(kv_heads, sh.groups, sh.width * gt, keys) @ values
        out = out.view(kv_heads, sh.groups * sh.width, gt, -1)  # [H_kv, cells, g*T, D]
        return out if sh.in_order else out.index_select(1, sh.row_cell)

    def _gather(self, which: int, layer: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
        """[H_kv, rows, keys, D]: a pool layer [H_kv, blocks, block_size, D] read at ``index`` (its slots
        seen as [H_kv * slots, D], from :meth:`_slots`), into the pool's scratch buffer ``which`` (see
        :meth:`BlockPool.scratch`)."""
        kv_heads, dim = layer.size(0), layer.size(-1)
        flat = layer.view(-1, dim)
        if torch.is_grad_enabled():  # out= has no autograd: a forward outside inference mode gathers plainly
            return flat.index_select(0, index).view(kv_heads, rows, -1, dim)
        buf = self.pool.scratch(which, (len(index), dim), flat.dtype, flat.device)
        return torch.index_select(flat, 0, index, out=buf).view(kv_heads, rows, -1, dim)

    def _torch_tables_instead(self) -> None:
        """Build the torch path's tables after all (keys that are not float32, or autograd on)."""
        prev_embed = self.prev_embed
        PagedBatch.__init__(self, self.pool, self.seqs, self.chunks, self.device, kernel=False)
        self.prev_embed = prev_embed

    def advance(self, t: int) -> None:
        for seq, count in zip(self.seqs, self.chunks):
            self.pool.commit(seq, count)


class PackedBatch:
    """The ``kv_cache`` of one forward that decodes some rows and prefills others: the input is one
    row of tokens [1, N], every decode row's token, then every prefill chunk's tokens back to back.

    Its matmuls (projections, MLP, head) see only real tokens: padding a decode row to a prefill chunk's
    width would multiply its work by that width. Attention runs in two parts, each a :class:`PagedBatch`:
    the decode rows (one query each) and the prefill chunks (right-padded to the longest, a padded copy
    of their queries in, the real outputs back). A step that admits a prompt thus runs one forward, not
    a prefill forward beside the decode one: a forward of this model costs milliseconds of fixed per-op
    overhead on CPU before any arithmetic."""

    def __init__(
        self, pool: BlockPool, decode: list[Sequence], prefill: list[Sequence], chunks: list[int], device: torch.device
    ) -> None:
        if not decode or not prefill:
            raise ValueError("a packed batch holds decode rows and prefill chunks both; else use PagedBatch")
        self.decode = PagedBatch(pool, decode, [1] * len(decode), device)
        self.prefill = PagedBatch(pool, prefill, chunks, device)
        # index tables in Python, made tensors in one call (as PagedBatch builds its own)
        n, width = len(decode), max(chunks)
        starts = list(itertools.accumulate([n, *chunks[:-1]]))  # each chunk's first packed token
        # the prefill part's token each padded slot copies (padding repeats its row's last token)
        pad = [start - n + min(t, c - 1) for start, c in zip(starts, chunks) for t in range(width)]
        unpad = [r * width + t for r, c in enumerate(chunks) for t in range(c)]  # each real token's padded slot
        ends = [start + c - 1 for start, c in zip(starts, chunks)]
        positions = [s.length for s in decode] + [s.length + t for s, c in zip(prefill, chunks) for t in range(c)]
        tables = _Tables(device)
        for values in (pad, unpad, positions, [*range(n), *starts], [*range(n), *ends]):
            tables.add(values)
        # row_starts: each row's first packed token; ends: its last
        self.pad, self.unpad, self._positions, self.row_starts, self.ends = tables.make()
        self.prev_embed: torch.Tensor | None = None

    @property
    def pos(self) -> int:
        return max(self.decode.pos, self.prefill.pos)

    def positions(self) -> torch.Tensor:
        """[1, N]: each packed token's position in its sequence."""
        return self._positions[None]

    def previous_tokens(self) -> list[int | None]:
        return self.decode.previous_tokens() + self.prefill.previous_tokens()

    def previous(self, x: torch.Tensor) -> torch.Tensor:
        """[1, N, C]: the embedding before each packed token: the token before it in the row of tokens,
        except at a row's first token, where it is that row's ``prev_embed``."""
        shifted = torch.cat([x.new_zeros(1, 1, x.size(2)), x[:, :-1]], dim=1)
        return shifted.index_copy(1, self.row_starts, self.prev_embed.transpose(0, 1).to(x.dtype))

    def last_index(self) -> torch.Tensor:
        """[rows]: each row's last token in the packed input, decode rows first."""
        return self.ends

    def plan(self, window: int | None) -> PagedPlan:
        return PagedPlan(None, (self.decode.plan(window), self.prefill.plan(window)))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PagedPlan) -> torch.Tensor:
        """q/k/v [1, heads, N, D]: the decode rows' part as [rows, heads, 1, D], the prefill part padded
        to [rows, heads, width, D]; each attends as a :class:`PagedBatch`, and the real outputs are packed again."""
        n, rows, width = len(self.decode.seqs), len(self.prefill.seqs), max(self.prefill.chunks)

        def padded(t: torch.Tensor) -> torch.Tensor:
            return t[0, :, n:].index_select(1, self.pad).view(t.size(1), rows, width, -1).transpose(0, 1)

        head = self.decode.attend(layer, *(t[:, :, :n].transpose(0, 2) for t in (q, k, v)), plan.parts[0])
        tail = self.prefill.attend(layer, padded(q), padded(k), padded(v), plan.parts[1])
        tail = tail.transpose(0, 1).reshape(q.size(1), rows * width, -1).index_select(1, self.unpad)
        return torch.cat([head.transpose(0, 2)[0], tail], dim=1)[None]

    def advance(self, t: int) -> None:
        self.decode.advance(1)
        self.prefill.advance(t)


def _padded(tables: list[list[int]], width: int, pad: int) -> list[int]:
    """``tables`` [rows][<= width] padded with ``pad`` to [rows, width], flattened."""
    return [b for t in tables for b in (*t, *[pad] * (width - len(t)))]


class _Tables:
    """Integer tables of one forward, built in Python and made tensors in one call (each such call
    costs microseconds, and a forward needs about ten): :meth:`add` each, then :meth:`make`."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.values, self.sizes = device, [], []

    def add(self, values: list[int]) -> int:
        """Queue ``values``; returns their index in :meth:`make`'s list."""
        self.values += values
        self.sizes.append(len(values))
        return len(self.sizes) - 1

    def make(self) -> list[torch.Tensor]:
        # through array('q'): torch.tensor converts a list of Python ints five times slower
        made = torch.frombuffer(array.array("q", self.values), dtype=torch.int64).clone()
        return list(made.to(self.device).split(self.sizes))
