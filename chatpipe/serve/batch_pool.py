"""The server's generation on one continuous batch: a :class:`chatpipe.inference.scheduler.Scheduler`
stepped in a process of its own, every request a row of its running batch (or ``n`` rows, one per
choice, sharing the prompt's prefill).

At most ``serve.batch_rows`` rows decode at once; up to ``serve.max_queue`` more requests wait (in
the scheduler's queue), then 503. Each row holds ``serve.batch_context`` KV positions, so the cache
never grows past ``batch_rows x batch_context`` positions; a request whose prompt plus
``max_tokens`` exceeds a row is refused (413) before it queues. A client that leaves marks its
request cancelled: its rows leave the batch at the next decode step. No request waits longer than
``serve.request_timeout_s``: then it is cancelled in the batch (its rows freed) and answered 504.

Why a process and not a thread: a decode step is a few hundred small torch ops, and each one
gives Python's GIL up and takes it back. In the server's own process the event loop (HTTP, the
JSON of every delta) holds the GIL between them, and the batch waited for it at every op: on a
2-core machine it served about half the tokens per second it decodes alone. The batch process
(:func:`run_batch`, started with ``spawn``: a forked child's OpenMP threads hang once its parent
used them) shares the model's weights with the server through shared memory and talks to it over
one pipe: requests and cancellations in; each step's tokens (with their log-probs when asked), the
batch's load and its queue times out. The server turns tokens into text (stop strings included) on
a reader thread.

Supervision: the reader thread is also the batch process's supervisor. When the process dies (or
anything the reader does raises), every request in flight ends at once with an error, the pool is
marked down (``/health`` answers 503, new requests get 503), and the process is started again after
0.5 s, then 1, 2, ... up to 30 s between failed tries (reset once a process has run for a minute),
each try logged.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any

import torch
import torch.multiprocessing as mp

from chatpipe import runtime
from chatpipe.inference.engine import Engine, TextStream
from chatpipe.inference.scheduler import GenRequest, Scheduler
from chatpipe.model.paged_cache import BlockPool
from chatpipe.serve.metrics import ServeMetrics

log = logging.getLogger(__name__)

READY_SECONDS = 300  # how long the batch process may take to start (import torch, map the weights)
BACKOFF_START, BACKOFF_MAX = 0.5, 30.0  # seconds before restarting a dead batch process: doubling, capped
STABLE_SECONDS = 60.0  # a process that ran this long resets the backoff


class Admission:
    """A request let in by ``check_capacity`` whose reply has not started yet.

    The pool holds these weakly: a client that goes away before its stream starts drops its
    Admission with the response, and its place in the queue is free again."""

    __slots__ = ("__weakref__", "tokens")

    def __init__(self, tokens: int = 0) -> None:
        self.tokens = tokens  # the most the request may generate: prompts x n x max_tokens


# --------------------------------------------------------------------------- the batch process


def run_batch(
    engine: Engine, rows: int, context: int, threads: int, conn: Any, kv: dict | None = None, own_process: bool = False
) -> None:
    """The batch process: step a :class:`Scheduler` over the requests ``conn`` brings.

    In: ``("submit", id, prompt, settings)``, ``("cancel", id)``, ``("stop",)``. Out, once a step's
    tokens are drawn (before its forward, which only prepares the next step's logits; and
    again if the step then fails): ``(events, (live rows, requests in the batch, steps), stats)``; an event is ``(id, sample,
    token, mask)`` (``(id, sample, token, mask, top)`` with ``top_logprobs``: see
    :attr:`GenRequest.tops`), or ``(id, sample, None, reason)`` when a sample ends; ``stats`` is
    :meth:`Scheduler.stats` with ``queue_times``, the seconds each request admitted since the last
    report waited in the queue. A step that raises ends every request the scheduler holds with
    ``"error: ..."``; the batch carries on. Returns when told to stop or when the server's end of
    the pipe closes (the server exited). ``kv``: the scheduler's KV pool and step budget
    (``kv_blocks``, ``block_size``, ``max_batch_tokens``; its defaults where absent). ``own_process``:
    this is the batch's own process, whose startup objects are then frozen out of the garbage
    collector's reach before it says it is ready (:func:`chatpipe.runtime.freeze_startup_heap`).
    """
    torch.set_num_threads(threads)
    sched = Scheduler(engine, rows=rows, context=context, **(kv or {}))
    reqs: dict[int, GenRequest] = {}
    arrived: dict[int, float] = {}  # requests not yet admitted: when they arrived
    events: list[tuple] = []
    if own_process:  # a full collection would walk torch's and the model's objects, pausing every row
        runtime.freeze_startup_heap()
    conn.send("ready")
    try:
        while take_messages(conn, sched, reqs, events, arrived, block=not sched.busy()):
            # the step's tokens go as soon as they are drawn, before its forward
            send = functools.partial(send_step, conn, sched, reqs, events, arrived)
            if not sched.busy():
                send()
                continue
            try:
                sched.step(sampled=send)
            except Exception as e:  # reported to every request the batch holds; the batch carries on
                log.exception("batch step failed")
                for req in sched.fail_all():
                    for j in range(req.num_samples):
                        req.on_done(j, f"error: {e}")
                send()
    except (EOFError, OSError, KeyboardInterrupt):  # the server is gone
        pass


def send_step(
    conn: Any, sched: Scheduler, reqs: dict[int, GenRequest], events: list, arrived: dict[int, float]
) -> None:
    """Send the events so far, the batch's load and its stats."""
    stats = {**sched.stats(), "queue_times": admitted_since(arrived, reqs)}
    active = len({id(row.req) for row in sched.live})
    conn.send((events, (len(sched.live), active, sched.steps), stats))
    events.clear()


