"""Byte-level BPE tokenizer: trained with ``rustbpe``, encoded with ``tiktoken``; chat rendering.

Usage::

    from chatpipe.tokenizer import Tokenizer
    tok = Tokenizer.train(texts, vocab_size=2048)    # texts: any iterable of str
    tok.save("artifacts/tokenizer")
    tok = Tokenizer.load("artifacts/tokenizer")
    ids = tok.encode("hello", prepend=tok.bos_id)
    ids, mask = tok.render_conversation({"messages": [...]})   # mask 1 = train on this token

On disk (one directory)::

    tokenizer.json     {"pattern", "special_tokens": {name: id}, "vocab_size", the sha256 of the two
                       files below and of itself (``checksums``): checked by :meth:`Tokenizer.load`}
    ranks.tiktoken     "<base64 token bytes> <rank>" per line (tiktoken's own format)
    token_bytes.pt     int32 byte length of every id, 0 for specials (for bits-per-byte)

The ``vocab_size`` passed to :meth:`Tokenizer.train` includes the special tokens; they take the
last ids, so ordinary tokens are ``0 .. vocab_size - len(SPECIAL_TOKENS) - 1``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import rustbpe
import tiktoken
import torch

from chatpipe.io import atomic_write, sha256_file, write_bytes_atomic

log = logging.getLogger(__name__)
# rustbpe logs a "Progress: N%" line per 1% of merges (100 lines a run) through Python logging;
# its other lines (counts, start and end of training) stay.
logging.getLogger("rustbpe").addFilter(lambda record: not record.getMessage().startswith("Progress:"))

SPECIAL_TOKENS = [
    "<|bos|>",  # starts every document / conversation
    "<|user_start|>",
    "<|user_end|>",
    "<|assistant_start|>",
    "<|assistant_end|>",
    "<|python_start|>",
    "<|python_end|>",  # the assistant calls the calculator tool
    "<|output_start|>",
    "<|output_end|>",  # the tool's result, inserted by the engine
]

# GPT-4 (cl100k) split pattern, except numbers split into runs of at most 2 digits rather than 3:
# nanochat found that wastes fewer tokens on number chunks when the vocab is small.
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,2}| ?[^\s\p{L}\p{N}]++[\r\n]*"""
    r"""|\s*[\r\n]|\s+(?!\S)|\s+"""
)

CONFIG_FILE = "tokenizer.json"
RANKS_FILE = "ranks.tiktoken"
TOKEN_BYTES_FILE = "token_bytes.pt"


def _config_digest(config: dict[str, Any]) -> str:
    """sha256 of tokenizer.json's content (its own digest left out), for the check at load."""
    sums = {k: v for k, v in (config.get("checksums") or {}).items() if k != CONFIG_FILE}
    body = {**config, "checksums": sums}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _check_sums(directory: Path, config: dict[str, Any], ranks_data: bytes) -> None:
    """The checksums tokenizer.json records (of itself, the ranks and token_bytes.pt) still hold: an
    edited split pattern or rank silently changes every encoding. A tokenizer saved before the
    checksums existed records none and is read as it is."""
    sums = config.get("checksums")
    if sums is None:
        return
    if not isinstance(sums, dict):
        raise ValueError(f"{directory / CONFIG_FILE}: corrupt tokenizer config (checksums is not a mapping)")
    if sums.get(CONFIG_FILE) != _config_digest(config):
        raise ValueError(f"{directory / CONFIG_FILE}: edited or corrupted since it was saved (its checksum differs)")
    actual = {RANKS_FILE: hashlib.sha256(ranks_data).hexdigest()}
    if (directory / TOKEN_BYTES_FILE).is_file():
        actual[TOKEN_BYTES_FILE] = sha256_file(directory / TOKEN_BYTES_FILE)
    for name, digest in actual.items():
        if sums.get(name) != digest:
            raise ValueError(
                f"{directory / name}: sha256 {digest[:12]}... does not match {str(sums.get(name))[:12]}... "
                f"recorded in {directory / CONFIG_FILE} (corrupted or modified); re-run the `tokenizer` stage"
            )


