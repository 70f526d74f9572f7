"""issue 71: OpenAI's sampling semantics and /metrics, against a real uvicorn server (tiny random model, paced).

Without a seed every request samples afresh; ``n`` choices are one request of ``n`` samples in the
batch; ``logprobs`` / ``top_logprobs`` come back in OpenAI's shapes, streamed and whole, and equal
the model's own log softmax; ``/metrics`` parses with prometheus_client's parser.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from chatpipe.model.loading import load_chat_model
from chatpipe.testing.chatmodel import make_artifacts, serve_paced, serve_settings
from chatpipe.testing.project import wait_until

QUESTION = [{"role": "user", "content": "hi"}]
CHAT = {"model": "sft", "messages": QUESTION, "max_tokens": 8}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_chat_model("sft", artifacts=make_artifacts(tmp_path_factory.mktemp("artifacts")), device="cpu")


@pytest.fixture(scope="module")
def server(loaded):
    cfg = serve_settings(batch_rows=4, max_queue=8, max_tokens=8, max_tokens_limit=1000, top_k=0)
    yield from serve_paced(loaded, cfg)


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def sse(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-1]
    return [json.loads(line) for line in lines[:-1]]


@torch.no_grad()
def raw_logprobs(loaded, ids: list[int]) -> torch.Tensor:
    """The model's log softmax over the next token after ``ids``."""
    return torch.log_softmax(loaded.model(torch.tensor([ids]))[0, -1].float(), dim=-1)


def test_unseeded_requests_sample_afresh_and_a_seed_reproduces(server):
    # before: with no seed every request used serve.seed (42): three requests gave one reply
    _, url = server
    body = {**CHAT, "temperature": 1.0}
    replies = [post(url, "/v1/chat/completions", body)["choices"][0]["message"]["content"] for _ in range(8)]
    assert len(set(replies)) >= 4, replies
    web = [
        post(url, "/api/chat", {"messages": QUESTION, "temperature": 1.0, "stream": False})["text"] for _ in range(4)
    ]
    assert len(set(web)) >= 2, web
    seeded = [post(url, "/v1/chat/completions", {**body, "seed": 7, "n": 2}) for _ in range(2)]
    texts = [[c["message"]["content"] for c in r["choices"]] for r in seeded]
    assert texts[0] == texts[1] and texts[0][0] != texts[0][1], texts  # reproducible, and its choices differ


def test_n_choices_decode_together_in_one_request(server):
    # before: n choices ran one after another, one request each
    app, url = server
    pool = app.state.pool
    widest: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            widest.append(pool.live_rows)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        chunks = sse(url, "/v1/chat/completions", {**CHAT, "n": 3, "max_tokens": 40, "temperature": 1.0, "seed": 3})
    finally:
        done.set()
        watcher.join()
    assert max(widest) == 3  # three rows of one request at once
    indices = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("content")]
    assert set(indices) == {0, 1, 2}
    assert indices != sorted(indices)  # interleaved as they decode, not one choice after another
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks}
    assert set(finishes) == {0, 1, 2} and set(finishes.values()) <= {"length", "stop"}, finishes  # one finish each
    texts = ["".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"][0]["index"] == i)
             for i in range(3)]  # fmt: skip
    assert len(set(texts)) == 3


