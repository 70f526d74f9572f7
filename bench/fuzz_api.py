"""Fuzz the /v1 API of a running chat server: ``python bench/fuzz_api.py [-n 10000] [--src DIR]``.

The campaign (server, generated and hand-made requests, checks) lives in chatpipe/testing/fuzz_api.py, which
tests/test_fuzz_api.py runs briefly in CI; this is its long run. ``campaign`` is re-exported for
bench/fuzz.py's whole table.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chatpipe.testing.fuzz_api import campaign, main  # noqa: E402

__all__ = ["campaign", "main"]

if __name__ == "__main__":
    sys.exit(main())
