"""The program :mod:`chatpipe.sandbox` runs inside bubblewrap (``python -I -S -B -c <this file>``):
a prelude that makes plain mistakes fail plainly, then the model-written code from stdin.

The prelude makes sockets, fork/exec/kill, subprocess and ctypes raise and refuses opens outside the
work dir (reads: also the stdlib), so such code gets a PermissionError and the status "error". It
can be bypassed (a fresh ``_io`` or ``_socket``, raw libc): bubblewrap's namespaces and the kernel
limits are the boundary. Exit codes report how the program ended (``sandbox._EXIT_STATUS``).
Importing this module does nothing; only running it as ``__main__`` does.
"""

import _io
import _socket
import builtins
import io
import linecache
import os
import posix
import signal
import socket
import sys
import traceback
import types

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PROCESS_CALLS = (
    "fork", "forkpty", "vfork", "kill", "killpg", "system", "popen", "execv", "execve", "execl", "execle",
    "execlp", "execlpe", "execvp", "execvpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnle",
    "spawnlp", "spawnlpe", "posix_spawn", "posix_spawnp", "setsid", "setpgid", "setpgrp", "pidfd_open", "_exit",
)  # fmt: skip
_PATH_WRITES = (
    "remove", "unlink", "rmdir", "mkdir", "rename", "replace", "link", "symlink", "chmod", "chown", "lchown",
    "truncate", "utime", "mkfifo", "mknod",
)  # fmt: skip
_SOCKET_CALLS = (
    "create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo", "gethostbyname",
    "gethostbyname_ex", "gethostbyaddr",
)  # fmt: skip


def _deny(name):
    def blocked(*args, **kwargs):
        raise PermissionError(f"sandbox: {name} is disabled")

    return blocked


def _within(path, roots):
    if isinstance(path, int):
        return True  # an already-open descriptor
    real = os.path.realpath(os.fsdecode(os.fspath(path)))
    return any(real == r or real.startswith(r + os.sep) for r in roots)


def _guard_files(work):
    """open, FileIO, os.open and the os path calls: writes only under ``work``, reads also the stdlib."""
    read_roots = (work, os.path.realpath(os.path.dirname(os.__file__)), "/dev/null", "/dev/zero", "/dev/urandom")

    def check(file, mode):
        if not _within(file, (work,) if any(ch in mode for ch in "wax+") else read_roots):
            raise PermissionError(f"sandbox: may not open {file!r} (mode {mode!r}) here")

    def guarded_open(file, mode="r", *args, **kwargs):
        check(file, mode)
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path, flags, *args, **kwargs):
        roots = (work,) if flags & _WRITE_FLAGS else read_roots
        if kwargs.get("dir_fd") is not None or not _within(path, roots):
            raise PermissionError(f"sandbox: may not open {path!r} here")
        return real_os_open(path, flags, *args, **kwargs)

    def guard_paths(real, name, roots):
        def guarded(*args, **kwargs):
            paths = [a for a in args if isinstance(a, (str, bytes, os.PathLike))]
            if any(k.endswith("dir_fd") and v is not None for k, v in kwargs.items()) or not all(
                _within(p, roots) for p in paths
            ):
                raise PermissionError(f"sandbox: os.{name} outside the work dir")
            return real(*args, **kwargs)

        return guarded

    class GuardedFileIO(_io.FileIO):
        def __init__(self, file, mode="r", *args, **kwargs):
            check(file, mode)
            super().__init__(file, mode, *args, **kwargs)

    real_open, real_os_open = _io.open, posix.open
    builtins.open = io.open = _io.open = guarded_open
    io.FileIO = _io.FileIO = GuardedFileIO
    os.open = posix.open = guarded_os_open
    for name in _PATH_WRITES:
        if hasattr(os, name):
            setattr(os, name, guard_paths(getattr(os, name), name, (work,)))
    for name in ("listdir", "scandir"):  # os only: importlib lists dirs through posix
        setattr(os, name, guard_paths(getattr(os, name), name, read_roots))


def _guard_processes_and_network():
    for name in _PROCESS_CALLS:
        for mod in (os, posix):
            if hasattr(mod, name):
                setattr(mod, name, _deny("os." + name))
    for name in ("pidfd_send_signal", "pthread_kill"):
        if hasattr(signal, name):
            setattr(signal, name, _deny("signal." + name))

    class NoSocket(socket.socket):
        def __init__(self, *args, **kwargs):
            raise PermissionError("sandbox: network is disabled")

    socket.socket = socket.SocketType = _socket.socket = _socket.SocketType = NoSocket
    for name in _SOCKET_CALLS:
        setattr(socket, name, _deny("socket." + name))
    sub = types.ModuleType("subprocess", "disabled in the sandbox")
    for name in ("Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"):
        setattr(sub, name, _deny("subprocess." + name))
    sys.modules["subprocess"] = sub
    for name in ("ctypes", "_ctypes", "_posixsubprocess", "multiprocessing", "_multiprocessing", "pty"):
        sys.modules[name] = None  # import raises ImportError


def _run(src):
    """Run ``src`` as ``__main__``; returns the exit code that says how it ended."""
    linecache.cache["<sandbox>"] = (len(src), None, src.splitlines(True), "<sandbox>")
    sys.argv = ["<sandbox>"]
    try:
        exec(compile(src, "<sandbox>", "exec"), {"__name__": "__main__", "__builtins__": builtins})
    except MemoryError:
        sys.stderr.write("MemoryError: memory limit reached\n")
        return 3
    except AssertionError:
        traceback.print_exc()
        return 1
    except SystemExit as e:
        sys.stderr.write(f"program exited before finishing (SystemExit {e.code!r})\n")
        return 1
    except BaseException:
        traceback.print_exc()
        return 2
    return 0


if __name__ == "__main__":
    _src = sys.stdin.read()
    _guard_files(os.path.realpath(os.getcwd()))
    _guard_processes_and_network()
    _status = _run(_src)
    sys.stdout.flush()
    raise SystemExit(_status)
