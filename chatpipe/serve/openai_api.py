"""OpenAI-compatible API for ``chatpipe serve``: the official ``openai`` client talks to it unchanged.

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model="sft", messages=[{"role": "user", "content": "hi"}], stream=True)

Endpoints (mounted by chatpipe/serve/app.py):

- ``GET /v1/models``, ``GET /v1/models/{id}``: the one model this server serves (its id is the
  name it was loaded by: ``sft``, ``models:/chatpipe/3``, a directory name).
- ``POST /v1/chat/completions``: ``messages`` rendered by the chat format the model was trained on;
  ``max_tokens`` (or ``max_completion_tokens``), ``temperature``, ``top_p``, ``top_k`` and
  ``min_tokens`` (extensions, as vLLM's: no stop token before ``min_tokens`` tokens), ``stop`` (up to ``serve.max_stops`` strings), ``n``, ``seed``, ``logprobs`` and
  ``top_logprobs`` (0..20), ``stream`` (server-sent events, ``stream_options.include_usage`` adds a
  last chunk with ``usage``). Answers carry ``usage``.
- ``POST /v1/completions``: plain text continuation (meant for base models): ``prompt`` (a string
  or a list of strings), ``echo``, ``logprobs`` (an int, 0..20: the top tokens per position) and
  the sampling fields above.

The model's calculator calls run on the server, as in the web UI. ``content`` is the reply's text
parts; a reply that used the tool also carries its parts (``{"type": "python" | "python_output" |
"text", "text"}``) in the non-standard ``message.parts`` (streamed: ``delta.part``). Assistant
messages sent back may use the same parts as their ``content``.

Request bodies are typed pydantic models (strict: ``"max_tokens": "8"`` is refused, not coerced), so
``/openapi.json`` describes them. Bad requests get OpenAI's error shape, ``{"error": {"message",
"type", "param", "code"}}``, with a 4xx status (413 over ``serve.max_body_bytes``; 503 when every
batch is full or its process is restarting; 504 after ``serve.request_timeout_s``). A request
generates at most ``serve.max_request_tokens`` (prompts x n x max_tokens).

Sampling follows OpenAI's API: without ``seed`` each request draws a fresh random seed; the ``n``
choices of a prompt are one request of ``n`` samples in the batch (their prompt prefilled once),
drawn from one generator seeded with ``seed`` (prompt ``p`` of a completions list: ``seed + p``),
so a seeded request is reproducible and its choices differ; at temperature 0 every choice is the
greedy reply. Log-probs are the model's own (log softmax of its logits, whatever the temperature,
as vLLM reports them), for the tokens the reply sampled (not stop tokens, not the calculator's
forced output; an echoed prompt carries none): chat ``choices[i].logprobs.content`` =
``[{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]``, completions
``choices[i].logprobs`` = ``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``;
streamed, each chunk carries those of its own tokens. A client that leaves stops its generation,
streamed or not.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing, suppress
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from chatpipe.serve.chat import ContextTooLong, append_part, check_fits, prompt_for

MAX_N = 8  # choices per request: each takes a row of the batch
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_SEED = 2**63 - 1  # a signed 64-bit seed (seed + i of n still fits torch's unsigned 64 bits)


class OpenAIError(Exception):
    """A refused request, rendered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        """The JSON error body with its HTTP status."""
        kind = "server_error" if self.status >= 500 else "invalid_request_error"
        kind = "authentication_error" if self.status == 401 else kind
        body = {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


# --------------------------------------------------------------------------- request bodies


def _unicode(text: str) -> str:
    """Refuse text that is not Unicode: JSON's ``\\ud800`` escapes can spell lone surrogates."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode: a lone surrogate at character {e.start}") from None
    return text


Text = Annotated[str, AfterValidator(_unicode)]


class StrictRequest(BaseModel):
    """The base of every request body this server takes (``/v1`` here, ``/api/chat`` in app.py).

    Strict: ``"max_tokens": "8"`` or ``"stream": "yes"`` is refused, never silently coerced. Unknown
    fields are refused too (a misspelt ``max_token`` would otherwise be ignored without a word);
    the fields OpenAI's clients send unasked (``user``, the penalties, ``logprobs``) are declared.
    """

    model_config = ConfigDict(extra="forbid", strict=True)


class ContentPart(StrictRequest):
    type: Literal["text", "python", "python_output"]
    text: Text


class ChatMessage(StrictRequest):
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[ContentPart]
    name: Text | None = None


class StreamOptions(StrictRequest):
    include_usage: bool = False


class _Sampling(StrictRequest):
    model: str
    max_tokens: int | None = Field(None, ge=1, description="new tokens per choice, up to serve.max_tokens_limit")
    temperature: float | None = Field(None, ge=0, le=2, description="0: greedy")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, description="an extension: 0 disables top-k")
    min_tokens: int = Field(0, ge=0, description="an extension (vLLM's): no stop token before this many tokens")
    stop: Text | list[Text] | None = Field(
        None, description="up to serve.max_stops strings of 1..serve.max_stop_chars characters"
    )
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    # accepted so clients that always send them work; only the neutral values are supported
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(None, description="return each sampled token's log-prob")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="with logprobs: the likeliest tokens per position"
    )


class CompletionRequest(_Sampling):
    prompt: Text | list[Text]
    echo: bool = False
    logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS, description="log-probs of the sampled tokens and this many likeliest"
    )


# --------------------------------------------------------------------------- helpers


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error shape: every 4xx and 503 of ``/v1``."""

    error: ErrorDetail


def validation_refusal(e: RequestValidationError) -> JSONResponse:
    """A body that is not JSON or does not fit the request model: a 400 naming the field."""
    err = e.errors()[0]
    # loc is ("body", field, ...): the top-level field is the param (deeper steps name union members)
    param = str(err["loc"][1]) if len(err["loc"]) > 1 else None
    if err["type"] == "json_invalid":
        return OpenAIError(400, f"request body is not valid JSON: {err['msg']}", code="invalid_json").response()
    if err["type"] == "extra_forbidden":
        return OpenAIError(400, f"unrecognized request argument supplied: {param}", param).response()
    if err["type"] == "missing":
        what = f"missing required parameter: {param}" if param else "the request body is missing"
        return OpenAIError(400, what, param).response()
    value = json.dumps(err.get("input"), default=str)[:100]
    where = ".".join(str(p) for p in err["loc"][1:]) or "the body"
    return OpenAIError(400, f"invalid value for {where}: {value}: {err['msg']}", param).response()


def stop_list(stop: str | list[str] | None, cfg: Any) -> list[str]:
    """The stop strings of a request: at most serve.max_stops, each 1..serve.max_stop_chars characters."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > cfg.max_stops:
        raise OpenAIError(400, f"{len(stops)} stop strings; the limit is {cfg.max_stops} (serve.max_stops)", "stop")
    for s in stops:
        if not s or len(s) > cfg.max_stop_chars:
            raise OpenAIError(
                400, f"a stop string of {len(s)} characters; each must have 1..{cfg.max_stop_chars} "
                "(serve.max_stop_chars)", "stop",
            )  # fmt: skip
    return stops


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
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise OpenAIError(400, f"{name}={getattr(req, name)!r} is not supported (only 0 / unset)", name)
    if req.stream_options is not None and not req.stream:
        raise OpenAIError(400, "stream_options is only allowed with stream=true", "stream_options")
    top_k = cfg.top_k if req.top_k is None else req.top_k
    max_tokens = max_tokens or min(cfg.max_tokens, cfg.max_tokens_limit)
    if req.min_tokens > max_tokens:
        raise OpenAIError(400, f"min_tokens={req.min_tokens} is over max_tokens={max_tokens}", "min_tokens")
    return dict(
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        temperature=cfg.temperature if req.temperature is None else req.temperature,
        top_k=top_k or None,
        top_p=req.top_p,
        top_logprobs=top_logprobs(req),
    )


def top_logprobs(req: _Sampling) -> int:
    """The scheduler's ``top_logprobs`` for a request: -1 without log-probs, else how many top tokens."""
    if isinstance(req, CompletionRequest):
        return -1 if req.logprobs is None else req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else -1


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
    kw: dict[str, Any]  # the engine's sampling arguments, stop strings included
    prompts: list[list[int]]
    base: dict[str, Any]  # id, created, model: the same in the answer and in each of its chunks
    tokenizer: Any  # to spell the tokens of log-probs
    seeds: list[int]  # one per prompt
    admission: Any = None  # the request's place in the engine queue until its first choice starts

    def index(self, prompt: int, sample: int) -> int:
        """Choice ``sample`` of prompt ``prompt`` has index p * n + j, as OpenAI numbers them."""
        return prompt * self.req.n + sample

    def echoed(self, index: int) -> str:
        """The prompt that choice ``index`` continues, when the request asks to echo it; else ''."""
        if self.chat or not self.req.echo:
            return ""
        return prompt_texts(self.req)[index // self.req.n]

    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def spell(self, token: int) -> tuple[str, list[int]]:
        """A token as text (undecodable bytes replaced) and its bytes."""
        raw = self.tokenizer.enc.decode_single_token_bytes(token)
        return raw.decode("utf-8", errors="replace"), list(raw)


@dataclass
class Choice:
    """What one choice has so far: its typed parts, its tokens' log-probs, the characters they spell."""

    parts: list[dict[str, str]] = field(default_factory=list)
    lps: list[tuple] = field(default_factory=list)
    offset: int = 0  # completions' text_offset of its next token (the echoed prompt counts)


def logprobs_shape(a: Answer, lps: list[tuple], offset: int) -> tuple[dict[str, Any], int]:
    """OpenAI's ``logprobs`` of the tokens ``lps`` (``(token, log-prob, [(token, log-prob)])``) and the
    text offset after them: chat ``{"content": [...]}``, completions ``{tokens, token_logprobs, ...}``."""
    if a.chat:
        content = []
        for tok, lp, best in lps:
            text, raw = a.spell(tok)
            tops = [dict(zip(("token", "bytes"), a.spell(t)), logprob=v) for t, v in best]
            content.append({"token": text, "logprob": lp, "bytes": raw, "top_logprobs": tops})
        return {"content": content, "refusal": None}, offset
    shape: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tok, lp, best in lps:
        text = a.spell(tok)[0]
        shape["tokens"].append(text)
        shape["token_logprobs"].append(lp)
        shape["top_logprobs"].append({a.spell(t)[0]: v for t, v in best})
        shape["text_offset"].append(offset)
        offset += len(text)
    return shape, offset


def check_budget(num_prompts: int, n: int, max_tokens: int, cfg: Any) -> int:
    """The tokens a request may generate (prompts x n x max_tokens), within serve.max_request_tokens."""
    budget = num_prompts * n * max_tokens
    if budget > cfg.max_request_tokens:
        raise OpenAIError(
            400, f"{num_prompts} prompt(s) x n={n} x max_tokens={max_tokens} = {budget} tokens; the limit "
            f"is {cfg.max_request_tokens} per request (serve.max_request_tokens)", "max_tokens",
        )  # fmt: skip
    return budget


def checked_answer(req: Any, chat: bool, loaded: Any, cfg: Any, pool: Any) -> Answer:
    """Check a request, in the order its errors are reported; 503 when the engine queue is full."""
    kw = check_sampling(req, loaded.name, cfg)
    kw["stop"] = stop_list(req.stop, cfg)
    budget = check_budget(1 if chat else len(prompt_texts(req)), req.n, kw["max_tokens"], cfg)
    if chat:
        prompts = [chat_prompt(req, loaded, cfg, kw["max_tokens"])]
    else:
        prompts = completion_prompts(req, loaded, cfg, kw["max_tokens"])
    admission = pool.check_capacity(budget, max(map(len, prompts)) + kw["max_tokens"], req.n)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    base = {"id": rid, "created": int(time.time()), "model": loaded.name}
    # no seed: a fresh one per prompt (OpenAI's API); a seed: seed + p for prompt p (a completions list)
    seeds = [secrets.randbits(63) if req.seed is None else req.seed + p for p in range(len(prompts))]
    return Answer(chat, req, kw, prompts, base, loaded.tokenizer, seeds, admission)


async def generate(pool: Any, a: Answer, p: int, stats: list[dict]) -> AsyncIterator[tuple]:
    """``(sample, kind, text, log-probs)`` deltas of prompt ``p``'s ``n`` choices, one request of ``n`` samples
    in the batch (cut at stop strings on the batch's reader thread)."""
    admission, a.admission = a.admission, None  # the first prompt takes the request's place in the queue
    kw = {**a.kw, "seed": a.seeds[p], "num_samples": a.req.n}
    async with aclosing(pool.stream(a.prompts[p], stats, admission, **kw)) as pieces:
        async for piece in pieces:
            yield piece


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def choice(a: Answer, index: int, got: Choice, finish: str) -> dict[str, Any]:
    """One choice of a whole answer: the reply's text (the tool's parts too, in ``message.parts``)."""
    parts = got.parts
    content = "".join(p["text"] for p in parts if p["type"] == "text")
    lps = logprobs_shape(a, got.lps, len(a.echoed(index)))[0] if a.kw["top_logprobs"] >= 0 else None
    if not a.chat:
        return {"index": index, "text": a.echoed(index) + content, "finish_reason": finish, "logprobs": lps}
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if any(p["type"] != "text" for p in parts):
        message["parts"] = parts
    return {"index": index, "message": message, "finish_reason": finish, "logprobs": lps}


def failure(e: Exception) -> OpenAIError:
    """A generation that failed (the batch's error, a timeout's 504) as OpenAI's error."""
    status = getattr(e, "status", 500)
    return OpenAIError(status, f"generation failed: {getattr(e, 'message', e)}", code="generation_failed")


async def whole_answer(pool: Any, a: Answer) -> Any:
    """The answer as one JSON object: each prompt's ``n`` choices generated together."""
    choices, completion_tokens, n = [], 0, a.req.n
    try:
        for p in range(len(a.prompts)):
            stats: list[dict[str, Any]] = [{} for _ in range(n)]
            got = [Choice() for _ in range(n)]
            async for j, kind, text, lps in generate(pool, a, p, stats):
                got[j].lps += lps or []
                if kind != "end":
                    append_part(got[j].parts, kind, text)
            for j in range(n):
                completion_tokens += stats[j].get("tokens", 0)
                choices.append(choice(a, a.index(p, j), got[j], stats[j].get("finish_reason", "length")))
    except Exception as e:
        return failure(e).response()
    kind = "chat.completion" if a.chat else "text_completion"
    return {**a.base, "object": kind, "choices": choices, "usage": usage(a.prompt_tokens(), completion_tokens)}


async def until_disconnected(request: Request, answer: Awaitable[Any]) -> Any:
    """Await ``answer``, cancelling it when the client goes away first (its engines stop at the next token).

    A streamed reply notices the disconnect when a send fails; a whole answer sends nothing until
    it is done, so it listens for the ASGI server's ``http.disconnect`` instead.
    """
    task = asyncio.ensure_future(answer)

    async def hang_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(hang_up())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        with suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)  # "client closed request": nobody reads it
    return task.result()


def chunk(a: Answer, choices: list[dict[str, Any]], **extra: Any) -> str:
    """One server-sent event of a streamed answer."""
    kind = "chat.completion.chunk" if a.chat else "text_completion"
    return f"data: {json.dumps({**a.base, 'object': kind, 'choices': choices, **extra})}\n\n"


def delta(a: Answer, index: int, payload: dict[str, Any], finish: str | None = None, lps: Any = None) -> dict[str, Any]:
    """A streamed choice: chat chunks carry ``delta``, completion chunks its ``text``."""
    if a.chat:
        return {"index": index, "delta": payload, "finish_reason": finish, "logprobs": lps}
    return {"index": index, "text": payload.get("content", ""), "finish_reason": finish, "logprobs": lps}


async def events(pool: Any, a: Answer) -> AsyncIterator[str]:
    """The answer's server-sent events: each prompt's choices' deltas as they come (each chunk names its
    choice's ``index``), optional usage, then [DONE]."""
    completion_tokens, n = 0, a.req.n
    try:
        for p in range(len(a.prompts)):
            stats: list[dict[str, Any]] = [{} for _ in range(n)]
            offsets = [len(a.echoed(a.index(p, j))) for j in range(n)]
            for j in range(n):
                if a.chat:
                    yield chunk(a, [delta(a, a.index(p, j), {"role": "assistant", "content": ""})])
                elif a.req.echo:
                    yield chunk(a, [delta(a, a.index(p, j), {"content": a.echoed(a.index(p, j))})])
            async for j, kind, text, lps in generate(pool, a, p, stats):
                index, shaped = a.index(p, j), None
                if lps is not None:
                    shaped, offsets[j] = logprobs_shape(a, lps, offsets[j])
                if kind == "end":
                    if lps:  # tokens that completed no text of their own (a stop string held them)
                        yield chunk(a, [delta(a, index, {"content": ""}, None, shaped)])
                    yield chunk(a, [delta(a, index, {}, stats[j].get("finish_reason", "length"))])
                elif kind == "text":
                    yield chunk(a, [delta(a, index, {"content": text}, None, shaped)])
                elif a.chat:
                    yield chunk(a, [delta(a, index, {"part": {"type": kind, "text": text}}, None, shaped)])
            completion_tokens += sum(s.get("tokens", 0) for s in stats)
        if a.req.stream_options and a.req.stream_options.include_usage:
            yield chunk(a, [], usage=usage(a.prompt_tokens(), completion_tokens))
        yield "data: [DONE]\n\n"
    except Exception as e:  # headers are sent: report in-band, in the error shape
        err = failure(e)
        body = {"message": err.message, "type": "server_error", "param": None, "code": err.code}
        yield f"data: {json.dumps({'error': body})}\n\n"


async def respond(request: Request, req: Any, loaded: Any, cfg: Any, pool: Any) -> Any:
    """Answer a chat or completions request: an error, one JSON object, or a stream of events."""
    chat = isinstance(req, ChatCompletionRequest)
    try:
        answer = checked_answer(req, chat, loaded, cfg, pool)
    except Exception as e:
        return refusal(e, chat)
    if not req.stream:
        return await until_disconnected(request, whole_answer(pool, answer))
    return StreamingResponse(
        events(pool, answer),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


# --------------------------------------------------------------------------- the router

# one server-sent event: a `data:` line holding a JSON chunk (or `[DONE]`)
SSE_EVENT = {"type": "object", "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorBody, "description": "a refused request, in OpenAI's error shape"},
    503: {"model": ErrorBody, "description": "the batch is full, or its process is restarting: retry shortly"},
    504: {"model": ErrorBody, "description": "no answer within serve.request_timeout_s"},
}
STREAMED = {
    200: {
        "description": "one JSON object, or with `stream: true` server-sent events (`data: {chunk}` lines, "
        "then `data: [DONE]`)",
        "content": {"text/event-stream": {"schema": SSE_EVENT}},
    }
}


def openai_router(loaded: Any, cfg: Any, pool: Any) -> APIRouter:
    """Routes under ``/v1`` serving ``loaded`` through the server's engine ``pool`` and limits ``cfg``.

    Unknown paths and wrong methods are the app's 404 and 405, in OpenAI's error shape there too.
    """
    router = APIRouter(prefix="/v1")
    created = int(time.time())
    model_card = {"id": loaded.name, "object": "model", "created": created, "owned_by": "chatpipe"}

    @router.get("/models", operation_id="listModels")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card]}

    @router.get("/models/{model_id:path}", operation_id="retrieveModel", responses={404: ERRORS["4XX"]})
    async def model(model_id: str) -> Any:
        if model_id != loaded.name:
            return OpenAIError(404, f"the model {model_id!r} does not exist", "model", "model_not_found").response()
        return model_card

    @router.post("/chat/completions", operation_id="createChatCompletion", responses={**STREAMED, **ERRORS})
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Any:
        return await respond(request, req, loaded, cfg, pool)

    @router.post("/completions", operation_id="createCompletion", responses={**STREAMED, **ERRORS})
    async def completions(req: CompletionRequest, request: Request) -> Any:
        return await respond(request, req, loaded, cfg, pool)

    return router
