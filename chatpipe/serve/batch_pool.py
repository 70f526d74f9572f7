"""The server's generation on one continuous batch: a :class:`chatpipe.inference.scheduler.Scheduler`
stepped in a process of its own, every reply a row (or several) of its running batch.

:class:`BatchPool` has :class:`chatpipe.serve.app.EnginePool`'s interface (``check_capacity``,
``stream``, the load counters ``/health`` reports), so the HTTP code is the same for both. At most
``serve.batch_rows`` replies decode at once; up to ``serve.max_queue`` more wait (in the
scheduler's queue), then 503. Each row holds ``serve.batch_context`` KV positions, so the cache
never grows past ``batch_rows x batch_context`` positions; a request whose prompt plus
``max_tokens`` exceeds a row is refused (413) before it queues. A client that leaves marks its
request cancelled: its row leaves the batch at the next decode step.

Why a process and not a thread: a decode step is a few hundred small torch ops, and each one
gives Python's GIL up and takes it back. In the server's own process the event loop (HTTP, the
JSON of every delta) holds the GIL between them, and the batch waited for it at every op: on a
2-core machine it served about half the tokens per second it decodes alone. The batch process
(:func:`run_batch`, started with ``spawn``: a forked child's OpenMP threads hang once its parent
used them) shares the model's weights with the server through shared memory and talks to it over
one pipe: requests and cancellations in, each step's tokens and the batch's load out. The server
turns tokens into text (stop strings included) on a reader thread, as before.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import weakref
from collections.abc import AsyncIterator
from typing import Any

import torch
import torch.multiprocessing as mp

from chatpipe.inference.engine import Engine, TextStream
from chatpipe.inference.scheduler import GenRequest, Scheduler
from chatpipe.model.paged_cache import BlockPool

log = logging.getLogger(__name__)

READY_SECONDS = 300  # how long the batch process may take to start (import torch, map the weights)


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


# --------------------------------------------------------------------------- the batch process


def run_batch(engine: Engine, rows: int, context: int, threads: int, conn: Any) -> None:
    """The batch process: step a :class:`Scheduler` over the requests ``conn`` brings.

    In: ``("submit", id, prompt, settings)``, ``("cancel", id)``, ``("stop",)``. Out, after every
    step: ``(events, (live rows, replies in the batch, steps))``; an event is
    ``(id, sample, token, mask)``, or ``(id, sample, None, reason)`` when a sample ends. Returns
    when told to stop or when the server's end of the pipe closes (the server exited).
    """
    torch.set_num_threads(threads)
    sched = Scheduler(engine, rows=rows, context=context)
    reqs: dict[int, GenRequest] = {}
    events: list[tuple] = []
    conn.send("ready")
    try:
        while take_messages(conn, sched, reqs, events, block=not sched.busy()):
            if sched.busy():
                try:
                    sched.step()
                except Exception as e:  # reported to every reply in the batch; the batch carries on
                    log.exception("batch step failed")
                    for req in sched.fail_all():
                        for j in range(req.num_samples):
                            req.on_done(j, f"error: {e}")
            active = len({id(row.req) for row in sched.live})
            conn.send((events, (len(sched.live), active, sched.steps)))
            events.clear()
    except (EOFError, OSError, KeyboardInterrupt):  # the server is gone
        pass


def take_messages(conn: Any, sched: Scheduler, reqs: dict[int, GenRequest], events: list, block: bool) -> bool:
    """Apply every message waiting on ``conn`` (waiting for one when ``block``); False on ``stop``."""
    while conn.poll(None if block else 0):
        block = False
        kind, *args = conn.recv()
        if kind == "stop":
            return False
        if kind == "cancel":
            if (req := reqs.get(args[0])) is not None:
                req.cancelled = True
            continue
        rid, prompt, settings = args
        try:
            req = GenRequest(prompt, on_token=_on_token(rid, events), on_done=_on_done(rid, events, reqs), **settings)
            reqs[rid] = req
            sched.submit(req)
        except (TypeError, ValueError) as e:  # the server checks requests first: a last guard
            reqs.pop(rid, None)
            events.append((rid, 0, None, f"error: {e}"))
    return True


def _on_token(rid: int, events: list):
    return lambda sample, tok, mask: events.append((rid, sample, tok, mask))


def _on_done(rid: int, events: list, reqs: dict[int, GenRequest]):
    def done(sample: int, reason: str) -> None:
        events.append((rid, sample, None, reason))
        req = reqs.get(rid)
        if req is None or req.done or reason.startswith("error: "):
            reqs.pop(rid, None)

    return done


# --------------------------------------------------------------------------- the server's side


class _Reply:
    """One reply on the server's side: where its deltas go, and its text so far."""

    __slots__ = ("loop", "queue", "text", "ended")

    def __init__(self, loop: asyncio.AbstractEventLoop, text: TextStream) -> None:
        self.loop, self.queue, self.text, self.ended = loop, asyncio.Queue(), text, False


