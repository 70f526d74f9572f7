"""Layers import one way only: flows -> (dvc, torchx) -> stages -> chatpipe, and no two library
subpackages (chatpipe/<pkg>/) import each other, directly or round a longer loop. Tests that can fail."""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def imports_of(path: Path, package: str | None = None) -> set[str]:
    """Dotted names ``path`` imports anywhere (module level or inside functions).

    With ``package`` (the dotted package ``path`` sits in), relative imports count too, resolved
    against it; without, they are left out.
    """
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.level == 0 or package is not None):
            here = package.split(".") if node.level else []
            base = here[: len(here) - node.level + 1]  # level 1 is the package itself, each dot more one up
            module = ".".join([*base, *([node.module] if node.module else [])])
            if not module:
                continue
            names.add(module)
            if "." not in module or node.level:  # `from stages import pretrain` imports the module stages.pretrain
                names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def layering_violations(root: Path) -> list[str]:
    """Every import that goes against the layers, as ``file: imports name``."""
    bad = []
    for path in sorted((root / "chatpipe").rglob("*.py")):
        for name in imports_of(path):
            if name.split(".")[0] in {"stages", "flows"}:
                bad.append(f"{path.relative_to(root)}: the library imports {name}")
    for path in sorted((root / "stages").glob("*.py")):
        for name in imports_of(path):
            top = name.split(".")[0]
            if top == "flows" or (top == "stages" and name != "stages"):
                bad.append(f"{path.relative_to(root)}: a stage imports {name}")
    for path in sorted((root / "flows").glob("*.py")):
        for name in imports_of(path):
            if name.split(".")[0] == "stages":
                bad.append(f"{path.relative_to(root)}: a flow imports {name} (flows reach stages through dvc/torchx)")
    return bad


def library_part(root: Path, dotted: str) -> str | None:
    """The part of the library a dotted name belongs to: ``chatpipe/<pkg>`` for a subpackage,
    ``chatpipe/<mod>.py`` for a top-level module; None outside the library or for the package itself."""
    parts = dotted.split(".")
    if parts[0] != "chatpipe" or len(parts) < 2 or parts[1] == "__init__":
        return None
    if (root / "chatpipe" / parts[1]).is_dir():
        return f"chatpipe/{parts[1]}"
    if (root / "chatpipe" / f"{parts[1]}.py").is_file():
        return f"chatpipe/{parts[1]}.py"
    return None


def library_graph(root: Path) -> dict[str, dict[str, str]]:
    """Which library part imports which: ``{part: {imported part: the first file importing it}}``."""
    graph: dict[str, dict[str, str]] = {}
    for path in sorted((root / "chatpipe").rglob("*.py")):
        rel = path.relative_to(root)
        package = ".".join(rel.parent.parts)  # chatpipe/model/gpt.py sits in chatpipe.model
        here = library_part(root, ".".join(rel.with_suffix("").parts))
        if here is None:  # chatpipe/__init__.py
            continue
        for name in sorted(imports_of(path, package)):
            there = library_part(root, name)
            if there is not None and there != here:
                graph.setdefault(here, {}).setdefault(there, f"{rel} imports {name}")
    return graph


def _shortest_loop(graph: dict[str, dict[str, str]], start: str) -> list[str] | None:
    """The shortest import path from ``start`` back to itself, as the parts along it."""
    came_from: dict[str, str] = {}
    todo = deque([start])
    while todo:
        part = todo.popleft()
        for nxt in sorted(graph.get(part, {})):
            if nxt == start:  # walk back from ``part`` to ``start``
                path = [part]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                return [*reversed(path), start]
            if nxt not in came_from:
                came_from[nxt] = part
                todo.append(nxt)
    return None


def import_cycles(root: Path) -> list[str]:
    """Loops of imports through library subpackages, as ``a -> b -> ... -> a (why each step)``:
    the shortest loop through each subpackage that is on one, each loop named once.

    Top-level modules (chatpipe/io.py, chatpipe/paths.py, ...) are shared helpers, not
    subpackages, but a loop that passes through them still counts.
    """
    graph, cycles, seen = library_graph(root), [], set()
    for start in sorted(graph):
        loop = None if start.endswith(".py") else _shortest_loop(graph, start)
        steps = frozenset(zip(loop, loop[1:])) if loop else None
        if steps is None or steps in seen:
            continue
        seen.add(steps)
        why = "; ".join(graph[a][b] for a, b in zip(loop, loop[1:]))
        cycles.append(f"{' -> '.join(loop)} ({why})")
    return cycles


def test_layers_import_one_way():
    assert layering_violations(REPO) == []


