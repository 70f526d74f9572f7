"""The temporary Prefect API server a command-line pipeline run starts for itself."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
import sys
import time

import httpx
import psutil
import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL

from flows import prefect_api
from tests.conftest import REPO


@flow(name="prefect-api-probe")
def probe() -> str:
    return "ok"


async def _state_on_server(flow_run_id) -> str:
    async with get_client() as client:
        return (await client.read_flow_run(flow_run_id)).state.type.value


def test_flow_reports_to_the_temporary_server_which_stops_afterwards():
    before = PREFECT_API_URL.value()
    server = prefect_api.TemporaryServer()
    try:
        with prefect_api.pointed_at(server):
            assert PREFECT_API_URL.value() == server.api_url
            state = probe(return_state=True)
            assert state.result() == "ok"
            # the run was recorded by this server
            assert asyncio.run(_state_on_server(state.state_details.flow_run_id)) == "COMPLETED"
        assert PREFECT_API_URL.value() == before
        proc = server.proc
    finally:
        server.stop()
    assert proc.poll() is not None and server.proc is None
    try:
        httpx.get(f"{server.api_url}/health", timeout=2)
        raise AssertionError("the server still answers after stop()")
    except httpx.TransportError:
        pass


def test_server_that_did_not_come_up_leaves_prefect_settings_alone(capsys):
    before = PREFECT_API_URL.value()
    server = prefect_api.TemporaryServer()
    server.stop()  # dead before anyone waits for it
    with prefect_api.pointed_at(server):
        assert PREFECT_API_URL.value() == before
    assert "did not start" in capsys.readouterr().err


def test_the_servers_own_errors_go_to_its_log_not_the_console(tmp_path, monkeypatch, capfd):
    """What the server prints (here uvicorn failing to bind a taken port) lands in its log file; the
    console only gets the warning, which names that file."""
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(prefect_api, "_free_port", lambda: taken.getsockname()[1])
        log = tmp_path / "logs" / "prefect-server.log"
        server = prefect_api.TemporaryServer(log)
        with prefect_api.pointed_at(server):
            pass
    console = capfd.readouterr()
    assert "did not start" in console.err and str(log) in console.err
    assert "address already in use" in log.read_text().lower()
    assert "address already in use" not in (console.out + console.err).lower()
    assert server.proc is None


def test_no_server_changes_nothing():
    before = PREFECT_API_URL.value()
    with prefect_api.pointed_at(None):
        assert PREFECT_API_URL.value() == before


@pytest.mark.skipif(sys.platform != "linux", reason="parent-death signal is Linux only")
def test_server_does_not_outlive_a_killed_pipeline_process(tmp_path):
    """SIGKILL of the process that started the server (no finally, no atexit) still stops the server."""
    script = (
        f"import sys, time; sys.path.insert(0, {str(REPO)!r})\n"
        "from flows.prefect_api import TemporaryServer\n"
        "s = TemporaryServer(); print(s.proc.pid, flush=True); time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server_pid = int(parent.stdout.readline())
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 30
    while psutil.pid_exists(server_pid) and psutil.Process(server_pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the server survived its parent"
        time.sleep(0.2)