def admitted_since(arrived: dict[int, float], reqs: dict[int, GenRequest]) -> list[float]:
    """The queue times (arrival to admission) of the requests admitted since the last call; forgets
    those that left without joining."""
    out = []
    for rid in list(arrived):
        req = reqs.get(rid)
        if req is None or req.admitted_at is not None:
            t = arrived.pop(rid)
            if req is not None:
                out.append(max(0.0, req.admitted_at - t))
    return out


def take_messages(
    conn: Any, sched: Scheduler, reqs: dict[int, GenRequest], events: list, arrived: dict[int, float], block: bool
) -> bool:
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
            req = GenRequest(
                prompt, on_token=_on_token(rid, events, reqs), on_done=_on_done(rid, events, reqs), **settings
            )
            reqs[rid] = req
            sched.submit(req)
            arrived[rid] = time.monotonic()
        except (TypeError, ValueError) as e:  # the server checks requests first: a last guard
            reqs.pop(rid, None)
            events.append((rid, 0, None, f"error: {e}"))
    return True


def _on_token(rid: int, events: list, reqs: dict[int, GenRequest]):
    def token(sample: int, tok: int, mask: int) -> None:
        req = reqs.get(rid)
        if req is not None and req.tops:  # what the scheduler recorded for this token (just appended)
            events.append((rid, sample, tok, mask, req.tops[sample][-1]))
        else:
            events.append((rid, sample, tok, mask))

    return token


def _on_done(rid: int, events: list, reqs: dict[int, GenRequest]):
    def done(sample: int, reason: str) -> None:
        events.append((rid, sample, None, reason))
        req = reqs.get(rid)
        if req is None or req.done or reason.startswith("error: "):
            reqs.pop(rid, None)

    return done


# --------------------------------------------------------------------------- the server's side


class _Reply:
    """One request on the server's side: where its deltas go, and each sample's text so far."""

    __slots__ = ("loop", "queue", "texts", "ended", "running", "lps", "top", "t0", "first", "last")

    def __init__(self, loop: asyncio.AbstractEventLoop, texts: list[TextStream], top: int) -> None:
        self.loop, self.queue, self.texts, self.top = loop, asyncio.Queue(), texts, top
        self.ended = [False] * len(texts)  # the sample's text is complete (its last delta sent)
        self.running = len(texts)  # samples the batch has not reported done
        self.lps: list[list[tuple]] = [[] for _ in texts]  # log-probs of tokens not yet sent with a delta
        self.t0, self.first = time.monotonic(), 0.0
        self.last = [0.0] * len(texts)  # when each sample's last token arrived


