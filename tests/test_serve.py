"""Tests for chatpipe.serve.app against a real uvicorn server on 127.0.0.1 (tiny random model)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from chatpipe.inference.engine import Engine
from chatpipe.model.loading import load_chat_model
from chatpipe.testing.chatmodel import make_artifacts, serve_paced, serve_settings
from chatpipe.testing.project import wait_until


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_chat_model("sft", artifacts=make_artifacts(tmp_path_factory.mktemp("artifacts")), device="cpu")


@pytest.fixture(scope="module")
def server(loaded):
    cfg = serve_settings(
        batch_rows=4,
        max_queue=16,
        max_message_chars=200,
        max_turns=5,
        max_tokens=16,
        max_tokens_limit=2200,
        temperature=0.0,
    )
    yield from serve_paced(loaded, cfg)


def user(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


def read_sse(response: httpx.Response) -> Iterator[dict]:
    """The JSON events of a server-sent event stream, as they arrive."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield json.loads(line.removeprefix("data: "))


def test_health_names_model_and_stage(server):
    _, url = server
    h = httpx.get(f"{url}/health").json()
    assert h["status"] == "ok" and h["model"] == "sft" and h["stage"] == "sft" and h["step"] == 7
    assert {k: h["limits"][k] for k in ("max_message_chars", "max_turns", "max_tokens")} == {
        "max_message_chars": 200,
        "max_turns": 5,
        "max_tokens": 2200,
    }
    assert h["limits"]["max_stops"] == 4 and h["limits"]["max_body_bytes"] == 1_000_000 and h["queued_tokens"] == 0
    page = httpx.get(url)
    assert page.status_code == 200 and "<title>chatpipe</title>" in page.text


def test_bad_requests_get_4xx_with_a_message(server):
    _, url = server
    post = lambda body, **kw: httpx.post(f"{url}/api/chat", json=body, **kw)  # noqa: E731
    r = post(user("x" * 201))
    assert r.status_code == 413 and "201 characters" in r.json()["error"] and "200" in r.json()["error"]
    r = httpx.post(f"{url}/api/chat", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = post({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 3})
    assert r.status_code == 422 and "6 messages" in r.json()["error"]
    r = post({**user("hi"), "max_tokens": 5000})
    assert r.status_code == 422 and "max_tokens_limit" in r.json()["error"]
    r = post({"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "hi"}]})
    assert r.status_code == 422 and "expected role 'user'" in r.json()["error"]
    r = post({"messages": [{"role": "robot", "content": "hi"}]})
    assert r.status_code == 422 and "messages.0.role" in r.json()["error"]
    long = {
        "messages": [
            {"role": "user", "content": "~" * 200},
            {"role": "assistant", "content": "~" * 200},
            {"role": "user", "content": "~" * 200},
        ],
        "max_tokens": 2200,
    }
    r = post(long)  # ~600 prompt tokens (an unseen byte each) + 2200 > the 2560-position context
    assert r.status_code == 413 and "context" in r.json()["error"]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_json_and_stream_give_the_same_reply(server, loaded):
    _, url = server
    body = {**user("hello"), "max_tokens": 12, "temperature": 0}
    plain = httpx.post(f"{url}/api/chat", json={**body, "stream": False}).json()
    with httpx.stream("POST", f"{url}/api/chat", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(read_sse(r))
    deltas, done = events[:-1], events[-1]
    assert len(deltas) > 1 and all(e["kind"] == "text" for e in deltas)  # token by token, not one blob
    assert "".join(e["text"] for e in deltas) == plain["text"] == done["text"] and done["done"]
    assert plain["tokens"] == 12 and plain["finish_reason"] == "length"
    engine = Engine(loaded.model, loaded.tokenizer)
    prompt = loaded.tokenizer.render_for_completion(user("hello"))
    assert plain["text"] == "".join(t for _, t in engine.stream(prompt, max_tokens=12, temperature=0.0))


def test_eight_concurrent_requests_get_their_own_replies(server, loaded):
    app, url = server
    engine = Engine(loaded.model, loaded.tokenizer)
    prompts = [f"tell me about {w}" for w in ("Pip", "Dot", "the river", "honey", "Ashford", "cows", "Iris", "bees")]
    kw = dict(max_tokens=40, temperature=1.0, top_k=20)
    expected = [
        "".join(t for _, t in engine.stream(loaded.tokenizer.render_for_completion(user(p)), seed=i, **kw))
        for i, p in enumerate(prompts)
    ]
    assert len(set(expected)) == 8
    got: dict[int, str] = {}
    spans: dict[int, tuple[float, float]] = {}

    def client(i: int) -> None:
        body = {**user(prompts[i]), "seed": i, **kw}
        with httpx.stream("POST", f"{url}/api/chat", json=body, timeout=60) as r:
            first = None
            parts = []
            for e in read_sse(r):
                first = first or time.perf_counter()
                if "text" in e and "kind" in e:
                    parts.append(e["text"])
            spans[i] = (first, time.perf_counter())
            got[i] = "".join(parts)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == dict(enumerate(expected))
    # replies really overlapped in time (4 batch rows), rather than running one after another
    overlaps = sum(a[0] < b[1] and b[0] < a[1] for i, a in spans.items() for j, b in spans.items() if i < j)
    assert overlaps >= 3
    assert wait_until(lambda: app.state.pool.active == 0)


def test_server_survives_client_disconnect_mid_stream(server):
    app, url = server
    pool = app.state.pool
    before = httpx.get(f"{url}/health").json()
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{url}/api/chat", json={**user("go on"), "max_tokens": 2000}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # 3 events, then hang up long before 2000 tokens
    assert sum(line.startswith("data: ") for line in got) == 3
    assert wait_until(lambda: pool.active == 0 and pool.cancelled > before["cancelled"])
    after = httpx.get(f"{url}/health").json()
    assert after["cancelled"] == before["cancelled"] + 1 and after["served"] == before["served"]
    assert after["active"] == 0
    assert time.perf_counter() - t0 < 8  # generation stopped: 2000 tokens take longer than this
    r = httpx.post(f"{url}/api/chat", json={**user("still there?"), "stream": False})
    assert r.status_code == 200 and r.json()["tokens"] == 16  # the default max_tokens of this server


def test_seed_past_int64_is_a_4xx_naming_the_limit(server):
    """issue 15 item 5: seed >= 2**63 used to reach torch and come back as a plain 500."""
    _, url = server
    r = httpx.post(f"{url}/api/chat", json={**user("hi"), "seed": 2**63, "stream": False, "max_tokens": 2})
    assert r.status_code == 422 and "seed" in r.json()["error"], r.text
    assert "9223372036854775807" in r.json()["error"]


def test_max_queue_is_enforced_exactly_for_requests_not_yet_streaming(server):
    """issue 15 item 5: requests admitted before their stream started were not counted, so 41
    could queue with max_queue=32."""
    from chatpipe.serve.app import ApiError

    pool = server[0].state.pool
    assert wait_until(lambda: pool.inflight == 0)
    admitted = [pool.check_capacity() for _ in range(4 + 16)]  # 4 rows + 16 queued
    with pytest.raises(ApiError, match="max_queue=16"):
        pool.check_capacity()
    del admitted[0]  # a client that went away before its stream started frees its place
    pool.check_capacity()
