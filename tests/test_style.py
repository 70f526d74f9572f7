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
