"""issue 46: the server's bounds and typed requests, against a real uvicorn server (tiny random model).

Each test names what it did before the fix. Generation is paced (>= 5 ms a token, like a real
model) so a long reply is still running while the test looks at the server.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from chatpipe.model.loading import load_chat_model
from chatpipe.testing.chatmodel import make_artifacts, serve_paced, serve_settings
from chatpipe.testing.project import wait_until

BIG_STOP = 100_000  # this server's serve.max_stop_chars: the largest stop string it allows
CHAT = {"model": "sft", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    loaded = load_chat_model("sft", artifacts=make_artifacts(tmp_path_factory.mktemp("artifacts")), device="cpu")
    cfg = serve_settings(
        batch_rows=2, max_queue=4, max_message_chars=200, max_turns=5, max_tokens=16, max_tokens_limit=2000,
        max_stop_chars=BIG_STOP, max_body_bytes=400_000, max_request_tokens=4000,
    )  # fmt: skip
    yield from serve_paced(loaded, cfg)


def post(url: str, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=kw.pop("timeout", 60), **kw)


def openai_error(r: httpx.Response, status: int, param: str | None) -> dict:
    """The error of ``r``, checked to be in OpenAI's shape with this status and param."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err


def test_seed_past_2_64_is_a_400_naming_seed(server):
    # before: 500 "Overflow when unpacking long long", labelled invalid_request_error
    _, url = server
    for seed in (2**64, 2**63, -1):
        err = openai_error(post(url, "/v1/chat/completions", {**CHAT, "seed": seed}), 400, "seed")
        assert err["type"] == "invalid_request_error"
    assert post(url, "/v1/chat/completions", {**CHAT, "seed": 2**63 - 1}).status_code == 200


def test_underflowing_temperature_and_top_p_answer(server):
    # before: 500 (the logits over 1e-50 are inf, their softmax NaN)
    _, url = server
    greedy = post(url, "/v1/chat/completions", {**CHAT, "temperature": 0}).json()["choices"][0]["message"]
    for extra in ({"temperature": 1e-50}, {"temperature": 5e-324}, {"top_p": 1e-300, "temperature": 1}):
        r = post(url, "/v1/chat/completions", {**CHAT, **extra})
        assert r.status_code == 200, (extra, r.text)
        if "top_p" not in extra:
            assert r.json()["choices"][0]["message"] == greedy
    r = post(url, "/api/chat", {"messages": CHAT["messages"], "temperature": 1e-50, "stream": False, "max_tokens": 4})
    assert r.status_code == 200, r.text


def test_types_are_strict(server):
    # before: "max_tokens": "8" and "stream": "yes" were coerced and answered 200
    _, url = server
    for field, value in [("max_tokens", "8"), ("stream", "yes"), ("n", 1.0), ("temperature", "0.5")]:
        openai_error(post(url, "/v1/chat/completions", {**CHAT, field: value}), 400, field)
    body = {"model": "sft", "prompt": ["a", 7], "max_tokens": 2}
    assert "prompt" in openai_error(post(url, "/v1/completions", body), 400, "prompt")["message"]
    r = post(url, "/api/chat", {"messages": CHAT["messages"], "max_tokens": "4", "stream": False})
    assert r.status_code == 422 and "max_tokens" in r.json()["error"]