class BatchPool:
    """Replies generated together in one batch of ``rows`` rows of ``context`` KV positions each."""

    def __init__(self, engine: Engine, rows: int, context: int, max_queue: int, error: type[Exception]) -> None:
        self.engine, self.max_queue, self.error = engine, max_queue, error
        self.size = self.rows = rows
        self.context = context or engine.model.config.sequence_len
        # the KV pool's blocks: rows sequences of context positions (the scheduler's default, its bound)
        self.kv_bytes = BlockPool.bytes_for(engine.model.config, rows * -(-self.context // 16), 16)
        self.inflight = self.served = self.cancelled = 0
        self.live_rows = self.active = self.steps = 0  # as the batch last reported
        self.gone: str | None = None  # why the batch process is gone, once it is
        self.admitted: weakref.WeakSet[Admission] = weakref.WeakSet()
        self.replies: dict[int, _Reply] = {}
        self.ids = itertools.count()
        self.outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        self.send_lock = threading.Lock()
        self.conn, self.worker = start_batch(engine, rows, self.context)
        self.reader = threading.Thread(target=self._read, name="batch-reader", daemon=True)
        self.reader.start()

    # ------------------------------------------------------------------ load figures

    @property
    def waiting(self) -> int:
        """Replies waiting for a row."""
        return max(0, self.inflight - self.active)

    def queued_tokens(self) -> int:
        """The token budgets of the requests admitted whose replies have not started."""
        return sum(a.tokens for a in list(self.admitted))

    def batch_report(self) -> dict[str, Any]:
        """The batch's shape and memory for ``/health``."""
        return {"rows": self.rows, "live_rows": self.live_rows, "context": self.context, "kv_bytes": self.kv_bytes}

    # ------------------------------------------------------------------ admission

    def check_capacity(self, tokens: int = 0, positions: int = 0) -> Admission:
        """Refuse a request whose longest reply cannot fit a row (413) or when the queue is full (503).

        ``positions``: the prompt plus ``max_tokens`` of its longest prompt.
        """
        if positions > self.context:
            raise self.error(
                413,
                f"prompt + max_tokens = {positions} tokens is over the {self.context} KV positions "
                "a batch row holds (serve.batch_context): ask for fewer tokens or start a new chat",
            )
        if not self.worker.is_alive():
            raise self.error(503, f"the batch process exited (code {self.worker.exitcode}): restart the server")
        limits = f"serve.batch_rows={self.size}, serve.max_queue={self.max_queue}"
        return take_place(self, self.inflight, tokens, limits, self.error)

    # ------------------------------------------------------------------ the pipe

    def _send(self, *message: Any) -> None:
        try:
            with self.send_lock:
                self.conn.send(message)
        except (OSError, ValueError):  # the batch process is gone: the reader fails what is in flight
            pass

    def _read(self) -> None:
        """The reader thread: each step's tokens to their replies' text, then to their event loops."""
        while True:
            try:
                events, (self.live_rows, self.active, self.steps) = self.conn.recv()
            except (EOFError, OSError):
                break
            for rid, _sample, tok, mask_or_reason in events:  # a server's reply is one sample
                if (reply := self.replies.get(rid)) is None:
                    continue  # cancelled here: its last tokens are dropped
                if tok is None:
                    self._done(rid, reply, mask_or_reason)
                else:
                    self._token(rid, reply, tok, mask_or_reason)
            self._hand_over()
        self.live_rows = self.active = 0
        self.gone = f"error: the batch process exited (code {self.worker.exitcode})"  # set before the last look
        for rid, reply in list(self.replies.items()):
            self._done(rid, reply, self.gone)
        self._hand_over()

    def _token(self, rid: int, reply: _Reply, tok: int, mask: int) -> None:
        for piece in reply.text.push(tok, mask):
            self._put(reply, piece)
        if reply.text.ended and not reply.ended:  # a stop token or stop string: the row can leave now
            reply.ended = True
            self._send("cancel", rid)

    def _done(self, rid: int, reply: _Reply, reason: str) -> None:
        self.replies.pop(rid, None)
        if reason.startswith("error: "):
            self._put(reply, RuntimeError(reason.removeprefix("error: ")))
        elif not reply.text.ended:
            for piece in reply.text.close(cut=reason == "tool_cut"):
                self._put(reply, piece)
        self._put(reply, None)

    def _put(self, reply: _Reply, item: Any) -> None:  # delivered after the step, one wake-up per loop
        self.outbox.setdefault(reply.loop, []).append((reply.queue, item))

    def _hand_over(self) -> None:
        """Pass this step's deltas to their event loops, one call per loop."""
        outbox, self.outbox = self.outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the event loop is gone (server shutting down)
                pass

    def close(self) -> None:
        """Stop the batch process (when the server stops)."""
        self._send("stop")
        self.worker.join(10)
        if self.worker.is_alive():
            self.worker.terminate()
            self.worker.join(5)
        self.conn.close()

    async def stream(
        self, prompt: list[int], stats: dict[str, Any], admission: Admission | None = None, **kw: Any
    ) -> AsyncIterator[tuple[str, str]]:
        """Deltas of one reply from its row of the batch; closing this iterator cancels it."""
        if admission is not None:
            self.admitted.discard(admission)
        rid = next(self.ids)
        reply = _Reply(
            asyncio.get_running_loop(), TextStream(self.engine, stats, kw.pop("stop", None), kw.get("stop_tokens"))
        )
        self.replies[rid] = reply
        self.inflight += 1
        self._send("submit", rid, list(prompt), kw)
        if self.gone:  # the reader had already failed the replies in flight: fail this one too
            self._done(rid, reply, self.gone)
            self._hand_over()
        finished = False
        try:
            while (item := await reply.queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                while not reply.queue.empty() and _joins(item, reply.queue._queue[0]):  # a slow client: larger deltas
                    item = (item[0], item[1] + reply.queue.get_nowait()[1])
                yield item
            finished = True
        finally:
            if not finished and self.replies.pop(rid, None) is not None:
                self._send("cancel", rid)
            self.inflight -= 1
            self.served += finished
            self.cancelled += not finished


def start_batch(engine: Engine, rows: int, context: int) -> tuple[Any, Any]:
    """Start :func:`run_batch` in its own process and wait until its batch is built: (pipe, process)."""
    ctx = mp.get_context("spawn")  # torch's: the weights go over as shared memory, not copies
    conn, child = ctx.Pipe()
    worker = ctx.Process(
        target=run_batch,
        args=(engine, rows, context, torch.get_num_threads(), child),
        name="chatpipe-batch",
        daemon=True,
    )
    worker.start()
    child.close()
    try:
        ready = conn.poll(READY_SECONDS) and conn.recv() == "ready"
    except (EOFError, OSError):  # it exited: its error is on stderr
        ready = False
    if not ready:
        worker.kill()
        worker.join(5)
        raise RuntimeError(
            f"the batch process did not start (exit code {worker.exitcode}; waited up to {READY_SECONDS} s)"
        )
    return conn, worker


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _joins(item: tuple[str, str], following: Any) -> bool:
    """Whether the delta ``following`` continues ``item``'s part (so the two can go as one)."""
    return isinstance(following, tuple) and following[0] == item[0]
