"""Shared test fixtures: repo paths, a params.yaml sandbox, the shared real-data folder."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture
def params_file(tmp_path, monkeypatch) -> Path:
    """A private copy of params.yaml (and profiles.yaml beside it) that CHATPIPE_PARAMS points at; env cleared."""
    for key in list(os.environ):
        if key.startswith("CHATPIPE_"):
            monkeypatch.delenv(key)
    path = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", path)
    shutil.copy(REPO / "profiles.yaml", tmp_path / "profiles.yaml")
    monkeypatch.setenv("CHATPIPE_PARAMS", str(path))
    return path


def require_shared_data() -> Path:
    """The ../shared/data folder, or skip the test with the reason."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real test data not found at {SHARED_DATA} (../shared/data beside the repo)")
    return SHARED_DATA
