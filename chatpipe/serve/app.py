"""Web UI and JSON API for chatting with a trained model (FastAPI + one static HTML page).

Run::

    chatpipe serve                               # http://127.0.0.1:8000, model from params.yaml `serve`
    chatpipe serve --model sft --port 8080 --batch-rows 32
    python -m chatpipe.serve.app --host 0.0.0.0      # expose it beyond this machine (on purpose only)

Endpoints:

- ``GET /``            the chat page (chatpipe/serve/static/index.html)
- ``GET /health``      status, model name and stage, limits, load; 503 (``"status": "down"``) while the
  batch process is down (it is restarted with backoff), 200 once it is back
- ``GET /metrics``     Prometheus text format: latency histograms (time to first token, inter-token,
  queue, end to end), the batch's load, requests by status (chatpipe/serve/metrics.py)
- ``POST /api/chat``   ``{"messages": [{"role": "user", "content": "hi"}], "temperature": 0.6,
  "top_k": 50, "max_tokens": 256, "seed": 1, "stream": true}``. With ``stream`` (the default) the
  reply comes as server-sent events, one JSON object per ``data:`` line: ``{"kind": "text" |
  "python" | "python_output", "text": ...}`` deltas, then ``{"done": true, "message": ...,
  "tokens": n, "finish_reason": ...}`` (or ``{"error": ...}``). Without it: one JSON object,
  ``{"message": {"role": "assistant", "content": ...}, "text": ..., "parts": [...], "tokens": n, ...}``;
  ``text`` is the whole reply as ``chatpipe chat`` shows it (calculator calls inline as
  ``[calc: 12+7 = 19]``), ``parts`` the typed pieces (``text`` / ``python`` / ``python_output``).
- ``GET /docs``        the OpenAPI page (its script and style come from a CDN; offline, ``GET /openapi.json``)

- ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``: the OpenAI-compatible API
  (chatpipe/serve/openai_api.py), so the official ``openai`` client works against this server.

Bad requests get a 4xx with ``{"error": "<what is wrong and the limit>"}`` (under ``/v1``, OpenAI's
shape); bodies over ``serve.max_body_bytes`` a 413, wrong methods a 405. Replies are decoded
together in one continuous batch of ``serve.batch_rows`` rows (chatpipe/serve/batch_pool.py: a
reply joins between decode steps and leaves when it ends, each with its own KV row and random
generator, so conversations never mix); up to ``max_queue`` more wait, then 503. A request whose
prompt plus ``max_tokens`` does not fit a row's ``serve.batch_context`` KV positions is a 413; one
still unanswered after ``serve.request_timeout_s`` a 504 (its rows freed). A request without a
``seed`` samples with a fresh random one. A client that disconnects, mid-stream or while waiting for
a whole reply, stops its generation at the next token.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from chatpipe.inference.engine import Engine
from chatpipe.serve.batch_pool import Admission, BatchPool
from chatpipe.serve.chat import ContextTooLong, append_part, context_limit, prompt_for, show_stream
from chatpipe.serve.metrics import ServeMetrics
from chatpipe.serve.openai_api import (
    SSE_EVENT,
    OpenAIError,
    StrictRequest,
    Text,
    openai_router,
    until_disconnected,
    validation_refusal,
)
from chatpipe.settings import ParamsError, ServeSettings, load_section

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"


class ApiError(Exception):
    """A request we refuse: HTTP status and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class Part(StrictRequest):
    type: Literal["text", "python", "python_output"]
    text: Text


class Message(StrictRequest):
    role: Literal["system", "user", "assistant"]
    content: Text | list[Part]


class ChatRequest(StrictRequest):
    messages: list[Message] = Field(min_length=1)
    temperature: float | None = Field(None, ge=0, le=5)
    top_k: int | None = Field(None, ge=0)
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)  # torch.Generator.manual_seed takes a 64-bit seed
    stream: bool = True


# --------------------------------------------------------------------------- app


def check_request(req: ChatRequest, cfg: ServeSettings) -> None:
    """Enforce the server's limits with messages that name them."""
    if len(req.messages) > cfg.max_turns:
        raise ApiError(
            422,
            f"conversation has {len(req.messages)} messages; the limit is {cfg.max_turns} "
            "(serve.max_turns): start a new chat",
        )
    for i, msg in enumerate(req.messages):
        n = len(msg.content) if isinstance(msg.content, str) else sum(len(p.text) for p in msg.content)
        if n > cfg.max_message_chars:
            raise ApiError(
                413, f"message {i} is {n} characters; the limit is {cfg.max_message_chars} (serve.max_message_chars)"
            )
    if req.max_tokens is not None and req.max_tokens > cfg.max_tokens_limit:
        raise ApiError(
            422, f"max_tokens={req.max_tokens} is over the limit of {cfg.max_tokens_limit} (serve.max_tokens_limit)"
        )
    if req.messages[-1].role != "user":
        raise ApiError(422, "the last message must be from the user")


