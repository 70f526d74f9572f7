"""``python -m chatpipe.settings [SECTION...]``: validate every section, then write the active profile's
overlay files of the named sections (default: all) to profile/ -- dvc.yaml's ``profile`` stage."""

from __future__ import annotations

import sys

from chatpipe.settings.load import validate_all, write_overlays
from chatpipe.settings.params import ParamsError


def main(argv: list[str]) -> int:
    try:
        validate_all()
        for p in write_overlays(argv):  # the sections dvc.yaml's profile stage declares
            print(p)
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
