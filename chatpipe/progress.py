"""Progress of long loops (training steps, eval items, rollouts, downloads) with elapsed time and ETA.

    from chatpipe.progress import progress
    bar = progress(total_steps, "pretrain", initial=start_step, unit="step")
    for ...:
        ...
        bar.update()
    bar.close()

On a terminal this is a tqdm bar. When the output is not a terminal (a stage under torchx, whose
log is streamed to the launcher; the Prefect flow; CI) the bar is off, and one plain log line
with done/total, elapsed and ETA is written at most every ``CHATPIPE_PROGRESS_EVERY`` seconds
(default 30; 0 turns it off), so a slow loop never goes silent for long. ``CHATPIPE_PROGRESS=off``
silences both; ``=bar`` forces the bar.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Any, TextIO

log = logging.getLogger("chatpipe.progress")


def _fmt(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:d}:{s:02d}"


class Progress:
    """A loop's progress: a tqdm bar on a terminal, else a throttled log line (see the module doc)."""

    def __init__(
        self,
        total: int | None,
        desc: str,
        *,
        initial: int = 0,
        unit: str = "it",
        stream: TextIO | None = None,
        every_s: float | None = None,
        mode: str | None = None,
    ) -> None:
        self.total, self.desc, self.unit = total, desc, unit
        self.n = self.start_n = initial
        self.t0 = self.last_line = time.monotonic()
        stream = stream or sys.stderr
        mode = mode or os.environ.get("CHATPIPE_PROGRESS", "auto")
        if mode not in ("auto", "bar", "off"):
            raise ValueError(f"CHATPIPE_PROGRESS = {mode!r}; allowed: auto, bar, off")
        is_tty = hasattr(stream, "isatty") and stream.isatty()
        self.bar: Any = None
        if mode == "bar" or (mode == "auto" and is_tty):
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, initial=initial, unit=unit, file=stream, dynamic_ncols=True)
        if every_s is None:
            every_s = float(os.environ.get("CHATPIPE_PROGRESS_EVERY", "30"))
        # the plain line only stands in for the bar when there is none
        self.every_s = every_s if (mode == "auto" and self.bar is None) else 0.0
        self._lock, self._closed = threading.Lock(), threading.Event()
        if self.every_s > 0:  # a line on time even while one item takes longer than every_s
            threading.Thread(target=self._tick, name=f"progress {desc}", daemon=True).start()

    def _tick(self) -> None:
        """The timer's loop: a line whenever ``every_s`` passed since the last one, until :meth:`close`."""
        while not self._closed.wait(max(self.every_s - (time.monotonic() - self.last_line), 0.01)):
            self._line_if_due({})

    def _line_if_due(self, postfix: dict[str, Any]) -> None:
        with self._lock:
            if self._closed.is_set() or time.monotonic() - self.last_line < self.every_s:
                return
            self.last_line = time.monotonic()
        log.info("%s", self.line(postfix))

    def update(self, n: int = 1, **postfix: Any) -> None:
        """Count ``n`` more done; ``postfix`` values (e.g. loss=...) show beside the bar or line."""
        self.n += n
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)
        elif self.every_s > 0:
            self._line_if_due(postfix)

    def line(self, postfix: dict[str, Any] | None = None) -> str:
        """``desc: 40/100 step | 0:12 elapsed | ETA 0:18 | loss 2.31``."""
        elapsed = time.monotonic() - self.t0
        done = self.n - self.start_n
        parts = [f"{self.desc}: {self.n}/{self.total if self.total is not None else '?'} {self.unit}"]
        parts.append(f"{_fmt(elapsed)} elapsed")
        if self.total is not None and done > 0:
            parts.append(f"ETA {_fmt(elapsed / done * (self.total - self.n))}")
        for key, value in (postfix or {}).items():
            parts.append(f"{key} {value:.4g}" if isinstance(value, float) else f"{key} {value}")
        return " | ".join(parts)

    def close(self) -> None:
        """Close the bar and stop the timer (idempotent)."""
        self._closed.set()
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress(total: int | None, desc: str, **kwargs: Any) -> Progress:
    """A :class:`Progress` for a loop of ``total`` items (None: unknown) named ``desc``."""
    return Progress(total, desc, **kwargs)


def iterate(items: Any, desc: str, total: int | None = None, **kwargs: Any):
    """Yield from ``items`` while counting them on a :class:`Progress` (closed at the end)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)
    with Progress(total, desc, **kwargs) as bar:
        for item in items:
            yield item
            bar.update()
