"""The cases of bench/fuzz.py and tests/test_fuzz_*.py: hypothesis strategies, how to run one, the oracle.

Only APIs that chatpipe had before these checks are used (load_section, validate_all, Tokenizer.load,
load_chat_model, resume_latest, tokenize_shards, TokenDocs, load_sweep), so the same cases measure an
older checkout too. Outcomes: ``clean``, ``wrong`` (silently wrong), ``traceback``, ``unnamed``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import types
import typing
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

# ---------------------------------------------------------------- settings


def _kinds(annotation: Any) -> set:
    """Scalar types a field admits (bool, int, float, str, None); empty for lists, dicts and models."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_kinds(a) for a in typing.get_args(annotation)))
    if origin is typing.Literal:
        return {str}
    if annotation is type(None):
        return {type(None)}
    return {annotation} if annotation in (bool, int, float, str) else set()


def scalar_keys() -> list[tuple[str, str]]:
    from chatpipe.settings import SECTIONS

    return [
        (section, name)
        for section, cls in sorted(SECTIONS.items())
        for name, field in cls.model_fields.items()
        if _kinds(field.annotation)
    ]


WORDS = ["yes", "no", "on", "off", "true", "false", "True", "8", "8.0", "1e3", " 7 ", "nan", "inf", "-inf", "auto"]
VALUES = st.one_of(
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 2**63 - 1, 2**63, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(WORDS),
    st.text(max_size=6),
    st.none(),
)
SOURCES = ("file", "profile", "other_profile", "env", "cli")


def settings_case() -> st.SearchStrategy:
    keys = scalar_keys()
    sections = sorted({s for s, _ in keys})
    return st.one_of(
        st.tuples(st.just("value"), st.sampled_from(SOURCES), st.sampled_from(keys), VALUES),
        st.tuples(st.just("duplicate"), st.sampled_from(("params.yaml", "profiles.yaml")), st.booleans()),
        st.tuples(st.just("bytes"), st.binary(max_size=48)),
        st.tuples(st.just("nested_env"), st.sampled_from(keys), st.text("ABCXYZ_0", min_size=1, max_size=4)),
        st.tuples(st.just("section"), st.sampled_from(sections), st.sampled_from([[], [1], "text", 3, True])),
    )


def as_text(value: Any) -> str:
    """What a person types for ``value`` in an environment variable or a ``--key=value`` flag."""
    return value if isinstance(value, str) else "null" if value is None else str(value)


def run_settings_case(case: tuple, tmp: Path, repo: Path) -> tuple[str, str]:
    """Run one case on fresh copies of the repo's params.yaml and profiles.yaml; (outcome, detail)."""
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    params, profiles = tmp / "params.yaml", tmp / "profiles.yaml"
    shutil.copy(repo / "params.yaml", params)
    shutil.copy(repo / "profiles.yaml", profiles)
    saved = {k: v for k, v in os.environ.items() if k.startswith("CHATPIPE_")}
    for k in saved:
        del os.environ[k]
    os.environ["CHATPIPE_PARAMS"] = str(params)
    try:
        return _judge_settings(case, params, profiles)
    finally:
        for k in [k for k in os.environ if k.startswith("CHATPIPE_")]:
            del os.environ[k]
        os.environ.update(saved)


def _outcome(call, names: list[str], accepted) -> tuple[str, str]:
    """Run ``call``: a ParamsError naming every one of ``names`` is clean; acceptance is judged by ``accepted``."""
    from chatpipe.settings import ParamsError

    try:
        result = call()
    except ParamsError as e:
        missing = [n for n in names if n not in str(e)]
        return ("unnamed" if missing else "clean"), f"{e} (missing: {missing})"
    except BaseException as e:  # noqa: BLE001 - anything else reaching the user is a traceback (a Rust panic too)
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        return "traceback", f"{type(e).__name__}: {e}"
    ok, why = accepted(result)
    return ("clean" if ok else "wrong"), why


