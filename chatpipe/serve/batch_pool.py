"""The server's generation on one continuous batch: a :class:`chatpipe.inference.scheduler.Scheduler`
stepped by one thread, every reply a row (or several) of its running batch.

:class:`BatchPool` has :class:`chatpipe.serve.app.EnginePool`'s interface (``check_capacity``,
``stream``, the load counters ``/health`` reports), so the HTTP code is the same for both. At most
``serve.batch_rows`` replies decode at once; up to ``serve.max_queue`` more wait (in the
scheduler's queue), then 503. Each row holds ``serve.batch_context`` KV positions, so the cache
never grows past ``batch_rows x batch_context`` positions; a request whose prompt plus
``max_tokens`` exceeds a row is refused (413) before it queues. A client that leaves marks its
request cancelled: its row leaves the batch at the next decode step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from chatpipe.inference.engine import Engine, TextStream
from chatpipe.inference.scheduler import GenRequest, Scheduler

log = logging.getLogger(__name__)


class Admission:
    """A request let in by ``check_capacity`` whose reply has not started yet.

    Pools hold these weakly: a client that goes away before its stream starts drops its
    Admission with the response, and its place in the queue is free again."""

    __slots__ = ("__weakref__", "tokens")

    def __init__(self, tokens: int = 0) -> None:
        self.tokens = tokens  # the most the request may generate: prompts x n x max_tokens


def take_place(pool: Any, in_flight: int, tokens: int, limits: str, error: type[Exception]) -> Admission:
    """Hold a place in ``pool`` for a request, or refuse it (503, naming ``limits``) when its
    ``size + max_queue`` places are taken: by the ``in_flight`` replies and by those admitted whose
    reply has not started (a streaming reply starts only after the response headers go out)."""
    pending = len(pool.admitted)
    if in_flight + pending >= pool.size + pool.max_queue:
        raise error(
            503,
            f"server busy: {pool.active} replies generating and {pool.waiting + pending} queued ({limits}); "
            "retry shortly",
        )
    admission = Admission(tokens)
    pool.admitted.add(admission)
    return admission


class BatchPool:
    """Replies generated together in one batch of ``rows`` rows of ``context`` KV positions each."""

    def __init__(self, engine: Engine, rows: int, context: int, max_queue: int, error: type[Exception]) -> None:
        self.engine, self.max_queue, self.error = engine, max_queue, error
        self.scheduler = Scheduler(engine, rows=rows, context=context)
        self.size = rows
        self.inflight = self.served = self.cancelled = 0
        self.admitted: weakref.WeakSet[Admission] = weakref.WeakSet()
        self.inbox: deque[GenRequest] = deque()
        # what the batch thread has for the event loops, handed over once per step (one wake-up, not one a token)
        self.outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        self.wake = threading.Event()
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, name="batch-engine", daemon=True)
        self.thread.start()

    # ------------------------------------------------------------------ load figures

    @property
    def live_rows(self) -> int:
        """Rows in the running batch now (a cancelled reply's row leaves within one decode step)."""
        return self.scheduler.cache.n

    @property
    def active(self) -> int:
        """Replies with a row in the batch."""
        return len({id(row.req) for row in list(self.scheduler.live)})

    @property
    def waiting(self) -> int:
        """Replies waiting for a row."""
        return len(self.inbox) + len(self.scheduler.waiting)

    def queued_tokens(self) -> int:
        """The token budgets of the requests admitted whose replies have not started."""
        return sum(a.tokens for a in list(self.admitted))

    def batch_report(self) -> dict[str, Any]:
        """The batch's shape and memory for ``/health``."""
        s = self.scheduler
        return {"rows": s.rows, "live_rows": self.live_rows, "context": s.context, "kv_bytes": s.memory_bytes}

    # ------------------------------------------------------------------ admission

    def check_capacity(self, tokens: int = 0, positions: int = 0) -> Admission:
        """Refuse a request whose longest reply cannot fit a row (413) or when the queue is full (503).

        ``positions``: the prompt plus ``max_tokens`` of its longest prompt.
        """
        if positions > self.scheduler.context:
            raise self.error(
                413,
                f"prompt + max_tokens = {positions} tokens is over the {self.scheduler.context} KV positions "
                "a batch row holds (serve.batch_context): ask for fewer tokens or start a new chat",
            )
        limits = f"serve.batch_rows={self.size}, serve.max_queue={self.max_queue}"
        return take_place(self, self.inflight, tokens, limits, self.error)

    # ------------------------------------------------------------------ the batch thread

    def _loop(self) -> None:
        while not self.stopped:
            while self.inbox:
                req = self.inbox.popleft()
                try:
                    self.scheduler.submit(req)
                except ValueError as e:
                    req.on_done(0, f"error: {e}")
            if not self.scheduler.busy():
                self.wake.wait(0.5)
                self.wake.clear()
                continue
            try:
                self.scheduler.step()
            except Exception as e:  # reported to every reply in the batch; the server carries on
                log.exception("batch step failed")
                for req in self.scheduler.fail_all():
                    for j in range(req.num_samples):
                        req.on_done(j, f"error: {e}")
            self._hand_over()

    def _hand_over(self) -> None:
        """Pass this step's deltas to their event loops, one call per loop."""
        outbox, self.outbox = self.outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the event loop is gone (server shutting down)
                pass

    def close(self) -> None:
        """Stop the batch thread (after the server stops)."""
        self.stopped = True
        self.wake.set()

    async def stream(
        self, prompt: list[int], stats: dict[str, Any], admission: Admission | None = None, **kw: Any
    ) -> AsyncIterator[tuple[str, str]]:
        """Deltas of one reply from its row of the batch; closing this iterator cancels it."""
        if admission is not None:
            self.admitted.discard(admission)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        text = TextStream(self.engine, stats, kw.pop("stop", None), kw.get("stop_tokens"))

        def put(item: Any) -> None:  # called in the batch thread; delivered after the step
            self.outbox.setdefault(loop, []).append((queue, item))

        def on_token(_: int, tok: int, mask: int) -> None:
            for piece in text.push(tok, mask):
                put(piece)
            if text.ended:  # a stop token or stop string: the row can leave now
                req.cancelled = True

        def on_done(_: int, reason: str) -> None:
            if reason.startswith("error: "):
                put(RuntimeError(reason.removeprefix("error: ")))
            elif not text.ended:
                for piece in text.close(cut=reason == "tool_cut"):
                    put(piece)
            put(None)

        req = GenRequest(list(prompt), on_token=on_token, on_done=on_done, **kw)
        self.inflight += 1
        self.inbox.append(req)
        self.wake.set()
        finished = False
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                while not queue.empty() and _joins(item, queue._queue[0]):  # a slow client gets larger deltas
                    item = (item[0], item[1] + queue.get_nowait()[1])
                yield item
            finished = True
        finally:
            req.cancelled = req.cancelled or not finished
            self.inflight -= 1
            self.served += finished
            self.cancelled += not finished


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _joins(item: tuple[str, str], following: Any) -> bool:
    """Whether the delta ``following`` continues ``item``'s part (so the two can go as one)."""
    return isinstance(following, tuple) and following[0] == item[0]
