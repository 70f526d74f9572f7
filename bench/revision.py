"""A git revision's tree beside this checkout, for benches that compare the two in processes of their own."""

from __future__ import annotations

import subprocess
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def unpack(revision: str) -> Path:
    """``revision``'s tree in a temporary directory: a process started there (``python -m ...``, or with it
    first on ``PYTHONPATH``) imports that revision's chatpipe instead of this checkout's."""
    out = Path(tempfile.mkdtemp(prefix="chatpipe-baseline-"))
    archive = subprocess.run(["git", "archive", revision], cwd=REPO, check=True, capture_output=True).stdout
    tar = out / "tree.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as t:
        t.extractall(out, filter="data")
    tar.unlink()
    return out
