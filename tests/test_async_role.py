"""The trainer's side of asynchronous RL (chatpipe/rl/async_role.py) against a rollout role run in a
thread over a real exchange directory; the stage tests run the role as its own torchx role."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import torch

from chatpipe.rl.async_role import rollout_exchange, take_rollouts
from chatpipe.rl.exchange import Exchange, run_rollout_role
from chatpipe.rl.rollout import Rollouts
from chatpipe.settings import RL_EXCHANGE_ENV, RL_THREADS_AFTER_ENV, RLSettings, load_section


def a_batch() -> Rollouts:
    return Rollouts(
        inputs=torch.zeros(1, 3, dtype=torch.long),
        targets=torch.ones(1, 3, dtype=torch.long),
        mask=torch.tensor([[0.0, 1.0, 1.0]]),
        scores=torch.tensor([1.0]),
        ended=torch.ones(1, dtype=torch.bool),
        lengths=torch.tensor([2]),
        groups=torch.zeros(1, dtype=torch.long),
        behav_logp=torch.tensor([[0.0, -0.5, -1.0]]),
    )


def test_the_role_samples_once_the_trainer_asks_for_a_batch_and_lends_it_its_cores_until_then(tmp_path, monkeypatch):
    """Failed before: the exchange published the first weights as it opened, so the role sampled
    while a fresh run's first evaluation ran on the trainer's own cores alone (on two cores, one
    thread: twice as long). Now the role waits for the trainer's first take_rollouts, the trainer
    computes on the role's cores until then, and on its own once the role samples."""
    cfg = load_section(RLSettings, {"rollout": {"role": True, "max_staleness": 1}, "max_steps": 2})
    monkeypatch.setenv(RL_EXCHANGE_ENV, str(tmp_path / "launch"))
    monkeypatch.setenv(RL_THREADS_AFTER_ENV, "2")
    sampled: list[int] = []

    def sample_step(step: int) -> dict:
        sampled.append(step)
        return {**a_batch().to_dict(), "idx": [step], "tools": {}}

    def role() -> None:
        ex = Exchange(tmp_path / "launch")
        with ex.heartbeat("rollout"):
            run_rollout_role(ex, torch.nn.Linear(2, 2), sample_step, max_steps=2, max_staleness=1, timeout_s=60)

    rt = SimpleNamespace(world_size=1, device=torch.device("cpu"))
    trainer = SimpleNamespace(policy=torch.nn.Linear(2, 2))
    run = SimpleNamespace(
        cfg=cfg, rt=rt, models=trainer, exchange=None, rollout_start=None, core_loan=None, engine=SimpleNamespace()
    )
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    thread = threading.Thread(target=role, daemon=True)
    try:
        thread.start()
        with rollout_exchange(run, 0):
            time.sleep(0.5)  # the first evaluation's time: nothing is sampled, and the trainer has both cores
            assert sampled == [] and run.exchange.start_mark() is None
            assert torch.get_num_threads() == 2
            batch, stats = take_rollouts(run, 0, [0])
            assert torch.get_num_threads() == 1, "the trainer's own thread while the role samples"
            assert run.exchange.start_mark()["step"] == 0 and stats["async/staleness"] == 0.0
            assert torch.equal(batch.behav_logp, a_batch().behav_logp)
            take_rollouts(run, 1, [1])  # the last step's batch: the role is done, its cores the trainer's
            assert torch.get_num_threads() == 2 and sampled == [0, 1]
        thread.join(30)
        assert not thread.is_alive(), "the role ends with the run"
    finally:
        torch.set_num_threads(before)
