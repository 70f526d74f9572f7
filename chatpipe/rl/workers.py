"""Several rollout workers (``rl.rollout.workers`` > 1): weights go to every worker in memory over
``torch.distributed``, with a version number; rollout batches still come back through the exchange dir.

    bus = WeightServer(store_address(), workers=2, device)      # trainer: a TCPStore it hosts
    bus.publish(version, policy.state_dict())                   # after every optimizer step; returns at once
    client = WeightClient(store_address(), worker=0, device)    # rollout worker 0
    version, flat = client.wait_version(at_least, timeout_s, alive)
    load_flat(policy, flat)

The trainer and worker ``w`` share a process group of their own (two ranks, gloo on CPU, NCCL on CUDA),
made from a prefix of one TCPStore the trainer hosts; the trainer feeds each one from a thread of its
own, so no group is used from two threads and a slow or dead worker never holds up the others or the
trainer's step. A message is a header (version, bytes, a hash of the state dict's layout) and the
state dict's bytes, flattened: tensors only, never a pickle. A worker's receiver thread keeps the
newest it was sent; versions only go up, and a worker may skip some (the bound needs "new enough").

Worker ``w`` samples the steps ``s`` with ``s % workers == w``, each whole: a step's batch is then
the one :func:`chatpipe.rl.sampling.sample_batch` draws for that step (its seed is the step's), so at
``max_staleness: 0`` it is the synchronous batch, whatever ``workers`` is. A shard of each step's
prompts per worker would draw other random numbers than the synchronous run does.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from chatpipe.rl.exchange import Exchange, ExchangeTimeout, RoleGone, RunMoved
from chatpipe.settings import RL_STORE_ENV

log = logging.getLogger("rl")

STOP = -1  # a header's version that says the run is over


class WorkerGone(RoleGone):
    """A rollout worker died or hangs: the trainer fails naming it."""


def node_name() -> str:
    """This process's node as the scheduler names it (two Slurm nodes may share one host name)."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def store_address(env: dict[str, str] | None = None) -> tuple[str, int]:
    """(host, port) of the trainer's TCPStore from ``CHATPIPE_RL_STORE`` (set by chatpipe.launch):
    ``<variable>:<port>``, where the variable holds the trainer's host (torchx's rank0_env), or
    ``<host>:<port>``."""
    env = os.environ if env is None else env
    value = env.get(RL_STORE_ENV, "")
    name, _, port = value.rpartition(":")
    if not name or not port.isdigit():
        raise ValueError(
            f"{RL_STORE_ENV}={value!r}: expected <host or variable naming it>:<port>; chatpipe.launch sets it for "
            "rl.rollout.workers > 1, so run the stage through it"
        )
    host = env.get(name, name) if name.replace("_", "").isalnum() and name.isupper() else name
    return host.split(",")[0], int(port)  # a node list's first node (Slurm's rank0_env)


def layout(state: dict[str, torch.Tensor]) -> int:
    """A 62-bit hash of the state dict's names, shapes and dtypes: the two ends must flatten alike."""
    text = ";".join(f"{k}:{tuple(v.shape)}:{v.dtype}" for k, v in state.items())
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def pack(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The state dict's bytes in its order, one uint8 tensor on its device (a copy: the optimizer
    goes on changing the weights while a thread sends them)."""
    return torch.cat([t.detach().reshape(-1).view(torch.uint8) for t in state.values()])


@torch.no_grad()
def load_flat(model: torch.nn.Module, flat: torch.Tensor, shape: int) -> None:
    """Copy :func:`pack`'s bytes into ``model``'s own tensors, in place and bit for bit; ``shape``: the
    sender's :func:`layout`."""
    state, offset = model.state_dict(), 0
    if layout(state) != shape:
        raise ValueError("the trainer's state dict has other names, shapes or dtypes than this worker's model")
    for t in state.values():
        n = t.numel() * t.element_size()
        t.reshape(-1).view(torch.uint8).copy_(flat[offset : offset + n])
        offset += n
    if offset != flat.numel():
        raise ValueError(f"weights of {flat.numel()} bytes for a model of {offset}: not the trainer's model")


