"""Continuous batching: one running batch that requests join and leave between decode steps.

A :class:`Scheduler` owns a :class:`chatpipe.model.row_cache.RowKVCache` of ``rows`` x
``context`` positions (and ``rows // 2`` prompt slots for requests of several samples), allocated
once: that is all the KV memory it ever uses. Each call of
:meth:`Scheduler.step`:

1. **admits** waiting requests, oldest first, while the batch has a free row for every sample of
   the next one: the joining prompts are prefilled together, right-padded (a prompt never attends
   to the padding after it, so each keeps its own positions). A prompt of one sample is copied
   into its row; a prompt of several into a prompt slot that its samples' rows read (they share
   its prefill and its keys/values, and hold only their replies);
2. samples one token for every live row, each row with its own stop tokens, ``max_tokens`` and
   calculator state. Every request has its own ``torch.Generator`` seeded with its seed: its live
   samples draw from it together, in sample order, wherever their rows sit in the batch;
3. **evicts** rows that finished or whose request was cancelled (the last live row moves into
   the gap, so live rows stay ``0 .. n - 1``);
4. runs one decode step for the rows left, each at its own position.

A request's tokens thus depend only on the request and its seed, not on its neighbours (up to the
float rounding of a matmul at another batch size). A request whose prompt plus ``max_tokens``
exceeds ``context`` is refused at :meth:`Scheduler.submit`; one that fits waits until rows free up.

Usage::

    sched = Scheduler(engine, rows=16, context=256)
    req = sched.submit(GenRequest(prompt, num_samples=4, max_tokens=48, temperature=1.0, seed=3))
    while sched.busy():
        sched.step()
    req.seqs, req.masks   # per sample: the generated tokens, 1 = sampled / 0 = forced tool output
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from chatpipe.inference.engine import Engine, _Row, draw, sampling_candidates
from chatpipe.model.gpt import KVCache
from chatpipe.model.row_cache import RowKVCache

log = logging.getLogger(__name__)


@dataclass(eq=False)
class GenRequest:
    """One prompt to sample ``num_samples`` replies for, with its sampling settings and results.

    ``on_token(sample, token, mask)`` and ``on_done(sample, reason)`` (``"stop"``, ``"length"``,
    ``"tool_cut"`` or ``"cancelled"``) are called from the thread running the scheduler.
    """

    prompt: list[int]
    num_samples: int = 1
    max_tokens: int = 64
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 42
    stop_tokens: list[int] | None = None
    logprobs: bool = False  # record each token's log-prob under the sampling temperature (``logps``)
    top_logprobs: int | None = None  # record the raw distribution's log-probs (``tops``): None = off, k = top k
    on_token: Callable[[int, int, int], None] | None = None
    on_done: Callable[[int, str], None] | None = None
    seqs: list[list[int]] = field(default_factory=list)
    masks: list[list[int]] = field(default_factory=list)
    logps: list[list[float]] = field(default_factory=list)  # with ``logprobs``: per token, 0.0 where forced
    # with ``top_logprobs``: per sample, per token (log-prob of the token, [(token, log-prob)] of the k
    # likeliest), at temperature 1 (the model's own distribution); (0.0, []) where forced
    tops: list[list[tuple[float, list[tuple[int, float]]]]] = field(default_factory=list)
    reasons: list[str | None] = field(default_factory=list)
    cancelled: bool = False
    rng: torch.Generator | None = field(default=None, repr=False)  # seeded when the request joins

    @property
    def done(self) -> bool:
        """Every sample has finished (or the request was cancelled and has left the batch)."""
        return len(self.reasons) == self.num_samples and all(r is not None for r in self.reasons)


@dataclass(eq=False)
class _Live:
    """A live row: which sample of which request, its tool state, its generator and its next input."""

    req: GenRequest
    sample: int
    stops: set[int]
    tool: _Row = field(default_factory=_Row)
    count: int = 0
    token: int = 0  # the token the next decode step feeds
    reason: str | None = None


class Scheduler:
    """Runs :class:`GenRequest` s together in one batch of at most ``rows`` rows (see the module docstring)."""

    def __init__(self, engine: Engine, rows: int = 16, context: int = 0) -> None:
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        self.engine, self.model = engine, engine.model
        self.context = context or engine.model.config.sequence_len
        self.cache = RowKVCache.from_config(engine.model.config, rows, self.context)
        self.device = next(engine.model.parameters()).device
        self.rows = rows
        self.live: list[_Live] = []
        self.waiting: deque[GenRequest] = deque()
        self.logits: torch.Tensor | None = None  # [len(live), V]: each live row's next-token logits
        self.steps = 0

    @property
    def memory_bytes(self) -> int:
        """The KV cache's bound in float32: rows, and rows // 2 prompt slots (allocated when a request
        with several samples first shares one), of context positions of every layer's keys and values."""
        return RowKVCache.bytes_for(self.model.config, self.rows + self.rows // 2, self.context)

    def fits(self, prompt_len: int, max_tokens: int, num_samples: int = 1) -> str | None:
        """Why a request this big can never run here (naming the limit), or None when it can."""
        if prompt_len + max_tokens > self.context:
            return (
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) is over the {self.context} "
                "KV positions a batch row holds"
            )
        if num_samples > self.rows:
            return f"{num_samples} samples need more rows than the batch's {self.rows}"
        return None

    def submit(self, req: GenRequest) -> GenRequest:
        """Queue ``req``; it joins the batch at a later :meth:`step`. A request that can never fit is a ValueError."""
        if not req.prompt:
            raise ValueError("prompt_ids must hold at least one token (e.g. <|bos|>)")
        if why := self.fits(len(req.prompt), req.max_tokens, req.num_samples):
            raise ValueError(why)
        req.seqs = [[] for _ in range(req.num_samples)]
        req.masks = [[] for _ in range(req.num_samples)]
        req.logps = [[] for _ in range(req.num_samples)] if req.logprobs else []
        req.tops = [[] for _ in range(req.num_samples)] if req.top_logprobs is not None else []
        req.reasons = [None] * req.num_samples
        self.waiting.append(req)
        return req

    def busy(self) -> bool:
        """Rows are live or requests wait."""
        return bool(self.live or self.waiting)

    def _admit(self) -> None:
        """Prefill waiting requests into free rows, oldest first, while the next one fits whole."""
        joining: list[GenRequest] = []
        free = self.rows - len(self.live)
        while self.waiting and (self.waiting[0].cancelled or self.waiting[0].num_samples <= free):
            req = self.waiting.popleft()
            if req.cancelled:
                _finish_cancelled(req)
                continue
            joining.append(req)
            free -= req.num_samples
        if not joining:
            return
        live = len(self.live)
        try:
            logits = self._prefill(joining)
        except Exception:  # back in the queue, so fail_all() reports them with the batch
            del self.live[live:]
            self.cache.n = live
            self.waiting.extendleft(reversed(joining))
            raise
        parts = [] if self.logits is None else [self.logits]
        repeats = torch.tensor([r.num_samples for r in joining], device=logits.device)
        self.logits = torch.cat([*parts, logits.repeat_interleave(repeats, 0)])

    def _prefill(self, joining: list[GenRequest]) -> torch.Tensor:
        """Prefill ``joining`` together (right-padded: a prompt never attends to the padding after it),
        copy each into a row per sample; returns each prompt's last logits [len(joining), V]."""
        lengths = [len(r.prompt) for r in joining]
        longest = max(lengths)
        prompt = KVCache.from_config(self.model.config, batch_size=len(joining), max_len=longest)
        ids = torch.tensor([r.prompt + [r.prompt[-1]] * (longest - len(r.prompt)) for r in joining], device=self.device)
        ends = (torch.arange(len(joining), device=self.device), torch.tensor(lengths, device=self.device) - 1)
        last = self.model(ids, kv_cache=prompt)[ends]  # each prompt's logits at its own last token
        if prompt.prev_embed is not None:  # smear: a row's previous embedding is its own last token's
            prompt.prev_embed = self.model.embed_for_smear(ids[ends])
        for i, req in enumerate(joining):
            stops = self.engine.stop_ids(req.stop_tokens)
            req.rng = torch.Generator(device=self.device)
            req.rng.manual_seed(req.seed)
            shared = req.num_samples > 1 and self.cache.free_slot() is not None  # else whole rows, as one sample
            slot = self.cache.add_prompt(prompt, source_row=i, length=lengths[i]) if shared else None
            for j in range(req.num_samples):
                if slot is None:
                    self.cache.load(len(self.live), prompt, source_row=i, length=lengths[i])
                else:  # the samples read one copy of their prompt (RowKVCache's shared prompts)
                    self.cache.join(len(self.live), slot, prompt, source_row=i)
                self.live.append(_Live(req, j, stops))
                self.cache.n = len(self.live)
        return last

    def _sample(self) -> list[int]:
        """One token per live row from its logits: argmax at temperature 0, else a draw from its request's
        generator (its live samples in sample order, one call a step), wherever its rows sit in the batch.
        With ``top_k`` the draw is over the k best tokens only (:func:`sampling_candidates`)."""
        tokens = [0] * len(self.live)
        by_request: dict[int, list[int]] = {}
        greedy = []
        for i, row in enumerate(self.live):
            if row.req.temperature < torch.finfo(torch.float32).tiny:
                greedy.append(i)
            else:
                by_request.setdefault(id(row.req), []).append(i)
        if greedy:
            for i, t in zip(greedy, self.logits[greedy].argmax(dim=-1).tolist()):
                tokens[i] = t
        if not by_request:
            return tokens
        settings: dict[tuple, list[list[int]]] = {}  # requests that sample alike: their probabilities together
        for idx in by_request.values():
            r = self.live[idx[0]].req
            idx.sort(key=lambda i: self.live[i].sample)
            settings.setdefault((r.temperature, r.top_k, r.top_p), []).append(idx)
        for (temperature, top_k, top_p), groups in settings.items():
            flat = [i for idx in groups for i in idx]
            probs, ids = sampling_candidates(self.logits[flat], temperature, top_k, top_p)
            drawn = draw(probs, [(len(idx), self.live[idx[0]].req.rng) for idx in groups])
            if ids is not None:  # a top-k candidate's index -> its token
                drawn = ids.gather(1, drawn[:, None]).squeeze(1)
            for i, t in zip(flat, drawn.tolist()):
                tokens[i] = t
        return tokens

    def _logprobs(self, tokens: list[int]) -> list[float]:
        """Each live row's log-prob of ``tokens`` under its sampling distribution before top-k/top-p,
        log softmax(logits / temperature) (1 for greedy rows): the behaviour policy's log-probs as a
        trainer recomputes them. Only rows of requests that ask (``logprobs``); 0.0 for the others."""
        asked = [i for i, row in enumerate(self.live) if row.req.logprobs]
        out = [0.0] * len(self.live)
        if not asked:
            return out
        tiny = torch.finfo(torch.float32).tiny  # below it a row is greedy (``_sample``)
        temps = [t if (t := self.live[i].req.temperature) >= tiny else 1.0 for i in asked]
        temps = torch.tensor(temps, device=self.logits.device)
        chosen = torch.tensor([tokens[i] for i in asked], device=self.logits.device)
        logp = torch.log_softmax(self.logits[asked].float() / temps[:, None], dim=-1)
        for i, v in zip(asked, logp.gather(1, chosen[:, None]).squeeze(1).tolist()):
            out[i] = v
        return out

    def _top_logprobs(self, tokens: list[int]) -> list[tuple[float, list[tuple[int, float]]] | None]:
        """For the rows of requests that ask (``top_logprobs`` not None): the log-prob of ``tokens`` and the
        ``top_logprobs`` likeliest tokens with theirs, under the raw distribution log softmax(logits), not
        the sampling temperature (what OpenAI's API reports); None for the other rows."""
        asked = [i for i, row in enumerate(self.live) if row.req.top_logprobs is not None]
        out: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(self.live)
        if not asked:
            return out
        logp = torch.log_softmax(self.logits[asked].float(), dim=-1)
        chosen = torch.tensor([tokens[i] for i in asked], device=logp.device)
        chosen_lp = logp.gather(1, chosen[:, None]).squeeze(1).tolist()
        k = max(self.live[i].req.top_logprobs for i in asked)
        values, ids = logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long())
        values, ids = values.tolist(), ids.tolist()
        for n, i in enumerate(asked):
            top = self.live[i].req.top_logprobs
            out[i] = (chosen_lp[n], list(zip(ids[n][:top], values[n][:top])))
        return out

    def _advance(self, row: _Live, sampled: int, logp: float = 0.0, top: tuple | None = None) -> None:
        """Apply one sampled token (its log-prob ``logp``, its raw ``top`` log-probs) to ``row``: forced
        tool output first, stop rules, the calculator."""
        tool = row.tool
        forced = bool(tool.forced)
        tok = tool.forced.popleft() if forced else sampled
        mask = 0 if forced else 1
        row.count += 1
        row.token = tok
        req = row.req
        req.seqs[row.sample].append(tok)
        req.masks[row.sample].append(mask)
        if req.logprobs:
            req.logps[row.sample].append(0.0 if forced else logp)
        if req.top_logprobs is not None:
            req.tops[row.sample].append((0.0, []) if forced or top is None else top)
        if req.on_token is not None:
            _call(req, req.on_token, row.sample, tok, mask)
        if forced and tool.cut and not tool.forced:
            row.reason = "tool_cut"
        elif not forced and tok in row.stops:
            row.reason = "stop"
        elif not forced:
            self.engine._tool_step(tool, tok)
        if row.reason is None and row.count >= req.max_tokens:
            row.reason = "length"

    def _evict(self) -> None:
        """Drop finished and cancelled rows; the last live rows move into their gaps."""
        keep = [i for i, row in enumerate(self.live) if row.reason is None and not row.req.cancelled]
        for row in self.live:
            if row.reason is None and row.req.cancelled:
                row.reason = "cancelled"
            if row.reason is not None:
                row.req.reasons[row.sample] = row.reason
                if row.req.on_done is not None:
                    _call(row.req, row.req.on_done, row.sample, row.reason)
        m, kept = len(keep), set(keep)
        holes = [i for i in range(m) if i not in kept]
        movers = [i for i in keep if i >= m]
        for src, dst in zip(movers, holes):
            self.cache.move(src, dst)
            self.live[dst] = self.live[src]
        del self.live[m:]
        self.cache.n = m

    @torch.inference_mode()
    def step(self) -> int:
        """Admit, sample a token per live row, evict the finished, decode the rest; returns the live rows."""
        for row in self.live:  # cancelled before sampling: leave now
            if row.req.cancelled and row.reason is None:
                row.reason = "cancelled"
        self._admit()
        if not self.live:
            self.logits = None
            return 0
        tokens = self._sample()
        for row, tok, logp, top in zip(self.live, tokens, self._logprobs(tokens), self._top_logprobs(tokens)):
            if row.reason is None:
                self._advance(row, tok, logp, top)
        self._evict()
        self.steps += 1
        if not self.live:
            self.logits = None
            return 0
        column = torch.tensor([[row.token] for row in self.live], dtype=torch.long, device=self.device)
        self.logits = self.model(column, kv_cache=self.cache)[:, -1, :]
        return len(self.live)

    def run(self) -> None:
        """Step until every submitted request has finished."""
        while self.busy():
            self.step()

    def stats(self) -> dict[str, int]:
        """The batch's load: rows decoding and samples waiting for a row, KV blocks in use and in all,
        and the prompt tokens looked up in a prefix cache and found there (0 while there is none)."""
        return {
            "running": len(self.live),
            "waiting": sum(r.num_samples for r in self.waiting),
            "kv_blocks_used": 0,
            "kv_blocks_total": 0,
            "prefix_hit_tokens": 0,
            "prefix_query_tokens": 0,
        }

    def fail_all(self) -> list[GenRequest]:
        """Forget every live and waiting request (after an error in a step); returns them."""
        reqs = list({id(r.req): r.req for r in self.live}.values()) + list(self.waiting)
        self.live, self.logits, self.cache.n = [], None, 0
        self.waiting.clear()
        return reqs