def test_a_library_import_of_a_stage_and_a_stage_importing_a_stage_are_caught(tmp_path):
    for rel in ("chatpipe/model/gpt.py", "stages/pretrain.py", "stages/sft.py", "flows/pipeline.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("import os\n")
    assert layering_violations(tmp_path) == []
    (tmp_path / "chatpipe/model/gpt.py").write_text("def f():\n    from stages.pretrain import main\n")
    (tmp_path / "stages/sft.py").write_text("from stages import pretrain\n")
    (tmp_path / "flows/pipeline.py").write_text("import stages.eval\n")
    assert layering_violations(tmp_path) == [
        "chatpipe/model/gpt.py: the library imports stages.pretrain",
        "stages/sft.py: a stage imports stages.pretrain",
        "flows/pipeline.py: a flow imports stages.eval (flows reach stages through dvc/torchx)",
    ]


def write_tree(root: Path, files: dict[str, str]) -> None:
    """A throwaway source tree: each relative path with its text."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_library_subpackages_import_no_cycle():
    assert import_cycles(REPO) == [], "move what both sides need below them (a top-level module) or into one side"


def test_an_import_cycle_between_subpackages_is_caught_and_named(tmp_path):
    files = {
        "chatpipe/__init__.py": "",
        "chatpipe/paths.py": "import os\n",
        "chatpipe/model/__init__.py": "",
        "chatpipe/model/gpt.py": "from chatpipe.paths import ARTIFACTS\n",
        "chatpipe/train/__init__.py": "",
        "chatpipe/train/loop.py": "from chatpipe.model.gpt import GPT\n",
        "chatpipe/data/__init__.py": "",
        "chatpipe/data/tasks/humaneval.py": "import chatpipe.paths\n",
    }
    write_tree(tmp_path, files)
    assert import_cycles(tmp_path) == []
    # model -> train, inside a function; data -> paths.py -> data, through a relative import
    (tmp_path / "chatpipe/model/gpt.py").write_text("def f():\n    from chatpipe.train import loop\n")
    (tmp_path / "chatpipe/paths.py").write_text("from .data.tasks import humaneval\n")
    assert import_cycles(tmp_path) == [
        "chatpipe/data -> chatpipe/paths.py -> chatpipe/data (chatpipe/data/tasks/humaneval.py imports chatpipe.paths; "
        "chatpipe/paths.py imports chatpipe.data.tasks)",
        "chatpipe/model -> chatpipe/train -> chatpipe/model (chatpipe/model/gpt.py imports chatpipe.train; "
        "chatpipe/train/loop.py imports chatpipe.model.gpt)",
    ]


def module_graph(root: Path) -> dict[str, dict[str, str]]:
    """Which library module imports which (anywhere in it, functions included):
    ``{module: {imported module: the name it imports}}``; a package counts as its ``__init__``."""
    modules = {".".join(p.relative_to(root).with_suffix("").parts) for p in (root / "chatpipe").rglob("*.py")}
    modules = {m.removesuffix(".__init__") for m in modules}
    graph: dict[str, dict[str, str]] = {}
    for path in sorted((root / "chatpipe").rglob("*.py")):
        rel = path.relative_to(root)
        here = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        package = ".".join(rel.parent.parts)
        for name in sorted(imports_of(path, package)):
            # `from chatpipe.settings.base import X` names chatpipe.settings.base.X: the longest module prefix
            parts = name.split(".")
            there = next(
                (".".join(parts[:i]) for i in range(len(parts), 0, -1) if ".".join(parts[:i]) in modules), None
            )
            if there and there != here and not here.startswith(f"{there}."):  # a package's modules may use it
                graph.setdefault(here, {}).setdefault(there, name)
    return graph


def module_cycles(root: Path) -> list[str]:
    """Every loop of imports between library modules, each as its shortest round from its first module."""
    graph, cycles, seen = module_graph(root), [], set()
    for start in sorted(graph):
        loop = _shortest_loop(graph, start)
        if not loop or frozenset(loop) in seen:
            continue
        seen.add(frozenset(loop))
        cycles.append(" -> ".join(loop))
    return cycles


def test_no_two_library_modules_import_each_other():
    """Not even inside one subpackage, and not through an import inside a function."""
    assert module_cycles(REPO) == [], "move what both need into a module below them"


def test_a_cycle_inside_a_subpackage_through_a_function_import_is_caught(tmp_path):
    settings = {"__init__": "from .load import load", "params": "import os", "load": "from .params import os"}
    write_tree(tmp_path, {"chatpipe/__init__.py": "", **{f"chatpipe/settings/{m}.py": t for m, t in settings.items()}})
    assert module_cycles(tmp_path) == []
    (tmp_path / "chatpipe/settings/params.py").write_text("def f():\n    from chatpipe.settings.load import g\n")
    assert module_cycles(tmp_path) == ["chatpipe.settings.load -> chatpipe.settings.params -> chatpipe.settings.load"]


def test_tests_import_nothing_from_bench_or_scripts():
    """What a test needs lives in the library or in tests/; bench scripts and scripts/ are entry points."""
    bad = [
        f"{path.relative_to(REPO)}: imports {name}"
        for path in sorted((REPO / "tests").rglob("*.py"))
        for name in imports_of(path)
        if name.split(".")[0] in {"bench", "scripts"}
    ]
    assert bad == []