def means_itself(given: Any, loaded: Any, typed: bool, key: str) -> bool:
    """Accepted ``given`` loaded as ``loaded``: does it mean what it says? ``typed``: a YAML value (not text)."""
    if key == "seed" and isinstance(loaded, int) and not 0 <= loaded <= 2**63 - 1:
        return False
    if isinstance(loaded, float) and not math.isfinite(loaded):
        return False
    if not typed or isinstance(given, str):
        if isinstance(loaded, str):
            return loaded == as_text(given)
        text = as_text(given).strip()
        if isinstance(loaded, bool):
            return text.lower() == str(loaded).lower()
        if isinstance(loaded, int):
            return re.fullmatch(r"[+-]?[0-9]+", text) is not None and int(text) == loaded
        if isinstance(loaded, float):
            try:
                return float(text) == loaded
            except ValueError:
                return False
        return loaded == given if isinstance(given, str) else loaded is None and text in ("null", "None", "")
    if isinstance(given, bool) or isinstance(loaded, bool):
        return type(given) is type(loaded) and given == loaded
    if isinstance(given, int):
        return isinstance(loaded, int | float) and loaded == given
    if isinstance(given, float):
        return isinstance(loaded, float) and loaded == given
    return loaded is given  # None


def _judge_settings(case: tuple, params: Path, profiles: Path) -> tuple[str, str]:
    import yaml

    from chatpipe.settings import SECTIONS, load_section, validate_all

    kind = case[0]
    if kind == "value":
        return _judge_value(case, params, profiles)
    if kind == "duplicate":
        path = params if case[1] == "params.yaml" else profiles
        text = path.read_text()
        if path == params:
            extra = "pretrain:\n  depth: 6\n" if case[2] else None
            text = text + extra if extra else text.replace("  depth: 4\n", "  depth: 4\n  depth: 6\n", 1)
        else:
            extra = "  pretrain:\n    depth: 6\n"
            text = (
                text.replace("speedrun:\n", "speedrun:\n" + extra, 1)
                if case[2]
                else text + "speedrun:\n  extends: d20\n"
            )
        path.write_text(text)
        return _outcome(validate_all, [str(path)], lambda _: (False, f"a key given twice in {path.name} was accepted"))
    if kind == "bytes":
        params.write_bytes(case[1])
        try:
            case[1].decode("utf-8")
            utf8 = True
        except UnicodeDecodeError:
            utf8 = False
        return _outcome(validate_all, [str(params)], lambda _: (utf8, f"bytes {case[1]!r} accepted as settings"))
    if kind == "nested_env":
        (section, key), sub = case[1], case[2]
        name = f"CHATPIPE_{section.upper()}__{key.upper()}__{sub}"
        os.environ[name] = "1"
        return _outcome(lambda: load_section(SECTIONS[section]), [name], lambda _: (False, f"{name} silently ignored"))
    section, value = case[1], case[2]  # "section": a section that is not a mapping
    data = yaml.safe_load(params.read_text())
    data[section] = value
    params.write_text(yaml.safe_dump(data))
    return _outcome(validate_all, [str(params)], lambda _: (value == [], f"{section}: {value!r} accepted"))


def _judge_value(case: tuple, params: Path, profiles: Path) -> tuple[str, str]:
    import yaml

    from chatpipe.settings import SECTIONS, load_section, validate_all

    _, source, (section, key), value = case
    cls = SECTIONS[section]
    if source in ("env", "cli"):
        text = as_text(value)
        if "\x00" in text:
            return "clean", "an environment value cannot hold NUL"
        if source == "env":
            name = f"CHATPIPE_{section.upper()}__{key.upper()}"
            os.environ[name] = text
            call, names = (lambda: load_section(cls)), [name]
        else:
            call, names = (lambda: load_section(cls, [f"--{key}={text}"])), [f"--{key}"]
        return _outcome(call, [*names, key], lambda cfg: _faithful(value, cfg, key, False))
    if source == "file":
        data = yaml.safe_load(params.read_text())
        data.setdefault(section, {})[key] = value
        params.write_text(yaml.safe_dump(data))
        return _outcome(lambda: load_section(cls), [str(params), key], lambda cfg: _faithful(value, cfg, key, True))
    data = yaml.safe_load(profiles.read_text())
    data["fz"] = {section: {key: value}}
    profiles.write_text(yaml.safe_dump(data))
    if source == "profile":
        os.environ["CHATPIPE_PROFILE"] = "fz"
        return _outcome(lambda: load_section(cls), [str(profiles), key], lambda cfg: _faithful(value, cfg, key, True))
    reference = _reference(cls, section, key, value, params)  # the same value in params.yaml: accepted?
    return _outcome(
        validate_all, [str(profiles), key], lambda _: (reference, f"{section}.{key}={value!r} in a profile")
    )


