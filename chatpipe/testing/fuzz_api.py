"""Fuzz `chatpipe serve` from outside: schemathesis-generated requests for every operation, plus
hand-made malformed ones, each sorted into clean / 5xx / bad error shape / silently wrong.

A tiny random chat model (chatpipe/testing/chatmodel.py) is served by ``python -m chatpipe.testing.fuzz_api --serve PORT``
in a subprocess started from a source tree (this one by default), so the same campaign runs against
another checkout's server too (``--src``: the "before" row of a fix). Requests go over HTTP with httpx;
each generated response is checked with schemathesis's response checks against the server's own
``/openapi.json`` (all but ``positive_data_acceptance``: a body can fit the schema and still be
refused for this server's limits or model name, by design).

Rows: tried (requests sent), clean (a 2xx that fits the schema, or a 4xx in the API's error shape
that the request deserved), 5xx, bad shape (a 4xx or 2xx that breaks the documented schema) and
silently wrong (a request that should have been refused answered 2xx, or a 2xx with the wrong
answer).

Run::

    python bench/fuzz_api.py                    # 10,000 generated + the hand-made requests
    python bench/fuzz_api.py -n 2000 --src /path/to/other/checkout

``campaign(n)`` returns the rows as a dict, for bench/fuzz.py's whole table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
ROWS = ("tried", "clean", "5xx", "bad shape", "silently wrong")
LIMITS = dict(batch_rows=2, max_queue=8, max_message_chars=200, max_turns=5, max_tokens=8, max_tokens_limit=16)


# --------------------------------------------------------------------------- the server


def serve(port: int) -> None:
    """Serve the tiny test model on 127.0.0.1:``port`` until killed (the subprocess's body)."""
    import uvicorn

    from chatpipe.model.loading import load_chat_model
    from chatpipe.serve.app import create_app
    from chatpipe.testing.chatmodel import make_artifacts, serve_settings

    root = Path(tempfile.mkdtemp(prefix="fuzz-api-"))
    loaded = load_chat_model("sft", artifacts=make_artifacts(root / "artifacts"), device="cpu")
    uvicorn.run(create_app(loaded, serve_settings(**LIMITS)), host="127.0.0.1", port=port, log_level="error")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(src: Path = ROOT, timeout: float = 120):
    """A fuzz server from source tree ``src`` in its own process; its base URL. Stopped by its pid."""
    from chatpipe.testing.project import running_server

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHATPIPE_")}
    env.update(PYTHONPATH=str(src), OMP_NUM_THREADS="1")
    # run from ``src`` as a module: its chatpipe (PYTHONPATH, and the working directory first on sys.path) serves
    cmd = [sys.executable, "-m", "chatpipe.testing.fuzz_api", "--serve", str(port)]
    with running_server(cmd, src, env, port, timeout, "fuzz server") as url:
        yield url


# --------------------------------------------------------------------------- generated requests


def error_shape_ok(path: str, response: httpx.Response) -> bool:
    """Whether an error response is in its API's shape: OpenAI's under /v1, ``{"error": str}`` elsewhere."""
    try:
        body = response.json()
    except ValueError:
        return False
    if path.startswith("/v1"):
        err = body.get("error") if isinstance(body, dict) else None
        return isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} and bool(err["message"])
    return isinstance(body, dict) and set(body) == {"error"} and isinstance(body["error"], str)


def classify(case: Any, response: httpx.Response, negative: bool, checks: list) -> str:
    """The row a generated request's response falls in."""
    if response.status_code >= 500:
        return "5xx"
    if negative and response.status_code < 400:
        return "silently wrong"  # a body that breaks the schema was accepted
    if response.status_code >= 400 and not error_shape_ok(case.path, response):
        return "bad shape"
    from schemathesis.core.failures import FailureGroup

    try:
        case.validate_response(response, checks=checks)
    except FailureGroup as failures:  # schemathesis's FailureGroup: one exception per failed check
        return "5xx" if any(type(f).__name__ == "ServerError" for f in failures.exceptions) else "bad shape"
    return "clean"


