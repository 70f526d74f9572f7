"""Run untrusted, model-written Python (HumanEval completions) in a contained child process.

    from chatpipe.sandbox import check_humaneval, run_program
    r = run_program("print(1 + 1)", timeout_s=5, memory_mb=512)
    r.passed, r.status, r.stdout            # True, "passed", "2\\n"
    check_humaneval(prompt, completion, test, entry_point).passed

bubblewrap (``bwrap``, Debian package ``bubblewrap``) is the boundary, and it is required: where
it is missing or cannot make its namespaces, :class:`SandboxUnavailable` says so and how to install
it, and no model-written code runs. The program runs in fresh namespaces of every kind
(``--unshare-all``: no network, its own PID namespace under bwrap's reaping PID 1, so nothing it
starts outlives it; ``--new-session``, ``--die-with-parent``) and sees only what the interpreter
needs, read-only (/usr, /lib*, the interpreter's prefix), a private /proc and /dev, and a
size-capped ``--tmpfs /tmp`` holding its cwd and HOME, which vanishes with it. Not the project
tree, not the real /tmp, not /home, /root or /work. As root, bwrap itself is started as
``nobody`` so RLIMIT_NPROC applies (root ignores it).

Inside, two more layers: kernel limits set before exec (RLIMIT_AS memory, RLIMIT_CPU, RLIMIT_NPROC
against fork bombs, RLIMIT_FSIZE for files and captured output, RLIMIT_CORE 0), and a prelude run
before the code (a fresh ``python -I -S -B``: no site-packages) that makes sockets, fork/exec/kill,
subprocess and ctypes raise and refuses opens outside the work dir, so plain mistakes get plain
statuses and messages. The prelude can be bypassed; the namespaces and limits are the boundary.

Statuses: passed, failed (assertion or early exit), error (any other exception, including the
sandbox's PermissionErrors and "File too large" past RLIMIT_FSIZE), timeout (wall or CPU
limit), memory (MemoryError), killed (ended by some other signal, e.g. SIGSEGV).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import pwd
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from chatpipe import sandbox_runner

log = logging.getLogger(__name__)

MAX_OUTPUT_CHARS = 20_000  # per stream, kept in the result
FSIZE_BYTES = 8 * 1024 * 1024  # any file the child writes, stdout/stderr included
NPROC = 64  # processes for the child's user; the child needs one
DISK_BYTES = 64 * 1024 * 1024  # the private /tmp: cwd, HOME and all the program writes
# The program's cwd and HOME inside its /tmp, named after the process that ran it.
WORK_PREFIX = f"chatpipe-sandbox-{os.getpid()}-"
BWRAP_WORK = f"/tmp/{WORK_PREFIX}work"
# Top-level system dirs the interpreter and its shared libraries live in (merged /usr: links).
SYSTEM_DIRS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin")
INSTALL_HINT = "install bubblewrap (apt-get install bubblewrap; the Dockerfile does)"

# What a candidate Python must import inside the sandbox for the runner below to work.
_PROBE = "import encodings, json, linecache, math, re, socket, traceback"

# Exit codes the runner below uses to report how the program ended.
_EXIT_STATUS = {0: "passed", 1: "failed", 2: "error", 3: "memory"}

# The program run inside: its prelude, then the code from stdin (a file of its own, so it is linted).
_RUNNER = Path(sandbox_runner.__file__).read_text()


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run; ``status`` says how it ended."""

    passed: bool
    status: str  # passed | failed | timeout | memory | error | killed
    stdout: str
    stderr: str
    seconds: float


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot run here, so model-written code is not run at all."""


@dataclass(frozen=True)
class _Bwrap:
    """How to run under bubblewrap here: the bwrap binary, a Python, and the user to start it as."""

    bwrap: str
    python: str
    run_as: tuple[int, int] | None  # as root: nobody, so RLIMIT_NPROC counts


def _lower_limit(which: int, soft: int, hard: int) -> None:
    cur_soft, cur_hard = resource.getrlimit(which)
    if cur_hard != resource.RLIM_INFINITY:
        hard = min(hard, cur_hard)
    resource.setrlimit(which, (min(soft, hard), hard))


def _set_limits(memory_bytes: int, cpu_s: int) -> None:
    """The kernel limits of the program, set between fork and exec of bwrap (which keeps them)."""
    _lower_limit(resource.RLIMIT_AS, memory_bytes, memory_bytes)
    _lower_limit(resource.RLIMIT_CPU, cpu_s, cpu_s + 1)  # SIGXCPU first, SIGKILL a second later
    _lower_limit(resource.RLIMIT_NPROC, NPROC, NPROC)
    _lower_limit(resource.RLIMIT_FSIZE, FSIZE_BYTES, FSIZE_BYTES)
    _lower_limit(resource.RLIMIT_CORE, 0, 0)


def _nobody() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


def _as_user(run_as: tuple[int, int] | None) -> dict:
    """Popen arguments that start the child as ``run_as`` (uid, gid) with no extra groups."""
    return {} if run_as is None else {"user": run_as[0], "group": run_as[1], "extra_groups": []}


def _bwrap_argv(bwrap: str, python: str) -> list[str]:
    """bwrap's command line: mounts only the interpreter needs, read-only; fresh namespaces."""
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--proc", "/proc", "--dev", "/dev"]
    for path in SYSTEM_DIRS:
        if os.path.islink(path):  # e.g. /lib -> usr/lib: the same link inside
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    prefix = str(Path(python).resolve().parent.parent)  # .../bin/python3 -> ...: the stdlib is below
    if not any(prefix == d or prefix.startswith(d + "/") for d in SYSTEM_DIRS):
        argv += ["--ro-bind", prefix, prefix]  # e.g. a pyenv Python under /root
    argv += ["--size", str(DISK_BYTES), "--tmpfs", "/tmp", "--dir", BWRAP_WORK, "--chdir", BWRAP_WORK]
    env = {"PATH": "/usr/bin:/bin", "HOME": BWRAP_WORK, "TMPDIR": BWRAP_WORK, "LANG": "C.UTF-8"}
    argv += ["--clearenv", *[a for k, v in env.items() for a in ("--setenv", k, v)]]
    return argv + [str(Path(python).resolve()), "-I", "-S", "-B"]


