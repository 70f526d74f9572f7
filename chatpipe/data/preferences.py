"""Preference pairs for the reward model: a chosen and a rejected response to the same prompt.

Three sources, each giving :class:`Pair` rows of token ids (chosen and rejected rendered as whole
conversations, ``<|assistant_end|>`` included, so the reward model scores both at their last token):

    pairs = read_jsonl_pairs(Path("prefs.jsonl"), tok, max_len=256)          # {prompt, chosen, rejected}
    pairs = read_hub_pairs("HuggingFaceH4/ultrafeedback_binarized", None, "train_prefs", tok, max_len=256)
    pairs = contrast_pairs(build_task("tinyworld_arith", "train", limit=256), tok, seed=0)   # tiny, offline
    pairs += ranked_pairs(prompt_ids, samples, verifier_scores, where="...")               # tiny, sampled
    pair_set = tiny_pairs(cfg, tok, sample)   # the reward model stage's tiny train and held-out pairs

Record formats (local JSONL lines and hub rows alike):

- ``{"prompt": str, "chosen": str, "rejected": str}``: one user turn and two assistant replies;
- ``{"prompt": str, "chosen": [messages], "rejected": [messages]}`` (ultrafeedback_binarized):
  ``chosen``/``rejected`` are whole conversations of ``{"role", "content"}`` messages;
- ``{"chosen": str, "rejected": str}`` (hh-rlhf): transcripts of ``\\n\\nHuman: ...`` and
  ``\\n\\nAssistant: ...`` turns.

A record with a missing or empty field, or whose rendered pair is longer than ``max_len`` tokens,
raises ValueError naming the file and line (hub rows: file and row) before any training.
"""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from chatpipe.data.jsonl import iter_jsonl

if TYPE_CHECKING:
    from chatpipe.settings import RewardModelSettings

log = logging.getLogger(__name__)

_TURN = re.compile(r"\n\n(Human|Assistant): ")


class TooLong(ValueError):
    """A pair longer than the context (a ValueError naming the file and line)."""


@dataclass(frozen=True)
class Pair:
    """Token ids of a preferred and a dispreferred conversation, and where the pair came from."""

    chosen: list[int]
    rejected: list[int]
    where: str  # "file:line", "file:row N" or the tiny source that made it
    mistake: str = ""  # tiny contrasts: which mistake the rejected side has (a key of CONTRASTS)


# --------------------------------------------------------------------------- records -> pairs


def _transcript(text: str, where: str, key: str) -> list[dict[str, str]]:
    """hh-rlhf ``\\n\\nHuman: ... \\n\\nAssistant: ...`` text as chat messages."""
    parts = _TURN.split(text)
    if len(parts) < 3 or parts[0].strip():
        raise ValueError(f"{where}: '{key}' is a string but not a '\\n\\nHuman: ...\\n\\nAssistant: ...' transcript")
    roles = {"Human": "user", "Assistant": "assistant"}
    return [{"role": roles[r], "content": c.strip()} for r, c in zip(parts[1::2], parts[2::2])]


def _messages(record: dict[str, Any], key: str, where: str) -> list[dict[str, Any]]:
    """The conversation ``record[key]`` stands for, ending with the assistant's reply."""
    if key not in record:
        raise ValueError(
            f"{where}: missing field '{key}' (a pair needs 'chosen' and 'rejected', and 'prompt' or a transcript)"
        )
    value, prompt = record[key], record.get("prompt")
    if isinstance(value, list):
        msgs = [dict(m) for m in value]
    elif isinstance(value, str) and prompt is None:
        msgs = _transcript(value, where, key)
    elif isinstance(value, str):
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"{where}: field 'prompt' is empty or not a string")
        msgs = [{"role": "user", "content": prompt}, {"role": "assistant", "content": value}]
    else:
        raise ValueError(f"{where}: field '{key}' must be a string or a list of messages, got {type(value).__name__}")
    if not msgs or msgs[-1].get("role") != "assistant" or not str(msgs[-1].get("content") or "").strip():
        raise ValueError(f"{where}: field '{key}' is empty (it needs a non-empty assistant reply)")
    return msgs