def _faithful(value: Any, cfg: Any, key: str, typed: bool) -> tuple[bool, str]:
    loaded = getattr(cfg, key)
    return means_itself(value, loaded, typed, key), f"{key}: {value!r} accepted as {loaded!r}"


def _reference(cls: Any, section: str, key: str, value: Any, params: Path) -> bool:
    """Whether ``value`` at ``section.key`` of params.yaml is accepted and means itself (a copy of the file)."""
    import yaml

    from chatpipe.settings import load_section

    copy = params.with_name("reference.yaml")
    data = yaml.safe_load(params.read_text())
    data.setdefault(section, {})[key] = value
    copy.write_text(yaml.safe_dump(data))
    os.environ["CHATPIPE_PARAMS"] = str(copy)
    try:
        return means_itself(value, getattr(load_section(cls), key), True, key)
    except Exception:  # noqa: BLE001 - refused: so must the profile be
        return False
    finally:
        os.environ["CHATPIPE_PARAMS"] = str(params)


# ---------------------------------------------------------------- damaged files

FORMATS = ("tokenizer", "model", "checkpoint", "tokens", "shard", "sweep")
TEXT = "Mira's pet is a sheep named Moss. What is 12 + 7? 日本"
FINGERPRINT = "fuzz"


def build_artifacts(root: Path, repo: Path) -> dict[str, Any]:
    """One intact artifact of every format under ``root``, and the answer each reader gives for it."""
    import torch

    from chatpipe.data.synthetic import pretrain_documents
    from chatpipe.io import sha256_file
    from chatpipe.model.files import save_model_dir
    from chatpipe.model.gpt import GPT, GPTConfig
    from chatpipe.tokenizer import Tokenizer

    root.mkdir(parents=True)
    tok = Tokenizer.train(pretrain_documents(0, 200), vocab_size=512)
    tok.save(root / "tokenizer")
    config = GPTConfig(sequence_len=64, vocab_size=tok.vocab_size, n_layer=1, n_head=2, n_kv_head=2, n_embd=32)
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    inputs = {"tokenizer": sha256_file(root / "tokenizer" / "tokenizer.json")}
    save_model_dir(
        root / "model", model, {"model_config": config.to_dict(), "stage": "sft", "step": 3, "inputs": inputs}
    )
    _write_checkpoints(root / "checkpoint")
    _write_text_shards(root / "text", pretrain_documents(1, 90))
    shutil.copytree(root / "text", root / "shard")
    from chatpipe.data.tokenstore import tokenize_shards

    tokenize_shards(root / "text", tok, root / "tokens", fingerprint=FINGERPRINT)
    (root / "sweep").mkdir()  # a dir of one file, like the other formats
    shutil.copy(repo / "sweeps" / "isoflop_tiny.yaml", root / "sweep" / "sweep.yaml")
    good = {"root": root, "repo": repo, "answers": {}}
    for fmt in FORMATS:
        good["answers"][fmt] = read(fmt, root / fmt, good)
    shutil.rmtree(root / "checkpoint" / "step_000002")  # what a fallback to step 1 gives
    good["answers"]["checkpoint_previous"] = read("checkpoint", root / "checkpoint", good)
    _write_checkpoints(root / "checkpoint")
    return good


def _tiny_trainer(seed: int = 0):
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return model, [torch.optim.AdamW(model.parameters(), lr=0.1)]


def _write_checkpoints(work: Path) -> None:
    import torch

    from chatpipe.train.checkpoint import save_checkpoint

    shutil.rmtree(work, ignore_errors=True)
    model, opts = _tiny_trainer()
    for step in (1, 2):
        model(torch.ones(2, 4)).sum().backward()
        opts[0].step()
        save_checkpoint(work, step, model=model, optimizers=opts, meta={"fingerprint": FINGERPRINT, "world_size": 1})


