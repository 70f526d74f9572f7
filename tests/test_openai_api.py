"""The OpenAI-compatible API: the official `openai` client against a real `chatpipe serve` process."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import httpx
import pytest
import torch

from chatpipe.inference.engine import Engine
from chatpipe.inference.sampler import sample_next
from chatpipe.model.loading import load_chat_model
from chatpipe.testing.project import running_server
from tests.trained import train_artifacts

openai = pytest.importorskip("openai")
REPO = Path(__file__).resolve().parents[1]
QUESTION = [{"role": "user", "content": "Where does Mia live?"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    return train_artifacts(tmp_path_factory.mktemp("project") / "artifacts")


@pytest.fixture(scope="module")
def ours(artifacts):
    return load_chat_model("sft", artifacts=artifacts, device="cpu")


@pytest.fixture(scope="module")
def server(artifacts):
    """`chatpipe serve --model sft` on a free port, in its own process; stopped (by its pid) after the tests."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATPIPE_")}
    env.update(PYTHONPATH=str(REPO), CHATPIPE_PARAMS=str(REPO / "params.yaml"), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "chatpipe.cli", "serve", "--model", "sft", "--device", "cpu", "--port", str(port)]
    cmd += ["--max-tokens-limit", "64", "--max-turns", "6"]
    with running_server(cmd, artifacts.parent, env, port, 120, "chatpipe serve") as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)


def engine_text(ours, prompt: list[int], max_tokens: int) -> tuple[str, int]:
    """Greedy reply text (text parts) of our engine and the tokens it generated."""
    stats: dict = {}
    pieces = Engine(ours.model, ours.tokenizer).stream(prompt, stats=stats, max_tokens=max_tokens, temperature=0.0)
    return "".join(t for kind, t in pieces if kind == "text"), stats["tokens"]


@pytest.mark.slow
def test_openai_client_streams_the_engines_greedy_reply(client, ours):
    expected, tokens = engine_text(ours, ours.tokenizer.render_for_completion({"messages": QUESTION}), 24)
    assert expected.strip()
    stream = client.chat.completions.create(
        model="sft",
        messages=QUESTION,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert len([c for c in chunks if c.choices]) > 3  # really streamed, not one blob
    assert chunks[-1].usage.prompt_tokens == len(ours.tokenizer.render_for_completion({"messages": QUESTION}))
    assert chunks[-1].usage.completion_tokens == tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length" if tokens == 24 else "stop"]


@pytest.mark.slow
def test_non_streamed_n_seed_stop_usage_and_models(client, ours):
    assert [m.id for m in client.models.list()] == ["sft"]
    expected, tokens = engine_text(ours, ours.tokenizer.render_for_completion({"messages": QUESTION}), 24)
    r = client.chat.completions.create(model="sft", messages=QUESTION, max_tokens=24, temperature=0, n=2, seed=3)
    assert [c.message.content for c in r.choices] == [expected, expected] and [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 2 * tokens and r.usage.total_tokens == r.usage.prompt_tokens + 2 * tokens
    # a stop string cuts the reply before it, and the finish reason says so
    word = expected.split()[2]
    r = client.chat.completions.create(model="sft", messages=QUESTION, max_tokens=24, temperature=0, stop=[word, "zzz"])
    assert r.choices[0].message.content == expected[: expected.index(word)] and r.choices[0].finish_reason == "stop"
    # sampling with a seed is reproducible; top_p / top_k are accepted
    kw = dict(
        model="sft", messages=QUESTION, max_tokens=12, temperature=1.0, top_p=0.9, seed=5, extra_body={"top_k": 20}
    )
    assert client.chat.completions.create(**kw).choices[0].message.content == (
        client.chat.completions.create(**kw).choices[0].message.content
    )
    # min_tokens (an extension): no stop before that many tokens, so the choices run to max_tokens
    r = client.chat.completions.create(
        model="sft", messages=QUESTION, max_tokens=40, temperature=0, n=2, extra_body={"min_tokens": 40}
    )
    assert r.usage.completion_tokens == 2 * 40  # the stop itself: tests/test_scheduler.py
    assert [c.finish_reason for c in r.choices] == ["length", "length"]
    with pytest.raises(openai.BadRequestError, match="min_tokens=9 is over max_tokens=8"):
        client.chat.completions.create(model="sft", messages=QUESTION, max_tokens=8, extra_body={"min_tokens": 9})


@pytest.mark.slow
def test_completions_continue_text_like_the_engine(client, ours):
    prompt = "Mia lives in"
    expected, tokens = engine_text(ours, ours.tokenizer.encode(prompt, prepend=ours.tokenizer.bos_id), 16)
    r = client.completions.create(model="sft", prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == expected and r.usage.completion_tokens == tokens
    streamed = client.completions.create(
        model="sft", prompt=prompt, max_tokens=16, temperature=0, stream=True, echo=True
    )
    assert "".join(c.choices[0].text for c in streamed) == prompt + expected


@pytest.mark.slow
def test_malformed_requests_get_4xx_in_openais_error_shape(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4", messages=QUESTION)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="sft", messages=QUESTION, temperature=3)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError, match="serve.max_tokens_limit"):
        client.chat.completions.create(model="sft", messages=QUESTION, max_tokens=65)
    bad_bodies = {
        b"{not json": "invalid_json",
        b'{"model": "sft"}': "messages",
        b'{"model": "sft", "messages": []}': "messages",
        b'{"model": "sft", "messages": [{"role": "user", "content": "hi"}], "n": 99}': "n",
        b'{"model": "sft", "messages": [{"role": "user", "content": "hi"}], "bogus": 1}': "bogus",
        b'{"model": "sft", "messages": [{"role": "assistant", "content": "hi"}]}': "messages",
        b'{"model": "sft", "messages": [{"role": "user", "content": "hi"}], "stop": ["a","b","c","d","e"]}': "stop",
        b'{"model": "sft", "messages": [{"role": "user", "content": "hi"}], "stream_options": {}}': "stream_options",
    }
    for body, where in bad_bodies.items():
        r = httpx.post(f"{server}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
        err = r.json()["error"]
        assert 400 <= r.status_code < 500, body
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
        assert where in (err["param"] or "") or where == err["code"], (body, err)
    r = httpx.get(f"{server}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
    # the web UI's own API keeps its format
    r = httpx.post(f"{server}/api/chat", json={"messages": QUESTION, "stream": False, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["message"]["role"] == "assistant"


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    rng = torch.Generator().manual_seed(0)
    draws = {sample_next(logits, rng, 1.0, top_p=0.7).item() for _ in range(300)}
    assert draws == {0, 1}  # 0.5 < 0.7 needs the second token; 0.8 >= 0.7 stops there
    assert {sample_next(logits, rng, 1.0, top_p=0.01).item() for _ in range(50)} == {0}
    a, b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    assert [sample_next(logits, a, 1.0).item() for _ in range(20)] == [
        sample_next(logits, b, 1.0, top_p=1.0).item() for _ in range(20)
    ]
