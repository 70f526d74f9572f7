"""The engine's front door: generation for a model and its chat tokenizer, as token rows or as text.

:class:`Engine` holds a model, its tokenizer and the row rules (stops, the calculator:
:mod:`chatpipe.inference.rows`), and runs everything on one continuous batch
(:mod:`chatpipe.inference.scheduler`). :class:`TextStream` turns one sample's tokens into the text
deltas a chat shows; :class:`StopMatcher` cuts them at stop strings.

Usage::

    engine = Engine(model, tokenizer)
    seqs, masks = engine.generate_batch(prompt_ids, num_samples=4, max_tokens=128, temperature=0.8)
    for kind, text in engine.stream(prompt_ids, max_tokens=128, stop=["\n\n"]):   # one sample, as text deltas
        ...  # kind: "text" | "python" (a tool call) | "python_output" (its result)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from chatpipe.inference.rows import RowRules
from chatpipe.inference.scheduler import GenRequest, Scheduler, generate_continuous


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
    """Generation for a :class:`chatpipe.model.gpt.GPT` and a tokenizer with chat special tokens.

    Every method runs on the engine's one :class:`chatpipe.inference.scheduler.Scheduler`, kept
    between calls: its KV pool is allocated once, and its prefix cache lets a chat's next turn
    compute only the new messages."""

    def __init__(self, model: Any, tokenizer: Any, max_tool_tokens: int = 32) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.rules = RowRules(tokenizer, max_tool_tokens)
        self._scheduler: Scheduler | None = None
        self.bos = self.rules.bos
        self.assistant_end = self.rules.assistant_end
        self.python_start, self.python_end = self.rules.python_start, self.rules.python_end
        self.output_start, self.output_end = self.rules.output_start, self.rules.output_end

    @property
    def tool_stats(self) -> dict[str, int]:
        """Running totals over every generation: calculator calls, failed ones, cut ones."""
        return self.rules.tool_stats

    @tool_stats.setter
    def tool_stats(self, value: dict[str, int]) -> None:
        self.rules.tool_stats = dict(value)

    def stop_ids(self, stop_tokens: list[int] | None = None) -> set[int]:
        """Tokens that end a sample: ``<|assistant_end|>``, ``<|bos|>`` and any extra ``stop_tokens``."""
        return self.rules.stop_ids(stop_tokens)

    def scheduler(self, rows: int, context: int, max_batch_tokens: int = 512) -> Scheduler:
        """The engine's scheduler (its KV pool and prefix cache kept between calls), made anew only
        when it is busy or another shape is asked for."""
        sched = self._scheduler
        same = sched is not None and (sched.rows, sched.max_batch_tokens) == (rows, max_batch_tokens)
        if not same or sched.context < context or sched.busy():
            sched = self._scheduler = Scheduler(self, rows=rows, context=context, max_batch_tokens=max_batch_tokens)
        return sched

    def generate_batch(
        self, prompt_ids: list[int] | list[list[int]], num_samples: int = 1, seed: int = 42, **kw: Any
    ) -> tuple[list[list[int]], list[list[int]]]:
        """Full sequences (prompt + generated, ending at the stop token if one came) and their masks.

        Masks are 0 on the prompt and on forced tool-output tokens, 1 on sampled tokens. Several
        prompts give their rows in order, ``num_samples`` per prompt; prompt ``i`` samples with seed
        ``seed + i``. Keyword arguments are :class:`GenRequest`'s sampling settings.
        """
        prompts = _as_prompts(prompt_ids)
        generated = self.generate_many(prompts, num_samples, seed=seed, max_rows=len(prompts) * num_samples, **kw)
        return [s for seqs, _ in generated for s in seqs], [m for _, masks in generated for m in masks]

    def generate_many(
        self, prompts: list[list[int]], num_samples: int = 1, *, seed: int = 0, max_rows: int = 128, **kw: Any
    ) -> list[tuple[list[list[int]], list[list[int]]]]:
        """(full sequences, masks) for each of ``prompts`` (any lengths), in their order, on one
        continuous batch of ``max_rows`` rows (:func:`chatpipe.inference.scheduler.generate_continuous`)."""
        if max_rows < num_samples:
            raise ValueError(f"max_rows = {max_rows} must be >= num_samples = {num_samples}")
        _as_prompts(prompts)
        return generate_continuous(self, prompts, num_samples, seed=seed, max_rows=max_rows, **kw)

    def stream(
        self, prompt_ids: list[int], stats: dict[str, Any] | None = None, stop: list[str] | None = None, **kw: Any
    ) -> Iterator[tuple[str, str]]:
        """One sample as ``(kind, text)`` deltas while it is generated, for chat front ends.

        ``kind`` is the assistant message part the text belongs to: ``"text"``, ``"python"`` (a
        calculator call) or ``"python_output"`` (its result); the special tokens that delimit parts
        are not shown. Text is held back while it ends inside a multi-byte UTF-8 character.
        ``stop`` strings end the reply before the first of them (in text parts; see
        :class:`StopMatcher`). Keyword arguments are :class:`GenRequest`'s sampling settings. A
        ``stats`` dict, when given, receives ``tokens`` (generated so far) and, at the end,
        ``finish_reason`` (``"stop"``: the model ended its turn or a stop string came; ``"length"``:
        ``max_tokens`` ran out; ``"tool_cut"``: a calculator call ran past ``max_tool_tokens`` and was cut).
        """
        prompt = _as_prompts(prompt_ids)[0]
        text = TextStream(self, stats, stop, kw.get("stop_tokens"))
        pieces: list[tuple[str, str]] = []
        req = GenRequest(prompt, on_token=lambda _s, tok, mask: pieces.extend(text.push(tok, mask)), **kw)
        need = len(prompt) + req.max_tokens  # may run past sequence_len, as far as the rotary table reaches
        sched = self.scheduler(1, max(self.model.config.sequence_len, need))  # kept: the next turn hits its prefix
        sched.submit(req)
        try:
            while sched.busy():
                sched.step()
                yield from pieces
                pieces.clear()
                if text.ended:
                    req.cancelled = True
            yield from text.close(cut=req.reasons[0] == "tool_cut")
        finally:  # a consumer that stops early: the request leaves the batch now
            req.cancelled = True
            while sched.busy():
                sched.step()


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