def _write_text_shards(directory: Path, docs: list[str]) -> None:
    """train_00000, train_00001, val_00000, written by the data stage's own shard writer."""
    from chatpipe.data.sources import _ShardWriter

    directory.mkdir(parents=True)
    for split, part in (("train", docs[:80]), ("val", docs[80:])):
        writer = _ShardWriter(directory, split, 40)
        for doc in part:
            writer.add(doc)
        writer.flush()


def read(fmt: str, path: Path, good: dict[str, Any]) -> Any:
    """What a reader of ``fmt`` gives for the artifact at ``path``: the answer the oracle compares."""
    import torch

    root = good["root"]
    if fmt == "tokenizer":
        from chatpipe.tokenizer import Tokenizer

        t = Tokenizer.load(path)
        return t.encode(TEXT), t.decode(t.encode(TEXT)), t.vocab_size, t.special_ids
    if fmt == "model":
        from chatpipe.model.loading import load_chat_model

        loaded = load_chat_model(str(path), tokenizer_dir=root / "tokenizer", device="cpu")
        with torch.no_grad():
            return loaded.model(torch.tensor([[loaded.tokenizer.bos_id, 5, 6, 7, 300]])).flatten().tolist()
    if fmt == "checkpoint":
        from chatpipe.train.checkpoint import resume_latest

        model, opts = _tiny_trainer(seed=99)
        meta = resume_latest(path, FINGERPRINT, model=model, optimizers=opts)
        return (meta or {}).get("step"), [p.flatten().tolist() for p in model.parameters()]
    if fmt == "tokens":
        return _read_tokens(path, root)
    if fmt == "shard":
        from chatpipe.data.tokenstore import _shard_texts

        names = ("train_00000", "train_00001", "val_00000")  # each shard the data stage wrote, as a reader asks
        return [t for name in names for batch in _shard_texts(path / f"{name}.parquet", 16) for t in batch]
    from chatpipe.sweep.spec import expand, load_sweep

    return [(p.name, p.params) for p in expand(load_sweep(path / "sweep.yaml"), good["repo"] / "params.yaml")]


def _read_tokens(path: Path, root: Path) -> Any:
    """As the pretrain stage reads its store: tokenize_shards (reuses a current store), then every document."""
    from chatpipe.data.tokenstore import TokenDocs, tokenize_shards
    from chatpipe.tokenizer import Tokenizer

    tokenize_shards(root / "text", Tokenizer.load(root / "tokenizer"), path, fingerprint=FINGERPRINT)
    out = []
    for split in ("train", "val"):
        docs = TokenDocs(path, split)
        out.append([docs.slice(d, int(docs.lengths[d])).tolist() for d in range(len(docs.lengths))])
    return out


JSON_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=False), st.text(max_size=4), st.just({})
)
DAMAGES = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1, exclude_max=True)),
    st.tuples(st.just("flip"), st.floats(0, 1, exclude_max=True), st.integers(0, 7)),
    st.tuples(st.just("overwrite"), st.floats(0, 1, exclude_max=True), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("replace"), st.binary(max_size=64)),
    st.tuples(st.just("delete")),
    st.tuples(st.just("structured"), st.integers(0, 10**6), JSON_VALUES),
)


def file_case(formats: tuple[str, ...] = FORMATS) -> st.SearchStrategy:
    """(format, which file of it, damage)."""
    return st.tuples(st.sampled_from(formats), st.integers(0, 10**6), DAMAGES)


