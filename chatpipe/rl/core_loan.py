"""The rollout role's cores, lent to the trainer while the role waits for weights.

At ``max_staleness`` k, once the role has sampled step s + k during the trainer's update of step s,
it can sample nothing more until the trainer publishes version s + 1: its cores idle. Where the
update is the slower half (on CPU, a d4 policy's update takes about 1.5x its sampling), they idle
for a quarter of every step. The loan puts them to work:

    loan = CoreLoan(exchange, max_staleness=1, own=1, every=2)
    loan.updating(step)     # the trainer took step's batch and updates on it
    ...                     # a thread sees the role's batch of step + k arrive: every core from here
    loan.give_back()        # before the trainer publishes, when the role samples again
    loan.close()

The trainer's threads change only between two torch ops of its main thread: the watcher thread
signals it (``SIGUSR2``), and Python runs the handler there, once the op running then returns.
Intra-op thread counts are per thread of a process, so no other thread could change them.
"""

from __future__ import annotations

import signal
import threading
import time

import torch

from chatpipe.rl.exchange import POLL_S, Exchange

SIGNAL = signal.SIGUSR2


class CoreLoan:
    """See the module docstring. ``own``: the trainer's own intra-op threads; ``every``: every core's
    (the role's too). Made and used in the main thread; :meth:`close` restores the signal's handler."""

    def __init__(self, ex: Exchange, max_staleness: int, own: int, every: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("CoreLoan must be made in the main thread: only it runs signal handlers")
        self.ex, self.max_staleness, self.own, self.every = ex, max_staleness, own, every
        self.step: int | None = None  # the step whose update runs now; None between updates
        self.lent_at: float | None = None  # when the role's cores came, while they are here
        self.lent_seconds = 0.0  # in all, for the stats
        self._signalled: int | None = None  # the step the watcher signalled for
        self._previous = signal.signal(SIGNAL, self._borrow)
        signal.siginterrupt(SIGNAL, False)  # a system call the signal lands in restarts, not fails
        self._main = threading.main_thread().ident
        self._done = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="core-loan", daemon=True)
        self._watcher.start()

    def updating(self, step: int) -> None:
        """The trainer took ``step``'s batch. At staleness 0 the role waits for this update's weights
        from the start, so its cores come at once."""
        self.step = step
        if self.max_staleness == 0:
            self._take()

    def give_back(self) -> None:
        """Back to the trainer's own threads, before it publishes weights the role samples with."""
        self.step = None
        if self.lent_at is not None:
            torch.set_num_threads(self.own)
            self.lent_seconds += time.perf_counter() - self.lent_at
            self.lent_at = None

    def take_lent_seconds(self) -> float:
        """Seconds the role's cores were the trainer's since the last call."""
        seconds, self.lent_seconds = self.lent_seconds, 0.0
        return seconds

    def close(self) -> None:
        """Stop watching, give back what is lent, restore the signal's handler."""
        self._done.set()
        self._watcher.join()
        self.give_back()
        signal.signal(SIGNAL, self._previous)

    def _watch(self) -> None:
        """In the watcher thread: signal the main thread once the role has sampled the last batch the
        bound allows before the update running now ends."""
        while not self._done.wait(POLL_S):
            step = self.step
            if step is None or self._signalled == step or self.lent_at is not None:
                continue
            if self.ex.has_rollouts(step + self.max_staleness):
                self._signalled = step
                signal.pthread_kill(self._main, SIGNAL)

    def _borrow(self, signum: int, frame) -> None:
        """In the main thread, between two ops: take every core if the update signalled for still runs
        (it may have ended, and its weights gone out, since the watcher looked). No logging here: the
        handler may run while the main thread holds the logging lock."""
        if self.step is not None and self.step == self._signalled:
            self._take()

    def _take(self) -> None:
        if self.lent_at is None:
            torch.set_num_threads(self.every)
            self.lent_at = time.perf_counter()