def _parse_ranks(ranks_path: Path, data: bytes) -> dict[bytes, int]:
    """``<base64 token> <rank>`` lines; ranks are distinct and non-negative (tiktoken assumes so)."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(data.splitlines(), start=1):
        try:
            tok, rank = line.split()
            token, value = base64.b64decode(tok, validate=True), int(rank)
        except ValueError as e:  # binascii.Error is a ValueError
            raise ValueError(f"{ranks_path}:{lineno}: corrupt rank line ({e})") from None
        if value < 0 or token in ranks or not token:
            raise ValueError(f"{ranks_path}:{lineno}: corrupt rank line (empty, repeated or negative token)")
        ranks[token] = value
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{ranks_path}: corrupt ranks (not the numbers 0..{len(ranks) - 1}, each once)")
    return ranks


class Tokenizer:
    """A ``tiktoken.Encoding`` with chatpipe's special tokens and chat rendering."""

    def __init__(self, enc: tiktoken.Encoding) -> None:
        missing = [s for s in SPECIAL_TOKENS if s not in enc._special_tokens]
        if missing:
            raise ValueError(f"encoding lacks special tokens {missing}")
        self.enc = enc
        self.special_ids = {name: enc._special_tokens[name] for name in SPECIAL_TOKENS}

    # ------------------------------------------------------------------ build / persist

    @classmethod
    def from_ranks(cls, ranks: dict[bytes, int], pattern: str = SPLIT_PATTERN) -> Tokenizer:
        """Build from mergeable ranks; special tokens get the ids right after the last rank."""
        n = len(ranks)
        specials = {name: n + i for i, name in enumerate(SPECIAL_TOKENS)}
        enc = tiktoken.Encoding(name="chatpipe", pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
        return cls(enc)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, pattern: str = SPLIT_PATTERN) -> Tokenizer:
        """Train byte-level BPE on ``texts``; ``vocab_size`` counts the special tokens too."""
        n_ordinary = vocab_size - len(SPECIAL_TOKENS)
        if n_ordinary < 256:
            raise ValueError(
                f"vocab_size={vocab_size} is too small: need at least "
                f"256 byte tokens + {len(SPECIAL_TOKENS)} special tokens"
            )
        trainer = rustbpe.Tokenizer()
        trainer.train_from_iterator(iter(texts), n_ordinary, pattern=pattern)
        ranks = {bytes(tok): rank for tok, rank in trainer.get_mergeable_ranks()}
        tok = cls.from_ranks(ranks, pattern)
        if tok.vocab_size < vocab_size:
            # Merges never cross regex chunks, so a small-vocabulary corpus (the tiny world) runs
            # out of pairs: every chunk is already one token. Use tok.vocab_size downstream.
            log.warning("BPE ran out of merges: vocab_size %d < requested %d", tok.vocab_size, vocab_size)
        return tok

    def save(self, directory: str | Path) -> None:
        """Write ``tokenizer.json``, ``ranks.tiktoken`` and ``token_bytes.pt`` atomically."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        ranks = self.enc._mergeable_ranks
        lines = [
            f"{base64.b64encode(tok).decode()} {rank}\n" for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])
        ]
        ranks_text = "".join(lines).encode()
        write_bytes_atomic(directory / RANKS_FILE, ranks_text)
        with atomic_write(directory / TOKEN_BYTES_FILE, "wb") as f:
            torch.save(self.token_bytes(), f)
        # The config goes last: its presence means the directory is complete.
        config = {"pattern": self.enc._pat_str, "special_tokens": self.special_ids, "vocab_size": self.vocab_size}
        files = {
            RANKS_FILE: hashlib.sha256(ranks_text).hexdigest(),
            TOKEN_BYTES_FILE: sha256_file(directory / TOKEN_BYTES_FILE),
        }
        config["checksums"] = {**files, CONFIG_FILE: _config_digest(config | {"checksums": files})}
        write_bytes_atomic(directory / CONFIG_FILE, json.dumps(config, indent=2).encode())

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        """Load a directory written by :meth:`save`; errors name the missing, corrupt or edited file."""
        directory = Path(directory)
        config_path, ranks_path = directory / CONFIG_FILE, directory / RANKS_FILE
        for path in (config_path, ranks_path):
            if not path.is_file():
                raise FileNotFoundError(f"{path}: tokenizer file missing; run the `tokenizer` stage first")
        try:
            config = json.loads(config_path.read_bytes())
            pattern, specials, vocab_size = config["pattern"], config["special_tokens"], config["vocab_size"]
        except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError, UnicodeDecodeError are ValueErrors
            raise ValueError(f"{config_path}: corrupt tokenizer config ({e!r})") from None
        ranks_data = ranks_path.read_bytes()
        ranks = _parse_ranks(ranks_path, ranks_data)  # first: a bad line is named by its number
        _check_sums(directory, config, ranks_data)
        try:
            tok = cls.from_ranks(ranks, pattern)
        except (ValueError, TypeError) as e:  # a pattern that is not a regex, ranks that are not a BPE table
            raise ValueError(f"{directory}: tokenizer files do not make a tokenizer ({e})") from None
        if tok.special_ids != specials or tok.vocab_size != vocab_size:
            raise ValueError(
                f"{directory}: {CONFIG_FILE} disagrees with {RANKS_FILE} (vocab {vocab_size} vs {tok.vocab_size})"
            )
        return tok

    # ------------------------------------------------------------------ encode / decode

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included."""
        return self.enc.n_vocab

    @property
    def bos_id(self) -> int:
        """Id of ``<|bos|>``."""
        return self.special_ids["<|bos|>"]

    def encode_special(self, name: str) -> int:
        """Id of a special token such as ``"<|user_start|>"``."""
        try:
            return self.special_ids[name]
        except KeyError:
            raise KeyError(f"unknown special token {name!r}; known: {SPECIAL_TOKENS}") from None

    def encode(
        self, text: str | list[str], prepend: int | str | None = None, num_threads: int = 4
    ) -> list[int] | list[list[int]]:
        """Encode text (special-token strings in it stay ordinary text); a list encodes in parallel.

        ``prepend`` (an id or a special token name) is put before every sequence.
        """
        head = [] if prepend is None else [prepend if isinstance(prepend, int) else self.encode_special(prepend)]
        if isinstance(text, str):
            return head + self.enc.encode_ordinary(text)
        batch = self.enc.encode_ordinary_batch(list(text), num_threads=num_threads)
        return [head + ids for ids in batch] if head else batch  # no per-sequence copy without a head

    def encode_arrays(self, texts: list[str], num_threads: int = 4) -> list[np.ndarray]:
        """Each text's ids as a uint32 array, like ``encode(texts)`` but without building Python int
        lists (bulk tokenizing spent a fifth of its time turning those into arrays)."""

        def one(text: str) -> np.ndarray:
            # nothing disallowed: special-token strings stay ordinary text, as in encode_ordinary
            return self.enc.encode_to_numpy(text, disallowed_special=())

        with ThreadPoolExecutor(num_threads) as pool:  # the BPE releases the GIL
            return list(pool.map(one, texts, chunksize=16))

    def decode(self, ids: Sequence[int]) -> str:
        """Text for ``ids``; special tokens appear as their names, broken UTF-8 as U+FFFD."""
        return self.enc.decode(list(ids))

    def token_bytes(self) -> torch.Tensor:
        """int32 tensor: UTF-8 byte length of every id, 0 for special tokens (for bits-per-byte)."""
        lengths = torch.zeros(self.vocab_size, dtype=torch.int32)
        for tok, rank in self.enc._mergeable_ranks.items():
            lengths[rank] = len(tok)
        return lengths

    # ------------------------------------------------------------------ chat rendering

    def render_conversation(self, conv: dict[str, Any], max_tokens: int = 2048) -> tuple[list[int], list[int]]:
        """Ids and a training mask (1 = assistant-produced token) for one conversation."""
        messages = normalize_messages(conv)
        ids: list[int] = []
        mask: list[int] = []

        def add(tokens: list[int], m: int) -> None:
            ids.extend(tokens)
            mask.extend([m] * len(tokens))

        sp = self.special_ids
        add([self.bos_id], 0)
        for msg in messages:
            if msg["role"] == "user":
                add([sp["<|user_start|>"], *self.encode(msg["content"]), sp["<|user_end|>"]], 0)
                continue
            add([sp["<|assistant_start|>"]], 0)
            for part in assistant_parts(msg["content"]):
                text = self.encode(part["text"])
                if part["type"] == "text":
                    add(text, 1)
                elif part["type"] == "python":
                    add([sp["<|python_start|>"], *text, sp["<|python_end|>"]], 1)
                else:  # python_output: the engine writes it at inference, so never a target
                    add([sp["<|output_start|>"], *text, sp["<|output_end|>"]], 0)
            # Supervising the end token teaches the model when to stop.
            add([sp["<|assistant_end|>"]], 1)
        return ids[:max_tokens], mask[:max_tokens]

    def render_for_completion(self, conv: dict[str, Any]) -> list[int]:
        """Prompt ids for generation: drops a final assistant message, ends with ``<|assistant_start|>``."""
        messages = normalize_messages(conv)
        if messages[-1]["role"] == "assistant":
            messages = messages[:-1]
        ids, _ = self.render_conversation({"messages": messages}, max_tokens=1 << 62)
        return ids + [self.special_ids["<|assistant_start|>"]]


