"""Reading JSON Lines files with errors that name the file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def iter_jsonl(path: Path | str) -> Iterator[tuple[int, Any]]:
    """``(line number, object)`` for every non-blank line of ``path``, read lazily.

    A missing file raises FileNotFoundError and a line that is not JSON raises ValueError,
    both naming the path (and ``path:line``).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    with open(path, "rb") as f:  # decoded per line, so a bad byte is reported with its line
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: not UTF-8 (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                    "re-encode the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: bad JSON line ({e.msg} at column {e.colno})") from None
