"""Run untrusted, model-written Python (HumanEval completions) in a contained child process.

    from chatpipe.sandbox import check_humaneval, run_program
    r = run_program("print(1 + 1)", timeout_s=5, memory_mb=512)
    r.passed, r.status, r.stdout            # True, "passed", "2\\n"
    check_humaneval(prompt, completion, test, entry_point).passed

Where bubblewrap (``bwrap``, Debian package ``bubblewrap``) is installed and works, it is the
boundary. The program runs in fresh namespaces of every kind (``--unshare-all``: no network, its
own PID namespace under bwrap's reaping PID 1, ``--new-session``, ``--die-with-parent``) and sees
only what the interpreter needs, read-only (/usr, /lib*, the interpreter's prefix), a private
/proc and /dev, and a size-capped ``--tmpfs /tmp`` holding its cwd and HOME, which vanishes with
it. Not the project tree, not the real /tmp, not /home, /root or /work. As root, bwrap itself is
started as ``nobody`` so RLIMIT_NPROC applies (root ignores it).

Without bwrap (or with CHATPIPE_SANDBOX=fallback), the older layers below are the documented
fallback; they have no filesystem boundary. :func:`sandbox_mode` says which mode runs; it is
logged and recorded with the HumanEval results.

Fallback layers, outermost first (a separate process, limits, no network, a temp dir):
1. A fresh ``python -I -S -B`` interpreter (no PYTHON* env, no site-packages, so not even the
   installed project) started in its own session and, where the kernel allows (root, or user
   namespaces), in its own PID namespace under a trusted init: when the run ends, the namespace
   is killed, so nothing it started survives, even after fork + setsid. Without namespaces its
   process group is killed, then every process still carrying its HOME marker in its
   environment (readable ones: all as root, else our uid's; code that re-execs with a fresh
   environment would escape that fallback).
2. Kernel limits set in the child before exec: RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_NPROC
   (fork bombs fail), RLIMIT_FSIZE (files and captured output), RLIMIT_CORE 0.
3. A new network namespace (no interfaces) where the kernel allows one. As root, the child
   also drops to ``nobody`` (using a system python3 if ours is unreadable for nobody), so it can
   neither signal us nor write our files, and RLIMIT_NPROC applies (root ignores it).
4. A fresh temp dir as cwd and HOME, deleted afterwards; a minimal environment.
5. A prelude run before the code: sockets, fork/exec/kill, subprocess and ctypes raise, and
   open/os.* refuse writes outside the temp dir and reads outside it and the stdlib. This
   layer is Python-level and can be bypassed by determined code; 1-4 are the boundary.
Under bubblewrap, layers 2 and 5 run too (5 keeps the statuses and messages of plain mistakes).

Statuses: passed, failed (assertion or early exit), error (any other exception, including the
sandbox's PermissionErrors and "File too large" past RLIMIT_FSIZE), timeout (wall or CPU
limit), memory (MemoryError), killed (ended by some other signal, e.g. SIGSEGV).
"""

from __future__ import annotations

import ctypes
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from chatpipe.procs import die_with_parent

log = logging.getLogger(__name__)

MAX_OUTPUT_CHARS = 20_000  # per stream, kept in the result
FSIZE_BYTES = 8 * 1024 * 1024  # any file the child writes, stdout/stderr included
NPROC = 64  # processes for the child's user; the child needs one
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000

# What a Python must import to run the runner below; probes that a candidate interpreter works.
_PROBE = "import encodings, json, linecache, math, re, socket, traceback"

# Exit codes the runner below uses to report how the program ended.
_EXIT_STATUS = {0: "passed", 1: "failed", 2: "error", 3: "memory"}

