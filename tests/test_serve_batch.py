"""issue 54: the server on one continuous batch, against a real uvicorn server (tiny random model, paced).

40 requests at once get 200s and 503s in OpenAI's error shape; a reply that cannot fit a batch
row is a 413 naming serve.batch_context; a client that leaves frees its row within a decode step;
the batch decodes in a process of its own, which stops with the server, and whose death the
server reports.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from chatpipe.model.loading import load_chat_model
from chatpipe.serve import batch_pool
from chatpipe.serve.app import create_app
from chatpipe.testing.chatmodel import make_artifacts, run_in_thread, serve_paced, serve_settings
from chatpipe.testing.project import wait_until

CHAT = {"model": "sft", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    loaded = load_chat_model("sft", artifacts=make_artifacts(tmp_path_factory.mktemp("artifacts")), device="cpu")
    cfg = serve_settings(
        batch_rows=4, batch_context=200, kv_cache_tokens=480, max_queue=6, max_tokens=16, max_tokens_limit=1000
    )
    yield from serve_paced(loaded, cfg)


def test_forty_requests_at_once_get_200s_and_503s_then_the_server_answers(server):
    app, url = server
    statuses: list[int] = []
    bodies: list[dict] = []

    def ask() -> None:
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60)
        statuses.append(r.status_code)
        bodies.append(r.json())

    threads = [threading.Thread(target=ask) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(statuses) == 40 and set(statuses) == {200, 503}, statuses
    assert statuses.count(200) >= 10  # 4 rows + 6 queued at least
    for status, body in zip(statuses, bodies):
        if status == 503:
            err = body["error"]
            assert set(err) == {"message", "type", "param", "code"} and "serve.max_queue=6" in err["message"]
        else:
            assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 12
    assert wait_until(lambda: app.state.pool.live_rows == 0)
    health = httpx.get(f"{url}/health").json()
    assert health["active"] == 0 and health["waiting"] == 0 and health["batch"]["rows"] == 4
    # k, v x layers x kv width x serve.kv_cache_tokens (30 blocks of 16, below 4 rows x 200) x float32
    assert health["batch"]["kv_bytes"] == 2 * 2 * 64 * 480 * 4
    r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12


def test_a_reply_that_cannot_fit_a_row_is_a_413_naming_the_limit(server):
    _, url = server
    r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 300}, timeout=30)
    assert r.status_code == 413, r.text
    assert "200 KV positions" in r.json()["error"]["message"] and "serve.batch_context" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/api/chat", json={"messages": CHAT["messages"], "max_tokens": 300}, timeout=30)
    assert r.status_code == 413 and "serve.batch_context" in r.json()["error"]


def test_a_client_leaving_mid_stream_frees_its_row_within_one_decode_step(server):
    app, url = server
    pool = app.state.pool
    before = pool.cancelled
    body = {"messages": CHAT["messages"], "max_tokens": 150}
    with httpx.stream("POST", f"{url}/api/chat", json=body, timeout=30) as r:
        lines = r.iter_lines()
        [next(lines) for _ in range(6)]  # 3 events, then hang up
        assert pool.live_rows == 1
    assert wait_until(lambda: pool.cancelled > before, 5.0, poll=0.0005)
    at_cancel = pool.steps
    t0 = time.monotonic()
    assert wait_until(lambda: pool.live_rows == 0, 5.0, poll=0.0005)
    # the step under way when the request was cancelled ends, and the next one evicts the row first
    assert pool.steps - at_cancel <= 2 and time.monotonic() - t0 < 1.0
    assert pool.served + pool.cancelled > 0 and pool.active == 0


def test_the_batch_decodes_in_its_own_process_that_stops_with_the_server(tmp_path):
    loaded = load_chat_model("sft", artifacts=make_artifacts(tmp_path), device="cpu")
    app = create_app(loaded, serve_settings(batch_rows=2, batch_context=200, max_queue=2, max_tokens=8))
    pool = app.state.pool
    srv, url = run_in_thread(app)
    try:
        worker = psutil.Process(pool.worker.pid)
        assert worker.pid != os.getpid() and worker.ppid() == os.getpid()
        r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 8}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        assert pool.steps >= 8  # the batch process stepped, and told the server
    finally:
        srv.should_exit = True
    assert wait_until(lambda: not pool.worker.is_alive(), 20.0), "the batch process outlived the server"
    assert pool.worker.exitcode == 0  # it was told to stop, not killed


@contextlib.contextmanager
def small_server(tmp_path, **settings):
    """A server of 2 batch rows, 20 ms a token, in a thread: yields (app, url)."""
    loaded = load_chat_model("sft", artifacts=make_artifacts(tmp_path), device="cpu")
    cfg = serve_settings(batch_rows=2, batch_context=200, max_queue=2, max_tokens=16, max_tokens_limit=1000, **settings)
    yield from serve_paced(loaded, cfg, seconds_per_token=0.02)


@contextlib.contextmanager
def batch_loop(tmp_path, rows: int):
    """:func:`run_batch` in a thread (so a test can patch what it calls): yields the server's end of its
    pipe; "stop" ends the loop after."""
    import multiprocessing

    from chatpipe.inference.engine import Engine
    from chatpipe.serve.batch_pool import run_batch

    loaded = load_chat_model("sft", artifacts=make_artifacts(tmp_path), device="cpu")
    conn, child = multiprocessing.Pipe()
    loop = threading.Thread(target=run_batch, args=(Engine(loaded.model, loaded.tokenizer), rows, 64, 1, child))
    loop.start()
    assert conn.recv() == "ready"
    yield conn
    conn.send(("stop",))
    loop.join(10)
    assert not loop.is_alive()


def read_events(lines) -> list[dict]:
    """The JSON events of server-sent event ``lines`` (a response's, or what is left of them)."""
    lines = lines.iter_lines() if isinstance(lines, httpx.Response) else lines
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


def test_a_killed_batch_process_ends_its_streams_health_is_503_until_it_is_back(tmp_path, monkeypatch):
    """issue 71: after kill -9 of the batch process /health stayed 200 and nothing restarted it."""
    monkeypatch.setattr(batch_pool, "BACKOFF_START", 2.0)  # a down window long enough to look at
    with small_server(tmp_path) as (app, url):
        pool = app.state.pool
        first = pool.worker.pid
        v1: list[dict] = []
        body = {**CHAT, "max_tokens": 150, "stream": True}
        other = threading.Thread(
            target=lambda: v1.extend(read_events(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)))
        )
        other.start()
        with httpx.stream("POST", f"{url}/api/chat", json={"messages": CHAT["messages"], "max_tokens": 150},
                          timeout=30) as r:  # fmt: skip
            lines = r.iter_lines()
            next(lines)  # generating
            assert wait_until(lambda: pool.active == 2, 10)
            os.kill(first, signal.SIGKILL)
            killed = time.monotonic()
            events = read_events(lines)
        other.join(10)
        assert time.monotonic() - killed < 10
        assert "batch process exited (code -9)" in events[-1]["error"], events[-1]
        err = v1[-1]["error"]
        assert set(err) == {"message", "type", "param", "code"} and "batch process exited" in err["message"], v1[-1]
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["status"] == "down", health.text
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 503 and "restarting" in r.json()["error"]["message"], r.text
        assert wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, 60, poll=0.2)
        assert pool.worker.pid != first and not psutil.pid_exists(first)  # the killed one was reaped
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12, r.text
        assert time.monotonic() - killed < 60
        assert httpx.get(f"{url}/health").json()["batch"]["restarts"] == 1 and pool.inflight == 0