def _same_replies(where: str) -> ValueError:
    return ValueError(f"{where}: 'chosen' equals 'rejected'; expected two different replies (the pair teaches nothing)")


def _check_record(record: Any, where: str) -> None:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object with 'chosen' and 'rejected', got {type(record).__name__}")


def check_jsonl_pairs(path: Path | str) -> int:
    """Every record of a pairs file checked without a tokenizer, so before any training: the fields, a
    non-empty reply on each side, chosen unlike rejected; returns how many pairs it holds."""
    n = 0
    for lineno, record in iter_jsonl(path):
        where = f"{path}:{lineno}"
        _check_record(record, where)
        if _messages(record, "chosen", where) == _messages(record, "rejected", where):
            raise _same_replies(where)
        n += 1
    if not n:
        raise ValueError(f"{path}: no preference pairs (the file is empty)")
    return n


def record_pair(record: Any, tok: Any, max_len: int, where: str) -> Pair:
    """The :class:`Pair` of one record, rendered with ``tok``; errors name ``where``."""
    _check_record(record, where)
    ids = {}
    for key in ("chosen", "rejected"):
        msgs = _messages(record, key, where)
        try:
            ids[key], _ = tok.render_conversation({"messages": msgs}, max_tokens=1 << 62)
        except ValueError as e:
            raise ValueError(f"{where}: field '{key}': {e}") from None
        if len(ids[key]) > max_len:
            raise TooLong(
                f"{where}: '{key}' is {len(ids[key])} tokens, longer than the context of {max_len} "
                "(reward_model.max_seq_len); shorten or drop the pair"
            )
    if ids["chosen"] == ids["rejected"]:
        raise _same_replies(where)
    return Pair(ids["chosen"], ids["rejected"], where)


def _collect(rows: Iterable[tuple[str, Any]], tok: Any, max_len: int, limit: int, skip_too_long: bool) -> list[Pair]:
    pairs = []
    for where, record in rows:
        try:
            pairs.append(record_pair(record, tok, max_len, where))
        except TooLong:
            if not skip_too_long:
                raise
        if limit and len(pairs) == limit:
            break
    return pairs


def read_jsonl_pairs(
    path: Path | str, tok: Any, max_len: int, limit: int = 0, skip_too_long: bool = False
) -> list[Pair]:
    """Every pair of a ``{prompt, chosen, rejected}`` JSONL file (the first ``limit``; 0: all); a pair
    over ``max_len`` tokens fails, or with ``skip_too_long`` is left out."""
    rows = ((f"{path}:{lineno}", record) for lineno, record in iter_jsonl(path))
    pairs = _collect(rows, tok, max_len, limit, skip_too_long)
    if not pairs:
        raise ValueError(f"{path}: no preference pairs (the file is empty)")
    return pairs


def read_hub_pairs(
    repo: str, config: str | None, split: str, tok: Any, max_len: int, limit: int = 0, skip_too_long: bool = False
) -> list[Pair]:
    """Pairs of one split of a hub dataset in the chosen/rejected format (through the hub cache,
    ``HF_ENDPOINT`` mirrors included); parquet or JSONL data files."""
    import pyarrow.parquet as pq

    from chatpipe.data import hub

    def rows() -> Iterator[tuple[str, Any]]:
        for path in hub.dataset_split_files(repo, config, split, cache_dir=hub.default_cache_dir()):
            if path.suffix == ".parquet":
                yield from ((f"{repo} {path.name}:row {i}", r) for i, r in enumerate(pq.read_table(path).to_pylist()))
            else:
                yield from ((f"{repo} {path.name}:{n}", r) for n, r in iter_jsonl(path))

    pairs = _collect(rows(), tok, max_len, limit, skip_too_long)
    if not pairs:
        raise ValueError(f"{repo} ({config}/{split}): no preference pairs")
    return pairs


