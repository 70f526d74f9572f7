"""kill -9 in the middle of chatpipe's file writes: the target is always the old file or the new one.

A writer process rewrites one kind of file over and over through chatpipe's own code, alternating
between two versions (A and B, a few MB each, so a kill often lands mid-write); this script kills it
with SIGKILL at a random moment and checks that every target file is byte-for-byte A or B.

    python bench/chaos_writes.py --trials 5                  # every kind
    python bench/chaos_writes.py --trials 20 --kinds tokenstore

Kinds: tokenizer (``Tokenizer.save``: ranks, token bytes, config), tokenstore (``save_npy_atomic``),
report (the report directory swapped in whole, ``atomic_dir``), settings (``write_profile`` on a
params.yaml); ``--kinds plain`` is the control, ``np.save`` straight onto the file, whose partial
files the check must find. A killed writer leaves its hidden temp file behind (nothing runs after SIGKILL);
those are counted, and the next successful write of the same file is unaffected.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KINDS = ("tokenizer", "tokenstore", "report", "settings")
WRITER = "--writer"  # the first argument of a writer process (kill_trial starts them)
CONTROL = "plain"  # np.save straight onto the target: the check must catch its partial files


def _tokenizers():
    from chatpipe.tokenizer import Tokenizer

    text = [f"the river {i} runs past town {i % 97} and back" for i in range(1500)]
    return Tokenizer.train(text, 400), Tokenizer.train(text, 300)


def write_forever(kind: str, out: Path, writes: int | None = None) -> None:
    """Rewrite ``out``'s files alternating between version A and B until killed (or ``writes`` times)."""
    import numpy as np

    from chatpipe.data.tokenstore import save_npy_atomic
    from chatpipe.io import atomic_dir
    from chatpipe.settings.load import write_profile

    toks = _tokenizers() if kind == "tokenizer" else None
    arrays = [np.zeros(3_000_000, np.uint16), np.ones(1_000_000, np.uint16)]
    if writes is None:
        print("ready", flush=True)
    for i in itertools.count() if writes is None else range(writes):
        v = i % 2
        if kind == "tokenizer":
            toks[v].save(out / "tok")
        elif kind == CONTROL:
            np.save(out / "shard.npy", arrays[v])
        elif kind == "tokenstore":
            save_npy_atomic(out / "shard.npy", arrays[v])
        elif kind == "report":
            with atomic_dir(out / "report") as tmp:
                (tmp / "report.md").write_text(f"# report {'AB'[v]}\n" + "x" * (2_000_000 + v))
                (tmp / "report.json").write_text(json.dumps({"version": "AB"[v]}))
        else:
            write_profile(("tiny", "speedrun")[v], out / "params.yaml")


def versions(kind: str, out: Path) -> dict[str, list[bytes]]:
    """Each target file's allowed contents (A and B), written once by a writer that is not killed."""
    allowed: dict[str, list[bytes]] = {}
    for v in (0, 1):
        ref = out.parent / f"ref{v}"
        shutil.rmtree(ref, ignore_errors=True)
        prepare(kind, ref)
        write_forever(kind, ref, writes=v + 1)  # in this process: the same code, no second start-up
        for path in sorted(p for p in ref.rglob("*") if p.is_file() and not p.name.startswith(".")):
            allowed.setdefault(str(path.relative_to(ref)), []).append(path.read_bytes())
    return allowed


def prepare(kind: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if kind == "settings":  # a params.yaml padded to a few MB, so its rewrite takes a while
        shutil.copy(REPO / "profiles.yaml", out / "profiles.yaml")
        pad = "".join(f"# padding line {i:07d} so a rewrite is not instant\n" for i in range(60_000))
        (out / "params.yaml").write_text((REPO / "params.yaml").read_text() + pad)


def kill_trial(kind: str, out: Path, rng: random.Random) -> None:
    """Start a writer, let it write for a random while, SIGKILL it."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, __file__, WRITER, kind, str(out)], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(rng.uniform(0.05, 1.5))
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def main_writer(argv: list[str]) -> None:
    """The writer process's body: ``WRITER kind out [writes]``."""
    write_forever(argv[0], Path(argv[1]), int(argv[2]) if len(argv) > 2 else None)


def check(out: Path, allowed: dict[str, list[bytes]]) -> tuple[list[str], int]:
    """(target files that are neither A nor B nor absent-before-first-write, hidden temps left)."""
    bad = []
    for rel, contents in allowed.items():
        path = out / rel
        if path.exists() and path.read_bytes() not in contents:
            bad.append(f"{rel}: {path.stat().st_size} bytes, neither version")
    temps = sum(1 for p in out.rglob(".*") if p.name != ".")
    return bad, temps


def run_kind(kind: str, work: Path, trials: int, rng: random.Random) -> dict:
    allowed = versions(kind, work / "refs" / "x")
    out = work / kind
    prepare(kind, out)
    partial: list[str] = []
    for _ in range(trials):
        kill_trial(kind, out, rng)
        partial += check(out, allowed)[0]
    return {"trials": trials, "partial": partial, "temps_left": check(out, allowed)[1], "files": sorted(allowed)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=(*KINDS, CONTROL))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--json", type=Path, help="write the summary here")
    args = ap.parse_args(argv)
    import tempfile

    work = args.work or Path(tempfile.mkdtemp(prefix="chaos-writes-"))
    rng = random.Random(args.seed)
    summary = {kind: run_kind(kind, work / kind, args.trials, rng) for kind in args.kinds}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    if sys.argv[1:2] == [WRITER]:
        main_writer(sys.argv[2:])
    else:
        main()