def _pair_group(store: dist.Store, worker: int, rank: int, device: torch.device, timeout_s: float):
    """The two-rank group of the trainer (rank 0) and ``worker`` (rank 1)."""
    prefixed = dist.PrefixStore(f"rollout-worker-{worker}/", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(prefixed, rank, 2, dist.ProcessGroupNCCL.Options())
    return dist.ProcessGroupGloo(prefixed, rank, 2, timeout)


def _shutdown(group) -> None:
    """End a group's threads now: one left to the interpreter's exit aborts the process (gloo)."""
    if group is not None:
        with contextlib.suppress(Exception):
            group.shutdown()


def _broadcast(group, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


class WeightServer:
    """The trainer's end: hosts the TCPStore and feeds each worker the newest weights from a thread."""

    def __init__(self, address: tuple[str, int], workers: int, device: torch.device, timeout_s: float = 600.0):
        self.workers, self.device, self.timeout_s = workers, device, timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore("0.0.0.0", address[1], None, True, timeout=timeout, wait_for_workers=False)
        self._cond = threading.Condition()
        self._newest: tuple[int, int, torch.Tensor] | None = None  # (version, layout, bytes)
        self._closing = False
        self.errors: dict[int, BaseException] = {}
        self.sent: dict[int, int] = {}  # worker -> the newest version it was sent
        self._threads = [
            threading.Thread(target=self._feed, args=(w,), name=f"weights-to-worker-{w}", daemon=True)
            for w in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        """Weights after ``version`` optimizer steps, to every worker; returns once they are copied."""
        flat = pack(state).to(self.device)
        with self._cond:
            self._newest = (version, layout(state), flat)
            self._cond.notify_all()

    def _feed(self, worker: int) -> None:
        group = None
        try:
            group = _pair_group(self.store, worker, 0, self.device, self.timeout_s)
            sent = None
            while True:
                with self._cond:
                    self._cond.wait_for(lambda sent=sent: self._closing or (self._newest and self._newest[0] != sent))
                    newest, closing = self._newest, self._closing
                if closing:
                    _broadcast(group, torch.tensor([STOP, 0, 0], dtype=torch.int64, device=self.device))
                    return
                version, shape, flat = newest
                _broadcast(group, torch.tensor([version, flat.numel(), shape], dtype=torch.int64, device=self.device))
                _broadcast(group, flat)
                sent = self.sent[worker] = version
        except Exception as e:  # the worker died (its socket closed) or never came: the trainer names it
            self.errors[worker] = e
        finally:
            _shutdown(group)

    def close(self, grace_s: float = 5.0) -> None:
        """Tell every worker the run is over, and wait ``grace_s`` at most for the threads."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        deadline = time.monotonic() + grace_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))


class WeightClient:
    """A worker's end: a thread receives every version the trainer sends and keeps the newest."""

    def __init__(self, address: tuple[str, int], worker: int, device: torch.device, timeout_s: float = 600.0):
        self.worker, self.device, self.timeout_s, self.address = worker, device, timeout_s, address
        self._cond = threading.Condition()
        self._newest: tuple[int, torch.Tensor, int] | None = None  # (version, bytes, layout)
        self.stopped = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._receive, name="weights-from-trainer", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        group = None
        try:
            timeout = datetime.timedelta(seconds=self.timeout_s)
            store = dist.TCPStore(self.address[0], self.address[1], None, False, timeout=timeout)
            group = _pair_group(store, self.worker, 1, self.device, self.timeout_s)
            while True:
                header = torch.zeros(3, dtype=torch.int64, device=self.device)
                _broadcast(group, header)
                version, nbytes, shape = (int(x) for x in header.tolist())
                if version == STOP:
                    break
                flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                _broadcast(group, flat)
                with self._cond:
                    self._newest = (version, flat, shape)
                    self._cond.notify_all()
        except Exception as e:  # the trainer died, or never came
            self.error = e
        _shutdown(group)
        del group  # before the main thread may exit: a group left to the interpreter's exit aborts it
        with self._cond:
            self.stopped = True
            self._cond.notify_all()

    def wait_version(self, at_least: int, timeout_s: float, alive: Callable[[], bool]) -> tuple[int, torch.Tensor, int]:
        """The newest (version, bytes, layout) once it is ``at_least`` or newer. Raises :class:`RunMoved` when the
        trainer said stop (or ``alive()`` is false), and :class:`ExchangeTimeout` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._newest is None or self._newest[0] < at_least:
                if self.error is not None:
                    raise RoleGone(f"rollout worker {self.worker}: the trainer's weights stopped coming: {self.error}")
                if self.stopped or not alive():
                    raise RunMoved(f"the trainer ended the run before sending weights of version {at_least}")
                if time.monotonic() > deadline:
                    raise ExchangeTimeout(
                        f"no weights of version {at_least} after {timeout_s:.0f} s (rl.rollout.timeout_s)"
                    )
                self._cond.wait(0.5)  # and look at alive() again
            return self._newest

    def wait_stop(self, alive: Callable[[], bool]) -> None:
        """Until the trainer says the run is over (it still trains the last steps and evaluates)."""
        with self._cond:
            while not self.stopped:
                alive()
                self._cond.wait(0.5)
        self._thread.join()
        if self.error is not None:
            raise RoleGone(f"rollout worker {self.worker}: the trainer went away before the run's end: {self.error}")


# ---------------------------------------------------------------------- the trainer's side


class WorkersExchange(Exchange):
    """The trainer's :class:`Exchange` with several workers: weights go out through ``server``, never to a
    file; the rollout role is alive while every worker is (its heartbeat, and its weights' socket)."""

    def __init__(self, root, dead_after_s: float, server: WeightServer):
        super().__init__(root, dead_after_s)
        self.server = server

    def publish(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        self.server.publish(version, weights)

    def check_alive(self, role: str) -> None:
        if role != "rollout":
            super().check_alive(role)
            return
        for w in range(self.server.workers):
            if w in self.server.errors:
                raise WorkerGone(
                    f"rollout worker {w} {self.where(w)}: its weights could not be sent "
                    f"({self.server.errors[w]}): it was killed or crashed; its log says why"
                )
            try:
                super().check_alive(f"rollout-{w}")
            except RoleGone:
                raise WorkerGone(
                    f"rollout worker {w} {self.where(w)} has given no sign of life for {self.dead_after_s:.0f} s "
                    "(rl.rollout.heartbeat_timeout_s): it was killed or hangs; its log says why"
                ) from None

    def where(self, worker: int) -> str:
        """Where worker ``worker`` runs, from its heartbeat file."""
        beat = self._read_json(f"rollout-{worker}.beat")
        return (
            f"(replica {worker}, node {beat['node']}, pid {beat['pid']})"
            if beat
            else f"(replica {worker}, no heartbeat yet)"
        )

    def stop(self, grace_s: float = 5.0) -> None:
        """Tell every worker the run is over (over the weights' groups) and remove the dir."""
        self.server.close(grace_s)
        self.remove()


def trainer_exchange(cfg, root, device: torch.device) -> Exchange:
    """The trainer's exchange: the shared dir alone with one rollout worker, with a :class:`WeightServer`
    beside it with more. ``cfg``: RLSettings."""
    if cfg.rollout.workers == 1:
        return Exchange(root, cfg.rollout.heartbeat_timeout_s)
    server = WeightServer(store_address(), cfg.rollout.workers, device, cfg.rollout.timeout_s)
    log.info(
        "rollout workers: %d, weights over torch.distributed; trainer on node %s", cfg.rollout.workers, node_name()
    )
    return WorkersExchange(root, cfg.rollout.heartbeat_timeout_s, server)


# ---------------------------------------------------------------------- a worker's side


def run_rollout_worker(
    ex: Exchange,
    client: WeightClient,
    policy: torch.nn.Module,
    sample_step: Callable[[int], dict[str, Any]],
    *,
    workers: int,
    max_steps: int,
    max_staleness: int,
    timeout_s: float,
) -> int:
    """Worker ``client.worker``'s run: sample its steps (``s % workers == worker``) from the trainer's start
    on, each with the newest weights it holds once they are at most ``max_staleness`` versions behind,
    stamped with their version; then wait for the trainer's stop. Returns the batches written."""
    worker = client.worker

    def alive() -> bool:
        ex.check_alive("trainer")
        return True

    client.wait_version(-(2**62), timeout_s, alive)  # the first weights: the trainer has started
    ex.wait_for(lambda: ex.start_mark() is not None, timeout_s, alive, "the trainer's start mark")
    mark, held, written = ex.start_mark(), -1, 0
    start = int(mark["step"])
    for step in range(start + (worker - start) % workers, max_steps, workers):
        t0 = time.perf_counter()
        version, flat, shape = client.wait_version(step - max_staleness, timeout_s, alive)
        if version > held:  # the bound allows anything this new or newer; take the newest there is
            load_flat(policy, flat, shape)
            held = version
        t1 = time.perf_counter()
        payload = sample_step(step)
        stamp = {"run": mark["id"], "version": held, "gen_seconds": time.perf_counter() - t1, "idle_seconds": t1 - t0}
        ex.put_rollouts(step, payload | stamp)
        written += 1
    client.wait_stop(alive)
    return written


def rollout_worker(cfg, root, policy: torch.nn.Module, sample_step, device: torch.device, worker: int) -> int:
    """One replica of the rollout role with ``rl.rollout.workers`` > 1; ``cfg``: RLSettings."""
    ex = Exchange(root, cfg.rollout.heartbeat_timeout_s)
    node = node_name()
    log.info("rollout worker %d of %d on node %s (pid %d)", worker, cfg.rollout.workers, node, os.getpid())
    # the heartbeat (node, pid) first: the trainer names this worker by it if it dies while connecting
    with ex.heartbeat(f"rollout-{worker}", {"node": node, "pid": os.getpid()}):
        client = WeightClient(store_address(), worker, device, cfg.rollout.timeout_s)
        with contextlib.suppress(RunMoved):  # the trainer ended first (it failed): its log says why
            return run_rollout_worker(
                ex,
                client,
                policy,
                sample_step,
                workers=cfg.rollout.workers,
                max_steps=cfg.max_steps,
                max_staleness=cfg.rollout.max_staleness,
                timeout_s=cfg.rollout.timeout_s,
            )
    return 0
