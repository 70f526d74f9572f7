"""Where asynchronous RL's two roles meet: one directory of whole files.

The trainer publishes the policy's weights after every optimizer step, with a version number (the
optimizer steps behind them). The rollout role samples step ``s``'s prompts with the newest weights
it holds, once they are at most ``max_staleness`` versions behind ``s``, and leaves the batch as
one file per step, stamped with the version that sampled it. So the role is never more than
``max_staleness + 1`` steps ahead, and nothing older than the bound is ever sampled.

Every file is written to a hidden name and renamed, so a reader sees the old file or the whole new
one; every file is read with ``torch.load(weights_only=True)``: tensors, numbers, strings and lists,
never code. The trainer starts each run (and each resume) with :meth:`Exchange.start`, which clears
what an earlier run left and names the step it starts from; a rollout role that sees a new start
begins again from there. On one host the directory sits in shared memory (``/dev/shm``); across
Slurm nodes it must be on the filesystem both share.

    ex = Exchange(Path("/dev/shm/chatpipe-rl"))
    ex.start(step=0, weights=policy.state_dict())             # trainer
    version, state = ex.weights()                             # rollout role
    ex.put_rollouts(0, {"version": version, ...})             # rollout role
    batch = ex.take_rollouts(0, timeout_s=600)                # trainer
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from chatpipe.io import atomic_write
from chatpipe.paths import WORK
from chatpipe.procs import process_start

POLL_S = 0.005  # how often a waiting role looks again: small beside a decode step


class ExchangeTimeout(TimeoutError):
    """The other role produced nothing in time: it died, or was never started."""


class RunMoved(Exception):
    """The trainer started again (a resume) or stopped while the rollout role waited."""


class RoleGone(RuntimeError):
    """The other role's heartbeat stopped: it was killed or hangs."""


HEARTBEAT_S = 1.0  # how often each role says it is alive (a thread: generation or an update may take long)

LAUNCH_DIR = re.compile(r"[0-9a-f]{12}|default")  # the names launch_dir gives a launch's dir
OWNER = "owner.json"  # the trainer that owns a launch's dir: host, pid and the pid's start time


# ---------------------------------------------------------------------- which dir, and whose


def launch_dir(setting: str, launch_id: str = "default", *, one_host: bool = True) -> Path:
    """The one place a launch's shared dir is decided: ``<base>/<launch_id>``. The base is ``setting``
    (``rl.rollout.exchange_dir``) when given; else shared memory on this host (``/dev/shm``, one dir per project)
    when both roles run on it (``one_host``); else the project's checkpoints dir, which every node sees
    (resuming needs it to) and which stands in where a host has no shared memory (macOS)."""
    shm = Path("/dev/shm")
    if setting:
        base = Path(setting)
    elif one_host and shm.is_dir():
        project = hashlib.sha256(str(Path.cwd().resolve()).encode()).hexdigest()[:12]
        base = shm / f"chatpipe-rl-{project}"
    else:
        base = WORK / "rl" / "exchange"
    return base / launch_id


