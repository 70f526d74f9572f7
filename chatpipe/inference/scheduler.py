"""The one engine loop: continuous batching over paged KV memory, with a prefix cache.

Every token chatpipe generates (chat, server, evals, rollouts, the reward model's sampling) comes
from a :class:`Scheduler`. It owns admission, the KV budget and preemption; the model only runs
forwards (:class:`chatpipe.model.paged_cache.PagedBatch`, ``PackedBatch``);
:mod:`chatpipe.inference.sampler` draws and :class:`chatpipe.inference.rows.RowState` applies stops
and the calculator. Each :meth:`Scheduler.step`:

1. **samples** one token per live row (each request from its own ``torch.Generator``), applies its
   row rules and **evicts** the rows that finished or were cancelled (their full blocks stay in the
   prefix cache);
2. **admits** waiting requests, oldest first, while the batch has a row for every sample of the
   next one and the KV pool has blocks for its prompt. Its prompt is looked up in the prefix cache
   first: the blocks found are shared, only the rest is computed;
3. **reserves** a slot for every live row's next position. A row that needs a new block and finds
   none **preempts** the newest row or prefill (its blocks are freed; it is recomputed later, mostly
   from the prefix cache), never running out of memory;
4. runs **one forward**: every live row's next token and the next chunk of each prefilling prompt,
   under a per-step token budget (``max_batch_tokens``, decode rows first), packed into one row of
   tokens. A long prompt takes several steps, and the rows already decoding get a token at every one
   of them. When a prompt is done, its samples fork from it (sharing its blocks) and draw their
   first tokens at the next step.

A request's tokens depend only on the request and its seed, not on its neighbours (up to the float
rounding of a matmul at another batch size, and the draw order of a request's samples when one of
them was preempted). A request that can never fit (its prompt plus ``max_tokens`` over the context
or the whole pool, or more samples than rows) is refused at :meth:`Scheduler.submit`.

Usage::

    sched = Scheduler(engine, rows=16, context=256)
    req = sched.submit(GenRequest(prompt, num_samples=4, max_tokens=48, temperature=1.0, seed=3))
    while sched.busy():
        sched.step()
    req.seqs, req.masks   # per sample: the generated tokens, 1 = sampled / 0 = forced tool output
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from chatpipe.inference.rows import RowState
from chatpipe.inference.sampler import draw, sampling_candidates, token_logprobs, top_logprobs
from chatpipe.model.paged_cache import BlockPool, PackedBatch, PagedBatch, Sequence

log = logging.getLogger(__name__)

GREEDY = torch.finfo(torch.float32).tiny  # a temperature below it samples the argmax


@dataclass(eq=False)
class GenRequest:
    """One prompt to sample ``num_samples`` replies for, with its sampling settings and results.

    ``on_token(sample, token, mask)`` and ``on_done(sample, reason)`` (``"stop"``, ``"length"``,
    ``"tool_cut"`` or ``"cancelled"``) are called from the thread running the scheduler.
    """

    prompt: list[int]
    num_samples: int = 1
    max_tokens: int = 64
    min_tokens: int = 0  # no stop token is sampled before this many tokens (vLLM's ``min_tokens``)
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 42
    stop_tokens: list[int] | None = None
    logprobs: bool = False  # record each token's log-prob under the sampling temperature (``logps``)
    top_logprobs: int = -1  # >= 0: record the raw log-prob of each token and its k best rivals (``tops``)
    on_token: Callable[[int, int, int], None] | None = None
    on_done: Callable[[int, str], None] | None = None
    seqs: list[list[int]] = field(default_factory=list)
    masks: list[list[int]] = field(default_factory=list)
    logps: list[list[float]] = field(default_factory=list)  # with ``logprobs``: per token, 0.0 where forced
    tops: list[list[tuple[float, list[tuple[int, float]]]]] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    cancelled: bool = False
    rng: torch.Generator | None = field(default=None, repr=False)  # seeded when the request is admitted
    admitted_at: float | None = None  # time.monotonic() when it left the queue for the batch

    @property
    def done(self) -> bool:
        """Every sample has finished (or the request was cancelled and has left the batch)."""
        return len(self.reasons) == self.num_samples and all(r is not None for r in self.reasons)


@dataclass(eq=False)
class _Row:
    """A live sample: its request, its row rules, its sequence in the KV pool and its next input."""

    req: GenRequest
    sample: int
    state: RowState
    seq: Sequence
    order: int  # admission order: the newest is preempted first
    token: int = 0


@dataclass(eq=False)
class _Prefill:
    """A sequence being prefilled: a new request's prompt (its samples fork from it when done), or
    one preempted ``row`` being recomputed (prompt and the tokens it had)."""

    req: GenRequest
    seq: Sequence
    order: int
    row: _Row | None = None
    looked_up: bool = False


class Scheduler:
    """Runs :class:`GenRequest` s together (see the module docstring).

    ``rows``: most samples generating at once. ``context``: most positions of one sequence (prompt
    plus reply). ``kv_blocks`` x ``block_size``: the KV pool (default: ``rows`` sequences of ``context``
    positions). ``max_batch_tokens``: tokens one step may compute (decode rows plus prefill chunks).
    """

    def __init__(
        self,
        engine: Any,
        rows: int = 16,
        context: int = 0,
        kv_blocks: int = 0,
        block_size: int = 16,
        max_batch_tokens: int = 512,
    ) -> None:
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        if max_batch_tokens <= rows:
            raise ValueError(f"max_batch_tokens ({max_batch_tokens}) must be above rows ({rows}): prefill needs room")
        self.engine, self.model, self.rules = engine, engine.model, engine.rules
        self.context = context or engine.model.config.sequence_len
        self.rows, self.max_batch_tokens = rows, max_batch_tokens
        self.pool = BlockPool(self.model.config, kv_blocks or rows * -(-self.context // block_size), block_size)
        self.device = next(self.model.parameters()).device
        self.live: list[_Row] = []
        self.prefills: list[_Prefill] = []
        self.waiting: deque[GenRequest] = deque()
        self.logits: torch.Tensor | None = None  # [len(live), V]: each live row's next-token logits
        self.steps = self.preemptions = self.hit_tokens = self.query_tokens = 0
        self._order = itertools.count()

    @property
    def memory_bytes(self) -> int:
        """The KV pool's bound in float32: all the KV memory this scheduler ever allocates."""
        return BlockPool.bytes_for(self.model.config, self.pool.num_blocks, self.pool.block_size)

    def stats(self) -> dict[str, int]:
        """The batch's load, for ``/metrics``: rows running and waiting, KV blocks, prefix-cache tokens."""
        return {
            "running": len(self.live) + sum(self._rows_of(p) for p in self.prefills),
            "waiting": sum(r.num_samples for r in self.waiting),
            "kv_blocks_used": self.pool.used,
            "kv_blocks_total": self.pool.num_blocks,
            "prefix_hit_tokens": self.hit_tokens,
            "prefix_query_tokens": self.query_tokens,
            "preemptions": self.preemptions,
        }

    def fits(self, prompt_len: int, max_tokens: int, num_samples: int = 1) -> str | None:
        """Why a request this big can never run here (naming the limit), or None when it can."""
        need = prompt_len + max_tokens
        if need > self.context:
            return f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) is over the {self.context} KV positions a sequence holds"
        if need > self.pool.slots:
            return f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) is over the KV pool's {self.pool.slots} positions"
        if num_samples > self.rows:
            return f"{num_samples} samples need more rows than the batch's {self.rows}"
        return None

    def submit(self, req: GenRequest) -> GenRequest:
        """Queue ``req``; it joins the batch at a later :meth:`step`. A request that can never fit is a ValueError."""
        if not req.prompt:
            raise ValueError("prompt_ids must hold at least one token (e.g. <|bos|>)")
        if why := self.fits(len(req.prompt), req.max_tokens, req.num_samples):
            raise ValueError(why)
        if not 0 <= req.min_tokens <= req.max_tokens:
            raise ValueError(f"min_tokens must be in 0..max_tokens ({req.max_tokens}), got {req.min_tokens}")
        req.seqs = [[] for _ in range(req.num_samples)]
        req.masks = [[] for _ in range(req.num_samples)]
        req.logps = [[] for _ in range(req.num_samples)] if req.logprobs else []
        req.tops = [[] for _ in range(req.num_samples)] if req.top_logprobs >= 0 else []
        req.reasons = [None] * req.num_samples
        self.waiting.append(req)
        return req

    def busy(self) -> bool:
        """Rows are live, prompts prefilling or requests waiting."""
        return bool(self.live or self.prefills or self.waiting)

    def run(self) -> None:
        """Step until every submitted request has finished."""
        while self.busy():
            self.step()

    # ------------------------------------------------------------------------ one step

    @torch.inference_mode()
    def step(self, sampled: Callable[[], None] | None = None) -> int:
        """Sample a token per live row, evict the finished, admit waiting requests into the rows freed,
        then one forward: every live row's next token and the next chunk of each prefilling prompt;
        returns the live rows (those that joined included: they draw their first token next step).
        ``sampled`` is called once the step's tokens are drawn and reported (``on_token`` /
        ``on_done``), before the forward: a server sends them on from there, so a token does not wait
        for the forward that prepares the next one."""
        self._drop_cancelled()
        if self.live:
            tokens = self._sample()
            self._record(tokens)
            self._evict()
        self.steps += 1
        if sampled is not None:
            sampled()
        self._admit()
        self._forward()
        return len(self.live)

    def _rows_of(self, p: _Prefill) -> int:
        return 1 if p.row is not None else p.req.num_samples

    def _drop_cancelled(self) -> None:
        """Rows of cancelled requests end now; their prefills leave and free their blocks."""
        for row in self.live:
            if row.req.cancelled and row.state.reason is None:
                row.state.reason = "cancelled"
        for p in [p for p in self.prefills if p.req.cancelled]:
            self.prefills.remove(p)
            self.pool.free_sequence(p.seq)
            samples = [p.row.sample] if p.row is not None else range(p.req.num_samples)
            for j in samples:
                _end(p.req, j, "cancelled")

    def _admit(self) -> None:
        """Start prefilling waiting requests, oldest first, while rows and KV blocks allow the next one."""
        in_use = len(self.live) + sum(self._rows_of(p) for p in self.prefills)
        while self.waiting:
            req = self.waiting[0]
            if req.cancelled:
                self.waiting.popleft()
                for j in range(req.num_samples):
                    _end(req, j, "cancelled")
                continue
            if in_use + req.num_samples > self.rows:
                return
            job = _Prefill(req, Sequence(list(req.prompt)), next(self._order))
            self._look_up(job)
            # its prompt's blocks and one more per sample (each sample's first own block) must be free now
            need = self.pool.blocks_for(len(req.prompt)) - len(job.seq.blocks) + req.num_samples
            if need > self.pool.available and (self.live or self.prefills):
                self.pool.free_sequence(job.seq)  # wait for memory; the prefix found is looked up again
                self.hit_tokens -= job.seq.length
                self.query_tokens -= len(req.prompt)
                return
            self.waiting.popleft()
            req.admitted_at = time.monotonic()
            req.rng = torch.Generator(device=self.device)
            req.rng.manual_seed(req.seed)
            self.prefills.append(job)
            in_use += req.num_samples

    def _look_up(self, job: _Prefill) -> None:
        """Share the prefix-cache blocks that hold the start of ``job``'s sequence (counted for the hit rate)."""
        found = self.pool.lookup(job.seq)
        job.looked_up = True
        self.hit_tokens += found
        self.query_tokens += len(job.seq.tokens)

    def _prefill(self) -> list[tuple[_Prefill, int]]:
        """The next chunk of each prefilling sequence, oldest first, within the step's token budget (the
        decode rows' tokens come first), with KV blocks reserved for it: (job, tokens) pairs."""
        budget = self.max_batch_tokens - len(self.live)
        batch: list[tuple[_Prefill, int]] = []
        for job in self.prefills:
            if budget <= 0:
                break
            if not job.looked_up:
                self._look_up(job)
            chunk = min(len(job.seq.tokens) - job.seq.length, budget)
            if not self.pool.reserve(job.seq, job.seq.length + chunk):
                break  # wait until rows finish and free blocks; later prefills wait behind this one
            batch.append((job, chunk))
            budget -= chunk
        return batch

    def _forward(self) -> None:
        """Room for every live row's next position (preempting the newest when the pool is full), the
        prefill chunks that fit, and one forward over both: the live rows' next logits; prompts whose
        last chunk this was join as live rows with theirs."""
        self._reserve_decode()
        batch = self._prefill()
        if not self.live and not batch:
            self.logits = None
            return
        seqs, chunks = [job.seq for job, _ in batch], [chunk for _, chunk in batch]
        if self.live and batch:  # one row of tokens: each live row's last token, then the chunks
            ids = [
                [row.token for row in self.live]
                + [t for s, c in zip(seqs, chunks) for t in s.tokens[s.length : s.length + c]]
            ]
            cache: PagedBatch | PackedBatch = PackedBatch(
                self.pool, [r.seq for r in self.live], seqs, chunks, self.device
            )
        elif self.live:
            ids = [[row.token] for row in self.live]
            cache = PagedBatch(self.pool, [row.seq for row in self.live], [1] * len(self.live), self.device)
        else:  # prompts only, right-padded to the longest chunk
            width = max(chunks)
            ids = [s.tokens[s.length : s.length + c] + [0] * (width - c) for s, c in zip(seqs, chunks)]
            cache = PagedBatch(self.pool, seqs, chunks, self.device)
        ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        logits = self.model(ids, kv_cache=cache, logits_at=cache.last_index())  # [live rows + chunks, V]
        decoded = len(self.live)
        self.logits = logits[:decoded] if decoded else None
        for i, (job, _) in enumerate(batch):
            if job.seq.length == len(job.seq.tokens):
                self.prefills.remove(job)
                self._join(job, logits[decoded + i])

    def _join(self, job: _Prefill, last: torch.Tensor) -> None:
        """A prefilled sequence's rows go live: its samples fork from it, or the preempted row resumes."""
        if job.row is not None:
            job.row.seq = job.seq
            rows = [job.row]
        else:
            rows = []
            for j in range(job.req.num_samples):
                seq = job.seq if j == 0 else self.pool.fork(job.seq)
                state = self.rules.row(job.req.max_tokens, job.req.stop_tokens)
                row = _Row(job.req, j, state, seq if seq is not None else Sequence([]), job.order)
                if seq is None:  # no block left for its copy: recomputed once memory frees
                    self.prefills.insert(0, _Prefill(job.req, Sequence(list(job.req.prompt)), job.order, row))
                    continue
                rows.append(row)
        self.live.extend(rows)
        new = last[None].expand(len(rows), -1)
        self.logits = new if self.logits is None else torch.cat([self.logits, new])

    def _sample(self) -> list[int]:
        """One token per live row from its logits: argmax at temperature 0, else a draw from its request's
        generator (its live samples in sample order, one call a step), wherever its rows sit in the batch.
        With ``top_k`` the draw is over the k best tokens only (:func:`sampling_candidates`)."""
        tokens = [0] * len(self.live)
        logits = self._stops_held()
        by_request: dict[int, list[int]] = {}
        greedy = []
        for i, row in enumerate(self.live):
            if row.req.temperature < GREEDY:
                greedy.append(i)
            else:
                by_request.setdefault(id(row.req), []).append(i)
        if greedy:
            for i, t in zip(greedy, logits[greedy].argmax(dim=-1).tolist()):
                tokens[i] = t
        settings: dict[tuple, list[list[int]]] = {}  # requests that sample alike: their probabilities together
        for idx in by_request.values():
            r = self.live[idx[0]].req
            idx.sort(key=lambda i: self.live[i].sample)
            settings.setdefault((r.temperature, r.top_k, r.top_p), []).append(idx)
        for (temperature, top_k, top_p), groups in settings.items():
            flat = [i for idx in groups for i in idx]
            probs, ids = sampling_candidates(logits[flat], temperature, top_k, top_p)
            drawn = draw(probs, [(len(idx), self.live[idx[0]].req.rng) for idx in groups])
            if ids is not None:  # a top-k candidate's index -> its token
                drawn = ids.gather(1, drawn[:, None]).squeeze(1)
            for i, t in zip(flat, drawn.tolist()):
                tokens[i] = t
        return tokens

    def _stops_held(self) -> torch.Tensor:
        """The live rows' logits, with their stop tokens at -inf in rows still short of their request's
        ``min_tokens`` (a copy then; the log-probs a client reads stay the model's own)."""
        short = [i for i, row in enumerate(self.live) if row.state.count < row.req.min_tokens]
        if not short:
            return self.logits
        logits = self.logits.clone()  # may be an expanded view (a request's samples share one row)
        for i in short:
            logits[i, list(self.live[i].state.stops)] = float("-inf")
        return logits

    def _record(self, tokens: list[int]) -> None:
        """Apply each live row's sampled token through its row rules; record it (and its log-probs)."""
        logps = self._logprobs(tokens)
        tops = self._tops(tokens)
        for i, row in enumerate(self.live):
            if row.state.reason is not None:  # cancelled before sampling
                continue
            tok, mask = row.state.advance(tokens[i])
            row.token = tok
            row.seq.tokens.append(tok)
            req = row.req
            req.seqs[row.sample].append(tok)
            req.masks[row.sample].append(mask)
            if req.logprobs:
                req.logps[row.sample].append(logps[i] if mask else 0.0)
            if req.top_logprobs >= 0:
                req.tops[row.sample].append(tops[i])
            if req.on_token is not None:
                _call(req, req.on_token, row.sample, tok, mask)

    def _logprobs(self, tokens: list[int]) -> list[float]:
        """Each live row's log-prob of its token under log softmax(logits / temperature) (1 for greedy
        rows), for requests that ask (``logprobs``); 0.0 for the others."""
        asked = [i for i, row in enumerate(self.live) if row.req.logprobs]
        out = [0.0] * len(self.live)
        if asked:
            temps = [t if (t := self.live[i].req.temperature) >= GREEDY else 1.0 for i in asked]
            chosen = torch.tensor([tokens[i] for i in asked], device=self.logits.device)
            values = token_logprobs(self.logits[asked], chosen, torch.tensor(temps, device=self.logits.device))
            for i, v in zip(asked, values.tolist()):
                out[i] = v
        return out

    def _tops(self, tokens: list[int]) -> list[Any]:
        """For requests with ``top_logprobs`` >= 0: (the token's raw log-prob, its k best rivals) per row."""
        asked = [i for i, row in enumerate(self.live) if row.req.top_logprobs >= 0]
        out: list[Any] = [None] * len(self.live)
        if asked:
            k = max(self.live[i].req.top_logprobs for i in asked)
            chosen = torch.tensor([tokens[i] for i in asked], device=self.logits.device)
            values, rivals = top_logprobs(self.logits[asked], chosen, k)
            for i, v, r in zip(asked, values, rivals):
                out[i] = (v, r[: self.live[i].req.top_logprobs])
        return out

    def _evict(self) -> None:
        """Drop finished and cancelled rows (their full blocks stay cached) and their logits."""
        keep = []
        for i, row in enumerate(self.live):
            if row.state.reason is None and row.req.cancelled:
                row.state.reason = "cancelled"
            if row.state.reason is None:
                keep.append(i)
                continue
            self.pool.free_sequence(row.seq)
            _end(row.req, row.sample, row.state.reason)
        if len(keep) < len(self.live):
            self.live = [self.live[i] for i in keep]
            self.logits = self.logits[keep] if keep else None

    def _reserve_decode(self) -> None:
        """A KV slot for every live row's next position, preempting the newest row or prefill while the
        pool has none."""
        for row in list(self.live):
            while row in self.live and not self.pool.reserve(row.seq, row.seq.length + 1):
                self._preempt_newest()

    def _preempt_newest(self) -> None:
        """Free the newest row or prefill's blocks; it is recomputed when memory allows (prefix cache first)."""
        holders = [p for p in self.prefills if p.seq.blocks]
        newest = max([*self.live, *holders], key=lambda x: x.order)
        self.preemptions += 1
        self.pool.free_sequence(newest.seq)
        if isinstance(newest, _Prefill):
            newest.looked_up = False
            return
        self.live.remove(newest)
        tokens = list(newest.req.prompt) + newest.req.seqs[newest.sample]
        self.prefills.insert(0, _Prefill(newest.req, Sequence(tokens), newest.order, newest))

    def fail_all(self) -> list[GenRequest]:
        """Forget every live, prefilling and waiting request (after an error in a step); returns them."""
        held = [r.req for r in self.live] + [p.req for p in self.prefills] + list(self.waiting)
        for seq in [r.seq for r in self.live] + [p.seq for p in self.prefills]:
            self.pool.free_sequence(seq)
        self.live, self.prefills, self.logits = [], [], None
        self.waiting.clear()
        return list({id(r): r for r in held}.values())


