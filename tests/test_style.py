"""ruff keeps the code linted and formatted (pyproject.toml [tool.ruff]), functions stay short; CI runs this with the suite."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80  # ruff's C901 (pyproject.toml) bounds the branches; this bounds the length


def ruff() -> list[str]:
    exe = Path(sys.executable).parent / "ruff"
    if exe.exists():
        return [str(exe)]
    if shutil.which("ruff"):
        return ["ruff"]
    pytest.skip("ruff is not installed (pip install -e '.[test]')")


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]], ids=["lint", "format"])
def test_ruff(args):
    r = subprocess.run([*ruff(), *args], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, f"ruff {' '.join(args)} (fix: ruff check --fix . && ruff format .):\n{r.stdout}{r.stderr}"


def test_code_speaks_about_chatpipe_not_the_spec_sections():
    """Comments and docstrings state the fact itself, never a pointer to a section of the design doc."""
    cites = ("SPEC " + "\u00a7", "SPEC" + ".md")  # spelled apart so this file does not match itself
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    code = [p for p in tracked if p.endswith((".py", ".yaml", ".toml", ".sh"))]
    hits = [
        f"{path}:{n}"
        for path in code
        for n, line in enumerate((REPO / path).read_text().splitlines(), 1)
        if any(c in line for c in cites)
    ]
    assert not hits, f"state the fact instead of citing the spec: {hits}"


def long_functions(path: Path, root: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (N lines)`` for each function (nested ones too) in ``path`` over ``limit`` lines."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (n := node.end_lineno - node.lineno + 1) > limit
    ]


def test_no_function_is_over_80_lines():
    """The library, stages and flows read as short functions; split a long one into named steps."""
    tracked = subprocess.run(
        ["git", "ls-files", "--", "chatpipe", "stages", "flows"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    offenders = [hit for path in tracked if path.endswith(".py") for hit in long_functions(REPO / path, REPO)]
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(offenders)


def test_long_function_check_catches_81_lines_and_passes_80(tmp_path):
    def function(name: str, lines: int, indent: str = "") -> str:  # a def line, then lines - 1 body lines
        return "\n".join([f"{indent}def {name}():"] + [f"{indent}    x = {i}" for i in range(lines - 1)]) + "\n"

    src = tmp_path / "m.py"
    src.write_text(function("fits", 80) + function("too_long", 81) + "class C:\n" + function("method", 81, "    "))
    assert long_functions(src, tmp_path) == ["m.py:81 too_long (81 lines)", "m.py:163 method (81 lines)"]