class BatchPool:
    """Requests generated together in one batch of ``rows`` rows of ``context`` KV positions each."""

    def __init__(
        self, engine: Engine, rows: int, context: int, max_queue: int, error: type[Exception],
        timeout_s: float = 600.0, metrics: ServeMetrics | None = None, kv: dict | None = None,
    ) -> None:  # fmt: skip
        self.engine, self.max_queue, self.error, self.timeout_s = engine, max_queue, error, timeout_s
        self.metrics = metrics or ServeMetrics()
        self.size = self.rows = rows
        self.context = context or engine.model.config.sequence_len
        self.kv = dict(kv or {})
        size = self.kv.get("block_size", 16)
        blocks = self.kv.get("kv_blocks") or rows * -(-self.context // size)  # the scheduler's default
        self.kv_bytes = BlockPool.bytes_for(engine.model.config, blocks, size)  # all the KV memory it uses
        self.inflight = self.served = self.cancelled = self.restarts = 0
        self.live_rows = self.active = self.steps = 0  # as the batch last reported
        self.gone: str | None = None  # "error: why", while the batch process is down
        self.closing = threading.Event()
        self.admitted: weakref.WeakSet[Admission] = weakref.WeakSet()
        self.replies: dict[int, _Reply] = {}
        self.ids = itertools.count()
        self.outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        self.send_lock = threading.Lock()
        self.conn, self.worker = start_batch(engine, rows, self.context, self.kv)
        self.metrics.up.set(1)
        self.reader = threading.Thread(target=self._supervise, name="batch-reader", daemon=True)
        self.reader.start()

    # ------------------------------------------------------------------ load figures

    @property
    def waiting(self) -> int:
        """Requests waiting for rows."""
        return max(0, self.inflight - self.active)

    def queued_tokens(self) -> int:
        """The token budgets of the requests admitted whose replies have not started."""
        return sum(a.tokens for a in list(self.admitted))

    def batch_report(self) -> dict[str, Any]:
        """The batch's shape, memory and process for ``/health``."""
        return {
            "rows": self.rows, "live_rows": self.live_rows, "context": self.context, "kv_bytes": self.kv_bytes,
            "process": "down" if self.gone else "up", "restarts": self.restarts,
        }  # fmt: skip

    # ------------------------------------------------------------------ admission

    def check_capacity(self, tokens: int = 0, positions: int = 0, samples: int = 1) -> Admission:
        """Hold a place for a request, or refuse it: its longest reply cannot fit a row (413), its ``samples``
        need more rows than the batch has (400), the batch process is down or the queue is full (503).

        ``positions``: the prompt plus ``max_tokens`` of its longest prompt. Requests admitted whose
        reply has not started count too (a streaming reply starts only after its headers go out).
        """
        try:
            return self._take_place(tokens, positions, samples)
        except self.error:
            self.metrics.count("refused")
            raise

    def _take_place(self, tokens: int, positions: int, samples: int) -> Admission:
        if positions > self.context:
            raise self.error(
                413,
                f"prompt + max_tokens = {positions} tokens is over the {self.context} KV positions "
                "a batch row holds (serve.batch_context): ask for fewer tokens or start a new chat",
            )
        if samples > self.rows:
            raise self.error(400, f"n={samples} choices need {samples} batch rows; the batch has {self.rows} "
                             "(serve.batch_rows)")  # fmt: skip
        if gone := self.gone:
            raise self.error(503, f"{gone.removeprefix('error: ')}; it is restarting: retry shortly")
        pending = len(self.admitted)
        if self.inflight + pending >= self.size + self.max_queue:
            raise self.error(
                503,
                f"server busy: {self.active} replies generating and {self.waiting + pending} queued "
                f"(serve.batch_rows={self.size}, serve.max_queue={self.max_queue}); retry shortly",
            )
        admission = Admission(tokens)
        self.admitted.add(admission)
        return admission

    # ------------------------------------------------------------------ the pipe and its supervisor

    def _send(self, *message: Any) -> None:
        try:
            with self.send_lock:
                self.conn.send(message)
        except (OSError, ValueError):  # the batch process is gone: the reader fails what is in flight
            pass

    def _supervise(self) -> None:
        """The reader thread: read the batch process's steps until it goes; then fail what is in
        flight and start a new process, with backoff, until one starts (or the server stops)."""
        delay = BACKOFF_START
        while True:
            began = time.monotonic()
            reason = self._read()
            if self.closing.is_set():
                return
            if time.monotonic() - began > STABLE_SECONDS:
                delay = BACKOFF_START
            while True:
                log.warning("the batch process is down (%s): restarting it in %.1f s", reason, delay)
                if self.closing.wait(delay):
                    return
                delay = min(2 * delay, BACKOFF_MAX)
                try:
                    conn, worker = start_batch(self.engine, self.rows, self.context, self.kv)
                except Exception as e:  # noqa: BLE001 (any failure to start is retried, later)
                    reason = f"restart failed: {e}"
                    continue
                break
            with self.send_lock:
                self.conn, self.worker, self.gone = conn, worker, None
            self.restarts += 1
            self.metrics.restarts.inc()
            self.metrics.up.set(1)
            log.warning("the batch process is back (pid %s, restart %d)", worker.pid, self.restarts)
            if self.closing.is_set():  # the server stopped while it started: stop it too (read to its EOF)
                self._send("stop")

    def _read(self) -> str:
        """Each step's tokens to their replies, until the process goes or reading fails (anything at
        all: never a reply left waiting); then mark the pool down, fail every reply in flight and
        return why."""
        try:
            while True:
                self._on_step(*self.conn.recv())
        except (EOFError, OSError):
            self.worker.join(5)
            reason = f"the batch process exited (code {self.worker.exitcode})"
        except Exception as e:  # noqa: BLE001 (a bug here must not hang every reply)
            log.exception("the batch reader failed")
            reason = f"the batch reader failed ({e!r})"
        with self.send_lock:  # from here, a new reply fails at once (stream checks gone under this lock)
            self.gone = f"error: {reason}"
        self.metrics.up.set(0)
        if self.worker.is_alive():  # the reader failed, not the process: start afresh
            self.worker.kill()
            self.worker.join(5)
        self.conn.close()
        self.live_rows = self.active = 0
        for rid, reply in list(self.replies.items()):
            self._fail(rid, reply, self.gone)
        self._hand_over()
        return reason

    def _on_step(self, events: list[tuple], load: tuple[int, int, int], stats: dict[str, Any]) -> None:
        self.live_rows, self.active, self.steps = load
        self.metrics.load(stats)
        now = time.monotonic()
        for rid, sample, tok, mask_or_reason, *top in events:
            if (reply := self.replies.get(rid)) is None:
                continue  # cancelled or ended here: its last tokens are dropped
            if tok is None:
                self._sample_done(rid, reply, sample, mask_or_reason)
            else:
                self._token(rid, reply, sample, tok, mask_or_reason, top[0] if top else None, now)
        self._hand_over()

    # ------------------------------------------------------------------ tokens to deltas

    def _token(self, rid: int, reply: _Reply, sample: int, tok: int, mask: int, top: Any, now: float) -> None:
        if reply.ended[sample]:  # past its stop string: the row leaves once every sample has ended
            return
        if not reply.first:
            reply.first = now
            self.metrics.ttft.observe(now - reply.t0)
        elif reply.last[sample]:
            self.metrics.itl.observe(now - reply.last[sample])
        reply.last[sample] = now
        text = reply.texts[sample]
        if top is not None and mask == 1 and tok not in text.stops:  # the reply's own tokens
            reply.lps[sample].append((tok, *top))
        for kind, piece in text.push(tok, mask):
            self._put(reply, (sample, kind, piece, self._take_lps(reply, sample)))
        if text.ended:  # a stop token or stop string: the sample is complete
            self._end_sample(rid, reply, sample)

    def _sample_done(self, rid: int, reply: _Reply, sample: int, reason: str) -> None:
        reply.running -= 1
        if reason.startswith("error: "):
            self._fail(rid, reply, reason)
        else:
            self._end_sample(rid, reply, sample, cut=reason == "tool_cut")

    def _end_sample(self, rid: int, reply: _Reply, sample: int, cut: bool = False) -> None:
        if reply.ended[sample]:
            return
        for kind, piece in reply.texts[sample].close(cut=cut):
            self._put(reply, (sample, kind, piece, self._take_lps(reply, sample)))
        reply.ended[sample] = True
        self._put(reply, (sample, "end", "", self._take_lps(reply, sample)))
        if all(reply.ended):
            self.replies.pop(rid, None)
            self._put(reply, None)
            if reply.running:  # ended by stop strings: its rows can leave now
                self._send("cancel", rid)

    @staticmethod
    def _take_lps(reply: _Reply, sample: int) -> list[tuple] | None:
        if reply.top < 0:  # not asked for
            return None
        lps, reply.lps[sample] = reply.lps[sample], []
        return lps

    def _fail(self, rid: int, reply: _Reply, reason: str) -> None:
        self.replies.pop(rid, None)
        self._put(reply, RuntimeError(reason.removeprefix("error: ")))

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
        """Stop the batch process (when the server stops). The reader, the pipe's one owner, closes
        the pipe when the process has gone."""
        self.closing.set()
        self._send("stop")
        self.worker.join(10)
        if self.worker.is_alive():
            self.worker.terminate()
            self.worker.join(5)
        self.reader.join(10)

    # ------------------------------------------------------------------ a request's deltas

    async def stream(
        self, prompt: list[int], stats: list[dict[str, Any]], admission: Admission | None = None, **kw: Any
    ) -> AsyncIterator[tuple[int, str, str, list[tuple] | None]]:
        """``(sample, kind, text, log-probs)`` deltas of a request's ``num_samples`` replies as they come
        (``kind`` "end" once per sample, when it is complete; ``stats[sample]`` then holds its tokens and
        finish reason). Log-probs, with ``top_logprobs``: ``(token, log-prob, [(token, log-prob)])`` of
        the tokens the delta completes. Closing this iterator cancels the request."""
        if admission is not None:
            self.admitted.discard(admission)
        stop = kw.pop("stop", None)
        texts = [TextStream(self.engine, s, stop, kw.get("stop_tokens")) for s in stats[: kw.get("num_samples", 1)]]
        loop = asyncio.get_running_loop()
        reply = _Reply(loop, texts, kw.get("top_logprobs", -1))
        rid = next(self.ids)
        self.replies[rid] = reply
        self.inflight += 1
        with self.send_lock:
            if not (gone := self.gone):
                try:
                    self.conn.send(("submit", rid, list(prompt), kw))
                except (OSError, ValueError):  # it just died: the reader fails this reply with the rest
                    pass
        if gone and self.replies.pop(rid, None) is not None:  # down: the reader has failed those in flight
            reply.queue.put_nowait(RuntimeError(gone.removeprefix("error: ")))
        status = "cancelled"  # unless it ends otherwise: the client left (the iterator was closed)
        timeout = self.error(
            504, f"the request took longer than {self.timeout_s:g} s (serve.request_timeout_s): cancelled"
        )
        timer = loop.call_later(self.timeout_s, reply.queue.put_nowait, timeout)  # one timer, not one per delta
        try:
            while (item := await reply.queue.get()) is not None:
                if isinstance(item, Exception):
                    status = "timeout" if isinstance(item, self.error) else "error"
                    raise item
                while not reply.queue.empty() and _joins(item, reply.queue._queue[0]):  # a slow client: larger deltas
                    item = _joined(item, reply.queue.get_nowait())
                yield item
            status = "ok"
        finally:
            timer.cancel()
            if status != "ok" and self.replies.pop(rid, None) is not None:
                self._send("cancel", rid)  # its rows leave the batch at the next step
            self.inflight -= 1
            self.served += status == "ok"
            self.cancelled += status == "cancelled"
            self.metrics.count(status)
            if status == "ok":
                self.metrics.e2e.observe(time.monotonic() - reply.t0)


def start_batch(engine: Engine, rows: int, context: int, kv: dict | None = None) -> tuple[Any, Any]:
    """Start :func:`run_batch` in its own process and wait until its batch is built: (pipe, process)."""
    ctx = mp.get_context("spawn")  # torch's: the weights go over as shared memory, not copies
    conn, child = ctx.Pipe()
    worker = ctx.Process(
        target=run_batch,
        args=(engine, rows, context, torch.get_num_threads(), child, kv, True),
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
        conn.close()
        raise RuntimeError(
            f"the batch process did not start (exit code {worker.exitcode}; waited up to {READY_SECONDS} s)"
        )
    return conn, worker


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _joins(item: tuple, following: Any) -> bool:
    """Whether the delta ``following`` continues ``item``'s part of the same sample (so the two can go as one)."""
    return isinstance(following, tuple) and following[:2] == item[:2] and item[1] != "end"


def _joined(item: tuple, following: tuple) -> tuple:
    lps = None if item[3] is None else item[3] + following[3]
    return (item[0], item[1], item[2] + following[2], lps)
