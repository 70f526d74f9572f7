"""issue 54: the server on one continuous batch, against a real uvicorn server (tiny random model, paced).

40 requests at once get 200s and 503s in OpenAI's error shape; a reply that cannot fit a batch
row is a 413 naming serve.batch_context; a client that leaves frees its row within a decode step;
the batch decodes in a process of its own, which stops with the server, and whose death the
server reports.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import psutil
import pytest

from chatpipe.model.loading import load_chat_model
from chatpipe.serve.app import create_app
from chatpipe.testing.chatmodel import make_artifacts, run_in_thread, serve_paced, serve_settings
from chatpipe.testing.project import wait_until

CHAT = {"model": "sft", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 12}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    loaded = load_chat_model("sft", artifacts=make_artifacts(tmp_path_factory.mktemp("artifacts")), device="cpu")
    cfg = serve_settings(batch_rows=4, batch_context=200, max_queue=6, max_tokens=16, max_tokens_limit=1000)
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
    # k, v x layers x kv width x (4 rows + 2 prompt slots) x positions x float32
    assert health["batch"]["kv_bytes"] == 2 * 2 * 64 * (4 + 2) * 200 * 4
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


def test_a_batch_process_that_dies_fails_its_replies_and_the_server_says_so(tmp_path):
    loaded = load_chat_model("sft", artifacts=make_artifacts(tmp_path), device="cpu")
    cfg = serve_settings(batch_rows=2, batch_context=200, max_queue=2, max_tokens=16, max_tokens_limit=1000)
    for app, url in serve_paced(loaded, cfg, seconds_per_token=0.02):
        pool = app.state.pool
        body = {"messages": CHAT["messages"], "max_tokens": 150}
        with httpx.stream("POST", f"{url}/api/chat", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)  # generating
            os.kill(pool.worker.pid, signal.SIGKILL)
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        assert "batch process exited" in events[-1]["error"], events[-1]
        r = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=30)
        assert r.status_code == 503 and "batch process exited" in r.json()["error"]["message"], r.text
        # a reply that got past the check as the process died ends with the error too, never hangs
        pool.reader.join(10)
        assert not pool.reader.is_alive()
        with pytest.raises(RuntimeError, match="batch process exited"):
            asyncio.run(asyncio.wait_for(drain(pool.stream([1, 2, 3], {}, max_tokens=4)), 10))


async def drain(stream) -> None:
    async for _ in stream:
        pass


def test_the_batch_loop_answers_a_bad_request_with_an_error_and_carries_on(tmp_path):
    """run_batch's protocol, in a thread here: a request the scheduler cannot take gets an error
    event naming why, the next one its tokens, and "stop" ends the loop."""
    import multiprocessing

    from chatpipe.inference.engine import Engine
    from chatpipe.serve.batch_pool import run_batch

    loaded = load_chat_model("sft", artifacts=make_artifacts(tmp_path), device="cpu")
    conn, child = multiprocessing.Pipe()
    loop = threading.Thread(target=run_batch, args=(Engine(loaded.model, loaded.tokenizer), 2, 64, 1, child))
    loop.start()
    assert conn.recv() == "ready"
    conn.send(("submit", 1, [1, 2, 3], {"max_tokens": 4, "bogus": 1}))
    conn.send(("submit", 2, [1, 2, 3], {"max_tokens": 100}))  # 3 + 100 positions > the row's 64
    conn.send(("submit", 3, [1, 2, 3], {"max_tokens": 4, "temperature": 0.0}))
    events = []
    while not any(e[0] == 3 and e[2] is None for e in events):
        assert conn.poll(10), f"the batch loop stopped answering (alive: {loop.is_alive()}); events so far {events}"
        events += conn.recv()[0]
    errors = {rid: reason for rid, _, tok, reason in events if tok is None and rid in (1, 2)}
    assert "bogus" in errors[1] and "64 KV positions" in errors[2], errors
    assert len([tok for rid, _, tok, _ in events if rid == 3 and tok is not None]) == 4
    conn.send(("stop",))
    loop.join(10)
    assert not loop.is_alive()