def send(client: httpx.Client, case: Any) -> httpx.Response:
    kw = case.as_transport_kwargs(base_url=str(client.base_url))
    kw.pop("url", None)
    if isinstance(kw.get("data"), (str, bytes)):  # a raw body (not a form): httpx calls that content
        kw["content"] = kw.pop("data")
    return client.request(kw.pop("method"), case.formatted_path, **{k: kw[k] for k in kw if k in SEND_KEYS})


SEND_KEYS = ("headers", "params", "json", "content", "data")


def run_operation(client, operation, negative: bool, examples: int, counts: Counter, samples: dict, checks) -> None:
    """Send ``examples`` generated requests for one operation and mode; ``counts`` gets their rows."""
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.core.failures import FailureGroup

    mode = GenerationMode.NEGATIVE if negative else GenerationMode.POSITIVE

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    def one(case: Any) -> None:
        # every other valid body names the served model, so the checks past the model name (limits,
        # prompts, generation) are fuzzed too, not only the 404 for an unknown model
        if not negative and isinstance(case.body, dict) and "model" in case.body and counts["tried"] % 2:
            case.body["model"] = "sft"
        try:
            response = send(client, case)
        except httpx.HTTPError as e:  # the server hung up or timed out: as bad as a 5xx
            response = httpx.Response(599, text=f"{type(e).__name__}: {e}")
        row = classify(case, response, negative, checks)
        samples.setdefault("operations", Counter())[operation.label] += 1
        samples.setdefault("statuses", Counter())[response.status_code] += 1
        counts["tried"] += 1
        counts[row] += 1
        if row != "clean":
            samples.setdefault(row, []).append(f"{case.method} {case.path} {response.status_code} {case.body!r:.200}")

    try:
        one()
    except (Exception, FailureGroup) as e:  # e.g. no invalid request for an operation without parameters
        samples.setdefault("skipped", []).append(f"{operation.label} ({mode.value}): {type(e).__name__}")


