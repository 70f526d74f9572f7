"""Stage code deps for dvc.yaml, generated from each stage's import closure so they cannot drift.

A stage's results depend on ``stages/<stage>.py`` and every ``chatpipe`` module it imports,
directly or through other modules, including imports made inside functions, plus the package
``__init__`` files those imports run and any data file in ``chatpipe/`` that one of them names
(e.g. ``core_tasks.yaml``). The files are found by reading the source (``ast``), never by
importing it, so the closure is the same on a machine without torch or a GPU.

    python -m chatpipe.lineage            # rewrite the code deps in dvc.yaml (other deps are kept)
    python -m chatpipe.lineage --check    # exit 1 and list the differences when dvc.yaml is stale
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

from chatpipe.io import atomic_write

CODE_ROOTS = ("chatpipe/", "stages/")


def module_file(root: Path, dotted: str) -> Path | None:
    """The file that defines ``dotted`` (``a.b`` -> ``a/b.py`` or ``a/b/__init__.py``), if it exists."""
    base = root.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_modules(tree: ast.AST) -> set[str]:
    """Dotted names a module imports (``from a import b`` yields ``a`` and ``a.b``; ``b`` may be a submodule)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n.split(".")[0] == "chatpipe"}


def _string_constants(tree: ast.AST) -> set[str]:
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def import_closure(root: Path, entry: Path) -> list[Path]:
    """Every source file ``entry`` runs when imported: itself, chatpipe modules, package inits, named data files."""
    data_files = [p for p in (root / "chatpipe").rglob("*") if p.is_file() and p.suffix not in {".py", ".pyc"}]
    seen: set[Path] = set()
    todo = [entry]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        for dotted in _imported_modules(tree):
            parts = dotted.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__, a/b/__init__ too
                found = module_file(root, ".".join(parts[:i]))
                if found is not None:
                    todo.append(found)
        strings = _string_constants(tree)
        seen.update(p for p in data_files if p.name in strings or any(s.endswith(p.name) for s in strings))
    return sorted(seen, key=lambda p: p.relative_to(root).as_posix())


def stage_code_deps(root: Path, stage: str) -> list[str]:
    """Repo-relative code deps of ``stage`` (``stages/<stage>.py`` and its closure)."""
    entry = root / "stages" / f"{stage}.py"
    return [p.relative_to(root).as_posix() for p in import_closure(root, entry)]


def _is_code_dep(dep: str) -> bool:
    return dep.startswith(CODE_ROOTS) and not dep.startswith("${")


def _load_dvc_yaml(path: Path):
    from ruamel.yaml import YAML  # dvc's own YAML library; round-trips comments

    yaml = YAML()
    yaml.preserve_quotes = True
    yaml.indent(mapping=2, sequence=4, offset=2)
    return yaml, yaml.load(path.read_text())


def stale_deps(root: Path) -> dict[str, tuple[list[str], list[str]]]:
    """``{stage: (missing, extra)}`` code deps of dvc.yaml against the import closure; empty when in sync."""
    _, doc = _load_dvc_yaml(root / "dvc.yaml")
    out = {}
    for stage, spec in doc["stages"].items():
        if not (root / "stages" / f"{stage}.py").is_file():
            continue  # bookkeeping stages (e.g. `profile`) run library code directly; their deps are hand-listed
        listed = {str(d) for d in spec.get("deps", []) if _is_code_dep(str(d))}
        wanted = set(stage_code_deps(root, stage))
        if listed != wanted:
            out[stage] = (sorted(wanted - listed), sorted(listed - wanted))
    return out


def write_deps(root: Path) -> list[str]:
    """Rewrite each stage's code deps in dvc.yaml (other deps and comments kept); returns the stages changed."""
    from ruamel.yaml.comments import CommentedSeq

    yaml, doc = _load_dvc_yaml(root / "dvc.yaml")
    changed = []
    for stage, spec in doc["stages"].items():
        if not (root / "stages" / f"{stage}.py").is_file():
            continue
        old = spec.get("deps", CommentedSeq())
        others = [d for d in old if not _is_code_dep(str(d))]
        new = CommentedSeq(stage_code_deps(root, stage) + others)
        for i, d in enumerate(others):  # keep each non-code dep's trailing comment
            j = list(old).index(d)
            if j in old.ca.items:
                new.ca.items[len(new) - len(others) + i] = old.ca.items[j]
        if list(new) != list(old):
            spec["deps"] = new
            changed.append(stage)
    if changed:
        path = root / "dvc.yaml"
        with atomic_write(path) as f:
            yaml.dump(doc, f)
    return changed


def main(argv: list[str] | None = None) -> int:
    """``python -m chatpipe.lineage [--check] [--root DIR]``."""
    p = argparse.ArgumentParser(prog="chatpipe lineage", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="report stale deps instead of rewriting them (exit 1)")
    p.add_argument("--root", type=Path, default=Path.cwd(), help="repo root (default: the current directory)")
    args = p.parse_args(argv)
    if args.check:
        stale = stale_deps(args.root)
        for stage, (missing, extra) in stale.items():
            print(f"dvc.yaml: stage {stage!r}: missing {missing or '-'}; not imported {extra or '-'}", file=sys.stderr)
        if stale:
            print("run `python -m chatpipe.lineage` to rewrite them", file=sys.stderr)
        return 1 if stale else 0
    changed = write_deps(args.root)
    print(f"dvc.yaml: code deps rewritten for {', '.join(changed)}" if changed else "dvc.yaml: code deps up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