def test_a_reader_that_raises_fails_the_replies_in_flight_and_restarts_the_batch(tmp_path):
    """issue 71: the reader thread caught only EOF and OSError; anything else left every reply waiting."""
    with small_server(tmp_path, request_timeout_s=30.0) as (app, url):
        pool = app.state.pool
        first = pool.worker
        on_step, calls = pool._on_step, []

        def broken(*message):
            calls.append(1)
            if len(calls) == 5:  # mid-reply
                raise KeyError("a bug in the reader")
            return on_step(*message)

        pool._on_step = broken
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 150}, timeout=30)
        assert r.status_code == 500 and "batch reader failed" in r.json()["error"]["message"], r.text
        assert time.monotonic() - t0 < 10  # failed at once, not at the request timeout
        assert wait_until(lambda: not first.is_alive(), 10)  # the old process was stopped
        assert wait_until(lambda: httpx.get(f"{url}/health").status_code == 200, 60, poll=0.2)
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12, r.text
        assert pool.inflight == 0 and wait_until(lambda: pool.live_rows == 0)


def test_a_request_past_serve_request_timeout_s_is_cancelled_and_its_row_freed(tmp_path):
    with small_server(tmp_path, request_timeout_s=1.0) as (app, url):
        pool = app.state.pool
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 150}, timeout=30)
        assert r.status_code == 504 and "serve.request_timeout_s" in r.json()["error"]["message"], r.text
        assert 1.0 <= time.monotonic() - t0 < 3.0
        with httpx.stream("POST", f"{url}/api/chat", json={"messages": CHAT["messages"], "max_tokens": 150},
                          timeout=30) as r:  # fmt: skip
            events = read_events(r)
        assert "serve.request_timeout_s" in events[-1]["error"]
        assert wait_until(lambda: pool.live_rows == 0 and pool.inflight == 0, 5)
        assert pool.metrics.requests.labels("timeout")._value.get() == 2