def generated(url: str, n: int, seed: int = 0) -> tuple[Counter, dict]:
    """About ``n`` schemathesis-generated requests over every operation, positive and negative."""
    import random

    import schemathesis
    from schemathesis import checks as st

    checks = [
        st.not_a_server_error, st.status_code_conformance, st.content_type_conformance,
        st.response_headers_conformance, st.response_schema_conformance,
    ]  # fmt: skip
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    with_body = [op for op in operations if op.body]
    counts, samples = Counter(), {}
    random.seed(seed)
    with httpx.Client(base_url=url, timeout=30) as client:
        for op in operations:  # every operation, both modes, at least a few times
            for negative in (False, True):
                run_operation(client, op, negative, 5, counts, samples, checks)
        while counts["tried"] < n:  # the rest where bodies can vary
            per = min(200, max(1, (n - counts["tried"]) // (2 * len(with_body)) + 1))
            for op in with_body:
                for negative in (False, True):
                    run_operation(client, op, negative, per, counts, samples, checks)
    return counts, samples


# --------------------------------------------------------------------------- hand-made requests

CHAT = {"model": "sft", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def hand_made() -> list[tuple[str, str, Any, int, str | None]]:
    """(method, path, body, expected status, expected param): malformed requests a user or attacker sends.

    A ``str`` or ``bytes`` body goes as is; anything else as JSON. A 200 is checked for the right answer.
    """
    v1 = "/v1/chat/completions"
    cases = [
        (v1, {**CHAT, "max_tokens": "8"}, 400, "max_tokens"),
        (v1, {**CHAT, "stream": "yes"}, 400, "stream"),
        (v1, {**CHAT, "n": 1.5}, 400, "n"),
        (v1, {**CHAT, "seed": 2**64}, 400, "seed"),
        (v1, {**CHAT, "seed": 2**63}, 400, "seed"),
        (v1, {**CHAT, "seed": -1}, 400, "seed"),
        (v1, {**CHAT, "temperature": 1e-50}, 200, None),
        (v1, {**CHAT, "temperature": 5e-324}, 200, None),
        (v1, {**CHAT, "top_p": 1e-300, "temperature": 1}, 200, None),
        (v1, {**CHAT, "temperature": 2.0000001}, 400, "temperature"),
        (
            v1,
            '{"model": "sft", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
            400,
            "temperature",
        ),
        (v1, '{"model": "sft", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}', 400, "top_p"),
        (v1, '{"model": "sft", "messages": [], "seed": 1' + "0" * 5000 + "}", 400, None),
        (v1, "[" * 100_000 + "]" * 100_000, 400, None),
        (v1, b"\xff\xfe{}", 400, None),
        (v1, "", 400, None),
        (v1, "null", 400, None),
        (v1, '"a string"', 400, None),
        (v1, {**CHAT, "stop": ["x"] * 5}, 400, "stop"),
        (v1, {**CHAT, "stop": ""}, 400, "stop"),
        (v1, {**CHAT, "stop": "s" * 1001}, 400, "stop"),
        (v1, {**CHAT, "stop": [1]}, 400, "stop"),
        (v1, {**CHAT, "max_tokens": 17}, 400, "max_tokens"),
        (v1, {**CHAT, "max_tokens": 0}, 400, "max_tokens"),
        (v1, {**CHAT, "n": 9}, 400, "n"),
        (v1, {**CHAT, "messages": []}, 400, "messages"),
        (v1, {**CHAT, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages"),
        (v1, {**CHAT, "messages": [{"role": "user", "content": [{"type": "image", "text": "x"}]}]}, 400, "messages"),
        (v1, {**CHAT, "messages": [{"role": "assistant", "content": "hi"}]}, 400, "messages"),
        (v1, {**CHAT, "messages": [{"role": "user", "content": "x" * 201}]}, 400, "messages"),
        (v1, {**CHAT, "messages": [{"role": "user", "content": "\x00\ud800"}]}, 400, None),
        (v1, {**CHAT, "bogus": 1}, 400, "bogus"),
        (v1, {**CHAT, "model": "gpt-4"}, 404, "model"),
        (v1, {**CHAT, "user": "u" * 1_100_000}, 413, None),
        (v1, {**CHAT, "logprobs": 1}, 400, "logprobs"),
        (v1, {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        (v1, {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
        ("/v1/completions", {"model": "sft", "prompt": "hi", "logprobs": True}, 400, "logprobs"),
        (v1, {**CHAT, "presence_penalty": 3}, 400, "presence_penalty"),
        (v1, {**CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("/v1/completions", {"model": "sft", "prompt": ["a", 7], "max_tokens": 2}, 400, "prompt"),
        ("/v1/completions", {"model": "sft", "prompt": [], "max_tokens": 2}, 400, "prompt"),
        ("/v1/completions", {"model": "sft", "prompt": ["a"] * 2000, "max_tokens": 16, "n": 8}, 400, "max_tokens"),
        ("/v1/completions", {"model": "sft", "prompt": "hi", "echo": "no"}, 400, "echo"),
        ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "8"}, 422, None),
        ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 422, None),
        ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, 422, None),
        (
            "/api/chat",
            {"messages": [{"role": "user", "content": "hi"}], "temperature": 1e-50, "stream": False, "max_tokens": 2},
            200,
            None,
        ),  # fmt: skip
        ("/api/chat", "{not json", 400, None),
        ("/api/chat", {"messages": []}, 422, None),
    ]
    made = [("POST", path, body, status, param) for path, body, status, param in cases]
    made += [("GET", v1, None, 405, None), ("PUT", "/v1/completions", None, 405, None)]
    made += [("GET", "/api/chat", None, 405, None), ("DELETE", "/v1/nothing", None, 404, None)]
    made += [("GET", "/v1/models/gpt-4", None, 404, "model"), ("POST", "/health", None, 405, None)]
    return made


def hand_made_row(client: httpx.Client, method: str, path: str, body: Any, status: int, param: str | None) -> str:
    """Send one hand-made request; its row."""
    if body is None:
        kw: dict[str, Any] = {}
    else:  # json.dumps escapes what is not ASCII: a lone surrogate goes as \ud800, as a client may send it
        content = body if isinstance(body, (str, bytes)) else json.dumps(body)
        kw = {"content": content, "headers": {"content-type": "application/json"}}
    try:
        r = client.request(method, path, **kw)
    except httpx.HTTPError:
        return "5xx"
    if r.status_code >= 500:
        return "5xx"
    if status >= 400 and r.status_code < 400:
        return "silently wrong"
    if r.status_code >= 400:
        if not error_shape_ok(path, r) or r.status_code != status:
            return "bad shape"
        if param and path.startswith("/v1") and r.json()["error"]["param"] != param:
            return "bad shape"
        return "clean"
    if path == "/v1/chat/completions" and "top_p" not in body:  # a tiny temperature answers as greedy does
        greedy = client.post(path, json={**body, "temperature": 0}).json()
        return "clean" if r.json()["choices"][0]["message"] == greedy["choices"][0]["message"] else "silently wrong"
    return "clean"


def hand_made_rows(url: str) -> tuple[Counter, dict]:
    counts, samples = Counter(), {}
    with httpx.Client(base_url=url, timeout=60) as client:
        for method, path, body, status, param in hand_made():
            row = hand_made_row(client, method, path, body, status, param)
            counts["tried"] += 1
            counts[row] += 1
            if row != "clean":
                samples.setdefault(row, []).append(f"{method} {path} {str(body)[:120]} (expected {status} {param})")
    return counts, samples


# --------------------------------------------------------------------------- the campaign


def campaign(n: int = 10_000, src: Path = ROOT, url: str | None = None) -> dict[str, Any]:
    """Fuzz a server (``url``, else one started from ``src``): rows for generated and hand-made requests.

    Returns ``{"generated": {row: count}, "hand-made": {row: count}, "samples": {part: {row: [...]}}}``.
    """
    if url is None:
        with server(src) as started:
            return campaign(n, src, started)
    t0 = time.perf_counter()
    gen, gen_samples = generated(url, n)
    hand, hand_samples = hand_made_rows(url)
    return {
        "generated": {row: gen[row] for row in ROWS},
        "hand-made": {row: hand[row] for row in ROWS},
        "samples": {"generated": gen_samples, "hand-made": hand_samples},
        "seconds": round(time.perf_counter() - t0, 1),
    }


def table(result: dict[str, Any]) -> str:
    """The rows as a markdown table."""
    lines = ["| part | " + " | ".join(ROWS) + " |", "|---|" + "---|" * len(ROWS)]
    for part in ("generated", "hand-made"):
        lines.append(f"| {part} requests | " + " | ".join(str(result[part][r]) for r in ROWS) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-n", type=int, default=10_000, help="generated requests (at least)")
    p.add_argument("--src", type=Path, default=ROOT, help="the source tree whose server to fuzz")
    p.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the server subprocess
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return 0
    result = campaign(args.n, args.src)
    print(table(result))
    for part, rows in result["samples"].items():
        for row, examples in rows.items():
            if row in ("operations", "statuses"):
                examples = [f"{key}: {k}" for key, k in sorted(examples.items(), key=str)]
            print(f"\n{part}, {row} ({len(examples)}):", *examples[:8], sep="\n  ")
    print(f"\n{result['seconds']} s; {json.dumps({k: result[k] for k in ('generated', 'hand-made')})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