@functools.lru_cache(maxsize=1)
def _bwrap_plan() -> _Bwrap:
    """How to run under bubblewrap here, or :class:`SandboxUnavailable` saying why not and how to fix it.

    Each candidate Python is tried for real, through bwrap, as the user it will run as: as root
    that is nobody, who cannot read a Python under /root, so a system python3 is tried next.
    """
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            f"model-written code runs only under bubblewrap: bwrap not found on PATH; {INSTALL_HINT}"
        )
    run_as = _nobody() if os.geteuid() == 0 else None
    own = getattr(sys, "_base_executable", sys.executable)  # a venv's python is a link to it
    why = "no Python found"
    for python in dict.fromkeys((own, sys.executable, "/usr/bin/python3", "/usr/local/bin/python3")):
        if not os.path.exists(python):
            continue
        try:
            argv = [*_bwrap_argv(bwrap, python), "-c", _PROBE]
            done = subprocess.run(argv, env={}, capture_output=True, timeout=30, **_as_user(run_as))
        except (OSError, subprocess.SubprocessError) as e:
            why = str(e)
            continue
        if done.returncode == 0:
            return _Bwrap(bwrap, python, run_as)
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        why = lines[-1] if lines else f"exit {done.returncode}"  # bwrap's own message, e.g. no user namespaces
    raise SandboxUnavailable(
        f"model-written code runs only under bubblewrap, and {bwrap} cannot run here: {why}; "
        "it needs user namespaces (sysctl user.max_user_namespaces > 0; in a container, one that allows them)"
    )


def sandbox_mode() -> str:
    """The sandbox :func:`run_program` uses ("bubblewrap", recorded with HumanEval results);
    raises :class:`SandboxUnavailable` where bubblewrap cannot run."""
    _bwrap_plan()
    _log_mode()
    return "bubblewrap"