def test_bounded_work_each_limit_named(server):
    _, url = server
    err = openai_error(post(url, "/v1/chat/completions", {**CHAT, "stop": ["x"] * 5}), 400, "stop")
    assert "serve.max_stops" in err["message"]
    err = openai_error(post(url, "/v1/chat/completions", {**CHAT, "stop": "x" * (BIG_STOP + 1)}), 400, "stop")
    assert "serve.max_stop_chars" in err["message"]
    # 2 prompts x n=3 x 1000 tokens = 6000 > serve.max_request_tokens = 4000
    body = {"model": "sft", "prompt": ["a", "b"], "n": 3, "max_tokens": 1000}
    err = openai_error(post(url, "/v1/completions", body), 400, "max_tokens")
    assert "6000" in err["message"] and "serve.max_request_tokens" in err["message"]
    big = {**CHAT, "user": "u" * 400_000}
    err = openai_error(post(url, "/v1/chat/completions", big), 413, None)
    assert "serve.max_body_bytes" in err["message"]
    r = httpx.post(f"{url}/api/chat", json={"messages": [{"role": "user", "content": "u" * 400_000}]})
    assert r.status_code == 413 and "serve.max_body_bytes" in r.json()["error"]

    def chunks():  # no Content-Length: the cap is counted as the body arrives
        yield b'{"model": "sft", "user": "'
        for _ in range(50):
            yield b"u" * 10_000

    r = httpx.post(f"{url}/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    assert openai_error(r, 413, None)["code"] == "request_too_large"


def health_seconds(client: httpx.Client) -> float:
    t0 = time.perf_counter()
    assert client.get("/health").status_code == 200
    return time.perf_counter() - t0


def test_health_answers_within_100ms_while_the_largest_stop_string_generates(server):
    # before: the stop check rescanned every prefix after each token on the event loop (300 KB: 6.8 s)
    app, url = server
    body = {**CHAT, "max_tokens": 400, "stop": "ab" * (BIG_STOP // 2)}
    done: dict = {}
    with httpx.Client(base_url=url, timeout=10) as client:
        # what /health costs on this machine with nothing generating: a shared CI box adds its own delay
        idle = sorted(health_seconds(client) for _ in range(9))[4]
        worker = threading.Thread(target=lambda: done.update(r=post(url, "/v1/chat/completions", body)))
        worker.start()
        assert wait_until(lambda: app.state.pool.active == 1, 10)
        times = []
        while worker.is_alive() and len(times) < 20:
            times.append(health_seconds(client))
            time.sleep(0.05)
    worker.join(60)
    assert done["r"].status_code == 200 and done["r"].json()["choices"][0]["finish_reason"] == "length"
    times.sort()
    assert len(times) >= 5 and times[len(times) // 2] < 0.1 + idle and times[-1] < 0.3 + idle, (idle, times)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat"])
def test_a_client_leaving_a_non_streamed_request_stops_its_generation_within_1s(server, path):
    # before: a non-streamed reply ran to max_tokens after its client left
    app, url = server
    pool = app.state.pool
    before = pool.cancelled
    body = {**CHAT, "max_tokens": 1500, "stream": False}
    with pytest.raises(httpx.ReadTimeout):
        post(url, path, body if path.startswith("/v1") else {k: body[k] for k in ("messages", "max_tokens", "stream")},
             timeout=1.0)  # fmt: skip
    left = time.monotonic()
    assert wait_until(lambda: pool.active == 0, 1.0), f"still generating {time.monotonic() - left:.1f} s later"
    assert pool.cancelled == before + 1


def test_openapi_schema_describes_every_operation(server):
    # before: /v1 bodies absent from the schema, operationId unknown_v1__path__patch five times,
    # /api/chat's documented 422 was FastAPI's {"detail": [...]} while it returned {"error": "..."}
    _, url = server
    schema = httpx.get(f"{url}/openapi.json").json()
    ops = [(p, m, op) for p, item in schema["paths"].items() for m, op in item.items()]
    ids = [op["operationId"] for _, _, op in ops]
    assert len(ids) == len(set(ids)) and not any("unknown" in i for i in ids)
    refs = {p: op["requestBody"]["content"]["application/json"]["schema"]["$ref"] for p, m, op in ops if m == "post"}
    assert refs == {
        "/v1/chat/completions": "#/components/schemas/ChatCompletionRequest",
        "/v1/completions": "#/components/schemas/CompletionRequest",
        "/api/chat": "#/components/schemas/ChatRequest",
    }
    for p, m, op in ops:
        if m == "post":
            err = op["responses"]["4XX"]["content"]["application/json"]["schema"]["$ref"]
            assert err.endswith("ErrorBody" if p.startswith("/v1") else "PlainError") and "422" not in op["responses"]
    # wrong methods are 405 with Allow, unknown paths 404, each in its API's error shape
    r = httpx.get(f"{url}/v1/chat/completions")
    assert openai_error(r, 405, None)["code"] == "method_not_allowed" and r.headers["allow"] == "POST"
    assert openai_error(httpx.delete(f"{url}/v1/nothing"), 404, None)["code"] == "unknown_url"
    r = httpx.get(f"{url}/api/chat")
    assert r.status_code == 405 and set(r.json()) == {"error"}
    r = httpx.post(f"{url}/api/chat", json={"messages": []})
    assert r.status_code == 422 and set(r.json()) == {"error"}


def test_pyfunc_params_out_of_range_are_named():
    from mlflow.exceptions import MlflowException

    from chatpipe.serve.pyfunc import checked_params

    assert checked_params({"seed": 2**63 - 1, "temperature": 1e-50})["seed"] == 2**63 - 1
    for name, value in [("seed", 2**64), ("seed", -1), ("temperature", float("nan")), ("max_tokens", 0)]:
        with pytest.raises(MlflowException, match=f"params.{name} = "):
            checked_params({name: value})
