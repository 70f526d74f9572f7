"""A local Hugging Face hub for air-gapped runs and tests (tests/hub_mirror.py, which the hub tests use):

python scripts/hub_mirror.py                       # build from ../shared/data into /tmp, serve on a free port
python scripts/hub_mirror.py --data ../shared/data --root /tmp/hubmirror --port 8090
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.hub_mirror import main  # noqa: E402

if __name__ == "__main__":
    main()