@functools.cache  # once per process, not once per program
def _log_mode() -> None:
    log.info("sandbox for model-written code: bubblewrap (%s)", _bwrap_plan().python)


def _read_output(path: Path) -> str:
    with path.open("rb") as f:
        data = f.read(MAX_OUTPUT_CHARS * 4 + 1)
    text = data.decode("utf-8", errors="replace")
    if len(text) > MAX_OUTPUT_CHARS or path.stat().st_size > len(data):
        text = text[:MAX_OUTPUT_CHARS] + "\n[... output truncated]"
    return text


def _status(code: int, timed_out: bool) -> str:
    """The status of a run from bwrap's exit code; its PID 1 reports a program killed by signal N as 128 + N."""
    if timed_out:
        return "timeout"
    if code > 128 or code < 0:  # < 0: bwrap itself killed (Popen's view)
        return "timeout" if abs(code) - 128 * (code > 0) == signal.SIGXCPU else "killed"
    return _EXIT_STATUS.get(code, "error")


def _kill_group(proc: subprocess.Popen, patience_s: float = 2.0) -> None:
    """SIGKILL bwrap's process group until it is gone, reaping bwrap so its zombie does not keep the
    group alive. bwrap's PID 1 dies with it (--die-with-parent), and the kernel kills its namespace."""
    deadline = time.monotonic() + patience_s
    while True:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.poll()
            os.killpg(proc.pid, 0)
        except (ProcessLookupError, PermissionError):
            return  # group gone
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)


def _run_bwrap(files: tuple, memory_bytes: int, cpu_s: int, timeout_s: float) -> tuple[int, bool]:
    """Run the runner under bubblewrap; returns (bwrap's exit code, timed out)."""
    plan = _bwrap_plan()
    proc = subprocess.Popen(
        [*_bwrap_argv(plan.bwrap, plan.python), "-c", _RUNNER],
        stdin=files[0],
        stdout=files[1],
        stderr=files[2],
        cwd="/",
        env={},
        start_new_session=True,  # bwrap leads its group: one killpg reaches it
        close_fds=True,
        preexec_fn=functools.partial(_set_limits, memory_bytes, cpu_s),
        **_as_user(plan.run_as),
    )
    try:
        proc.wait(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        _kill_group(proc)
        proc.wait()
    return proc.returncode, timed_out


def run_program(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, cpu_s: int | None = None) -> SandboxResult:
    """Run ``code`` as a fresh Python program inside the sandbox; never raises for bad code, raises
    :class:`SandboxUnavailable` (with the install hint) where bubblewrap cannot run."""
    cpu_s = cpu_s if cpu_s is not None else math.ceil(timeout_s) + 1
    sandbox_mode()
    io_dir = Path(tempfile.mkdtemp(prefix="chatpipe-sandbox-io-"))  # ours; the child gets fds only
    try:
        (io_dir / "stdin").write_text(code, encoding="utf-8")
        start = time.monotonic()
        with (
            (io_dir / "stdin").open("rb") as fin,
            (io_dir / "stdout").open("wb") as fout,
            (io_dir / "stderr").open("wb") as ferr,
        ):
            code_, timed_out = _run_bwrap((fin, fout, ferr), memory_mb * 1024 * 1024, cpu_s, timeout_s)
        seconds = time.monotonic() - start
        status = _status(code_, timed_out)
        stdout, stderr = _read_output(io_dir / "stdout"), _read_output(io_dir / "stderr")
        return SandboxResult(status == "passed", status, stdout, stderr, seconds)
    finally:
        shutil.rmtree(io_dir, ignore_errors=True)


def check_humaneval(prompt: str, completion: str, test: str, entry_point: str, **limits: float) -> SandboxResult:
    """Run a HumanEval problem: prompt + completion, then the test's ``check(entry_point)``."""
    program = f"{prompt}{completion}\n\n{test}\n\ncheck({entry_point})\n"
    return run_program(program, **limits)
