"""The Prefect API a command-line pipeline run talks to.

With a Prefect server configured (``PREFECT_API_URL``, e.g. ``prefect server start`` for the UI),
runs report there. Without one, Prefect would start a temporary server itself when the flow begins:
import its server app in this process (~4 s on a laptop), then wait for a uvicorn child (~6 s).
:class:`TemporaryServer` starts that same child first thing instead, so its boot overlaps the
parameter check and the MLflow store setup, and this process never imports the server app.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
from prefect.settings import PREFECT_API_URL, temporary_settings

# where a flow's temporary server writes (relative to the project, beside logs/torchx)
SERVER_LOG = Path("logs") / "prefect-server.log"


def _die_with_parent() -> None:
    """In the server child (Linux): get SIGTERM when the pipeline process dies, even by SIGKILL."""
    import signal

    from chatpipe.procs import die_with_parent

    die_with_parent(signal.SIGTERM)


def _free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class TemporaryServer:
    """A Prefect API server in a child process for the length of one pipeline run (no UI, no scheduler).

    ``log``: the file its output is appended to (the flows use ``logs/prefect-server.log``); None
    leaves it on this process's console. The server's own errors are its business: a request the
    flow cancels can make its database pool log a 20-line traceback that is no failure of the run,
    and a real failure reaches the flow as a failed API call anyway.
    """

    def __init__(self, log: Path | None = None) -> None:
        self.port = _free_port()
        self.log = log
        # The same app and flags Prefect's own temporary server uses: API only, ephemeral services.
        env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
        # No telemetry heartbeat: it cannot reach the internet from an offline run, and its write to
        # the sqlite store while the flow writes printed a 60-line "database is locked" traceback.
        env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
        out = None
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            out = log.open("ab")
        self.proc: subprocess.Popen | None = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "--factory",
                "prefect.server.api.server:create_app",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--log-level",
                "error",
                "--lifespan",
                "on",
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            # its own session: a Ctrl-C or SIGTERM to the terminal's process group reaches the flow
            # but not the server, so the flow can still report the crash before stopping it
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        if out is not None:
            out.close()  # the child holds its own copy

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def wait_ready(self, timeout_s: float = 180.0) -> bool:
        """Block until the server answers its health check; False if it exited or timed out."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc is None or self.proc.poll() is not None:
                    return False
                try:
                    if client.get(f"{self.api_url}/health").status_code == 200:
                        return True
                except httpx.TransportError:
                    pass
                time.sleep(0.1)
        return False

    def stop(self) -> None:
        """Terminate the server and reap it (killed if it does not stop within 10 s)."""
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def configured() -> bool:
    """True when runs should report to an existing Prefect server (``PREFECT_API_URL`` set)."""
    return bool(PREFECT_API_URL.value())


def _drain() -> None:
    """Send the flow's queued logs and events now, while the server still answers.

    Prefect's exit hooks would send them after the server is stopped and then retry for minutes.
    """
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all(timeout=5)
    EventsWorker.drain_all(timeout=5)


@contextlib.contextmanager
def pointed_at(server: TemporaryServer | None) -> Iterator[None]:
    """Point Prefect at ``server`` (once it is up) while the block runs.

    ``None`` leaves Prefect to its settings; a server that failed to come up leaves Prefect to
    start its own temporary one, with a warning.
    """
    if server is None:
        yield
    elif server.wait_ready():
        with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
            try:
                yield
            finally:
                _drain()
    else:
        where = f" (its output: {server.log})" if server.log is not None else ""
        print(
            f"warning: the temporary Prefect server did not start{where}; letting Prefect start its own",
            file=sys.stderr,
        )
        server.stop()
        yield