def this_process() -> dict[str, Any]:
    """Who this process is, in a form another process can check later: host, pid, the pid's start time."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start(os.getpid())}


def owner_alive(owner: dict[str, Any]) -> bool:
    """False only when ``owner`` (:func:`this_process` of a trainer) is provably gone: on this host,
    with its pid unused or used by a process that started at another time. Another host's owner cannot
    be checked from here, so it counts as alive."""
    if owner.get("host") != socket.gethostname():
        return True
    started = process_start(int(owner["pid"]))
    return started is not None and started == owner.get("start")


def read_owner(root: Path) -> dict[str, Any] | None:
    """The owner record of the launch dir ``root``, or None when it has none (yet) or it is unreadable."""
    try:
        owner = json.loads((root / OWNER).read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) and {"host", "pid", "start"} <= owner.keys() else None


def claim(root: Path) -> None:
    """Make ``root`` this trainer's launch dir: refused while another live trainer owns it (two runs of
    one project without the launcher both use ``default``), else its owner record is this process."""
    owner = read_owner(root)
    me = this_process()
    if owner is not None and owner_alive(owner) and owner["pid"] != me["pid"]:
        raise RuntimeError(
            f"{root} belongs to another RL trainer (pid {owner['pid']} on {owner['host']}), still running: "
            "launch each run with `python -m chatpipe.launch rl` (a dir per launch), or give it its own "
            "rl.rollout.exchange_dir"
        )
    root.mkdir(parents=True, exist_ok=True)
    with atomic_write(root / OWNER, fsync=False) as f:
        json.dump(me, f)


def reap_dead_launches(root: Path) -> list[Path]:
    """Remove the launch dirs beside ``root`` whose trainer is provably dead (:func:`owner_alive`): a
    killed trainer cannot remove its own, and its weights would stay in shared memory. A dir with no
    owner record, a live owner or one on another host stays, and so does anything not named as
    :func:`launch_dir` names them. Returns the dirs removed."""
    removed = []
    for old in sorted(root.parent.iterdir()) if root.parent.is_dir() else []:
        if old == root or not old.is_dir() or not LAUNCH_DIR.fullmatch(old.name):
            continue
        owner = read_owner(old)
        if owner is not None and not owner_alive(owner):
            shutil.rmtree(old, ignore_errors=True)
            removed.append(old)
    return removed


class Exchange:
    """The shared directory of one RL run: weights (newest only), rollouts by step, start and stop marks."""

    def __init__(self, root: Path, dead_after_s: float = 30.0):
        self.root = Path(root)
        self.run_id = ""  # the trainer's, set by start(): batches of other runs are not taken
        self.dead_after_s = dead_after_s
        self._seen: dict[str, tuple[Any, float]] = {}  # a peer's last beat, and when (here) it changed

    # ------------------------------------------------------------------ heartbeats

    @contextlib.contextmanager
    def heartbeat(self, role: str, info: dict | None = None) -> Iterator[None]:
        """Say ``role`` is alive every :data:`HEARTBEAT_S` seconds from a thread, while the block runs;
        ``info`` (its node, its pid) goes into every beat, for whoever names it when it stops."""
        done = threading.Event()

        def write(count: int) -> None:
            with contextlib.suppress(OSError):  # the trainer may be clearing the dir to start again
                self._write_json(f"{role}.beat", {"beat": count, "id": secrets.token_hex(4), **(info or {})})

        def beat() -> None:
            count = 1
            while not done.wait(HEARTBEAT_S):
                count += 1
                write(count)

        write(1)  # before the block runs: whoever names this role when it stops finds its node and pid
        thread = threading.Thread(target=beat, name=f"{role}-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def check_alive(self, role: str) -> None:
        """Raise :class:`RoleGone` when ``role``'s heartbeat has not changed for ``dead_after_s``
        (counted on this host's clock from when this process first looked)."""
        beat, now = self._read_json(f"{role}.beat"), time.monotonic()
        last, since = self._seen.get(role, (None, now))
        if beat != last or role not in self._seen:
            self._seen[role] = (beat, now)
        elif now - since > self.dead_after_s:
            raise RoleGone(
                f"the {role} role has given no sign of life for {self.dead_after_s:.0f} s "
                f"(rl.rollout.heartbeat_timeout_s; {self.root}): it was killed or hangs; its log says why"
            )

    # ------------------------------------------------------------------ trainer side

    def start(self, step: int, weights: dict[str, torch.Tensor]) -> str:
        """Begin a run at ``step``: clear the directory, publish ``weights`` as version ``step`` and
        write a fresh start mark (a new id), which tells a running rollout role to begin again."""
        # the role beats into the directory once a second, from another process or node, so the
        # directory is emptied file by file rather than removed (removing it races the beat: "exists"
        # or "not empty"); a file the role writes meanwhile is harmless: batches carry the start's id
        self.root.mkdir(parents=True, exist_ok=True)
        for entry in self.root.iterdir():
            if entry.name == OWNER:  # the trainer's claim on the dir (claim) outlives a restart
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        self.publish(step, weights)
        self.run_id = secrets.token_hex(8)
        self._write_json("start.json", {"step": step, "id": self.run_id})
        return self.run_id

    def publish(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        """The policy after ``version`` optimizer steps; the version file is written after the weights,
        so a reader who sees a version finds weights at least that new."""
        with atomic_write(self.root / "weights.pt", "wb", fsync=False) as f:
            torch.save({"version": version, "state": weights}, f)
        self._write_json("version.json", {"version": version})

    def has_rollouts(self, step: int) -> bool:
        """Whether step ``step``'s rollouts are in the dir, whole (they are written aside, then renamed)."""
        return self._rollouts_path(step).exists()

    def take_rollouts(self, step: int, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> dict[str, Any]:
        """Wait for step ``step``'s rollouts, read them and remove the file. Raises
        :class:`ExchangeTimeout` after ``timeout_s`` or as soon as ``alive()`` is false."""
        path = self._rollouts_path(step)
        while True:
            self.wait_for(path.exists, timeout_s, alive, f"rollouts of step {step}")
            payload = torch.load(path, map_location="cpu", weights_only=True)
            path.unlink()
            if payload.get("run") == self.run_id:
                return payload
            # a batch the role finished for the run before this start (it checks, but may lose the race)

    def stop(self, grace_s: float = 5.0) -> None:
        """Tell the rollout role the run is over; it removes the dir as it exits, or after ``grace_s``
        (a role that is gone) the trainer does, so no weights stay behind in shared memory."""
        self._write_json("stop.json", {"stop": True})
        deadline = time.monotonic() + grace_s
        while self.root.exists() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        self.remove()

    def remove(self) -> None:
        """Delete the dir (the newest weights, in shared memory), and the project's dir above it once
        no launch has one in it."""
        shutil.rmtree(self.root, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.root.parent.rmdir()

    # ------------------------------------------------------------------ rollout-role side

    def start_mark(self) -> dict[str, Any] | None:
        """The trainer's newest start mark ({"step", "id"}), or None before the trainer started."""
        return self._read_json("start.json")

    def stopped(self) -> bool:
        return (self.root / "stop.json").exists()

    def version(self) -> int:
        """The newest published version (-1 before the first)."""
        mark = self._read_json("version.json")
        return -1 if mark is None else int(mark["version"])

    def weights(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, state dict) of the newest published weights."""
        payload = torch.load(self.root / "weights.pt", map_location="cpu", weights_only=True)
        return int(payload["version"]), payload["state"]

    def wait_version(self, at_least: int, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> int:
        """Wait until weights of version ``at_least`` or newer are out; returns the newest version."""
        self.wait_for(lambda: self.version() >= at_least, timeout_s, alive, f"weights of version {at_least}")
        return self.version()

    def put_rollouts(self, step: int, payload: dict[str, Any]) -> None:
        with atomic_write(self._rollouts_path(step), "wb", fsync=False) as f:
            torch.save(payload, f)

    # ------------------------------------------------------------------ plumbing

    def wait_for(self, ready: Callable[[], bool], timeout_s: float, alive: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if not alive():
                raise RunMoved(f"stopped waiting for {what} in {self.root}: the run started again or stopped")
            if time.monotonic() > deadline:
                raise ExchangeTimeout(
                    f"no {what} in {self.root} after {timeout_s:.0f} s (rl.rollout.timeout_s): is the other "
                    "role running? Its log says why it stopped"
                )
            time.sleep(POLL_S)

    def _rollouts_path(self, step: int) -> Path:
        return self.root / f"rollouts-{step:08d}.pt"

    def _write_json(self, name: str, obj: dict) -> None:
        with atomic_write(self.root / name, fsync=False) as f:
            json.dump(obj, f)

    def _read_json(self, name: str) -> dict | None:
        try:
            return json.loads((self.root / name).read_text())
        except FileNotFoundError:
            return None


# ---------------------------------------------------------------------- the rollout role


def run_rollout_role(
    ex: Exchange,
    policy: torch.nn.Module,
    sample_step: Callable[[int], dict[str, Any]],
    *,
    max_steps: int,
    max_staleness: int,
    timeout_s: float,
) -> int:
    """The rollout role's life: for each run the trainer starts (and each resume), sample its steps
    from the start mark's step on, until the trainer says stop. ``sample_step(step)`` samples that
    step's batch with ``policy`` as it is (its payload dict); this loop keeps ``policy`` on the newest
    weights the bound allows and stamps each batch with their version, the seconds it sampled and the
    seconds it waited before. Returns the batches written."""
    written = 0
    while True:
        ex.wait_for(lambda: ex.start_mark() is not None or ex.stopped(), timeout_s, lambda: True, "the trainer's start")
        if ex.stopped():  # the run is over
            ex.remove()
            return written
        mark = ex.start_mark()
        try:
            written += _sample_run(ex, policy, sample_step, mark, max_steps, max_staleness, timeout_s)
        except (RunMoved, FileNotFoundError):  # the trainer cleared the dir to start again, or stopped
            continue
        # the trainer still trains the last steps and evaluates: no time bound here, only its heartbeat
        ex.wait_for(
            lambda m=mark: ex.stopped() or ex.start_mark() != m,
            float("inf"),
            lambda: ex.check_alive("trainer") or True,
            "the trainer's end",
        )


def _sample_run(ex, policy, sample_step, mark: dict, max_steps: int, max_staleness: int, timeout_s: float) -> int:
    """One run's steps, from its start mark on; see :func:`run_rollout_role`."""
    held = -1

    def alive() -> bool:
        ex.check_alive("trainer")
        return not ex.stopped() and ex.start_mark() == mark

    for step in range(int(mark["step"]), max_steps):
        t0 = time.perf_counter()
        newest = ex.wait_version(step - max_staleness, timeout_s, alive)
        if newest > held:  # the bound allows anything this new or newer; take the newest there is
            held, state = ex.weights()
            policy.load_state_dict(state)
        t1 = time.perf_counter()
        payload = sample_step(step)
        if not alive():
            raise RunMoved("the trainer started again while this step sampled")
        stamp = {"run": mark["id"], "version": held, "gen_seconds": time.perf_counter() - t1, "idle_seconds": t1 - t0}
        ex.put_rollouts(step, payload | stamp)
    return max_steps - int(mark["step"])
