"""Layers import one way only: flows -> (dvc, torchx) -> stages -> chatpipe. A test that can fail."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def imports_of(path: Path) -> set[str]:
    """Top-level package names ``path`` imports anywhere (module level or inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if "." not in node.module:  # `from stages import pretrain` imports the module stages.pretrain
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
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