_RUNNER = r"""
import builtins, io, _io, linecache, os, posix, signal, socket, _socket, sys, traceback, types
_src = sys.stdin.read()
_WORK = os.path.realpath(os.getcwd())
_READ_ROOTS = (_WORK, os.path.realpath(os.path.dirname(os.__file__)),
               "/dev/null", "/dev/zero", "/dev/urandom")

def _deny(name):
    def blocked(*args, **kwargs):
        raise PermissionError(f"sandbox: {name} is disabled")
    return blocked

def _within(path, roots):
    if isinstance(path, int):
        return True  # an already-open descriptor
    real = os.path.realpath(os.fsdecode(os.fspath(path)))
    return any(real == r or real.startswith(r + os.sep) for r in roots)

def _guard_open(real_open):
    def guarded(file, mode="r", *args, **kwargs):
        writing = any(ch in mode for ch in "wax+")
        if not _within(file, (_WORK,) if writing else _READ_ROOTS):
            raise PermissionError(f"sandbox: may not open {file!r} (mode {mode!r}) here")
        return real_open(file, mode, *args, **kwargs)
    return guarded

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
def _guard_os_open(real_open):
    def guarded(path, flags, *args, **kwargs):
        roots = (_WORK,) if flags & _WRITE_FLAGS else _READ_ROOTS
        if kwargs.get("dir_fd") is not None or not _within(path, roots):
            raise PermissionError(f"sandbox: may not open {path!r} here")
        return real_open(path, flags, *args, **kwargs)
    return guarded

def _guard_paths(real, name, roots):
    def guarded(*args, **kwargs):
        paths = [a for a in args if isinstance(a, (str, bytes, os.PathLike))]
        if any(k.endswith("dir_fd") and v is not None for k, v in kwargs.items()) or \
                not all(_within(p, roots) for p in paths):
            raise PermissionError(f"sandbox: os.{name} outside the work dir")
        return real(*args, **kwargs)
    return guarded

builtins.open = io.open = _io.open = _guard_open(_io.open)
class _GuardedFileIO(_io.FileIO):
    def __init__(self, file, mode="r", *args, **kwargs):
        writing = any(ch in mode for ch in "wax+")
        if not _within(file, (_WORK,) if writing else _READ_ROOTS):
            raise PermissionError(f"sandbox: may not open {file!r} (mode {mode!r}) here")
        super().__init__(file, mode, *args, **kwargs)
io.FileIO = _io.FileIO = _GuardedFileIO
os.open = posix.open = _guard_os_open(posix.open)
for _name in ("remove", "unlink", "rmdir", "mkdir", "rename", "replace", "link", "symlink",
              "chmod", "chown", "lchown", "truncate", "utime", "mkfifo", "mknod"):
    if hasattr(os, _name):
        setattr(os, _name, _guard_paths(getattr(os, _name), _name, (_WORK,)))
for _name in ("listdir", "scandir"):  # os only: importlib lists dirs through posix
    setattr(os, _name, _guard_paths(getattr(os, _name), _name, _READ_ROOTS))
for _name in ("fork", "forkpty", "vfork", "kill", "killpg", "system", "popen", "execv", "execve",
              "execl", "execle", "execlp", "execlpe", "execvp", "execvpe", "spawnv", "spawnve",
              "spawnvp", "spawnvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "posix_spawn",
              "posix_spawnp", "setsid", "setpgid", "setpgrp", "pidfd_open", "_exit"):
    for _mod in (os, posix):
        if hasattr(_mod, _name):
            setattr(_mod, _name, _deny("os." + _name))
for _name in ("pidfd_send_signal", "pthread_kill"):
    if hasattr(signal, _name):
        setattr(signal, _name, _deny("signal." + _name))

class _NoSocket(socket.socket):
    def __init__(self, *args, **kwargs):
        raise PermissionError("sandbox: network is disabled")
socket.socket = socket.SocketType = _socket.socket = _socket.SocketType = _NoSocket
for _name in ("create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo",
              "gethostbyname", "gethostbyname_ex", "gethostbyaddr"):
    setattr(socket, _name, _deny("socket." + _name))

_sub = types.ModuleType("subprocess", "disabled in the sandbox")
for _name in ("Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"):
    setattr(_sub, _name, _deny("subprocess." + _name))
sys.modules["subprocess"] = _sub
for _name in ("ctypes", "_ctypes", "_posixsubprocess", "multiprocessing", "_multiprocessing", "pty"):
    sys.modules[_name] = None  # import raises ImportError

linecache.cache["<sandbox>"] = (len(_src), None, _src.splitlines(True), "<sandbox>")
sys.argv = ["<sandbox>"]
try:
    exec(compile(_src, "<sandbox>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
except MemoryError:
    sys.stderr.write("MemoryError: memory limit reached\n")
    _status = 3
except AssertionError:
    traceback.print_exc()
    _status = 1
except SystemExit as e:
    sys.stderr.write(f"program exited before finishing (SystemExit {e.code!r})\n")
    _status = 1
except BaseException:
    traceback.print_exc()
    _status = 2
else:
    _status = 0
sys.stdout.flush()
raise SystemExit(_status)
"""


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one sandboxed run; ``status`` says how it ended."""

    passed: bool
    status: str  # passed | failed | timeout | memory | error | killed
    stdout: str
    stderr: str
    seconds: float


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _unshare(flags: int) -> None:
    if hasattr(os, "unshare"):  # Python >= 3.12
        os.unshare(flags)
        return
    if _libc().unshare(flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def _isolate_network() -> bool:
    """Move the (forked, single-threaded) child into an empty network namespace, and its future
    children into a new PID namespace, where allowed.

    Returns True when a PID namespace was made (see :func:`_enter_pid_namespace`).
    """
    for flags in (CLONE_NEWNET | CLONE_NEWPID, CLONE_NEWNET):
        try:
            _unshare(flags)  # needs CAP_SYS_ADMIN, e.g. root
            return bool(flags & CLONE_NEWPID)
        except OSError:
            pass
    for flags in (CLONE_NEWUSER | CLONE_NEWNET | CLONE_NEWPID, CLONE_NEWUSER | CLONE_NEWNET):
        try:  # unprivileged: a user namespace of our own may create network and PID namespaces
            uid, gid = os.getuid(), os.getgid()
            _unshare(flags)
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
            return bool(flags & CLONE_NEWPID)
        except OSError:
            pass
    return False  # no namespaces here: the prelude's socket guard and the HOME marker are all we have


def _enter_pid_namespace() -> None:
    """Run the program in the new PID namespace under a trusted init; this process stays outside
    as a shim that exits the way the program did (code or signal), which is what Popen sees.

    Three processes: the shim (outside), init (PID 1 inside, root, only reaps) and the program
    (PID 2, its own session). When init ends, for any reason, the kernel SIGKILLs every process
    in the namespace, wherever it moved (setsid, double fork, re-parenting, nested namespaces);
    :func:`_kill_everything` kills init (the shim's child), and init dies with the shim
    (PR_SET_PDEATHSIG), the shim with us. The program is not init itself: the kernel shields
    init from signals, including its own RLIMIT_CPU ones. Runs between fork and exec, so only
    the program's branch returns.
    """
    read_end, write_end = os.pipe()
    if os.fork() != 0:  # the shim
        die_with_parent(signal.SIGKILL)
        os.close(write_end)
        _close_fds_except(read_end)  # incl. Popen's exec-status pipe: Popen returns once the program execs
        report = b""
        while chunk := os.read(read_end, 64):
            report += chunk
        _, init_status = os.waitpid(-1, 0)
        _exit_like(int(report) if report else init_status)
    die_with_parent(signal.SIGKILL)  # init, PID 1: ends with the shim
    os.close(read_end)
    program = os.fork()
    if program == 0:
        os.close(write_end)
        os.setsid()  # leader of its own group and session, as without a namespace
        return
    _close_fds_except(write_end)
    while True:  # reap everything (init inherits orphans) until the program itself ends
        try:
            pid, status = os.wait()
        except InterruptedError:
            continue
        if pid == program:
            break
    os.write(write_end, str(status).encode())
    os._exit(0)


def _close_fds_except(keep: int) -> None:
    os.closerange(3, keep)
    os.closerange(keep + 1, 1 << 16)


def _exit_like(status: int) -> None:
    """Exit this process the way a child with wait ``status`` did."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # SIGXCPU's default also dumps core
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 1)


