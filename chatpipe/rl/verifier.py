"""A verifier of your own for RL: a Python function in your own file scores each reply.

    # my_verifier.py (rl.reward.verifier_file), function `score` (rl.reward.verifier_function)
    def score(reply: str, problem: dict) -> float:      # in [0, 1]
        return float(reply.strip().endswith(problem["answer"]))

    v = Verifier("my_verifier.py", "score", timeout_s=5.0)
    v("... 42", {"prompt": "...", "answer": "42"}, index=3)   # 1.0, or None when the call failed

``problem`` is the row of your problems file as written (every field you put there), or for a
built-in task its conversation. A call that raises, returns something other than a number (a bool
counts as 0 or 1), returns NaN or a number outside [0, 1], or runs past ``timeout_s`` is a
failure: it is logged and kept in :attr:`Verifier.errors` with the problem's index and the error,
and the call returns None, never a score (RL leaves that reply out of the update; pass@k counts it
as not passed).

``sandbox=False`` (the default) imports the file into the RL process and limits each call with
SIGALRM (main thread) or a waiting thread (elsewhere). ``sandbox=True`` runs every call as a
fresh program under :mod:`chatpipe.sandbox` (bubblewrap: no network, no project tree, the
standard library only, wall and memory limits): for a verifier you do not trust, at the cost of
starting a Python per call (~50 ms).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import json
import logging
import math
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_MARK = "<<chatpipe-verifier-score>>"
_CACHE_SIZE = 4096  # replies remembered, so pass@k's verdict does not call (and report) twice


@dataclass(frozen=True)
class VerifierError:
    """One failed call: which problem, and what went wrong."""

    index: int
    error: str

    def __str__(self) -> str:
        return f"problem {self.index}: {self.error}"


class VerifierFailed(Exception):
    """A call of the user's verifier that gave no score (raised, wrong type or range, too slow)."""


def checked_score(value: Any) -> float:
    """``value`` as a score in [0, 1], or :class:`VerifierFailed` saying what came back instead."""
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)):
        raise VerifierFailed(f"returned {type(value).__name__} {value!r:.80}, expected a number in [0, 1]")
    if math.isnan(value) or not 0.0 <= value <= 1.0:
        raise VerifierFailed(f"returned {value!r}, expected a number in [0, 1]")
    return float(value)


def _defines(source: str, path: Path, function: str) -> None:
    """Refuse a file that does not parse or has no top-level ``def function``, naming file and line."""
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as e:
        raise ValueError(f"{path}:{e.lineno}: rl.reward.verifier_file is not valid Python ({e.msg})") from None
    names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if function not in names:
        raise ValueError(
            f"{path}: no top-level function {function!r} (rl.reward.verifier_function); "
            f"the file defines {names or 'no function'}; expected def {function}(reply, problem) -> float"
        )


def load_function(path: Path, function: str) -> Callable[[str, Any], Any]:
    """Import ``path`` as a module of its own and return its ``function``."""
    spec = importlib.util.spec_from_file_location(f"chatpipe_user_verifier_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ValueError(f"{path}: importing rl.reward.verifier_file failed: {type(e).__name__}: {e}") from e
    return getattr(module, function)


class _Timeout(BaseException):  # not an Exception, so a verifier's own `except Exception` cannot swallow it
    pass


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    def fire(signum, frame):
        raise _Timeout

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _call_with_limit(fn: Callable[[], Any], timeout_s: float) -> Any:
    """``fn()``, or :class:`VerifierFailed` when it raises or runs past ``timeout_s``."""
    try:
        if threading.current_thread() is threading.main_thread():
            with _alarm(timeout_s):
                return fn()
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = fn()
            except Exception as e:  # carried back to the caller's thread
                box["error"] = e

        worker = threading.Thread(target=target, daemon=True)
        worker.start()
        worker.join(timeout_s)
        if worker.is_alive():
            raise _Timeout
        if "error" in box:
            raise box["error"]
        return box["value"]
    except _Timeout:
        raise VerifierFailed(f"took longer than {timeout_s:g} s (rl.reward.verifier_timeout_s)") from None
    except Exception as e:
        raise VerifierFailed(f"raised {type(e).__name__}: {e}") from None


def _sandbox_program(source: str, function: str, reply: str, problem: Any) -> str:
    """The verifier's file, then one call whose result is printed after a marker line."""
    args = json.dumps([reply, problem])
    return (
        f"{source}\n\n"
        "import json as _json, math as _math\n"
        f"_value = {function}(*_json.loads({args!r}))\n"
        "if isinstance(_value, (bool, int, float)):\n"
        f"    print({_MARK!r} + _json.dumps({{'value': float(_value)}}))\n"
        "else:\n"
        f"    print({_MARK!r} + _json.dumps({{'type': type(_value).__name__, 'repr': repr(_value)[:80]}}))\n"
    )


class Verifier:
    """The user's ``function`` in ``path``, called as ``verifier(reply, problem, index)`` -> score or None."""

    def __init__(
        self, path: str | Path, function: str = "score", *, sandbox: bool = False, timeout_s: float = 5.0
    ) -> None:
        self.path, self.function, self.sandbox, self.timeout_s = Path(path), function, sandbox, timeout_s
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: rl.reward.verifier_file not found")
        self.source = self.path.read_text(encoding="utf-8")
        _defines(self.source, self.path, function)
        if sandbox:
            from chatpipe.sandbox import sandbox_mode

            sandbox_mode()  # no bubblewrap: fail now, with the install hint, not at the first reply
            self._fn = None
        else:
            self._fn = load_function(self.path, function)
        self.errors: list[VerifierError] = []
        self.calls = 0
        self._cache: dict[tuple[int, str], float | None] = {}

    def __call__(self, reply: str, problem: Any, index: int) -> float | None:
        key = (index, reply)
        if key in self._cache:
            return self._cache[key]
        self.calls += 1
        try:
            score = checked_score(self._run(reply, problem))
        except VerifierFailed as e:
            failure = VerifierError(index, str(e))
            self.errors.append(failure)
            log.warning("verifier %s:%s failed on %s", self.path, self.function, failure)
            score = None
        if len(self._cache) >= _CACHE_SIZE:
            self._cache.clear()
        self._cache[key] = score
        return score

    def _run(self, reply: str, problem: Any) -> Any:
        if self._fn is not None:
            return _call_with_limit(lambda: self._fn(reply, problem), self.timeout_s)
        from chatpipe.sandbox import run_program

        result = run_program(_sandbox_program(self.source, self.function, reply, problem), timeout_s=self.timeout_s)
        if result.status == "timeout":
            raise VerifierFailed(f"took longer than {self.timeout_s:g} s (rl.reward.verifier_timeout_s)")
        if result.status != "passed":
            lines = result.stderr.strip().splitlines()
            raise VerifierFailed(f"raised in the sandbox ({result.status}): {lines[-1] if lines else 'no message'}")
        found = [line[len(_MARK) :] for line in result.stdout.splitlines() if line.startswith(_MARK)]
        if not found:
            raise VerifierFailed("printed no score (did it exit early?)")
        out = json.loads(found[-1])
        if "value" not in out:
            raise VerifierFailed(f"returned {out['type']} {out['repr']}, expected a number in [0, 1]")
        return out["value"]

    def summary(self) -> dict[str, float]:
        """Calls and failures so far (the stage's metrics)."""
        return {"verifier_calls": self.calls, "verifier_errors": len(self.errors)}
