"""The one parent-death helper: it works, and nothing else calls prctl."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# The middle process starts a grandchild that asks for SIGKILL on its parent's death, prints its
# PID and sleeps; the middle process then exits at once, which must take the grandchild along.
_MIDDLE = r"""
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c",
    "import os, signal, sys, time\n"
    "from chatpipe.procs import die_with_parent, parent_gone\n"
    "parent = os.getppid()\n"
    "assert die_with_parent(signal.SIGKILL) and not parent_gone(parent)\n"
    "print(os.getpid(), flush=True)\n"
    "time.sleep(60)\n"], stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), flush=True)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_child_dies_with_its_parent():
    out = subprocess.run([sys.executable, "-c", _MIDDLE], capture_output=True, text=True, timeout=30, cwd=REPO)
    pid = int(out.stdout.strip())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(pid)
    if alive:
        os.kill(pid, 9)
    assert not alive, "the grandchild outlived its parent"


def test_prctl_is_called_in_one_place_only():
    """Every layer goes through chatpipe.procs; a copied ctypes prctl call shows up here."""
    callers = sorted(
        str(path.relative_to(REPO))
        for top in ("chatpipe", "stages", "flows", "scripts", "bench")
        for path in (REPO / top).rglob("*.py")
        if ".prctl(" in path.read_text()
    )
    assert callers == ["chatpipe/procs.py"]