def test_a_prefill_that_raises_fails_its_requests_and_frees_their_rows(tmp_path, monkeypatch):
    """issue 71: requests moved into the joining list never got on_done when their prefill raised."""
    from chatpipe.inference.scheduler import Scheduler

    prefill = Scheduler._prefill

    def broken(self):  # requests 2 and 3 (however they arrive) break their prefill
        if any(p.req.num_samples == 2 or p.req.prompt[-1] == 4 for p in self.prefills):
            raise RuntimeError("prefill broke")
        return prefill(self)

    monkeypatch.setattr(Scheduler, "_prefill", broken)
    with batch_loop(tmp_path, rows=4) as conn:
        conn.send(("submit", 1, [1, 2, 3], {"max_tokens": 30, "temperature": 0.0}))
        conn.recv()
        conn.send(("submit", 2, [1, 2, 3], {"max_tokens": 4, "num_samples": 2}))
        conn.send(("submit", 3, [1, 2, 4], {"max_tokens": 4}))
        ended: dict[tuple[int, int], str] = {}
        deadline = time.monotonic() + 10
        while len(ended) < 4:
            assert conn.poll(max(0.0, deadline - time.monotonic())), f"replies left waiting: only {ended} ended"
            events, load, stats = conn.recv()
            ended.update({(rid, j): reason for rid, j, tok, reason, *_ in events if tok is None})
        assert all("prefill broke" in reason for reason in ended.values()), ended
        assert set(ended) == {(1, 0), (2, 0), (2, 1), (3, 0)} and load[0] == 0 and stats["waiting"] == 0
        conn.send(("submit", 4, [1, 2, 3], {"max_tokens": 4, "num_samples": 4}))  # every row is free again
        got: list[tuple] = []
        while sum(e[0] == 4 and e[2] is None for e in got) < 4:
            assert conn.poll(10), f"request 4 did not finish: {got}"
            got += conn.recv()[0]
        assert len([e for e in got if e[0] == 4 and e[2] is not None]) == 16