def _call(req: GenRequest, callback: Callable[..., None], *args: Any) -> None:
    """A request's callback; one that fails cancels its own request, never the batch."""
    try:
        callback(*args)
    except Exception:
        log.exception("a request's callback failed: the request is cancelled")
        req.cancelled = True


def _finish_cancelled(req: GenRequest) -> None:
    """A request cancelled before it joined: every sample ends without a token."""
    for j in range(req.num_samples):
        req.reasons[j] = "cancelled"
        if req.on_done is not None:
            _call(req, req.on_done, j, "cancelled")


def generate_continuous(
    engine: Engine,
    prompts: list[list[int]],
    num_samples: int = 1,
    *,
    seed: int = 0,
    max_rows: int = 128,
    context: int = 0,
    logprobs: bool = False,
    **kw: Any,
) -> list[tuple]:
    """:meth:`Engine.generate_many` on a continuous batch: (full sequences, masks) per prompt, in order;
    with ``logprobs`` (full sequences, masks, per-token log-probs, 0.0 on the prompt and forced tokens).

    Prompt ``i`` samples with seed ``seed + i``, so results depend only on the prompts and ``seed``.
    The batch holds ``max_rows`` rows (rounded down to whole prompts); when a row finishes, the
    next prompt's samples take its place as soon as there are rows for all of them. The batch stays
    on ``engine.batch`` for the next call of the same size (its KV memory is allocated once).
    """
    longest = max(len(p) for p in prompts) if prompts else 0
    rows = min(max(num_samples, (max_rows // num_samples) * num_samples), len(prompts) * num_samples)
    need = longest + kw.get("max_tokens", 64)
    context = context or max(need, min(-(-need // 64) * 64, engine.model.config.sequence_len))  # reused more
    sched = engine.batch
    if not isinstance(sched, Scheduler) or sched.rows != rows or sched.context < context or sched.busy():
        sched = engine.batch = Scheduler(engine, rows=rows, context=context)  # RL's next step reuses its memory
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
