"""How the flow stops a stage's process group: it waits for the launcher, not only for DVC.

On a stop, DVC (the group leader) dies at once, while the launcher under it is still cancelling its
Slurm job or workers. A flow that returned when DVC did would exit, close the pipe the launcher
writes its log to, and leave the launcher to die on that pipe before it cancelled anything.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from flows.pipeline import _stop_group

# The group leader (DVC's part) dies on SIGTERM; its child (the launcher's part) takes 1.5 s to
# cancel, then records that it did.
GROUP = textwrap.dedent(
    """
    import subprocess, sys, time
    child = '''
    import signal, sys, time
    def stop(*_):
        time.sleep(1.5)
        open(sys.argv[1], "w").write("cancelled")
        sys.exit(130)
    signal.signal(signal.SIGTERM, stop)
    open(sys.argv[1] + ".ready", "w").write("")
    while True:
        time.sleep(0.1)
    '''
    subprocess.Popen([sys.executable, "-c", child, sys.argv[1]])
    time.sleep(600)
    """
)


def test_stop_group_waits_for_every_process_of_the_group(tmp_path: Path):
    marker = tmp_path / "cancelled"
    proc = subprocess.Popen([sys.executable, "-c", GROUP, str(marker)], start_new_session=True)
    deadline = time.monotonic() + 30
    while not Path(f"{marker}.ready").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    started = time.monotonic()
    _stop_group(proc, grace_s=20)
    assert proc.poll() is not None
    assert marker.exists(), "returned before the group's last process finished its cancel"
    assert time.monotonic() - started < 15


def test_stop_group_kills_what_outlives_the_grace(tmp_path: Path):
    stubborn = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: time.sleep(0.1)"
    proc = subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True)
    time.sleep(0.5)
    started = time.monotonic()
    _stop_group(proc, grace_s=1.0)
    assert proc.poll() is not None and time.monotonic() - started < 10
