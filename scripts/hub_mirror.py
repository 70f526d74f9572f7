"""A local Hugging Face hub for air-gapped runs and tests: small dataset repos served by olah on 127.0.0.1.

    python scripts/hub_mirror.py                       # build from ../shared/data into /tmp, serve on a free port
    python scripts/hub_mirror.py --data ../shared/data --root /tmp/hubmirror --port 8090
    # then, in another shell:
    HF_ENDPOINT=http://127.0.0.1:8090 python -m flows.pipeline --profile rehearsal

The repos, their builder and the server (:class:`Mirror`) live in chatpipe/testing/hub_mirror.py, which the
hub tests use the same way; this is the command line.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chatpipe.testing.hub_mirror import DEFAULT_DATA, Mirror, build_repos  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description="Build small hub dataset repos from shared test data and serve them with olah."
    )
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the shared test data folder")
    p.add_argument("--root", type=Path, default=Path("/tmp/chatpipe-hub"), help="where the repos are built")
    p.add_argument("--port", type=int, default=0, help="0: a free port")
    p.add_argument("--shards", type=int, default=4, help="pretraining parquet shards")
    p.add_argument("--build-only", action="store_true", help="build the repos and exit")
    args = p.parse_args(argv)
    for repo, sha in build_repos(args.data, args.root, args.shards).items():
        print(f"built {repo} @ {sha[:10]}")
    if args.build_only:
        return
    # SIGTERM unwinds like Ctrl-C, so the `with` below stops olah (it runs in its own session).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with Mirror(args.root, args.port) as mirror:
        print(
            f"serving on {mirror.url} (olah log: {mirror.log_path}); Ctrl-C stops it\n  export HF_ENDPOINT={mirror.url}"
        )
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
