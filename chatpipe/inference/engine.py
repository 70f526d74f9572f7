"""Inference engine: KV-cached sampling with calculator tool use.

Each prompt is prefilled once (several prompts of different lengths together, left-padded to
one length with the padding masked), its KV cache copied into ``num_samples`` rows, then one
token per row is produced per step. When a row emits ``<|python_end|>``, the text since
``<|python_start|>`` goes to :func:`chatpipe.inference.calculator.evaluate`; a result is forced back into
that row as ``<|output_start|>`` + result tokens + ``<|output_end|>``, one token per step, mask 0.
A call the calculator rejects forces nothing. A call still open after ``max_tool_tokens`` tokens
(a model looping on digits) is cut: ``<|python_end|>`` is forced and the row stops there, so no
runaway output. Both count as failed calls in ``engine.tool_stats``.

Usage::

    engine = Engine(model, tokenizer)
    for tokens, masks in engine.generate(prompt_ids, num_samples=4, max_tokens=128, temperature=0.8):
        ...  # one column: next token of each row, 1 = sampled / 0 = forced or padding
    seqs, masks = engine.generate_batch(prompt_ids, num_samples=4, max_tokens=128)
    for kind, text in engine.stream(prompt_ids, max_tokens=128, stop=["\n\n"]):   # one sample, as text deltas
        ...  # kind: "text" | "python" (a tool call) | "python_output" (its result)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from chatpipe.inference.calculator import evaluate
from chatpipe.model.gpt import KVCache


@dataclass
class _Row:
    """Per-sample state: the tool-use state machine and the queue of tokens to force."""

    done: bool = False
    in_python: bool = False
    python_tokens: list[int] = field(default_factory=list)
    forced: deque[int] = field(default_factory=deque)
    cut: bool = False  # a tool call ran past max_tool_tokens: stop once the forced tokens are out


def sample_next(
    logits: torch.Tensor,
    rng: torch.Generator,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """Next token per row from logits [B, V]: argmax when temperature is 0, else top-k / top-p sampling.

    ``top_p`` (nucleus) keeps the most likely tokens whose probabilities, after top-k, sum to at
    least ``top_p`` (the first token always stays).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    # a temperature below float32's smallest normal number is 0 or a denormal there: dividing
    # by it gives inf - inf = NaN. Its distribution is the argmax's, so take the argmax.
    if temperature < torch.finfo(torch.float32).tiny:
        return logits.argmax(dim=-1)
    probs, ids = sampling_candidates(logits, temperature, top_k, top_p)
    drawn = draw(probs, [(probs.size(0), rng)])
    return drawn if ids is None else ids.gather(1, drawn[:, None]).squeeze(1)


def draw(probs: torch.Tensor, groups: list[tuple[int, torch.Generator]]) -> torch.Tensor:
    """One index per row of ``probs`` [B, K], drawn in proportion to it: ``groups`` splits the rows, in
    order, into runs of ``count`` rows that draw from one generator each.

    The same numbers as ``torch.multinomial(probs[run], 1, generator=g)`` run by run, which draws
    as ``argmax(probs / q)`` with ``q`` exponential noise from ``g``. Here each run's noise still
    comes from its own generator, but the division and the argmax run once over every row: a batch
    of 16 requests makes one kernel of each instead of 16 multinomial calls (the draw 1.7x faster at
    16 rows, 3x at 8 groups of 8: bench/README.md, rollouts round seven).
    """
    covered = sum(count for count, _ in groups)
    if covered != probs.size(0):  # refused before any generator moves
        raise ValueError(f"the draw's groups cover {covered} rows of {probs.size(0)}")
    if not bool(torch.isfinite(probs).all()):  # multinomial refuses these; an argmax would not
        raise ValueError("the sampling probabilities hold inf or NaN: the model's logits are not finite")
    noise = torch.empty_like(probs)
    start = 0
    for count, rng in groups:
        noise[start : start + count].exponential_(generator=rng)
        start += count
    return probs.div(noise).argmax(dim=-1)


