"""Talk to a trained model in the terminal; replies stream token by token.

Run::

    chatpipe chat                          # the most advanced stage in artifacts/ (params.yaml `chat`)
    chatpipe chat --model sft -t 0.8 --top-k 40
    chatpipe chat --model models:/chatpipe/3
    chatpipe chat -p "What is 12 + 7?"     # one reply, then exit
    python -m chatpipe.serve.chat ...            # the same without the console script

Type ``/clear`` to start a new conversation, ``/exit`` (or Ctrl-D) to quit. Calculator calls
the model makes are shown inline as ``[calc: 12+7 = 19]``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from chatpipe.inference.engine import Engine
from chatpipe.settings import ChatSettings, ParamsError, load_section

HELP = "/clear starts a new conversation, /exit quits"


# --------------------------------------------------------------------------- shared with serve.py


def append_part(parts: list[dict[str, str]], kind: str, text: str) -> None:
    """Add a streamed ``(kind, text)`` delta to an assistant message's parts, merging same-kind runs."""
    if parts and parts[-1]["type"] == kind:
        parts[-1]["text"] += text
    else:
        parts.append({"type": kind, "text": text})


class ContextTooLong(ValueError):
    """The conversation plus the reply would not fit in the model's context."""


def context_limit(model: Any) -> int:
    """Most positions (prompt + reply) the model can attend over: the length of its rotary table."""
    return int(model.cos.size(2))


def prompt_for(tokenizer: Any, model: Any, messages: list[dict[str, Any]], max_tokens: int) -> list[int]:
    """Prompt ids for the next assistant reply.

    Raises ValueError for a malformed conversation, :class:`ContextTooLong` when it cannot fit.
    """
    ids = tokenizer.render_for_completion({"messages": messages})
    check_fits(ids, model, max_tokens, "conversation", ": start a new chat or ask for fewer tokens")
    return ids


def check_fits(ids: list[int], model: Any, max_tokens: int, what: str, advice: str = "") -> None:
    """Raise :class:`ContextTooLong` when ``ids`` plus ``max_tokens`` new ones exceed the model's context."""
    limit = context_limit(model)
    if len(ids) + max_tokens > limit:
        raise ContextTooLong(
            f"{what} is {len(ids)} tokens; with max_tokens={max_tokens} that exceeds the "
            f"model's {limit}-token context{advice}"
        )


# --------------------------------------------------------------------------- terminal


def _bracket(prev: str, new: str) -> str:
    """What to print between parts so a tool call reads ``[calc: 12+7 = 19]``."""
    close = "]" if prev != "text" and not (prev == "python" and new == "python_output") else ""
    return close + {"python": "[calc: ", "python_output": " = " if prev == "python" else "[calc = "}.get(new, "")


def show_stream(pieces: Iterator[tuple[str, str]], out: TextIO) -> list[dict[str, str]]:
    """Write deltas to ``out`` as they arrive (tool calls bracketed); return the message parts."""
    parts: list[dict[str, str]] = []
    kind = "text"
    for new_kind, text in pieces:
        if new_kind != kind:
            out.write(_bracket(kind, new_kind))
            kind = new_kind
        out.write(text)
        out.flush()
        append_part(parts, new_kind, text)
    if kind != "text":
        out.write("]")
    out.write("\n")
    out.flush()
    return parts


def reply(engine: Engine, messages: list[dict[str, Any]], cfg: ChatSettings, seed: int, out: TextIO) -> None:
    """Generate, stream and record the assistant's answer to ``messages`` (appended in place)."""
    prompt = prompt_for(engine.tokenizer, engine.model, messages, cfg.max_tokens)
    pieces = engine.stream(
        prompt, max_tokens=cfg.max_tokens, temperature=cfg.temperature, top_k=cfg.top_k or None, seed=seed
    )
    parts = show_stream(pieces, out)
    text_only = all(p["type"] == "text" for p in parts)
    messages.append({"role": "assistant", "content": "".join(p["text"] for p in parts) if text_only else parts})


def parse_args(argv: list[str] | None) -> tuple[ChatSettings, str | None]:
    """Command-line flags over the params.yaml `chat` section; returns (settings, one-shot prompt)."""
    p = argparse.ArgumentParser(prog="chatpipe chat", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="base | mid | sft | rl | latest | models:/<name>/<version> | a model dir")
    p.add_argument("--device", help="auto | cpu | cuda")
    p.add_argument("-t", "--temperature", type=float)
    p.add_argument("-k", "--top-k", dest="top_k", type=int, help="0 disables top-k")
    p.add_argument("--max-tokens", dest="max_tokens", type=int, help="new tokens per reply")
    p.add_argument("--seed", type=int)
    p.add_argument("-p", "--prompt", help="answer this one prompt and exit")
    args = vars(p.parse_args(argv))
    prompt = args.pop("prompt")
    return load_section(ChatSettings, {k: v for k, v in args.items() if v is not None}), prompt


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``chatpipe chat``."""
    from chatpipe.model.loading import load_chat_model  # after flag parsing: --help stays instant

    try:
        cfg, prompt = parse_args(argv)
        loaded = load_chat_model(cfg.model, device=cfg.device)
    except (ParamsError, FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"chatpipe chat: {e}", file=sys.stderr)
        return 2
    if cfg.max_tokens >= context_limit(loaded.model):
        print(
            f"chatpipe chat: --max-tokens {cfg.max_tokens} leaves no room for a prompt in the model's "
            f"{context_limit(loaded.model)}-token context (chat.max_tokens)", file=sys.stderr,
        )  # fmt: skip
        return 2
    engine = Engine(loaded.model, loaded.tokenizer)
    out = sys.stdout
    messages: list[dict[str, Any]] = []
    if prompt is not None:
        try:
            reply(engine, [{"role": "user", "content": prompt}], cfg, cfg.seed, out)
        except ContextTooLong as e:
            print(f"chatpipe chat: {e}", file=sys.stderr)
            return 2
        return 0
    print(f"chatpipe chat: {loaded.describe()}\n{HELP}", flush=True)
    turn = 0
    while True:
        try:
            line = input("\nYou: ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/clear":
            messages = []
            print("(new conversation)")
            continue
        if not line:
            continue
        if line.startswith("/"):
            print(HELP)
            continue
        messages.append({"role": "user", "content": line})
        print("Assistant: ", end="", flush=True)
        try:
            reply(engine, messages, cfg, cfg.seed + turn, out)
        except ValueError as e:
            messages.pop()
            print(f"\n({e})")
        except KeyboardInterrupt:  # Ctrl-C stops this reply, not the session
            messages.pop()
            print("\n(interrupted)")
        turn += 1


if __name__ == "__main__":
    sys.exit(main())