def _damage_structured(path: Path, index: int, value: Any) -> None:
    """A change that keeps the file well-formed: a JSON leaf, an array element, a YAML key or number."""
    import numpy as np

    if path.suffix == ".json":
        data = json.loads(path.read_text())
        leaves = list(_leaves(data, ()))
        if leaves:
            _set(data, leaves[index % len(leaves)], value)
        path.write_text(json.dumps(data, indent=2))
    elif path.suffix == ".npy":
        arr = np.load(path)
        flat = arr.reshape(-1).copy()
        op = index % 4
        if op == 0 and len(flat):
            flat[(index // 4) % len(flat)] = np.iinfo(flat.dtype).max if flat.dtype.kind in "iu" else 7
        elif op == 1 and len(flat) > 2:
            flat[1:-1] += 1
        elif op == 2:
            flat = flat[::-1].copy()
        else:
            flat = flat[:-1]
        np.save(path, flat.reshape(-1, *arr.shape[1:]) if arr.ndim > 1 and len(flat) % arr.shape[1] == 0 else flat)
    elif path.suffix == ".yaml":
        _damage_yaml(path, index)
    else:
        _damage_bytes(path, ("flip", (index % 997) / 997, index % 8))


def _damage_yaml(path: Path, index: int) -> None:
    """Changes a sweep file must be refused for: a key given twice, a NaN, a byte that is not UTF-8."""
    lines = path.read_bytes().splitlines(keepends=True)
    op = index % 3
    keyed = [i for i, line in enumerate(lines) if re.match(rb"\s*\w+:", line)]
    if op == 0 and keyed:
        line = lines[keyed[index // 3 % len(keyed)]]
        dup = line.rstrip() + b" {}\n" if line.rstrip().endswith(b":") else line  # a block key: given empty
        lines.insert(keyed[index // 3 % len(keyed)] + 1, dup)
    elif op == 1:
        text = b"".join(lines)
        path.write_bytes(re.sub(rb"(?<=[ \[])[0-9][0-9.e+]*(?=[,\]\s])", b".nan", text, count=1))
        return
    else:
        i = index // 3 % max(1, len(lines))
        lines.insert(i, b"\xff\xfe")
    path.write_bytes(b"".join(lines))


def _leaves(data: Any, at: tuple) -> Any:
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _leaves(v, (*at, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _leaves(v, (*at, i))
    if at:
        yield at


def _set(data: Any, at: tuple, value: Any) -> None:
    for k in at[:-1]:
        data = data[k]
    data[at[-1]] = value


def _damage_bytes(path: Path, damage: tuple) -> None:
    data = bytearray(path.read_bytes())
    kind = damage[0]
    if kind == "truncate":
        data = data[: int(len(data) * damage[1])]
    elif kind == "flip" and data:
        data[int(len(data) * damage[1])] ^= 1 << damage[2]
    elif kind == "overwrite" and data:
        i = int(len(data) * damage[1])
        data[i : i + len(damage[2])] = damage[2]
    elif kind == "replace":
        data = bytearray(damage[1])
    path.write_bytes(bytes(data))


def damage_file(path: Path, damage: tuple) -> None:
    """Apply one damage of :data:`DAMAGES` to ``path``. Sweep files take only changes that must be
    refused: a byte-level change there may well be another valid sweep, which no reader can tell."""
    if damage[0] == "delete":
        path.unlink()
    elif damage[0] == "structured":
        _damage_structured(path, damage[1], damage[2])
    elif path.suffix == ".yaml" and damage[0] != "replace":
        _damage_yaml(path, int(damage[1] * 1000) if isinstance(damage[1], float) else 0)
    else:
        _damage_bytes(path, damage)


def run_file_case(case: tuple, good: dict[str, Any], work: Path) -> tuple[str, str]:
    """Damage one file of a copy of the intact artifact, read it, judge: (outcome, detail)."""
    fmt, which, damage = case
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(good["root"] / fmt, work / fmt)
    files = sorted(p for p in (work / fmt).rglob("*") if p.is_file())
    target = files[which % len(files)]
    damage_file(target, damage)
    what = f"{fmt}: {target.relative_to(work)} {damage[0]}{damage[1:2]}"
    try:
        answer = read(fmt, work / fmt, good)
    except (ValueError, OSError) as e:
        named = target.name in str(e) or str(work / fmt) in str(e)
        return ("clean" if named else "unnamed"), f"{what}: {type(e).__name__}: {e}"
    except BaseException as e:  # noqa: BLE001 - anything else reaching the user is a traceback (a Rust panic too)
        if isinstance(e, KeyboardInterrupt | SystemExit):
            raise
        return "traceback", f"{what}: {type(e).__name__}: {e}"
    right = answer == good["answers"][fmt]
    if fmt == "checkpoint" and "step_000002" in target.parts:  # falling back to the previous one is right
        right = right or answer == good["answers"]["checkpoint_previous"]
    return ("clean" if right else "wrong"), f"{what}: read without an error, {'same' if right else 'another'} answer"
