"""The JSON API beyond chatting: the non-streaming reply keeps calculator calls, and the API docs answer.

A real uvicorn server on 127.0.0.1. For the calculator test the engine's token stream is scripted
(a random tiny model never calls the tool: the batch pool's stream is scripted); the app's own assembly of the reply is what is tested.
"""

from __future__ import annotations

import json

import httpx
import pytest

from chatpipe.model.loading import load_chat_model
from chatpipe.serve.app import create_app
from chatpipe.testing.chatmodel import make_artifacts, run_in_thread, serve_settings

CALC_REPLY = [("text", "12 + 7 is "), ("python", "12+7"), ("python_output", "19"), ("text", ", so 19.")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    loaded = load_chat_model("sft", artifacts=make_artifacts(tmp_path_factory.mktemp("artifacts")), device="cpu")
    limits = dict(batch_rows=1, max_queue=4, max_message_chars=200, max_turns=5, max_tokens=16, max_tokens_limit=64)
    app = create_app(loaded, serve_settings(**limits))

    async def scripted(prompt, stats, admission=None, **kw):  # the pool's deltas of one sample, scripted
        stats[0].update(tokens=9, finish_reason="stop")
        for kind, text in CALC_REPLY:
            yield 0, kind, text, None
        yield 0, "end", "", None

    app.state.pool.stream = scripted
    srv, url = run_in_thread(app)
    yield url
    srv.should_exit = True


def ask(url: str, stream: bool) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "What is 12 + 7?"}], "stream": stream}
    return httpx.post(f"{url}/api/chat", json=body, timeout=30)


def test_non_streaming_reply_keeps_the_calculator_call_and_result(server):
    # before: "text" was "12 + 7 is , so 19." (the call and its result dropped)
    reply = ask(server, stream=False).json()
    assert reply["text"] == "12 + 7 is [calc: 12+7 = 19], so 19."
    assert reply["parts"] == [{"type": t, "text": x} for t, x in CALC_REPLY]
    assert reply["message"] == {"role": "assistant", "content": reply["parts"]}
    assert reply["finish_reason"] == "stop" and reply["tokens"] == 9


def test_stream_and_json_agree_on_tool_calls(server):
    events = [json.loads(line[6:]) for line in ask(server, stream=True).text.splitlines() if line.startswith("data: ")]
    assert [(e["kind"], e["text"]) for e in events[:-1]] == CALC_REPLY
    assert events[-1]["done"] and events[-1]["text"] == ask(server, stream=False).json()["text"]


def test_docs_page_and_openapi_schema_answer(server):
    # before: /docs was 404 (the page lived at /api/docs)
    page = httpx.get(f"{server}/docs")
    assert page.status_code == 200 and "swagger" in page.text.lower() and "/openapi.json" in page.text
    schema = httpx.get(f"{server}/openapi.json").json()
    assert "/api/chat" in schema["paths"] and "/health" in schema["paths"]
    old = httpx.get(f"{server}/api/docs", follow_redirects=True)
    assert old.status_code == 200 and str(old.url).endswith("/docs")


def test_unknown_fields_are_refused_by_name_on_both_apis(server):
    # before: /api/chat ignored a field it did not know ("max_token": 2 answered with the default length)
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": False, "max_token": 2}
    r = httpx.post(f"{server}/api/chat", json=body, timeout=30)
    assert r.status_code == 422 and "max_token" in r.json()["error"], r.text
    nested = {"messages": [{"role": "user", "content": "hi", "x": 1}], "stream": False}
    r = httpx.post(f"{server}/api/chat", json=nested, timeout=30)
    assert r.status_code == 422 and "messages.0.x" in r.json()["error"], r.text
    r = httpx.post(f"{server}/v1/chat/completions", json={"model": "sft", **body}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_token", r.text
