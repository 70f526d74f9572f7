"""Layers import one way only: flows -> (dvc, torchx) -> stages -> chatpipe, and no two library
subpackages (chatpipe/<pkg>/) import each other, directly or round a longer loop. Tests that can fail."""

from __future__ import annotations

import ast
import re
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
    for folder in ("chatpipe", "stages", "flows"):  # what tests and benches share is theirs alone
        for path in sorted((root / folder).rglob("*.py")):
            if path.relative_to(root).parts[:2] == ("chatpipe", "testing"):
                continue
            bad += [
                f"{path.relative_to(root)}: imports {n}" for n in imports_of(path) if n.startswith("chatpipe.testing")
            ]
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
        "chatpipe/train/step.py": "from chatpipe.model.gpt import GPT\n",
        "chatpipe/data/__init__.py": "",
        "chatpipe/data/tasks/humaneval.py": "import chatpipe.paths\n",
    }
    write_tree(tmp_path, files)
    assert import_cycles(tmp_path) == []
    # model -> train, inside a function; data -> paths.py -> data, through a relative import
    (tmp_path / "chatpipe/model/gpt.py").write_text("def f():\n    from chatpipe.train import step\n")
    (tmp_path / "chatpipe/paths.py").write_text("from .data.tasks import humaneval\n")
    assert import_cycles(tmp_path) == [
        "chatpipe/data -> chatpipe/paths.py -> chatpipe/data (chatpipe/data/tasks/humaneval.py imports chatpipe.paths; "
        "chatpipe/paths.py imports chatpipe.data.tasks)",
        "chatpipe/model -> chatpipe/train -> chatpipe/model (chatpipe/model/gpt.py imports chatpipe.train; "
        "chatpipe/train/step.py imports chatpipe.model.gpt)",
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


# Each folder of entry points and the folders it may not reach, by import or by the module search path:
# tests and benches share helpers through chatpipe/testing/, never each other's files.
APART = {"tests": ("bench", "scripts"), "bench": ("tests",), "scripts": ("tests",)}
PATH_CALLS = {"sys.path.insert", "sys.path.append", "sys.path.extend", "site.addsitedir"}


def _dotted(node: ast.AST) -> str:
    """``sys.path.insert`` for the expression naming that function; '' for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else ""


def search_path_additions(path: Path) -> list[tuple[int, str]]:
    """``(line, source)`` of each place ``path`` adds to the module search path: a ``sys.path`` insert,
    append or extend, ``site.addsitedir``, a ``PYTHONPATH`` value (keyword, dict entry, item assignment,
    ``setenv``), and code written as a string that does one of these (``python -c "...sys.path..."``)."""
    text = path.read_text()
    found = []

    def add(node: ast.AST) -> None:
        found.append((node.lineno, ast.get_source_segment(text, node) or ""))

    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.Call) and _dotted(node.func) in PATH_CALLS:
            add(node)
        elif isinstance(node, ast.Call) and _dotted(node.func).endswith(("setenv", "putenv")) and node.args:
            if isinstance(node.args[0], ast.Constant) and node.args[0].value == "PYTHONPATH":
                add(node)
        elif isinstance(node, ast.keyword) and node.arg == "PYTHONPATH":
            add(node.value)
        elif isinstance(node, ast.Dict):
            found += [
                (v.lineno, ast.get_source_segment(text, v) or "")
                for k, v in zip(node.keys, node.values)
                if isinstance(k, ast.Constant) and k.value == "PYTHONPATH"
            ]
        elif isinstance(node, ast.Assign) and any(
            isinstance(tg, ast.Subscript) and isinstance(tg.slice, ast.Constant) and tg.slice.value == "PYTHONPATH"
            for tg in node.targets
        ):
            add(node.value)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "sys.path" in node.value:
            add(node)
        elif isinstance(node, ast.JoinedStr) and any(
            isinstance(v, ast.Constant) and "sys.path" in v.value for v in node.values
        ):
            add(node)
    return sorted(set(found))


def folder_crossings(root: Path, exempt: tuple[str, ...] = ()) -> list[str]:
    """Every import of, or search-path entry into, a folder that :data:`APART` keeps apart, as
    ``file:line what`` (imports without a line); files in ``exempt`` (repo-relative) are not read."""
    bad = []
    for folder, others in APART.items():
        names = re.compile(rf"(?<![\w.-])({'|'.join(others)})(?![\w-])")  # the folder's name as a path part or word
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            if rel.as_posix() in exempt:
                continue
            bad += [f"{rel}: imports {name}" for name in sorted(imports_of(path)) if name.split(".")[0] in others]
            bad += [
                f"{rel}:{line} puts {names.search(source).group(1)}/ on the module search path: {source}"
                for line, source in search_path_additions(path)
                if names.search(source)
            ]
    return bad


def test_tests_and_benches_import_nothing_from_each_other_nor_put_it_on_the_search_path():
    """What both need lives in chatpipe/testing/; bench scripts and scripts/ are entry points."""
    # this file's own fixtures below are crossings written as strings, on purpose
    assert folder_crossings(REPO, exempt=("tests/test_layering.py",)) == []


# the ways f18dbe9's tree crossed (tests/test_chaos.py, tests/test_gpu_acceptance.py, bench/chaos.py,
# bench/chaos_writes.py, scripts/hub_mirror.py) and the ways a fix might still cross
CROSSINGS = {
    "tests/test_chaos.py": 'sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))\nimport chaos\n',
    "tests/test_gpu.py": 'REPO = Path(".")\nsys.path.append(str(REPO / "bench"))\n',
    "tests/test_env.py": 'env = {"PYTHONPATH": f"{REPO}/scripts"}\nrun(env=dict(PYTHONPATH=str(REPO / "bench")))\n',
    "tests/test_code.py": "code = \"import sys; sys.path.insert(0, 'bench'); import fuzz\"\n",
    "tests/test_set.py": 'def t(monkeypatch):\n    monkeypatch.setenv("PYTHONPATH", "bench")\n    os.environ["PYTHONPATH"] = "scripts"\n',
    "bench/chaos.py": "from tests.project import make_project\n",
    "bench/writes.py": "code = f\"import sys; sys.path.insert(0, {str(REPO / 'tests')!r})\"\n",
    "scripts/hub_mirror.py": "from tests.hub_mirror import Mirror\n",
}
# what stays allowed: the repo root on the path, a word like "benchmark", tests importing tests
ALLOWED = {
    "tests/test_ok.py": 'env = {"PYTHONPATH": str(REPO)}\nsys.path.insert(0, sys.argv[1])\nbenchmark = 1\n'
    "from tests.conftest import REPO\nfrom chatpipe.testing.project import make_project\n",
    "bench/ok.py": "sys.path.insert(0, str(REPO))\nfrom chatpipe.testing.project import make_project\n",
}


def test_crossing_by_import_or_by_the_search_path_is_caught_and_the_repo_root_is_not(tmp_path):
    write_tree(tmp_path, ALLOWED)
    assert folder_crossings(tmp_path) == []
    write_tree(tmp_path, CROSSINGS)
    found = folder_crossings(tmp_path)
    assert [f.split(" ")[0] for f in found] == [
        "tests/test_chaos.py:1",
        "tests/test_code.py:1",
        "tests/test_env.py:1",
        "tests/test_env.py:2",
        "tests/test_gpu.py:2",
        "tests/test_set.py:2",
        "tests/test_set.py:3",
        "bench/chaos.py:",
        "bench/writes.py:1",
        "scripts/hub_mirror.py:",
    ], found
    assert "tests/test_chaos.py:1 puts bench/ on the module search path" in found[0]
    assert found[-1] == "scripts/hub_mirror.py: imports tests.hub_mirror"


def test_only_tests_and_benches_import_the_shared_helpers(tmp_path):
    files = {"chatpipe/model/gpt.py": "import os\n", "chatpipe/testing/project.py": "from chatpipe.model import gpt\n"}
    write_tree(tmp_path, {**files, "stages/rl.py": "import chatpipe.model\n", "flows/pipeline.py": ""})
    assert layering_violations(tmp_path) == []
    write_tree(tmp_path, {"stages/rl.py": "from chatpipe.testing.project import make_project\n"})
    assert layering_violations(tmp_path) == ["stages/rl.py: imports chatpipe.testing.project"]
