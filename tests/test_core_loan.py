"""chatpipe.rl.core_loan: the rollout role's cores, the trainer's while the role waits for weights,
with a real exchange dir and the real signal (the loan changes this process's intra-op threads)."""

from __future__ import annotations

import signal
import time

import pytest
import torch

from chatpipe.rl.core_loan import SIGNAL, CoreLoan
from chatpipe.rl.exchange import Exchange


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def threads_after_ops(want: int, seconds: float) -> int:
    """Run small torch ops in this (the main) thread, where the loan's handler runs between two of them,
    until torch computes with ``want`` threads or ``seconds`` pass; the threads then."""
    deadline, x = time.monotonic() + seconds, torch.ones(64, 64)
    while torch.get_num_threads() != want and time.monotonic() < deadline:
        x = (x @ x).clamp_(max=1.0)
    return torch.get_num_threads()


def test_the_roles_cores_come_once_it_sampled_all_the_bound_allows_and_go_back_before_the_weights(tmp_path, one_thread):
    ex = Exchange(tmp_path)
    previous = signal.getsignal(SIGNAL)
    loan = CoreLoan(ex, max_staleness=1, own=1, every=2)
    try:
        loan.updating(5)  # the trainer took step 5's batch; the role samples step 6
        assert threads_after_ops(2, 0.3) == 1  # the role is still sampling: its core is its own
        ex.put_rollouts(6, {"step": 6})  # step 6 sampled: the role waits for version 6
        assert threads_after_ops(2, 5.0) == 2
        loan.give_back()  # before version 6 goes out
        assert torch.get_num_threads() == 1 and loan.take_lent_seconds() > 0

        # the next update: step 7 is not sampled yet, and step 6's batch, still in the dir, is no signal
        loan.updating(6)
        assert threads_after_ops(2, 0.3) == 1
        loan.give_back()
        assert loan.take_lent_seconds() == 0.0
    finally:
        loan.close()
    assert signal.getsignal(SIGNAL) == previous and torch.get_num_threads() == 1


def test_at_staleness_0_the_role_waits_through_every_update_so_its_cores_come_at_once(tmp_path, one_thread):
    loan = CoreLoan(Exchange(tmp_path), max_staleness=0, own=1, every=2)
    try:
        loan.updating(3)
        assert torch.get_num_threads() == 2
        loan.give_back()
        assert torch.get_num_threads() == 1
    finally:
        loan.close()


def test_closing_mid_update_gives_the_cores_back(tmp_path, one_thread):
    loan = CoreLoan(Exchange(tmp_path), max_staleness=0, own=1, every=2)
    loan.updating(0)
    loan.close()  # a run that fails mid-update: the exchange closes the loan on its way out
    assert torch.get_num_threads() == 1


def test_the_loan_is_made_only_where_one_role_shares_the_trainers_host_and_its_main_thread(
    tmp_path, monkeypatch, one_thread
):
    import threading
    from types import SimpleNamespace

    from chatpipe.rl.async_role import core_loan
    from chatpipe.settings import RL_THREADS_AFTER_ENV

    def cfg(**rollout):
        return SimpleNamespace(
            rollout=SimpleNamespace(**({"lend_cores": True, "workers": 1, "max_staleness": 1} | rollout))
        )

    ex = Exchange(tmp_path)
    monkeypatch.setenv(RL_THREADS_AFTER_ENV, "2")  # the launcher's word: the two roles have 2 cores
    loan = core_loan(cfg(), ex, own=1)
    assert isinstance(loan, CoreLoan)
    loan.close()
    assert core_loan(cfg(lend_cores=False), ex, own=1) is None
    assert core_loan(cfg(workers=2), ex, own=1) is None  # workers get weights over torch.distributed
    assert core_loan(cfg(), ex, own=2) is None  # nothing beside the trainer's own cores
    in_a_thread = []
    thread = threading.Thread(target=lambda: in_a_thread.append(core_loan(cfg(), ex, own=1)))
    thread.start()
    thread.join()
    assert in_a_thread == [None]  # only the main thread runs signal handlers: no loan, and no error
    monkeypatch.delenv(RL_THREADS_AFTER_ENV)
    assert core_loan(cfg(), ex, own=1) is None  # launched without the launcher's core count
