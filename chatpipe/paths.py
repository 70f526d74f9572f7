"""Where the pipeline keeps its files, relative to the project root (the stages' working directory)."""

from __future__ import annotations

from pathlib import Path

ARTIFACTS = Path("artifacts")  # DVC-tracked stage outputs
WORK = Path("checkpoints")  # in-progress checkpoints; not DVC outs, so they survive a failed run
