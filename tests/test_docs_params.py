"""Settings values the docs quote stay equal to params.yaml (the default profile's file).

A doc quotes a setting's current value in one of two ways, and only these are read (a span such as
``rl.rollout.role: true`` elsewhere shows how to set a key, not what params.yaml holds):

- the words "params.yaml has" and then a code span ``section.key: value``
  (params.yaml has ``reward_model.max_steps: 1400``), the path dotted from a top-level section down
  to the key;
- a row of a table whose header's second cell is ``default``, whose first cell is one such path in
  a code span and whose second cell is one code span (``| `rl.reward.model_dir` | `artifacts/reward_model` |``).

The value is read as YAML and compared with params.yaml's. A quoted path that params.yaml does not
have fails too (the key was renamed or removed). Paths naming no params section are not settings.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
PATH = r"[a-z_]+(?:\.[a-z_0-9]+)+"
INLINE = re.compile(rf"params\.yaml has `({PATH}): ([^`]+)`")
TABLE_ROW = re.compile(rf"^\|\s*`({PATH})`\s*\|\s*`([^`]*)`\s*\|")
DEFAULT_HEADER = re.compile(r"^\|[^|]*\|\s*default\s*\|")
MISSING = object()


def lookup(params: dict, dotted: str):
    node = params
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def quoted_settings(text: str) -> list[tuple[int, str, str]]:
    """``(line, dotted path, quoted value)`` of each quote in ``text`` by the module's two conventions."""
    found = [(text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2)) for m in INLINE.finditer(text)]
    in_defaults = False
    for number, line in enumerate(text.splitlines(), 1):
        in_defaults = bool(DEFAULT_HEADER.match(line)) or (in_defaults and line.startswith("|"))
        m = TABLE_ROW.match(line) if in_defaults else None
        if m:
            found.append((number, m.group(1), m.group(2)))
    return sorted(found)


def stale_quotes(paths: list[Path], params: dict) -> list[str]:
    """``file:line path: quoted (params.yaml: actual)`` for each quote that differs from ``params``."""
    bad = []
    for path in paths:
        for line, dotted, quoted in quoted_settings(path.read_text()):
            if dotted.split(".")[0] not in params:
                continue  # a module path or a metric, not a setting
            actual = lookup(params, dotted)
            where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{line} {dotted}"
            if actual is MISSING:
                bad.append(f"{where}: params.yaml has no such key")
                continue
            try:
                value = yaml.safe_load(quoted)
            except yaml.YAMLError:
                value = quoted
            if value != actual and quoted != str(actual):
                bad.append(f"{where}: {quoted} (params.yaml: {actual!r})")
    return bad


def params() -> dict:
    return yaml.safe_load((REPO / "params.yaml").read_text())


def test_every_setting_the_docs_quote_equals_params_yaml():
    assert stale_quotes(DOCS, params()) == []


def test_a_planted_wrong_value_or_a_gone_key_is_caught_and_other_spans_are_not_read(tmp_path):
    doc = tmp_path / "page.md"
    table = "| key | default | what |\n|---|---|---|\n"
    doc.write_text(
        "Train as params.yaml has `reward_model.max_steps: 1400`.\n"
        f"{table}| `rl.reward.model_dir` | `artifacts/reward_model` | the reward model |\n\n"
        "Not quotes: set `rl.rollout.role: true`; `chatpipe.settings.load: x`, `max_steps` alone.\n"
        "| key | role |\n|---|---|\n| `rl.ref_dir` | `the reference` |\n"
    )
    assert stale_quotes([doc], params()) == []
    doc.write_text(
        "`max_steps` is 1000: params.yaml has `reward_model.max_steps: 1000`.\n"
        f"{table}| `rl.reward.model_dir` | `artifacts/rm` | the reward model |\n"
        "| `reward_model.no_such_key` | `3` | gone |\n"
    )
    got = [line.split(" ", 1)[1] for line in stale_quotes([doc], params())]
    assert got == [
        "reward_model.max_steps: 1000 (params.yaml: 1400)",
        "rl.reward.model_dir: artifacts/rm (params.yaml: 'artifacts/reward_model')",
        "reward_model.no_such_key: params.yaml has no such key",
    ]