def _lower_limit(which: int, soft: int, hard: int) -> None:
    cur_soft, cur_hard = resource.getrlimit(which)
    if cur_hard != resource.RLIM_INFINITY:
        hard = min(hard, cur_hard)
    resource.setrlimit(which, (min(soft, hard), hard))


def _drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)


def _set_limits(memory_bytes: int, cpu_s: int) -> None:
    """The kernel limits of the program (both modes), set between fork and exec."""
    _lower_limit(resource.RLIMIT_AS, memory_bytes, memory_bytes)
    _lower_limit(resource.RLIMIT_CPU, cpu_s, cpu_s + 1)  # SIGXCPU first, SIGKILL a second later
    _lower_limit(resource.RLIMIT_NPROC, NPROC, NPROC)
    _lower_limit(resource.RLIMIT_FSIZE, FSIZE_BYTES, FSIZE_BYTES)
    _lower_limit(resource.RLIMIT_CORE, 0, 0)


def _child_setup(memory_bytes: int, cpu_s: int, run_as: tuple[int, int] | None) -> None:
    """Runs in the fallback's child between fork and exec (preexec_fn): namespaces, limits, user."""
    own_pids = _isolate_network()
    if own_pids:
        _enter_pid_namespace()
    _set_limits(memory_bytes, cpu_s)
    if run_as is not None:
        _drop_privileges(*run_as)


