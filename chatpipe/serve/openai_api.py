"""OpenAI-compatible API for ``chatpipe serve``: the official ``openai`` client talks to it unchanged.

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model="sft", messages=[{"role": "user", "content": "hi"}], stream=True)

Endpoints (mounted by chatpipe/serve/app.py):

- ``GET /v1/models``, ``GET /v1/models/{id}``: the one model this server serves (its id is the
  name it was loaded by: ``sft``, ``models:/chatpipe/3``, a directory name).
- ``POST /v1/chat/completions``: ``messages`` rendered by the chat format the model was trained on;
  ``max_tokens`` (or ``max_completion_tokens``), ``temperature``, ``top_p``, ``top_k`` (an
  extension), ``stop`` (up to 4 strings), ``n``, ``seed``, ``stream`` (server-sent events,
  ``stream_options.include_usage`` adds a last chunk with ``usage``). Answers carry ``usage``.
- ``POST /v1/completions``: plain text continuation (meant for base models): ``prompt`` (a string
  or a list of strings), ``echo`` and the sampling fields above.

The model's calculator calls run on the server, as in the web UI. ``content`` is the reply's text
parts; a reply that used the tool also carries its parts (``{"type": "python" | "python_output" |
"text", "text"}``) in the non-standard ``message.parts`` (streamed: ``delta.part``). Assistant
messages sent back may use the same parts as their ``content``.

Bad requests get OpenAI's error shape, ``{"error": {"message", "type", "param", "code"}}``, with a
4xx status (503 when every engine is busy and the queue is full). Choice ``i`` of ``n`` samples
with seed ``seed + i``; at temperature 0 every choice is the greedy reply.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from chatpipe.serve.chat import ContextTooLong, append_part, check_fits, prompt_for

MAX_N = 8  # choices per request: each is a full generation on an engine
MAX_STOP = 4  # OpenAI allows up to 4 stop sequences


class OpenAIError(Exception):
    """A refused request, rendered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        """The JSON error body with its HTTP status."""
        kind = {401: "authentication_error", 404: "invalid_request_error", 503: "server_error"}.get(
            self.status, "invalid_request_error"
        )
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


# --------------------------------------------------------------------------- request bodies


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ContentPart(_Strict):
    type: Literal["text", "python", "python_output"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # accepted so clients that always send them work; only the neutral values are supported
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool | int | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    echo: bool = False


# --------------------------------------------------------------------------- helpers


def _parse(model: type[BaseModel], raw: bytes) -> Any:
    """Validate a request body; malformed JSON or bad fields become a 400 naming the field."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise OpenAIError(400, f"request body is not valid JSON: {err['msg']}", code="invalid_json") from None
        param = ".".join(str(p) for p in err["loc"]) or None
        if err["type"] == "extra_forbidden":
            raise OpenAIError(400, f"unrecognized request argument supplied: {param}", param=param) from None
        if err["type"] == "missing":
            raise OpenAIError(400, f"missing required parameter: {param}", param=param) from None
        value = json.dumps(err.get("input"), default=str)[:100]
        raise OpenAIError(400, f"invalid value for {param}: {value}: {err['msg']}", param=param) from None


def stop_list(stop: str | list[str] | None) -> list[str]:
    """The stop strings of a request (at most 4, none empty)."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP or any(not s for s in stops):
        raise OpenAIError(400, f"stop must be up to {MAX_STOP} non-empty strings, got {stops!r}", param="stop")
    return stops


class StopScanner:
    """Cuts a streamed text at the first stop string; holds back a tail that may start one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.pending, self.stopped = stops, "", False

    def feed(self, text: str) -> str:
        """The text now safe to emit; after a stop string, ``stopped`` is set and the rest is dropped."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending, self.stopped = self.pending[: min(hits)], "", True
            return out
        keep = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out) :]
        return out

    def flush(self) -> str:
        """What is held back when the generation ends without a stop string."""
        out, self.pending = self.pending, ""
        return out