def split_pairs(pairs: Sequence[Pair], val: int, seed: int) -> tuple[list[Pair], list[Pair]]:
    """(train, held-out): ``val`` pairs drawn at random (seeded) are held out, the rest train."""
    if val >= len(pairs):
        raise ValueError(f"{len(pairs)} pairs cannot hold out {val} and keep any to train on; lower val_pairs")
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    held = set(order[:val])
    return [p for i, p in enumerate(pairs) if i not in held], [pairs[i] for i in sorted(held)]


# --------------------------------------------------------------------------- tiny: made offline


def ranked_pairs(prompt: list[int], samples: list[list[int]], scores: list[float], where: str) -> list[Pair]:
    """Pairs from one prompt's samples ranked by the verifier: each better-scored sample against a
    worse one (sample ids include the prompt). Ties give no pair; each sample is used at most once
    on each side, so one prompt adds at most ``len(samples) // 2`` pairs."""
    del prompt  # the samples carry it; kept in the signature so callers say which prompt they rank
    order = sorted(range(len(samples)), key=lambda i: -scores[i])
    top, bottom = order[: len(order) // 2], order[len(order) // 2 :][::-1]
    return [
        Pair(list(samples[i]), list(samples[j]), f"{where}:samples {i}>{j}")
        for i, j in zip(top, bottom)
        if scores[i] > scores[j]
    ]


def _replace_answer(parts: list[dict[str, str]], answer: str, new: str) -> list[dict[str, str]]:
    """Assistant parts with the final text's answer ``answer`` changed to ``new`` (sentence and ``####``)."""
    out = [dict(p) for p in parts]
    last = out[-1]
    last["text"] = last["text"].replace(f"is {answer}.", f"is {new}.").replace(f"#### {answer}", f"#### {new}")
    return out


_CALL = re.compile(r"^(-?[0-9]+)(\+|-|\*|//)([0-9]+)$")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "//": lambda a, b: a // b}


def _last_call(parts: list[dict[str, str]]) -> tuple[int, int, str, int] | None:
    """(index, a, op, b) of the last calculator call ``a op b`` that has its output after it; None if none."""
    calls = [i for i, p in enumerate(parts) if p["type"] == "python"]
    if not calls or calls[-1] + 1 >= len(parts) or parts[calls[-1] + 1]["type"] != "python_output":
        return None
    m = _CALL.match(parts[calls[-1]]["text"].strip())
    return (calls[-1], int(m.group(1)), m.group(2), int(m.group(3))) if m else None


def _wrong_call(parts: list[dict[str, str]], answer: str, rng: random.Random) -> list[dict[str, str]] | None:
    """Assistant parts whose last calculator call has one operand off by 1-3 (misread from the question,
    or the previous result miscopied); its output and the final answer follow that call, so the reply
    agrees with itself and only the question shows it wrong. None if no such change alters the answer."""
    last = _last_call(parts)
    if last is None:
        return None
    at, a, op, b = last
    side, delta = rng.randrange(2), rng.choice([-3, -2, -1, 1, 2, 3])
    for d in (delta, -delta):  # the other direction where the first gives an operand < 1 or the same answer
        x, y = (a + d, b) if side == 0 else (a, b + d)
        if min(x, y) < 1 or (op == "-" and x < y):
            continue
        value = _OPS[op](x, y)
        if str(value) != answer:
            out = _replace_answer(parts, answer, str(value))
            out[at] = {**parts[at], "text": f"{x}{op}{y}"}
            out[at + 1] = {**parts[at + 1], "text": str(value)}
            return out
    return None


def _wrong_op(parts: list[dict[str, str]], answer: str, rng: random.Random) -> list[dict[str, str]] | None:
    """Assistant parts whose last calculator call uses another operation (``+``, ``-`` or ``*`` for the
    one the question asks), carried through to the answer like :func:`_wrong_call`: the reply is as
    long and as well formed as the gold one, so only reading the question tells them apart. None
    where no other operation gives another non-negative answer."""
    last = _last_call(parts)
    if last is None:
        return None
    at, a, op, b = last
    others = [o for o in ("+", "-", "*") if o != op]
    rng.shuffle(others)
    for other in others:
        value = _OPS[other](a, b)
        if value >= 0 and str(value) != answer:
            out = _replace_answer(parts, answer, str(value))
            out[at] = {**parts[at], "text": f"{a}{other}{b}"}
            out[at + 1] = {**parts[at + 1], "text": str(value)}
            return out
    return None


CONTRASTS = ("miscopied", "unformatted", "wrong_call", "wrong_op")


def contrasts(conv: dict[str, Any], rng: random.Random) -> dict[str, dict[str, Any]]:
    """Wrong versions of a solved tiny-world arithmetic conversation by kind (:data:`CONTRASTS`), each
    one the verifier rejects: ``miscopied``, the final answer miscopied from the calculator's result
    (off by -3..+3 or +10); ``unformatted``, the answer without ``####``; ``wrong_call``
    (:func:`_wrong_call`), a wrong last calculator call carried through to the answer; ``wrong_op``
    (:func:`_wrong_op`), the last call with the wrong operation. All but ``unformatted`` keep the
    gold reply's format and (within a token or two) its length, so no shortcut ranks them."""
    user, reply = conv["messages"][0], conv["messages"][-1]
    parts = reply["content"] if isinstance(reply["content"], list) else [{"type": "text", "text": reply["content"]}]
    m = re.search(r"####\s*(-?[0-9]+)", parts[-1]["text"])
    if not m:
        return {}
    answer = m.group(1)
    off = str(int(answer) + rng.choice([-3, -2, -1, 1, 2, 3, 10]))
    unformatted = [dict(p) for p in parts]
    unformatted[-1]["text"] = parts[-1]["text"].split("####")[0].rstrip()
    bad = [_replace_answer(parts, answer, off), unformatted, _wrong_call(parts, answer, rng)]
    bad.append(_wrong_op(parts, answer, rng))
    return {k: {"messages": [user, {"role": "assistant", "content": b}]} for k, b in zip(CONTRASTS, bad) if b}


def contrast_pairs(convs: Sequence[dict[str, Any]], tok: Any, seed: int, where: str = "tiny contrasts") -> list[Pair]:
    """Synthetic pairs: each gold conversation (chosen) against each of its :func:`contrasts` (rejected)."""
    rng = random.Random(seed)
    pairs = []
    for i, conv in enumerate(convs):
        chosen, _ = tok.render_conversation(conv, max_tokens=1 << 62)
        for mistake, bad in contrasts(conv, rng).items():
            rejected, _ = tok.render_conversation(bad, max_tokens=1 << 62)
            pairs.append(Pair(chosen, rejected, f"{where}:{i} {mistake}", mistake))
    return pairs


# --------------------------------------------------------------------------- tiny: the reward model's pair sets

SAMPLED = "sampled"  # the origin of a pair of the init model's own samples, ranked by the verifier
FROM_FILE = "file"  # the origin of every pair read from a user's file or the hub: it names no mistake
# per problem: its prompt ids, its sampled sequences (prompt included) and the verifier's score of each;
# called with the set's name ("train", "held-out") and its problems
Samples = Callable[[str, list[dict[str, Any]]], list[tuple[list[int], list[list[int]], list[float]]]]


@dataclass
class PairSet:
    """Train and held-out pairs and the origin of each: ``file``, ``sampled`` or ``contrast_<mistake>``
    (per-origin held-out accuracy tells which mistakes the reward model catches)."""

    train: list[Pair]
    val: list[Pair]
    val_origins: list[str] = field(default_factory=list)
    train_origins: list[str] = field(default_factory=list)


def tiny_problems(split: str, n: int) -> list[dict]:
    """The ``n`` arithmetic problems tiny pairs are made from: the train split's ``preferences`` part
    (:func:`chatpipe.data.synthetic.preference_problem`), which no other stage reads, or a held-out split."""
    from chatpipe.data.tasks import build_task

    task = build_task("tinyworld_arith", split, limit=n, part="preferences" if split == "train" else None)
    return [task[i] for i in range(min(n, len(task)))]


def tiny_problem_sets(n_train: int, n_held_out: int) -> tuple[list[dict], list[dict]]:
    """(train, held-out) problems of the reward model, both from the train split's ``preferences``
    part and disjoint by question text. Held-out problems used to come from the val split, which RL
    evaluates on: its pass@k and the reward model's accuracy then shared their problems, and the
    reward model's held-out accuracy was measured on the split the RL settings were tuned on. The
    train problems are the same draw as before, so the trained weights do not move; the held-out
    ones are the first ``n_held_out`` of a larger draw that the train set does not hold."""
    train = tiny_problems("train", n_train)
    seen = {c["messages"][0]["content"] for c in train}
    wider = tiny_problems("train", n_train + n_held_out)  # holds at least n_held_out outside ``train``
    held_out = [c for c in wider if c["messages"][0]["content"] not in seen][:n_held_out]
    return train, held_out


def tiny_pairs(cfg: RewardModelSettings, tok: Any, sample: Samples | None) -> PairSet:
    """Tiny-world pairs, from the train split's ``preferences`` problems (:func:`tiny_problem_sets`):
    ``tiny_prompts`` problems make the train pairs, ``tiny_val_problems`` others the held-out ones:
    every sampled pair of those (the kind PPO needs ranked), then their contrasts up to ``val_pairs``
    in all. ``sample`` samples and scores replies to a split's problems (None: contrasts only)."""
    train_convs, held_convs = tiny_problem_sets(cfg.tiny_prompts, cfg.tiny_val_problems)
    train = tiny_split(cfg, tok, sample, "train", train_convs, cfg.tiny_sample_prompts)
    val = tiny_split(cfg, tok, sample, "train", held_convs, len(held_convs), label="held-out")
    random.Random(cfg.seed).shuffle(val)
    sampled = [po for po in val if po[1] == SAMPLED]
    val = sampled + [po for po in val if po[1] != SAMPLED][: max(cfg.val_pairs - len(sampled), 0)]
    return PairSet([p for p, _ in train], [p for p, _ in val], [o for _, o in val], [o for _, o in train])


def tiny_split(
    cfg: RewardModelSettings,
    tok: Any,
    sample: Samples | None,
    split: str,
    convs: int | list[dict],
    n_sampled: int,
    label: str = "",
) -> list[tuple[Pair, str]]:
    """(pair, origin) for the arithmetic problems ``convs`` of ``split`` (an int: that many, from
    :func:`tiny_problems`): synthetic contrasts, then the model's samples on the first ``n_sampled``
    ranked by the task's verifier (a right answer over a wrong or unfinished one), the pairs longer
    than ``max_seq_len`` left out (:func:`fitting`). ``label`` names them in ``where`` (default: the split)."""
    label = label or split
    convs = tiny_problems(split, convs) if isinstance(convs, int) else convs
    made = contrast_pairs(convs, tok, cfg.seed, f"tinyworld_arith/{label} contrast")
    out = [(p, f"contrast_{p.mistake}") for p in made]  # contrast_miscopied, ...
    convs = convs[:n_sampled]  # sampling costs far more than a contrast
    if sample is not None and convs:
        for i, (prompt, seqs, scores) in enumerate(sample(label, convs)):
            where = f"tinyworld_arith/{label} problem {i}"
            out += [(p, SAMPLED) for p in ranked_pairs(prompt, seqs, scores, where)]
    return fitting(out, cfg.max_seq_len, label)


def fitting(pairs: list[tuple[Pair, str]], max_len: int, split: str) -> list[tuple[Pair, str]]:
    """The pairs of at most ``max_len`` tokens: made here, not read from a user's file, so longer ones
    are left out (and counted in the log), not an error."""
    fits = [(p, o) for p, o in pairs if max(len(p.chosen), len(p.rejected)) <= max_len]
    if len(fits) < len(pairs):
        log.info(
            "tiny %s: %d of %d pairs over max_seq_len %d left out", split, len(pairs) - len(fits), len(pairs), max_len
        )
    return fits
