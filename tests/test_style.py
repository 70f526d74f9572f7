"""ruff keeps the code linted and formatted (pyproject.toml [tool.ruff]); CI runs this with the suite."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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