def _message_for_engine(msg: ChatMessage) -> dict[str, Any]:
    """An OpenAI message in chatpipe's conversation format (developer = system; user parts joined)."""
    role = "system" if msg.role == "developer" else msg.role
    content = msg.content
    if isinstance(content, list) and role != "assistant":
        if any(p.type != "text" for p in content):
            raise OpenAIError(400, f"{role} content parts must have type 'text'", param="messages")
        content = "".join(p.text for p in content)
    elif isinstance(content, list):
        content = [p.model_dump() for p in content]
    return {"role": role, "content": content}


# --------------------------------------------------------------------------- checking a request


def check_sampling(req: _Sampling, model_name: str, cfg: Any) -> dict[str, Any]:
    """Refuse what this server does not serve; else the engine's sampling keyword arguments."""
    if req.model != model_name:
        raise OpenAIError(
            404, f"the model {req.model!r} does not exist; this server serves {model_name!r}", "model",
            "model_not_found",
        )  # fmt: skip
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if max_tokens is not None and max_tokens > cfg.max_tokens_limit:
        raise OpenAIError(
            400, f"max_tokens={max_tokens} is over this server's limit of {cfg.max_tokens_limit} "
            "(serve.max_tokens_limit)", "max_tokens",
        )  # fmt: skip
    for name in ("presence_penalty", "frequency_penalty", "logprobs"):
        if getattr(req, name):
            raise OpenAIError(400, f"{name}={getattr(req, name)!r} is not supported (only 0 / unset)", name)
    if req.stream_options is not None and not req.stream:
        raise OpenAIError(400, "stream_options is only allowed with stream=true", "stream_options")
    top_k = cfg.top_k if req.top_k is None else req.top_k
    return dict(
        max_tokens=max_tokens or min(cfg.max_tokens, cfg.max_tokens_limit),
        temperature=cfg.temperature if req.temperature is None else req.temperature,
        top_k=top_k or None,
        top_p=req.top_p,
        seed=cfg.seed if req.seed is None else req.seed,
    )


def chat_prompt(req: ChatCompletionRequest, loaded: Any, cfg: Any, max_tokens: int) -> list[int]:
    """The prompt ids of a chat request, within the server's limits on turns and message size."""
    if len(req.messages) > cfg.max_turns:
        raise OpenAIError(
            400, f"{len(req.messages)} messages; the limit is {cfg.max_turns} (serve.max_turns)", "messages"
        )
    messages = [_message_for_engine(m) for m in req.messages]
    for i, m in enumerate(messages):
        n = len(json.dumps(m["content"])) if not isinstance(m["content"], str) else len(m["content"])
        if n > cfg.max_message_chars:
            raise OpenAIError(
                400, f"message {i} is {n} characters; the limit is {cfg.max_message_chars} "
                "(serve.max_message_chars)", "messages",
            )  # fmt: skip
    if messages[-1]["role"] != "user":
        raise OpenAIError(400, "the last message must be from the user", "messages")
    return prompt_for(loaded.tokenizer, loaded.model, messages, max_tokens)


def prompt_texts(req: CompletionRequest) -> list[str]:
    """The prompts of a completions request (one string or a list of them)."""
    return [req.prompt] if isinstance(req.prompt, str) else req.prompt


def completion_prompts(req: CompletionRequest, loaded: Any, cfg: Any, max_tokens: int) -> list[list[int]]:
    """The prompt ids of a completions request, each with room for ``max_tokens`` in the context."""
    texts = prompt_texts(req)
    if not texts or any(len(t) > cfg.max_message_chars for t in texts):
        raise OpenAIError(400, f"prompt must be 1+ strings of at most {cfg.max_message_chars} characters", "prompt")
    prompts = [loaded.tokenizer.encode(t, prepend=loaded.tokenizer.bos_id) for t in texts]
    for p in prompts:
        check_fits(p, loaded.model, max_tokens, "prompt")
    return prompts