def sampling_probs(
    logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """The distribution :func:`sample_next` draws from, per row of ``logits`` [B, V] (``temperature`` > 0)."""
    # shifted so the best logit is 0: a tiny temperature sends the others to -inf, never to +inf
    logits = logits.float()
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if top_k is not None and top_k > 0:
        k = min(top_k, logits.size(-1))
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        p_sorted = torch.softmax(sorted_logits, dim=-1)
        drop = p_sorted.cumsum(dim=-1) - p_sorted >= top_p  # the more likely tokens already hold top_p
        drop[:, 0] = False  # a top_p that is 0 in float32 would otherwise drop every token
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.softmax(logits, dim=-1)


def sampling_candidates(
    logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(probabilities [B, K], their token ids [B, K] or None for the whole vocabulary): what every
    draw (:func:`sample_next`, the continuous batch) samples from. It is :func:`sampling_probs`'s
    distribution, with a ``top_k`` below the vocabulary's size cut to its ``top_k`` best tokens first,
    so a draw looks at K numbers per row instead of V (at top-k 50 of a 1k vocabulary, the draw over
    tokens it could never pick was ~10% of a rollout's time). Ties at the k-th logit, which
    :func:`sampling_probs` keeps, are cut to k here."""
    if top_k is None or top_k <= 0 or top_k >= logits.size(-1):
        return sampling_probs(logits, temperature, None, top_p), None
    best, ids = torch.topk(logits.float(), top_k, dim=-1)  # sorted, best first: top_p reads them in order
    return sampling_probs(best, temperature, None, top_p), ids


def _prefix_table(s: str) -> list[int]:
    """KMP failure table: ``t[i]`` is the longest proper prefix of ``s[: i + 1]`` that is also its suffix."""
    t, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = t[k - 1]
        k += s[i] == s[k]
        t[i] = k
    return t


class StopMatcher:
    """Cuts streamed text at the first stop string to end; holds back a tail that may start one.

    Each stop string runs a KMP automaton, so every character is looked at once per stop string
    and the held-back text is never longer than the longest stop string: the work is linear in
    the text and the stop strings, however they overlap.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.tables = [_prefix_table(s) for s in self.stops]
        self.states = [0] * len(self.stops)  # characters of each stop string matched so far
        self.pending, self.stopped = "", False

    def _step(self, ch: str) -> int:
        """Advance every automaton by ``ch``; the length of the longest stop string it completes, or 0."""
        done = 0
        for i, (stop, table) in enumerate(zip(self.stops, self.tables)):
            k = self.states[i]
            while k and stop[k] != ch:
                k = table[k - 1]
            k += stop[k] == ch
            if k == len(stop):
                done, k = max(done, k), table[k - 1]
            self.states[i] = k
        return done

    def feed(self, text: str) -> str:
        """The text now safe to emit; after a stop string, ``stopped`` is set and the rest is dropped."""
        held = len(self.pending)
        buf = self.pending + text
        for i, ch in enumerate(text):
            if matched := self._step(ch):
                self.pending, self.stopped = "", True
                return buf[: held + i + 1 - matched]
        keep = max(self.states, default=0)
        self.pending = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """What is held back when the text ends (or a tool call starts) without a stop string."""
        out, self.pending = self.pending, ""
        self.states = [0] * len(self.stops)
        return out


class Engine:
    """Generation for a :class:`chatpipe.model.gpt.GPT` and a tokenizer with chat special tokens."""

    def __init__(self, model: Any, tokenizer: Any, max_tool_tokens: int = 32) -> None:
        if max_tool_tokens < 1:
            raise ValueError(f"max_tool_tokens must be >= 1, got {max_tool_tokens}")
        self.model = model
        self.tokenizer = tokenizer
        # the calculator's expressions are a few numbers and operators: 32 tokens is generous
        self.max_tool_tokens = max_tool_tokens
        self.tool_stats = {"calls": 0, "failed": 0, "cut": 0}  # running totals over every generate()
        self.batch: Any = None  # the continuous batch generate_continuous keeps for its next call
        special = tokenizer.encode_special
        self.bos = tokenizer.bos_id
        self.assistant_end = special("<|assistant_end|>")
        self.python_start, self.python_end = special("<|python_start|>"), special("<|python_end|>")
        self.output_start, self.output_end = special("<|output_start|>"), special("<|output_end|>")

    def stop_ids(self, stop_tokens: list[int] | None = None) -> set[int]:
        """Tokens that end a sample: ``<|assistant_end|>``, ``<|bos|>`` and any extra ``stop_tokens``."""
        return {self.assistant_end, self.bos, *(stop_tokens or [])}

    def _tool_step(self, row: _Row, token: int) -> None:
        """Advance the python-tool state machine of one row by one token."""
        if token == self.python_start:
            row.in_python, row.python_tokens = True, []
        elif token == self.python_end and row.in_python:
            row.in_python = False
            self.tool_stats["calls"] += 1
            result = evaluate(self.tokenizer.decode(row.python_tokens))
            if result is not None:
                row.forced.extend([self.output_start, *self.tokenizer.encode(result), self.output_end])
            else:
                self.tool_stats["failed"] += 1
        elif row.in_python:
            row.python_tokens.append(token)
            if len(row.python_tokens) >= self.max_tool_tokens:
                row.in_python, row.cut = False, True
                row.forced.append(self.python_end)
                self.tool_stats["calls"] += 1
                self.tool_stats["failed"] += 1
                self.tool_stats["cut"] += 1

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: list[int] | list[list[int]],
        num_samples: int = 1,
        max_tokens: int = 64,
        temperature: float = 1.0,
        top_k: int | None = None,
        seed: int = 42,
        stop_tokens: list[int] | None = None,
        top_p: float | None = None,
    ) -> Iterator[tuple[list[int], list[int]]]:
        """Stream (tokens, masks), one column per step, until every row stopped or ``max_tokens``.

        ``prompt_ids`` is one prompt, or a list of prompts (of any lengths: shorter ones are
        left-padded and the padding masked); prompt ``i`` owns rows ``i * num_samples .. (i + 1) *
        num_samples - 1``.
        Rows that have finished keep yielding ``bos`` with mask 0 as padding; callers ignore it
        (the engine never forces ``bos``, so a masked ``bos`` is always padding).
        """
        prompts = _as_prompts(prompt_ids)
        device = next(self.model.parameters()).device
        rng = torch.Generator(device=device)
        rng.manual_seed(seed)
        stops = self.stop_ids(stop_tokens)
        config = self.model.config
        length, num_rows = max(map(len, prompts)), len(prompts) * num_samples

        # prefill each prompt once (shorter ones left-padded, the padding masked), then share its
        # keys/values across its rows
        prompt_cache = KVCache.from_config(config, batch_size=len(prompts), max_len=length)
        ids = torch.tensor([[self.bos] * (length - len(p)) + p for p in prompts], dtype=torch.long, device=device)
        if any(len(p) < length for p in prompts):
            prompt_cache.key_mask = torch.tensor(
                [[False] * (length - len(p)) + [True] * len(p) for p in prompts], device=device
            )
        logits = self.model(ids, kv_cache=prompt_cache)[:, -1, :].repeat_interleave(num_samples, dim=0)
        cache = KVCache.from_config(config, batch_size=num_rows, max_len=length + max_tokens)
        cache.prefill(prompt_cache)
        del prompt_cache

        rows = [_Row() for _ in range(num_rows)]
        for step in range(max_tokens):
            sampled = sample_next(logits, rng, temperature, top_k, top_p).tolist()
            tokens, masks = [], []
            for row, tok in zip(rows, sampled):
                if row.done:
                    tokens.append(self.bos)
                    masks.append(0)
                    continue
                forced = bool(row.forced)
                tok = row.forced.popleft() if forced else tok
                tokens.append(tok)
                masks.append(0 if forced else 1)
                if forced and row.cut and not row.forced:
                    row.done = True
                elif not forced and tok in stops:
                    row.done = True
                elif not forced:
                    self._tool_step(row, tok)
            yield tokens, masks
            if all(r.done for r in rows) or step == max_tokens - 1:
                return
            column = torch.tensor(tokens, dtype=torch.long, device=device).unsqueeze(1)
            logits = self.model(column, kv_cache=cache)[:, -1, :]

    def generate_batch(
        self, prompt_ids: list[int] | list[list[int]], num_samples: int = 1, **kw: Any
    ) -> tuple[list[list[int]], list[list[int]]]:
        """Full sequences (prompt + generated, ending at the stop token if one came) and their masks.

        Masks are 0 on the prompt and on forced tool-output tokens, 1 on sampled tokens. Several
        prompts give their rows in order, ``num_samples`` per prompt.
        """
        stops = self.stop_ids(kw.get("stop_tokens"))
        prompts = _as_prompts(prompt_ids)
        seqs = [list(p) for p in prompts for _ in range(num_samples)]
        masks = [[0] * len(p) for p in prompts for _ in range(num_samples)]
        done = [False] * len(seqs)
        for tokens, column_masks in self.generate(prompt_ids, num_samples=num_samples, **kw):
            for i, (tok, m) in enumerate(zip(tokens, column_masks)):
                if done[i] or (m == 0 and tok == self.bos):  # padding after the row stopped (e.g. a cut call)
                    done[i] = True
                    continue
                seqs[i].append(tok)
                masks[i].append(m)
                done[i] = m == 1 and tok in stops
            if all(done):
                break
        return seqs, masks

    def generate_many(
        self, prompts: list[list[int]], num_samples: int = 1, *, seed: int = 0, max_rows: int = 128, **kw: Any
    ) -> list[tuple[list[list[int]], list[list[int]]]]:
        """:meth:`generate_batch` for each of ``prompts`` (any lengths), in their order.

        A tiny model's decode step costs about the same for 4 rows as for 100 (per-op overhead
        dominates), so consecutive prompts are generated together, whatever their lengths, up to
        ``max_rows`` rows per call. A call's random stream is seeded by ``seed`` plus the index of its
        first prompt, so results depend only on the prompts, ``seed`` and ``max_rows``.
        """
        if max_rows < num_samples:
            raise ValueError(f"max_rows = {max_rows} must be >= num_samples = {num_samples}")
        per_call = max_rows // num_samples
        out: list[tuple[list[list[int]], list[list[int]]]] = []
        for start in range(0, len(prompts), per_call):
            group = prompts[start : start + per_call]
            seqs, masks = self.generate_batch(group, num_samples=num_samples, seed=seed + start, **kw)
            for k in range(len(group)):
                rows = slice(k * num_samples, (k + 1) * num_samples)
                out.append((seqs[rows], masks[rows]))
        return out

    def stream(
        self, prompt_ids: list[int], stats: dict[str, Any] | None = None, stop: list[str] | None = None, **kw: Any
    ) -> Iterator[tuple[str, str]]:
        """One sample as ``(kind, text)`` deltas while it is generated, for chat front ends.

        ``kind`` is the assistant message part the text belongs to: ``"text"``, ``"python"`` (a
        calculator call) or ``"python_output"`` (its result); the special tokens that delimit parts
        are not shown. Text is held back while it ends inside a multi-byte UTF-8 character.
        ``stop`` strings end the reply before the first of them (in text parts; see
        :class:`StopMatcher`), in this thread, so a server's event loop never scans them.
        Keyword arguments are those of :meth:`generate` (``num_samples`` is 1). A ``stats`` dict,
        when given, receives ``tokens`` (generated so far) and, at the end, ``finish_reason``
        (``"stop"``: the model ended its turn or a stop string came; ``"length"``: ``max_tokens``
        ran out; ``"tool_cut"``: a calculator call ran past ``max_tool_tokens`` and was cut).
        """
        cuts = self.tool_stats["cut"]
        text = TextStream(self, stats, stop, kw.get("stop_tokens"))
        for tokens, masks in self.generate(prompt_ids, num_samples=1, **kw):
            yield from text.push(tokens[0], masks[0])
            if text.ended:
                return
        yield from text.close(cut=self.tool_stats["cut"] > cuts)


class TextStream:
    """One sample's tokens in, :meth:`Engine.stream`'s ``(kind, text)`` deltas out, a token at a time.

    :meth:`push` takes each generated token (and its mask) and returns the deltas it completes;
    :meth:`close` the rest when generation ends. ``ended`` turns True at a stop token or stop
    string: later tokens are ignored (the caller stops generating). ``stats`` gets ``tokens`` and
    ``finish_reason`` as :meth:`Engine.stream` describes.
    """

    def __init__(
        self, engine: Engine, stats: dict[str, Any] | None, stop: list[str] | None, stop_tokens: list[int] | None
    ) -> None:
        self.decode = engine.tokenizer.decode
        self.kinds = {
            engine.python_start: "python",
            engine.output_start: "python_output",
            engine.python_end: "text",
            engine.output_end: "text",
        }
        self.stops = engine.stop_ids(stop_tokens)
        self.stats = {} if stats is None else stats
        self.stats.update(tokens=0, finish_reason="length")
        self.matcher = StopMatcher(stop or [])
        self.kind, self.pending = "text", []  # tokens not shown yet: they end inside a UTF-8 character
        self.ended = False

    def _emit(self, kind: str, text: str, out: list[tuple[str, str]]) -> None:
        if kind != "text":
            if held := self.matcher.flush():  # a stop string never spans a tool call
                out.append(("text", held))
            out.append((kind, text))
        elif piece := self.matcher.feed(text):
            out.append((kind, piece))
        if self.matcher.stopped:
            self.stats["finish_reason"] = "stop"
            self.ended = True

    def push(self, tok: int, mask: int) -> list[tuple[str, str]]:
        """The deltas ``tok`` completes (none while a character or a tool part is still open)."""
        out: list[tuple[str, str]] = []
        if self.ended:
            return out
        self.stats["tokens"] += 1
        if mask == 1 and tok in self.stops:
            self.stats["finish_reason"] = "stop"
            return self.close()
        if tok in self.kinds:
            if self.pending:
                self._emit(self.kind, self.decode(self.pending), out)
            self.kind, self.pending = self.kinds[tok], []
            return out
        self.pending.append(tok)
        text = self.decode(self.pending)
        if not text.endswith("\ufffd"):
            self._emit(self.kind, text, out)
            self.pending = []
        return out

    def close(self, cut: bool = False) -> list[tuple[str, str]]:
        """What is held back when generation ends; ``cut``: it ended at a calculator call cut short."""
        out: list[tuple[str, str]] = []
        if self.ended and self.stats["finish_reason"] == "stop" and self.matcher.stopped:
            return out
        if self.pending:
            self._emit(self.kind, self.decode(self.pending), out)
            self.pending = []
        if not self.matcher.stopped:
            if held := self.matcher.flush():
                out.append(("text", held))
            if cut:
                self.stats["finish_reason"] = "tool_cut"
        self.ended = True
        return out


def _as_prompts(prompt_ids: list[int] | list[list[int]]) -> list[list[int]]:
    """One prompt or several, as a list of prompts (each at least one token)."""
    prompts = [prompt_ids] if prompt_ids and isinstance(prompt_ids[0], int) else prompt_ids
    if not prompts or not all(prompts):
        raise ValueError("prompt_ids must hold at least one token (e.g. <|bos|>)")
    return [list(p) for p in prompts]