def reply_text(tokenizer: Any, generated: Sequence[int], mask: Sequence[int]) -> tuple[str, bool]:
    """The text of a sampled reply and whether the model ended its turn.

    ``generated`` is a sample's ids after its prompt, ``mask`` their sampled (1) / forced (0) flags.
    The reply ended when its last token is an ``<|assistant_end|>`` the model sampled; that token is
    dropped from the text, any other token kept as decoded. Every reader of sampled replies uses this
    rule: RL rollouts and pass@k, the chat checks, the reward model's sampled pairs.
    """
    end = tokenizer.encode_special("<|assistant_end|>")
    ended = bool(generated) and generated[-1] == end and mask[-1] == 1
    return tokenizer.decode(generated[:-1] if ended else generated), ended


def assistant_parts(content: str | list[dict[str, str]]) -> list[dict[str, str]]:
    """An assistant message's content as a list of ``{"type", "text"}`` parts."""
    return [{"type": "text", "text": content}] if isinstance(content, str) else list(content)


def normalize_messages(conv: dict[str, Any]) -> list[dict[str, Any]]:
    """Validate a conversation and merge a leading system message into the first user message.

    Returns the messages alternating user / assistant, starting with user. Raises ``ValueError``
    naming the (original) message index and the problem.
    """
    messages = conv.get("messages") if isinstance(conv, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ValueError("conversation must be a dict with a non-empty 'messages' list")
    out: list[dict[str, Any]] = []
    start = 0
    system = None
    if messages[0].get("role") == "system":
        system = messages[0].get("content")
        if not isinstance(system, str):
            raise ValueError("message 0: system content must be a string")
        if len(messages) < 2 or messages[1].get("role") != "user":
            raise ValueError("message 1: a system message must be followed by a user message")
        start = 1
    for i in range(start, len(messages)):
        msg = messages[i]
        role, content = msg.get("role"), msg.get("content")
        expected = "user" if (i - start) % 2 == 0 else "assistant"
        if role != expected:
            raise ValueError(
                f"message {i}: expected role {expected!r}, got {role!r} "
                "(roles must alternate user/assistant after an optional leading system)"
            )
        if role == "user":
            if not isinstance(content, str):
                raise ValueError(f"message {i}: user content must be a string")
            if system is not None:
                content, system = f"{system}\n\n{content}", None
        else:
            _check_parts(i, content)
        out.append({"role": role, "content": content})
    return out


def _check_parts(index: int, content: Any) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise ValueError(f"message {index}: assistant content must be a string or a list of parts")
    for j, part in enumerate(content):
        if (
            not isinstance(part, dict)
            or part.get("type") not in ("text", "python", "python_output")
            or not isinstance(part.get("text"), str)
        ):
            raise ValueError(
                f"message {index}, part {j}: expected {{'type': 'text'|'python'|"
                f"'python_output', 'text': str}}, got {part!r}"
            )


# ---------------------------------------------------------------------- evaluation


def _get_encoding(name: str, timeout: float) -> tiktoken.Encoding:
    """tiktoken.get_encoding with a deadline: the first use downloads, and requests has no timeout."""
    result: dict[str, Any] = {}

    def fetch() -> None:
        try:
            result["enc"] = tiktoken.get_encoding(name)
        except Exception as e:  # offline: ConnectionError, DNS failure, ...
            result["err"] = e

    worker = threading.Thread(target=fetch, daemon=True)  # daemon: an abandoned fetch never blocks exit
    worker.start()
    worker.join(timeout)
    if "enc" in result:
        return result["enc"]
    err = result.get("err")
    raise RuntimeError(f"{type(err).__name__}: {err}" if err else f"no answer within {timeout:.0f} s")


def roundtrip_failures(tokenizer: Tokenizer, texts: Sequence[str]) -> list[tuple[int, int]]:
    """``(text index, first differing char)`` of every text for which ``decode(encode(text)) != text``.

    Byte-level BPE keeps every valid string; what breaks the round trip is text that is not valid
    Unicode (a lone surrogate from a ``\\ud800`` escape), which encoding replaces."""
    failures = []
    for i, text in enumerate(texts):
        back = tokenizer.decode(tokenizer.encode(text))
        if back != text:
            at = next((j for j, (a, b) in enumerate(zip(text, back)) if a != b), min(len(text), len(back)))
            failures.append((i, at))
    return failures


def check_corpus(
    tok: Tokenizer, vocab_size: int, sample: Sequence[str], corpus: str | None, n_chars: int
) -> dict[str, int]:
    """The checks of a tokenizer trained on a user's ``corpus`` (its name; None for the generated tiny
    world, which runs out of merges by design and keeps the smaller vocabulary): the corpus held
    enough text for ``vocab_size``, and ``decode(encode(text)) == text`` on every text of ``sample``.
    A failure raises naming the corpus; else the round trip's counts (the stage's metrics)."""
    if corpus is not None and tok.vocab_size < vocab_size:
        raise ValueError(
            f"{corpus}: {n_chars:,} chars of train text are too few for tokenizer.vocab_size={vocab_size}: "
            f"byte-pair merges ran out at {tok.vocab_size} tokens; expected more text, "
            f"or set tokenizer.vocab_size <= {tok.vocab_size}"
        )
    failures = roundtrip_failures(tok, sample)
    if failures:
        i, at = failures[0]
        raise ValueError(
            f"{corpus or 'the pretraining text'}: decode(encode(text)) != text for {len(failures)} of "
            f"{len(sample)} sampled train documents (first: document {i}, char {at}: "
            f"{sample[i][max(0, at - 20) : at + 20]!r}); expected text that is valid Unicode"
        )
    return {"docs": len(sample), "failures": 0}


def compression_report(tokenizer: Tokenizer, text: str, timeout: float = 10.0) -> dict[str, Any]:
    """Bytes per token of ours vs GPT-2 and GPT-4 (cl100k_base) on ``text``.

    A reference tokenizer that cannot be loaded (offline) gets ``{"skipped": reason}``.
    """
    n_bytes = len(text.encode("utf-8"))

    def stats(n_tokens: int) -> dict[str, Any]:
        return {"tokens": n_tokens, "bytes_per_token": n_bytes / max(n_tokens, 1)}

    report: dict[str, Any] = {"bytes": n_bytes, "ours": stats(len(tokenizer.encode(text)))}
    report["ours"]["vocab_size"] = tokenizer.vocab_size
    for name in ("gpt2", "cl100k_base"):
        try:
            enc = _get_encoding(name, timeout)
        except RuntimeError as e:
            report[name] = {"skipped": f"could not load tiktoken encoding {name!r}: {str(e)[:200]}"}
            continue
        report[name] = stats(len(enc.encode_ordinary(text))) | {"vocab_size": enc.n_vocab}
    return report