def refusal(e: Exception, chat: bool) -> JSONResponse:
    """The error response for an exception raised while checking a request."""
    if isinstance(e, OpenAIError):
        return e.response()
    if isinstance(e, ContextTooLong):
        return OpenAIError(400, str(e), "messages" if chat else "prompt", "context_length_exceeded").response()
    if isinstance(e, ValueError):  # roles out of order, bad assistant parts
        return OpenAIError(400, str(e), "messages").response()
    # the pool's ApiError (503: busy) and friends
    return OpenAIError(getattr(e, "status", 500), getattr(e, "message", str(e))).response()


# --------------------------------------------------------------------------- answering a request


@dataclass
class Answer:
    """A checked request and what every choice of its answer shares."""

    chat: bool  # /chat/completions, else /completions
    req: Any  # ChatCompletionRequest | CompletionRequest
    kw: dict[str, Any]  # the engine's sampling arguments
    stops: list[str]
    prompts: list[list[int]]
    base: dict[str, Any]  # id, created, model: the same in the answer and in each of its chunks

    def jobs(self) -> list[tuple[list[int], int, int]]:
        """(prompt, sample j, choice index): choice j of prompt p has index p * n + j, as OpenAI numbers them."""
        return [(p, j, pi * self.req.n + j) for pi, p in enumerate(self.prompts) for j in range(self.req.n)]

    def echoed(self, index: int) -> str:
        """The prompt that choice ``index`` continues, when the request asks to echo it; else ''."""
        if self.chat or not self.req.echo:
            return ""
        return prompt_texts(self.req)[index // self.req.n]

    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


async def checked_answer(request: Request, chat: bool, loaded: Any, cfg: Any, pool: Any) -> Answer:
    """Parse and check a request body, in the order its errors are reported; 503 when the engine queue is full."""
    req = _parse(ChatCompletionRequest if chat else CompletionRequest, await request.body())
    kw = check_sampling(req, loaded.name, cfg)
    stops = stop_list(req.stop)
    if chat:
        prompts = [chat_prompt(req, loaded, cfg, kw["max_tokens"])]
    else:
        prompts = completion_prompts(req, loaded, cfg, kw["max_tokens"])
    pool.check_capacity()
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    base = {"id": rid, "created": int(time.time()), "model": loaded.name}
    return Answer(chat, req, kw, stops, prompts, base)


async def generate(
    pool: Any, prompt: list[int], kw: dict[str, Any], stops: list[str], index: int, stats: dict
) -> AsyncIterator[tuple[str, str]]:
    """(kind, text) deltas of sample ``index``, cut at a stop string; ``stats`` gets tokens and finish."""
    scanner = StopScanner(stops)
    async with aclosing(pool.stream(prompt, stats, **{**kw, "seed": kw["seed"] + index})) as pieces:
        async for kind, text in pieces:
            if kind != "text":
                yield kind, text
                continue
            if out := scanner.feed(text):
                yield kind, out
            if scanner.stopped:
                stats["finish_reason"] = "stop"
                return  # closing the stream stops the generation at its next token
    if rest := scanner.flush():
        yield "text", rest


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def choice(a: Answer, index: int, parts: list[dict[str, str]], finish: str) -> dict[str, Any]:
    """One choice of a whole answer: the reply's text (the tool's parts too, in ``message.parts``)."""
    content = "".join(p["text"] for p in parts if p["type"] == "text")
    if not a.chat:
        return {"index": index, "text": a.echoed(index) + content, "finish_reason": finish, "logprobs": None}
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if any(p["type"] != "text" for p in parts):
        message["parts"] = parts
    return {"index": index, "message": message, "finish_reason": finish, "logprobs": None}


async def whole_answer(pool: Any, a: Answer) -> Any:
    """The answer as one JSON object, every choice generated in turn."""
    choices, completion_tokens = [], 0
    try:
        for prompt, j, index in a.jobs():
            stats: dict[str, Any] = {}
            parts: list[dict[str, str]] = []
            async for kind, text in generate(pool, prompt, a.kw, a.stops, j, stats):
                append_part(parts, kind, text)
            completion_tokens += stats.get("tokens", 0)
            choices.append(choice(a, index, parts, stats.get("finish_reason", "length")))
    except Exception as e:
        return OpenAIError(500, f"generation failed: {e}", code="generation_failed").response()
    kind = "chat.completion" if a.chat else "text_completion"
    return {**a.base, "object": kind, "choices": choices, "usage": usage(a.prompt_tokens(), completion_tokens)}


def chunk(a: Answer, choices: list[dict[str, Any]], **extra: Any) -> str:
    """One server-sent event of a streamed answer."""
    kind = "chat.completion.chunk" if a.chat else "text_completion"
    return f"data: {json.dumps({**a.base, 'object': kind, 'choices': choices, **extra})}\n\n"


def delta(a: Answer, index: int, payload: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    """A streamed choice: chat chunks carry ``delta``, completion chunks its ``text``."""
    if a.chat:
        return {"index": index, "delta": payload, "finish_reason": finish, "logprobs": None}
    return {"index": index, "text": payload.get("content", ""), "finish_reason": finish, "logprobs": None}


async def events(pool: Any, a: Answer) -> AsyncIterator[str]:
    """The answer's server-sent events: each choice's deltas in turn, optional usage, then [DONE]."""
    completion_tokens = 0
    try:
        for prompt, j, index in a.jobs():
            stats: dict[str, Any] = {}
            if a.chat:
                yield chunk(a, [delta(a, index, {"role": "assistant", "content": ""})])
            elif a.req.echo:
                yield chunk(a, [delta(a, index, {"content": a.echoed(index)})])
            async for part_kind, text in generate(pool, prompt, a.kw, a.stops, j, stats):
                if part_kind == "text":
                    yield chunk(a, [delta(a, index, {"content": text})])
                elif a.chat:
                    yield chunk(a, [delta(a, index, {"part": {"type": part_kind, "text": text}})])
            completion_tokens += stats.get("tokens", 0)
            yield chunk(a, [delta(a, index, {}, stats.get("finish_reason", "length"))])
        if a.req.stream_options and a.req.stream_options.include_usage:
            yield chunk(a, [], usage=usage(a.prompt_tokens(), completion_tokens))
        yield "data: [DONE]\n\n"
    except Exception as e:  # headers are sent: report in-band, in the error shape
        err = {"message": f"generation failed: {e}", "type": "server_error", "param": None, "code": None}
        yield f"data: {json.dumps({'error': err})}\n\n"


async def respond(request: Request, chat: bool, loaded: Any, cfg: Any, pool: Any) -> Any:
    """Answer a chat or completions request: an error, one JSON object, or a stream of events."""
    try:
        answer = await checked_answer(request, chat, loaded, cfg, pool)
    except Exception as e:
        return refusal(e, chat)
    if not answer.req.stream:
        return await whole_answer(pool, answer)
    return StreamingResponse(
        events(pool, answer),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


# --------------------------------------------------------------------------- the router


def openai_router(loaded: Any, cfg: Any, pool: Any) -> APIRouter:
    """Routes under ``/v1`` serving ``loaded`` through the server's engine ``pool`` and limits ``cfg``."""
    router = APIRouter(prefix="/v1")
    created = int(time.time())
    model_card = {"id": loaded.name, "object": "model", "created": created, "owned_by": "chatpipe"}

    @router.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card]}

    @router.get("/models/{model_id:path}")
    async def model(model_id: str) -> Any:
        if model_id != loaded.name:
            return OpenAIError(404, f"the model {model_id!r} does not exist", "model", "model_not_found").response()
        return model_card

    @router.post("/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await respond(request, True, loaded, cfg, pool)

    @router.post("/completions")
    async def completions(request: Request) -> Any:
        return await respond(request, False, loaded, cfg, pool)

    @router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def unknown(path: str, request: Request) -> JSONResponse:
        return OpenAIError(404, f"unknown endpoint {request.method} /v1/{path}", code="unknown_url").response()

    return router