def _end(req: GenRequest, sample: int, reason: str) -> None:
    req.reasons[sample] = reason
    if req.on_done is not None:
        _call(req, req.on_done, sample, reason)


def _call(req: GenRequest, callback: Callable[..., None], *args: Any) -> None:
    """A request's callback; one that fails cancels its own request, never the batch."""
    try:
        callback(*args)
    except Exception:
        log.exception("a request's callback failed: the request is cancelled")
        req.cancelled = True


def generate_continuous(
    engine: Any,
    prompts: list[list[int]],
    num_samples: int = 1,
    *,
    seed: int = 0,
    max_rows: int = 128,
    context: int = 0,
    logprobs: bool = False,
    **kw: Any,
) -> list[tuple]:
    """(full sequences, masks) per prompt, in order, ``num_samples`` each; with ``logprobs`` (full
    sequences, masks, per-token log-probs, 0.0 on the prompt and forced tokens).

    Prompt ``i`` samples with seed ``seed + i``, so results depend only on the prompts and ``seed``.
    The batch holds ``max_rows`` rows (rounded down to whole prompts); when a row finishes, the
    next prompt's samples take its place as soon as there are rows for all of them. The engine keeps
    the scheduler for its next call of the same size (its KV memory is allocated once).
    """
    longest = max(len(p) for p in prompts) if prompts else 0
    rows = min(max(num_samples, (max_rows // num_samples) * num_samples), len(prompts) * num_samples)
    need = longest + kw.get("max_tokens", 64)
    context = context or max(need, min(-(-need // 64) * 64, engine.model.config.sequence_len))  # reused more
    sched = engine.scheduler(rows, context, max_batch_tokens=rows * context + 1)  # every joining prompt at once
    reqs = [
        sched.submit(GenRequest(list(p), num_samples=num_samples, seed=seed + i, logprobs=logprobs, **kw))
        for i, p in enumerate(prompts)
    ]
    sched.run()
    out = []
    for p, req in zip(prompts, reqs):
        seqs = [list(p) + s for s in req.seqs]
        masks = [[0] * len(p) + m for m in req.masks]
        out.append((seqs, masks, [[0.0] * len(p) + lp for lp in req.logps]) if logprobs else (seqs, masks))
    return out
