"""The README's layout section matches the tree: every listed module exists, every module is listed."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def layout_paths(readme: str) -> set[str]:
    """Paths named in the README's Layout code block, with their folders joined from the indentation."""
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    paths, stack = set(), []
    for line in block.splitlines():
        m = re.match(r"^( *)(\S+)", line)
        if not m or line.strip().startswith(("custom", "(")):
            continue
        depth, name = len(m.group(1)) // 2, m.group(2).rstrip(",")
        if not re.match(r"^[\w.]+/?$", name):
            continue
        stack = stack[:depth]
        full = "/".join([*stack, name.rstrip("/")])
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
        paths.add(full)
    return paths


def test_every_listed_path_exists_and_every_module_is_listed():
    listed = layout_paths((REPO / "README.md").read_text())
    missing = sorted(p for p in listed if not (REPO / p).exists())
    assert not missing, f"README Layout lists paths that do not exist: {missing}"
    modules = {
        p.relative_to(REPO).as_posix()
        for folder in ("chatpipe", "stages", "flows")
        for p in (REPO / folder).rglob("*.py")
        if p.name != "__init__.py" and "/tasks/" not in p.as_posix()
    }
    unlisted = sorted(m for m in modules if m not in listed)
    assert not unlisted, f"modules missing from the README's Layout section: {unlisted}"