@pytest.mark.parametrize("own_process", [True, False])
def test_the_batch_process_freezes_its_startup_heap_before_it_says_ready(tmp_path, monkeypatch, own_process):
    # before: a full garbage collection in the batch process walked torch's and the model's objects,
    # ~0.1 s in which no row got a token. In a thread here (a test process's heap stays unfrozen):
    # the loop freezes only where it is the batch's own process, as start_batch says it is
    import multiprocessing

    from chatpipe import runtime
    from chatpipe.inference.engine import Engine
    from chatpipe.serve.batch_pool import run_batch

    calls = []
    monkeypatch.setattr(runtime, "freeze_startup_heap", lambda: calls.append("frozen") or 0)
    loaded = load_chat_model("sft", artifacts=make_artifacts(tmp_path), device="cpu")
    conn, child = multiprocessing.Pipe()
    engine = Engine(loaded.model, loaded.tokenizer)
    loop = threading.Thread(target=run_batch, args=(engine, 2, 64, 1, child, None, own_process))
    loop.start()
    assert conn.recv() == "ready"
    assert calls == (["frozen"] if own_process else [])
    conn.send(("stop",))
    loop.join(10)
    assert not loop.is_alive()


def test_the_batch_loop_answers_a_bad_request_with_an_error_and_carries_on(tmp_path):
    """run_batch's protocol, in a thread here: a request the scheduler cannot take gets an error
    event naming why, the next one its tokens, and "stop" ends the loop."""
    with batch_loop(tmp_path, rows=2) as conn:
        conn.send(("submit", 1, [1, 2, 3], {"max_tokens": 4, "bogus": 1}))
        conn.send(("submit", 2, [1, 2, 3], {"max_tokens": 100}))  # 3 + 100 positions > the row's 64
        conn.send(("submit", 3, [1, 2, 3], {"max_tokens": 4, "temperature": 0.0}))
        events = []
        while not any(e[0] == 3 and e[2] is None for e in events):
            assert conn.poll(10), f"the batch loop stopped answering; events so far {events}"
            events += conn.recv()[0]
        errors = {rid: reason for rid, _, tok, reason in events if tok is None and rid in (1, 2)}
        assert "bogus" in errors[1] and "64 KV positions" in errors[2], errors
        assert len([tok for rid, _, tok, _ in events if rid == 3 and tok is not None]) == 4


class _Recording:
    """A pipe end that notes, for every message the batch loop sends, how many forwards had run."""

    def __init__(self, conn, forwards: list) -> None:
        self.conn, self.forwards, self.sent = conn, forwards, []

    def send(self, message) -> None:
        if message != "ready":  # the loop clears its events list once sent: keep a copy
            self.sent.append((len(self.forwards), list(message[0])))
        self.conn.send(message)

    def poll(self, timeout=0.0) -> bool:
        return self.conn.poll(timeout)

    def recv(self):
        return self.conn.recv()


def test_the_batch_loop_sends_a_steps_tokens_before_its_decode_forward(tmp_path):
    # before: the loop sent a step's tokens after Scheduler.step returned, so a reply's first token
    # also waited for the decode forward that only prepares the next step's logits
    import multiprocessing

    from chatpipe.inference.engine import Engine
    from chatpipe.serve.batch_pool import run_batch

    loaded = load_chat_model("sft", artifacts=make_artifacts(tmp_path), device="cpu")
    forwards: list[int] = []
    loaded.model.register_forward_pre_hook(lambda _, inputs: forwards.append(inputs[0].shape[1]))
    conn, child = multiprocessing.Pipe()
    child = _Recording(child, forwards)
    loop = threading.Thread(target=run_batch, args=(Engine(loaded.model, loaded.tokenizer), 2, 64, 1, child))
    loop.start()
    assert conn.recv() == "ready"
    conn.send(("submit", 1, [1, 2, 3], {"max_tokens": 4, "temperature": 0.0}))
    events = []
    while not any(e[2] is None for e in events):
        assert conn.poll(10), f"the batch loop stopped answering; events so far {events}"
        events += conn.recv()[0]
    conn.send(("stop",))
    loop.join(10)
    with_tokens = [(n, sent) for n, sent in child.sent if any(e[2] is not None for e in sent)]
    assert with_tokens[0][0] == 1 and forwards[0] == 3, (with_tokens, forwards)  # the prefill's forward only
    assert [n for n, _ in with_tokens] == [1, 2, 3, 4], with_tokens  # each step's token before its decode