def _minimal_env(home: str) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8"}


def _nobody() -> tuple[int, int]:
    try:
        entry = pwd.getpwnam("nobody")
        return entry.pw_uid, entry.pw_gid
    except KeyError:
        return 65534, 65534


@functools.lru_cache(maxsize=1)
def _interpreter() -> tuple[str, tuple[int, int] | None]:
    """The Python to run and the (uid, gid) to run it as (None: stay as we are).

    As root we want to drop to ``nobody``; our own interpreter may live where nobody cannot
    read it (e.g. under /root), so a system python3 is tried next. The program only needs the
    stdlib, so any Python 3 will do. If none works for nobody we stay root, and the prelude and
    process group are what remain against kill and fork.
    """
    if os.geteuid() != 0:
        return sys.executable, None
    ids = _nobody()
    for python in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            done = subprocess.run(
                [python, "-I", "-S", "-B", "-c", _PROBE],
                cwd="/",
                env=_minimal_env("/"),
                preexec_fn=functools.partial(_drop_privileges, *ids),
                capture_output=True,
                timeout=30,
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            return python, ids
    return sys.executable, None


def _read_output(path: Path) -> str:
    with path.open("rb") as f:
        data = f.read(MAX_OUTPUT_CHARS * 4 + 1)
    text = data.decode("utf-8", errors="replace")
    if len(text) > MAX_OUTPUT_CHARS or path.stat().st_size > len(data):
        text = text[:MAX_OUTPUT_CHARS] + "\n[... output truncated]"
    return text


def _status(returncode: int, timed_out: bool) -> str:
    if timed_out:
        return "timeout"
    if returncode < 0:
        return "timeout" if -returncode == signal.SIGXCPU else "killed"
    return _EXIT_STATUS.get(returncode, "error")


def _kill_group(proc: subprocess.Popen, patience_s: float = 2.0) -> None:
    """SIGKILL the child's process group until it is gone (a fork racing the first kill can
    leave a straggler), reaping the child so its zombie does not keep the group alive."""
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


def _pid_namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _children(pid: int) -> list[int]:
    try:
        return [
            int(c)
            for t in os.listdir(f"/proc/{pid}/task")
            for c in open(f"/proc/{pid}/task/{t}/children").read().split()
        ]
    except OSError:
        return []


def _leftovers(namespace: str | None, marker: bytes) -> list[int]:
    """PIDs in the program's PID namespace, or whose initial environment holds its HOME marker.

    The namespace catches everything (root, or where user namespaces are allowed). The marker is
    the fallback without namespaces: it finds processes we may read (root: all; else our uid)
    that still carry the sandbox's HOME, i.e. all but code that re-execs with a new environment.
    """
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if namespace is not None and _pid_namespace(pid) == namespace:
            found.append(pid)
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if marker in f.read():
                    found.append(pid)
        except OSError:
            continue  # gone, or not ours to read
    return found


def _kill_everything(proc: subprocess.Popen, namespace: str | None, marker: bytes, patience_s: float = 2.0) -> None:
    """SIGKILL the program, its process group and whatever it started wherever it moved.

    With a PID namespace, the program is the init of ``namespace`` (the shim's child): killing it
    makes the kernel kill the whole namespace. The scan after it catches stragglers either way.
    """
    for init in _children(proc.pid):
        try:
            os.kill(init, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    _kill_group(proc, patience_s)
    deadline = time.monotonic() + patience_s
    while pids := [p for p in _leftovers(namespace, marker) if p != os.getpid()]:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        proc.poll()
        if time.monotonic() > deadline:
            return
        time.sleep(0.01)


# --- bubblewrap -------------------------------------------------------------------------------

SANDBOX_ENV = "CHATPIPE_SANDBOX"  # "fallback" forces the fallback layers (tests; a broken bwrap)
DISK_BYTES = 64 * 1024 * 1024  # the private /tmp under bubblewrap: cwd, HOME and all it writes
# The program's cwd and HOME: BWRAP_WORK inside that /tmp, or a temp dir of the fallback's; both
# named after the process that ran the program, so its runs can be told from other processes' runs.
WORK_PREFIX = f"chatpipe-sandbox-{os.getpid()}-"
BWRAP_WORK = f"/tmp/{WORK_PREFIX}work"
# Top-level system dirs the interpreter and its shared libraries live in (merged /usr: links).
SYSTEM_DIRS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin")


@dataclass(frozen=True)
class _Bwrap:
    """How to run under bubblewrap here: the bwrap binary, a Python, and the user to start it as."""

    bwrap: str
    python: str
    run_as: tuple[int, int] | None  # as root: nobody, so RLIMIT_NPROC counts


def _prefix(python: str) -> str:
    """The install prefix of ``python`` (.../bin/python3 -> ...): its stdlib lives below it."""
    return str(Path(python).resolve().parent.parent)


def _bwrap_argv(bwrap: str, python: str) -> list[str]:
    """bwrap's command line: mounts only the interpreter needs, read-only; fresh namespaces."""
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--proc", "/proc", "--dev", "/dev"]
    for path in SYSTEM_DIRS:
        if os.path.islink(path):  # e.g. /lib -> usr/lib: the same link inside
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    prefix = _prefix(python)
    if not any(prefix == d or prefix.startswith(d + "/") for d in SYSTEM_DIRS):
        argv += ["--ro-bind", prefix, prefix]  # e.g. a pyenv Python under /root
    argv += ["--size", str(DISK_BYTES), "--tmpfs", "/tmp", "--dir", BWRAP_WORK, "--chdir", BWRAP_WORK]
    return argv + [str(Path(python).resolve()), "-I", "-S", "-B"]


@functools.lru_cache(maxsize=1)
def _bwrap_plan() -> tuple[_Bwrap | None, str]:
    """(how to run under bubblewrap, "") where it works here, else (None, why not).

    Each candidate Python is tried for real, through bwrap, as the user it will run as: as root
    that is nobody, who cannot read a Python under /root, so a system python3 is tried next.
    """
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return None, "bwrap not found"
    run_as = _nobody() if os.geteuid() == 0 else None
    own = getattr(sys, "_base_executable", sys.executable)  # a venv's python is a link to it
    why = ""
    for python in dict.fromkeys((own, sys.executable, "/usr/bin/python3", "/usr/local/bin/python3")):
        if not os.path.exists(python):
            continue
        try:
            done = subprocess.run(
                [*_bwrap_argv(bwrap, python), "-c", _PROBE],
                env=_minimal_env(BWRAP_WORK),
                capture_output=True,
                timeout=30,
                **_as_user(run_as),
            )
        except (OSError, subprocess.SubprocessError) as e:
            why = str(e)
            continue
        if done.returncode == 0:
            return _Bwrap(bwrap, python, run_as), ""
        lines = done.stderr.decode(errors="replace").strip().splitlines()
        why = lines[-1] if lines else f"exit {done.returncode}"  # bwrap's own message, e.g. no user namespaces
    return None, f"bwrap unusable here: {why}"


def _as_user(run_as: tuple[int, int] | None) -> dict:
    """Popen arguments that start the child as ``run_as`` (uid, gid) with no extra groups."""
    return {} if run_as is None else {"user": run_as[0], "group": run_as[1], "extra_groups": []}


def sandbox_mode() -> str:
    """Which sandbox :func:`run_program` uses: "bubblewrap" or "fallback (<why>)"."""
    if os.environ.get(SANDBOX_ENV, "") == "fallback":
        return f"fallback ({SANDBOX_ENV}=fallback)"
    plan, why = _bwrap_plan()
    return "bubblewrap" if plan is not None else f"fallback ({why})"


@functools.cache  # once per mode and process, not once per program
def _log_mode(mode: str) -> None:
    (log.info if mode == "bubblewrap" else log.warning)("sandbox for model-written code: %s", mode)


def _run_bwrap(plan: _Bwrap, files: tuple, limits: Callable[[], None], timeout_s: float) -> tuple[int, bool]:
    """Run the runner under bubblewrap; returns (returncode as Popen reports a signal, timed out)."""
    proc = subprocess.Popen(
        [*_bwrap_argv(plan.bwrap, plan.python), "-c", _RUNNER],
        stdin=files[0],
        stdout=files[1],
        stderr=files[2],
        cwd="/",
        env=_minimal_env(BWRAP_WORK),
        start_new_session=True,  # bwrap leads its group: one killpg reaches it
        close_fds=True,
        preexec_fn=limits,
        **_as_user(plan.run_as),
    )
    try:
        proc.wait(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        # Killing bwrap kills its PID 1 (--die-with-parent), and with it the whole namespace.
        _kill_group(proc)
        proc.wait()
    code = proc.returncode
    # bwrap's PID 1 reports a program killed by signal N as exit 128 + N.
    return (-(code - 128) if code > 128 else code), timed_out


# --- the fallback, and running a program in either mode ---------------------------------------


def _run_fallback(files: tuple, memory_bytes: int, cpu_s: int, timeout_s: float) -> tuple[int, bool]:
    """Run the runner under the fallback layers; returns (Popen's returncode, timed out)."""
    python, run_as = _interpreter()
    work = tempfile.mkdtemp(prefix=WORK_PREFIX)  # the child's cwd and HOME
    try:
        if run_as is not None:
            os.chown(work, *run_as)
        proc = subprocess.Popen(
            [python, "-I", "-S", "-B", "-c", _RUNNER],
            stdin=files[0],
            stdout=files[1],
            stderr=files[2],
            cwd=work,
            env=_minimal_env(work),
            start_new_session=True,
            close_fds=True,
            preexec_fn=functools.partial(_child_setup, memory_bytes, cpu_s, run_as),
        )
        # Popen returns once the program has exec'd: as the shim's child, in its own PID
        # namespace when one could be made (else no children, or one in our namespace).
        namespace = next(iter(_pid_namespace(c) for c in _children(proc.pid)), None)
        if namespace == _pid_namespace(os.getpid()):
            namespace = None
        try:
            proc.wait(timeout=timeout_s)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_everything(proc, namespace, f"HOME={work}\0".encode())  # and all it left behind
            proc.wait()
        return proc.returncode, timed_out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_program(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, cpu_s: int | None = None) -> SandboxResult:
    """Run ``code`` as a fresh Python program inside the sandbox; never raises for bad code."""
    cpu_s = cpu_s if cpu_s is not None else math.ceil(timeout_s) + 1
    mode = sandbox_mode()
    _log_mode(mode)
    io_dir = Path(tempfile.mkdtemp(prefix="chatpipe-sandbox-io-"))  # ours; the child gets fds only
    try:
        (io_dir / "stdin").write_text(code, encoding="utf-8")
        start = time.monotonic()
        with (
            (io_dir / "stdin").open("rb") as fin,
            (io_dir / "stdout").open("wb") as fout,
            (io_dir / "stderr").open("wb") as ferr,
        ):
            if mode == "bubblewrap":
                limits = functools.partial(_set_limits, memory_mb * 1024 * 1024, cpu_s)
                returncode, timed_out = _run_bwrap(_bwrap_plan()[0], (fin, fout, ferr), limits, timeout_s)
            else:
                returncode, timed_out = _run_fallback((fin, fout, ferr), memory_mb * 1024 * 1024, cpu_s, timeout_s)
        seconds = time.monotonic() - start
        status = _status(returncode, timed_out)
        stdout, stderr = _read_output(io_dir / "stdout"), _read_output(io_dir / "stderr")
        return SandboxResult(status == "passed", status, stdout, stderr, seconds)
    finally:
        shutil.rmtree(io_dir, ignore_errors=True)


def check_humaneval(prompt: str, completion: str, test: str, entry_point: str, **limits: float) -> SandboxResult:
    """Run a HumanEval problem: prompt + completion, then the test's ``check(entry_point)``."""
    program = f"{prompt}{completion}\n\n{test}\n\ncheck({entry_point})\n"
    return run_program(program, **limits)
