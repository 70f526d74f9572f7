"""Process lifetime: a child that dies with its parent, the one place every layer asks for it.

Linux's ``PR_SET_PDEATHSIG`` makes the kernel send a signal to a process when the thread that
forked it dies, for any reason including ``kill -9``; it survives ``execve``. The launcher's
workers, the Slurm launcher, a stage under torchrun, the flow's `dvc repro`
children and the Prefect server child all use it. :func:`process_start` (psutil) tells a live process
from a reused PID, for the launcher's parent watch and MLflow's stale-run check. Standard library only (no torch, no chatpipe
import), so the library, the stages, the flows and a ``python -c`` guard can all import it, and
libc is opened at import: a ``preexec_fn`` runs between fork and exec, where a first ``dlopen``
could block on a lock another thread held at the fork.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def process_start(pid: int) -> str | None:
    """When ``pid`` started (psutil's create time, seconds since the epoch, as text), to tell a live
    process from a later one that reused its PID; None when there is no such process."""
    import psutil  # here: this module stays importable with the standard library alone

    try:
        return f"{psutil.Process(pid).create_time():.2f}"
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied, ValueError):
        return None


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent dies; False where unsupported."""
    if _LIBC is None:
        return False
    return _LIBC.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def parent_gone(parent: int) -> bool:
    """True when ``parent`` (``os.getppid()`` read before :func:`die_with_parent`) already died.

    A parent that died before the prctl took effect sends nothing; the process was re-parented
    to PID 1 or a subreaper instead, which this sees.
    """
    return parent == 1 or os.getppid() != parent