def test_chat_logprobs_are_the_models_log_softmax_streamed_and_whole(server, loaded):
    _, url = server
    body = {**CHAT, "temperature": 0, "logprobs": True, "top_logprobs": 3, "max_tokens": 6}
    whole = post(url, "/v1/chat/completions", body)["choices"][0]
    content = whole["logprobs"]["content"]
    assert len(content) == 6 and "".join(e["token"] for e in content) == whole["message"]["content"]
    ids = loaded.tokenizer.render_for_completion({"messages": QUESTION})
    for entry in content:  # greedy: each token is its position's likeliest
        ref = raw_logprobs(loaded, ids)
        best = ref.topk(3)
        tok = int(best.indices[0])
        assert entry["logprob"] == pytest.approx(float(best.values[0]), abs=1e-4)
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(best.values.tolist(), abs=1e-4)
        assert entry["top_logprobs"][0]["token"] == entry["token"]
        assert bytes(entry["bytes"]) == loaded.tokenizer.enc.decode_single_token_bytes(tok)
        ids.append(tok)
    streamed = sse(url, "/v1/chat/completions", body)
    entries = [
        e
        for c in streamed
        if c["choices"] and c["choices"][0]["logprobs"]
        for e in c["choices"][0]["logprobs"]["content"]
    ]
    assert [(e["token"], e["bytes"]) for e in entries] == [(e["token"], e["bytes"]) for e in content]
    assert [e["logprob"] for e in entries] == pytest.approx([e["logprob"] for e in content], abs=1e-5)
    plain = post(url, "/v1/chat/completions", {**body, "logprobs": False, "top_logprobs": None})
    assert plain["choices"][0]["logprobs"] is None
    r = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "top_logprobs": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    r = httpx.post(f"{url}/v1/chat/completions", json={**body, "top_logprobs": 21}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_completions_logprobs_in_the_legacy_shape(server, loaded):
    _, url = server
    body = {"model": "sft", "prompt": "Mia lives in", "max_tokens": 5, "temperature": 0, "logprobs": 2, "echo": True}
    choice = post(url, "/v1/completions", body)["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"} and len(lp["tokens"]) == 5
    assert choice["text"] == "Mia lives in" + "".join(lp["tokens"])
    assert lp["text_offset"][0] == len("Mia lives in")
    assert [lp["text_offset"][i + 1] - lp["text_offset"][i] for i in range(4)] == [len(t) for t in lp["tokens"][:4]]
    ids = loaded.tokenizer.encode("Mia lives in", prepend=loaded.tokenizer.bos_id)
    ref = raw_logprobs(loaded, ids)
    assert lp["token_logprobs"][0] == pytest.approx(float(ref.max()), abs=1e-4)
    assert len(lp["top_logprobs"][0]) == 2 and lp["tokens"][0] in lp["top_logprobs"][0]
    chunks = sse(url, "/v1/completions", body)
    tokens = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert tokens == lp["tokens"]


def test_metrics_are_prometheus_text_and_move_with_requests(server):
    app, url = server

    def scrape() -> dict[str, dict]:
        r = httpx.get(f"{url}/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        return {s.name + str(sorted(s.labels.items())): s.value for f in text_string_to_metric_families(r.text)
                for s in f.samples}  # fmt: skip

    before = scrape()
    # unseeded, a random model may end a reply early: min_tokens holds each one to 8 tokens
    replies = [post(url, "/v1/chat/completions", {**CHAT, "min_tokens": 8}) for _ in range(3)]
    assert [r["usage"]["completion_tokens"] for r in replies] == [8, 8, 8]
    assert wait_until(lambda: app.state.pool.inflight == 0)
    after = scrape()
    for name in ("time_to_first_token", "queue_time", "e2e_request_latency"):
        key = f"chatpipe_{name}_seconds_count[]"
        assert after[key] - before[key] == 3, (name, before[key], after[key])
    key = "chatpipe_inter_token_latency_seconds_count[]"
    assert after[key] - before[key] == 3 * 7  # 8 tokens: 7 gaps each
    ok = "chatpipe_requests_total[('status', 'ok')]"
    assert after[ok] - before[ok] == 3
    assert {"chatpipe_running_rows[]", "chatpipe_waiting_rows[]", "chatpipe_kv_blocks_used[]",
            "chatpipe_prefix_cache_hit_rate[]", "chatpipe_batch_process_up[]"} <= set(after)  # fmt: skip
    assert after["chatpipe_batch_process_up[]"] == 1