class PlainError(BaseModel):
    """The web UI API's error body (``/api/chat``, ``/health``, ``/``): what is wrong and the limit."""

    error: str


def error_response(path: str, status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in the shape of the API that ``path`` belongs to: OpenAI's under ``/v1``, else ``{"error"}``."""
    if path.startswith("/v1/") or path == "/v1":
        code = {404: "unknown_url", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
        response = OpenAIError(status, message, code=code).response()
        response.headers.update(headers or {})
        return response
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def api_error(request: Request, e: ApiError) -> JSONResponse:
    """A refused request: ``{"error": ...}`` with its status."""
    return error_response(request.url.path, e.status, e.message)


async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """Unknown paths (404), wrong methods (405, with ``Allow``), unreadable bodies: in the API's error shape."""
    detail = e.detail if isinstance(e.detail, str) else json.dumps(e.detail, default=str)
    if e.status_code in (404, 405):
        detail = f"{detail}: {request.method} {request.url.path}"
    return error_response(request.url.path, e.status_code, detail, dict(e.headers or {}))


async def invalid_request(request: Request, e: RequestValidationError) -> JSONResponse:
    """A body that is not JSON (400) or does not fit :class:`ChatRequest` (422), each problem named.

    Under ``/v1`` both are 400s in OpenAI's shape, naming the parameter.
    """
    if request.url.path.startswith("/v1/"):
        return validation_refusal(e)
    errors = e.errors()
    if any(err["type"] == "json_invalid" for err in errors):
        detail = "; ".join(
            f"{err.get('ctx', {}).get('error', err['msg'])} at character {err['loc'][-1]}"
            for err in errors
            if err["type"] == "json_invalid"
        )
        return JSONResponse({"error": f"request body is not valid JSON: {detail}"}, status_code=400)
    msgs = [f"{'.'.join(str(p) for p in err['loc'][1:]) or 'body'}: {err['msg']}" for err in errors]
    return JSONResponse({"error": "invalid request: " + "; ".join(msgs)}, status_code=422)


class BodyLimit:
    """ASGI middleware: a request body over ``limit`` bytes is a 413, read no further than the limit."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    def too_large(self, path: str) -> JSONResponse:
        return error_response(path, 413, f"request body is over {self.limit} bytes (serve.max_body_bytes)")

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.limit:
            return await self.too_large(scope["path"])(scope, receive, send)
        seen = 0

        async def limited() -> dict:  # a chunked body has no length up front: count as it arrives
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:  # FastAPI passes an HTTPException raised while reading the body through
                raise HTTPException(413, f"request body is over {self.limit} bytes (serve.max_body_bytes)")
            return message

        await self.app(scope, limited, send)


def health_report(loaded: Any, cfg: ServeSettings, pool: BatchPool) -> dict[str, Any]:
    """What ``GET /health`` reports: the model, the batch's load, the limits and sampling defaults."""
    return {
        "status": "down" if pool.gone else "ok",
        "error": pool.gone.removeprefix("error: ") if pool.gone else None,
        "model": loaded.name,
        "stage": loaded.stage,
        "step": loaded.meta.get("step"),
        "description": loaded.describe(),
        "device": loaded.device.type,
        "engines": pool.size,
        "batch": pool.batch_report(),
        "active": pool.active,
        "waiting": pool.waiting,
        "served": pool.served,
        "cancelled": pool.cancelled,
        "queued_tokens": pool.queued_tokens(),
        "limits": {
            "max_message_chars": cfg.max_message_chars,
            "max_turns": cfg.max_turns,
            "max_tokens": cfg.max_tokens_limit,
            "max_request_tokens": cfg.max_request_tokens,
            "max_body_bytes": cfg.max_body_bytes,
            "max_stops": cfg.max_stops,
            "max_stop_chars": cfg.max_stop_chars,
            "request_timeout_s": cfg.request_timeout_s,
        },
        "defaults": {"temperature": cfg.temperature, "top_k": cfg.top_k, "max_tokens": cfg.max_tokens},
    }


def reply_summary(parts: list[dict[str, str]], stats: dict[str, Any], t0: float, model_name: str) -> dict[str, Any]:
    """The whole reply: the message, its text as ``chatpipe chat`` shows it, its parts and its stats."""
    text = all(p["type"] == "text" for p in parts)
    content = "".join(p["text"] for p in parts) if text else parts
    shown = io.StringIO()
    show_stream(((p["type"], p["text"]) for p in parts), shown)  # tool calls bracketed, as in the CLI
    return {
        "message": {"role": "assistant", "content": content},
        "text": shown.getvalue().removesuffix("\n"),
        "parts": parts,
        "tokens": stats.get("tokens", 0),
        "finish_reason": stats.get("finish_reason"),
        "seconds": round(time.perf_counter() - t0, 4),
        "model": model_name,
    }


async def reply_events(
    pool: BatchPool, prompt: list[int], stats: dict[str, Any], admission: Admission, kw: dict[str, Any],
    summary: Callable[[list[dict[str, str]]], dict[str, Any]],
) -> AsyncIterator[str]:  # fmt: skip
    """The reply as server-sent events: each delta, then the summary (or the error)."""
    parts: list[dict[str, str]] = []
    try:
        async for _, kind, text, _ in pool.stream(prompt, [stats], admission, **kw):
            if kind != "end":
                append_part(parts, kind, text)
                yield f"data: {json.dumps({'kind': kind, 'text': text})}\n\n"
        yield f"data: {json.dumps({'done': True, **summary(parts)})}\n\n"
    except Exception as e:  # headers are sent: report in-band
        yield f"data: {json.dumps({'error': f'generation failed: {e}'})}\n\n"


async def whole_reply(
    pool: BatchPool, prompt: list[int], stats: dict[str, Any], admission: Admission, kw: dict[str, Any],
    summary: Callable[[list[dict[str, str]]], dict[str, Any]],
) -> dict[str, Any]:  # fmt: skip
    """The reply as one JSON object."""
    parts: list[dict[str, str]] = []
    try:
        async for _, kind, text, _ in pool.stream(prompt, [stats], admission, **kw):
            if kind != "end":
                append_part(parts, kind, text)
    except RuntimeError as e:  # the batch failed it (its process died, a step raised): this API's error shape
        raise ApiError(500, f"generation failed: {e}") from None
    return summary(parts)


async def chat_reply(req: ChatRequest, request: Request, loaded: Any, cfg: ServeSettings, pool: BatchPool) -> Any:
    """Answer ``POST /api/chat``: one JSON object, or a stream of events."""
    check_request(req, cfg)
    messages = [m.model_dump() for m in req.messages]
    max_tokens = req.max_tokens or min(cfg.max_tokens, cfg.max_tokens_limit)
    try:
        prompt = prompt_for(loaded.tokenizer, loaded.model, messages, max_tokens)
    except ValueError as e:  # roles out of order, or too long for the context
        raise ApiError(413 if isinstance(e, ContextTooLong) else 422, str(e)) from None
    admission = pool.check_capacity(max_tokens, len(prompt) + max_tokens)
    top_k = cfg.top_k if req.top_k is None else req.top_k
    kw = dict(
        max_tokens=max_tokens,
        temperature=cfg.temperature if req.temperature is None else req.temperature,
        top_k=top_k or None,
        seed=secrets.randbits(63) if req.seed is None else req.seed,  # no seed: a fresh draw, as OpenAI's API
    )
    stats: dict[str, Any] = {}
    t0 = time.perf_counter()

    def summary(parts: list[dict[str, str]]) -> dict[str, Any]:
        return reply_summary(parts, stats, t0, loaded.name)

    if not req.stream:  # cancelled, like a stream, when the client leaves before it is done
        return await until_disconnected(request, whole_reply(pool, prompt, stats, admission, kw, summary))
    return StreamingResponse(
        reply_events(pool, prompt, stats, admission, kw, summary),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


CHAT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "one JSON object, or with `stream` (the default) server-sent events",
        "content": {"text/event-stream": {"schema": SSE_EVENT}},
    },
    "4XX": {"model": PlainError, "description": "a refused request: 400 not JSON, 413 too long, 422 invalid"},
    503: {"model": PlainError, "description": "the batch is full, or its process is restarting: retry shortly"},
    504: {"model": PlainError, "description": "no reply within serve.request_timeout_s"},
}


def batch_context(model: Any, cfg: ServeSettings) -> int:
    """KV positions per batch row: ``serve.batch_context``, or (0) the longest reply the other limits
    allow after a prompt of the training length, within the model's context."""
    if cfg.batch_context:
        return cfg.batch_context
    return min(context_limit(model), model.config.sequence_len + cfg.max_tokens_limit)


def make_pool(engine: Engine, cfg: ServeSettings, metrics: ServeMetrics) -> BatchPool:
    """The continuous batch of ``serve.batch_rows`` rows, in its supervised process."""
    context = batch_context(engine.model, cfg)
    blocks = -(-cfg.kv_cache_tokens // cfg.kv_block_size)  # 0: batch_rows sequences of the whole context
    kv = {"kv_blocks": blocks, "block_size": cfg.kv_block_size, "max_batch_tokens": cfg.max_batch_tokens}
    return BatchPool(engine, cfg.batch_rows, context, cfg.max_queue, ApiError, cfg.request_timeout_s, metrics, kv)


def create_app(loaded: Any, cfg: ServeSettings) -> FastAPI:
    """The FastAPI app serving ``loaded`` (a :class:`chatpipe.model.loading.Loaded`) under ``cfg``'s limits."""
    engine = Engine(loaded.model, loaded.tokenizer)
    metrics = ServeMetrics()  # this app's own registry
    pool = make_pool(engine, cfg, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        pool.close()  # its batch process stops with the server

    app = FastAPI(title="chatpipe", docs_url="/docs", redoc_url=None, lifespan=lifespan)
    app.state.pool = pool
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.include_router(openai_router(loaded, cfg, pool))  # /v1/...: the OpenAI-compatible API

    @app.get("/api/docs", include_in_schema=False)
    async def old_docs() -> RedirectResponse:  # where the docs page used to be
        return RedirectResponse("/docs")

    @app.get("/", operation_id="chatPage", response_class=HTMLResponse)
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/health", operation_id="health", responses={503: {"description": "the batch process is down"}})
    async def health() -> Any:
        report = health_report(loaded, cfg, pool)
        return JSONResponse(report, status_code=503) if pool.gone else report

    @app.get("/metrics", operation_id="metrics", response_class=Response)
    async def prometheus() -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    @app.post("/api/chat", operation_id="chat", responses=CHAT_RESPONSES)
    async def chat(req: ChatRequest, request: Request):
        return await chat_reply(req, request, loaded, cfg, pool)

    return app


# --------------------------------------------------------------------------- running


def parse_args(argv: list[str] | None) -> ServeSettings:
    """Command-line flags over the params.yaml `serve` section."""
    p = argparse.ArgumentParser(prog="chatpipe serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="base | mid | sft | rl | latest | models:/<name>/<version> | a model dir")
    p.add_argument("--device", help="auto | cpu | cuda")
    p.add_argument("--host", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int)
    p.add_argument("--max-queue", dest="max_queue", type=int)
    p.add_argument("--batch-rows", dest="batch_rows", type=int, help="rows of the running batch")
    p.add_argument("--request-timeout-s", dest="request_timeout_s", type=float, help="longest a request may take")
    p.add_argument(
        "--kv-cache-tokens", dest="kv_cache_tokens", type=int, help="the KV pool in positions (0: rows x context)"
    )
    p.add_argument("--max-batch-tokens", dest="max_batch_tokens", type=int, help="tokens one step may compute")
    p.add_argument("-t", "--temperature", type=float)
    p.add_argument("-k", "--top-k", dest="top_k", type=int)
    p.add_argument("--max-tokens", dest="max_tokens", type=int, help="default new tokens per reply")
    p.add_argument("--max-message-chars", dest="max_message_chars", type=int)
    p.add_argument("--max-turns", dest="max_turns", type=int)
    p.add_argument("--max-tokens-limit", dest="max_tokens_limit", type=int)
    args = vars(p.parse_args(argv))
    return load_section(ServeSettings, {k: v for k, v in args.items() if v is not None})


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``chatpipe serve``."""
    import uvicorn

    from chatpipe.model.loading import load_chat_model
    from chatpipe.runtime import freeze_startup_heap, share_cores

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = parse_args(argv)
        # computing threads x intra-op threads <= cores: the batch's process shares with the event loop
        share_cores(2)
        loaded = load_chat_model(cfg.model, device=cfg.device)
    except (ParamsError, FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"chatpipe serve: {e}", file=sys.stderr)
        return 2
    print(f"serving {loaded.describe()} at http://{cfg.host}:{cfg.port}", flush=True)
    app = create_app(loaded, cfg)
    freeze_startup_heap()  # a full collection would walk torch's, the model's and the app's objects, pausing every stream
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
