"""Run a stage as a Slurm job: submit through torchx's slurm scheduler, stream its log, report, cancel.

    CHATPIPE_PROFILE=slurm python -m chatpipe.launch pretrain     # what dvc.yaml runs under that profile

torchx 0.7 builds the job: one heterogeneous-job component per node, each an ``srun`` of the same
``torchrun`` (or ``python -m``) command. This module adjusts that request before it is submitted:
- worker logs go to ``<log_dir>/slurm/<stage>-<jobid>-<role>-<k>.{out,err}`` (absolute paths, so they
  land in the repository wherever the node starts the step, not beside the submitting shell);
- a multi-node job asks for whole nodes (``--exclusive``), so its components are on distinct nodes;
- every worker first checks that it sees the repository at the submitting host's path (a marker file
  written just before submission) and otherwise exits with :data:`NO_SHARED_FS_EXIT`, naming the path
  and its node: artifacts/ and checkpoints/ are read and written through that same path.

The job is then followed here rather than with torchx's ``wait``: torchx 0.7 reads state only
through ``sacct`` and its state table lacks the ``CANCELLED by <uid>`` that ``sacct`` prints after a
cancel (its ``status`` raises AssertionError), so :func:`job_status` queries ``sacct`` (and ``squeue``
before accounting knows the job) itself. The rank-0 log is printed live; when the job fails, the tail
of each other failed component's log and the exit code or signal of the worker that failed are too.
SIGINT/SIGTERM/SIGHUP to the launcher, or the death of its parent (DVC), cancel the job (``scancel``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from chatpipe.procs import die_with_parent, parent_gone

# Exit status of a worker that cannot see the repository (EX_NOINPUT from sysexits.h).
NO_SHARED_FS_EXIT = 66
# Slurm job states after which nothing more runs (sacct's base word, without "by <uid>").
TERMINAL = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
     "PREEMPTED", "REVOKED", "SPECIAL_EXIT"}
)  # fmt: skip
TAIL_LINES = 30


@dataclass
class Component:
    """One heterogeneous-job component (one node's torchrun), or the whole job when it is not heterogeneous."""

    index: int
    state: str  # sacct's State as printed, e.g. "CANCELLED by 0"
    exit_code: int = 0
    signal: int = 0
    node: str = ""

    @property
    def base_state(self) -> str:
        """The state word alone: ``CANCELLED by 0`` -> ``CANCELLED``."""
        return self.state.split()[0] if self.state else "UNKNOWN"


@dataclass
class JobStatus:
    """A Slurm job's state, from sacct (or squeue while accounting does not know it yet)."""

    job_id: str
    components: list[Component] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return bool(self.components) and all(c.base_state in TERMINAL for c in self.components)

    @property
    def state(self) -> str:
        """SUCCEEDED, FAILED, CANCELLED (torchx's words) when done; otherwise Slurm's PENDING/RUNNING."""
        states = {c.base_state for c in self.components}
        if not self.done:
            return "RUNNING" if "RUNNING" in states else (sorted(states)[0] if states else "UNKNOWN")
        if states == {"COMPLETED"}:
            return "SUCCEEDED"
        # A component that failed is the cause; the others were cancelled by --kill-on-bad-exit.
        return "CANCELLED" if states <= {"CANCELLED", "COMPLETED"} else "FAILED"

    @property
    def nodes(self) -> list[str]:
        return [c.node for c in self.components]


def _slurm(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True)


def _exit_pair(text: str) -> tuple[int, int]:
    code, _, sig = text.partition(":")
    return (int(code) if code.isdigit() else 0, int(sig) if sig.isdigit() else 0)


def job_status(job_id: str) -> JobStatus | None:
    """The job's components with state, exit code/signal and node; None when Slurm does not know the job."""
    out = _slurm(
        "sacct", "-j", job_id, "--parsable2", "--noheader", "--format=JobID,State,ExitCode,NodeList"
    )  # fmt: skip
    comps: dict[int, Component] = {}
    if out.returncode == 0:
        for line in out.stdout.splitlines():
            parts = line.split("|")
            if len(parts) < 4:
                continue
            jid, state, exit_code, node = parts[:4]
            head, _, step = jid.partition(".")
            base, _, het = head.partition("+")
            if base != job_id:
                continue
            idx = int(het) if het.isdigit() else 0
            code, sig = _exit_pair(exit_code)
            if not step:
                comps[idx] = Component(idx, state, code, sig, node)
            elif step not in ("batch", "extern") and idx in comps and (code or sig):
                # the srun step's status is the worker's; the allocation's hides a signal behind exit 0
                comps[idx].exit_code, comps[idx].signal = code, sig
    if comps:
        return JobStatus(job_id, [comps[k] for k in sorted(comps)])
    # Accounting records a job a moment after submission; the controller knows it at once.
    out = _slurm("squeue", "-j", job_id, "-h", "-o", "%i|%T|%N")
    rows = [r.split("|") for r in out.stdout.splitlines() if r.count("|") == 2] if out.returncode == 0 else []
    if not rows:
        return None
    return JobStatus(job_id, [Component(int(jid.partition("+")[2] or 0), st, node=n) for jid, st, n in rows])


def shared_fs_guard(repo: Path, marker: Path, token: str) -> str:
    """Bash that stops a worker which cannot see the repository, naming the path and the node."""
    msg = (
        "chatpipe: node %s cannot see the repository at %s (marker %s missing or different). Workers read and"
        " write artifacts/ and checkpoints/ there: mount the repository on every node at the same path as on"
        " the submitting host.\\n"
    )
    quoted = " ".join(shlex.quote(str(p)) for p in (repo, marker))
    return (
        f'if [ "$(cat {shlex.quote(str(marker))} 2>/dev/null)" != {token} ]; then '
        f'printf {shlex.quote(msg)} "${{SLURMD_NODENAME:-$(hostname)}}" {quoted} >&2; '
        f"exit {NO_SHARED_FS_EXIT}; fi; cd {shlex.quote(str(repo))} && "
    )


def prepare(runner, app, cfg: dict, stage: str, log_dir: Path, repo: Path):
    """torchx's sbatch request for ``app`` with chatpipe's log paths, node exclusivity and shared-FS check.

    Returns (dry-run info to submit with ``runner.schedule``, per-component log paths, marker file, token).
    """
    from torchx.specs import macros

    for role in app.roles:  # one-process stages run torchx's utils.python, whose role is "python"
        if role.name == "python":
            role.name = stage  # job names (sacct, squeue) and log names then say which stage
    info = runner.dryrun(app, "slurm", cfg=cfg)
    req = info.request
    log_dir = log_dir.resolve() / "slurm"
    token = uuid.uuid4().hex
    marker = log_dir / f".repo-{token}"
    guard = shared_fs_guard(repo, marker, token)
    logs = []
    names = list(req.replicas)
    for i, name in enumerate(names):
        r = req.replicas[name]
        out, err = (f"{log_dir}/{stage}-{macros.app_id}-{name}.{ext}" for ext in ("out", "err"))
        r.srun_opts.update(output=out, error=err)
        logs.append((out, err))
        if len(names) > 1:
            r.sbatch_opts["exclusive"] = None  # whole nodes: the components cannot share one
        inner = r.args[1] if r.entrypoint == "bash" and r.args[:1] == ["-c"] else shlex.join([r.entrypoint, *r.args])
        r.entrypoint, r.args = "bash", ["-c", guard + inner]
        if i == 0:  # the batch script's own output (sbatch puts it in the submit dir otherwise)
            r.sbatch_opts["output"] = f"{log_dir}/{stage}-%j.batch.out"
    return info, logs, marker, token


class _Follower:
    """Prints the lines appended to a file since the last call (the file may not exist yet)."""

    def __init__(self, path: Path):
        self.path, self.pos, self.partial = path, 0, ""

    def pump(self, final: bool = False) -> None:
        try:
            with self.path.open("r", errors="replace") as f:
                f.seek(self.pos)
                data = f.read()
                self.pos = f.tell()
        except FileNotFoundError:
            return
        text = self.partial + data
        lines = text.split("\n")
        self.partial = "" if final else lines.pop()
        for line in lines if final else lines:
            if line or not final:
                print(line, flush=True)


def tail(path: Path, n: int = TAIL_LINES) -> list[str]:
    """The last ``n`` lines of ``path`` ([] when it does not exist)."""
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except FileNotFoundError:
        return []


# torchrun's failure summary: "  rank      : 1 (local_rank: 0)" then "  exitcode  : -9 (pid: 123)".
_ROOT_CAUSE = re.compile(r"^\s*rank\s*:\s*(\d+) \(local_rank.*\n\s*exitcode\s*:\s*(-?\d+)", re.M)


def describe_failure(status: JobStatus, logs: list[tuple[Path, Path]], repo: Path) -> list[str]:
    """One line per failed component: node, exit code or signal, and the failed worker's rank and exit/signal."""
    lines = []
    for comp in status.components:
        if comp.base_state == "COMPLETED":
            continue
        out, err = logs[comp.index] if comp.index < len(logs) else (Path("?"), Path("?"))
        where = f"component {comp.index} on node {comp.node or '?'}: {comp.state}"
        how = f", exit code {comp.exit_code}" + (f", signal {_signame(comp.signal)}" if comp.signal else "")
        line = where + how
        if comp.exit_code == NO_SHARED_FS_EXIT:
            line += f" -- the node cannot see the repository at {repo} (shared filesystem required)"
        found = _ROOT_CAUSE.findall(Path(err).read_text(errors="replace")) if Path(err).exists() else []
        if found:  # torchrun's "Root Cause" block names the worker that failed first
            rank, code = found[-1]
            code = int(code)
            line += f"; worker rank {rank} " + (
                f"killed by signal {_signame(-code)}" if code < 0 else f"exited with code {code}"
            )
        elif not Path(out).exists() and not Path(err).exists() and comp.base_state not in ("CANCELLED", "PENDING"):
            line += f" -- it wrote no log at {out}: does the node see the repository at {repo}?"
        lines.append(line)
    return lines


def _signame(sig: int) -> str:
    try:
        return f"{sig} ({signal.Signals(sig).name})"
    except ValueError:
        return str(sig)


def _die_with_parent() -> None:
    """Get SIGTERM when the parent (DVC) dies, so an orphaned launcher still cancels its job (Linux)."""
    parent = os.getppid()
    if die_with_parent(signal.SIGTERM) and parent_gone(parent):
        os.kill(os.getpid(), signal.SIGTERM)


def cancel(job_id: str, timeout_s: float = 60.0) -> JobStatus | None:
    """``scancel`` the job and wait until the controller no longer runs any of it."""
    _slurm("scancel", job_id)
    wait_until_gone(job_id, timeout_s)
    return job_status(job_id)


def wait_until_gone(job_id: str, timeout_s: float = 60.0, poll_s: float = 0.5) -> bool:
    """Wait until ``squeue`` no longer lists the job as pending, running or COMPLETING.

    Accounting (sacct) calls a job CANCELLED or FAILED as soon as it is decided, while its
    processes may still be dying on the nodes (squeue's COMPLETING): a retry started then finds
    the rendezvous port still bound (EADDRINUSE). False when ``timeout_s`` passed first.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        q = _slurm("squeue", "-j", job_id, "-h", "-o", "%T")
        if q.returncode != 0 or not q.stdout.strip() or set(q.stdout.split()) <= {"CANCELLED", "COMPLETED"}:
            return True
        time.sleep(poll_s)
    return False


def run(runner, app, cfg: dict, stage: str, log_dir: Path, poll_s: float = 1.0) -> int:
    """Submit ``app`` as a Slurm job and follow it to the end; 0 succeeded, 1 failed, 130 interrupted."""
    from torchx.specs import parse_app_handle

    repo = Path.cwd().resolve()
    info, log_paths, marker, token = prepare(runner, app, cfg, stage, log_dir, repo)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(token)
    _die_with_parent()
    started = time.perf_counter()
    job_id = None
    # No signal between sbatch and knowing the job id: a job submitted but not known could not be cancelled.
    blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
    try:
        try:
            handle = runner.schedule(info)
            job_id = parse_app_handle(handle).app_id
            print(
                f"[launch] {stage}: {handle} (slurm job {job_id}; logs {marker.parent}/{stage}-{job_id}-*)", flush=True
            )
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
        logs = [tuple(Path(p.replace("${app_id}", job_id)) for p in pair) for pair in log_paths]
        rank0 = [_Follower(p) for p in logs[0]]
        status, next_poll = None, 0.0
        while True:
            for f in rank0:
                f.pump()
            if time.monotonic() >= next_poll:
                status = job_status(job_id)
                next_poll = time.monotonic() + poll_s
                if status is not None and status.done:
                    break
            time.sleep(0.2)
        for f in rank0:
            f.pump(final=True)
        seconds = time.perf_counter() - started
        if status.state != "SUCCEEDED":
            wait_until_gone(job_id)  # a retry must not meet this job's processes (and ports) still dying
            for comp in status.components:
                if comp.index == 0 or comp.base_state == "COMPLETED" or comp.index >= len(logs):
                    continue
                for path in logs[comp.index]:
                    lines = tail(path)
                    if lines:
                        print(f"[launch] --- last {len(lines)} lines of {path} ---", flush=True)
                        print("\n".join(lines), flush=True)
            for line in describe_failure(status, logs, repo):
                print(f"[launch] {stage}: {line}", flush=True)
        nodes = ",".join(status.nodes)
        print(f"[launch] {stage}: {status.state} ({seconds:.1f} s) slurm job {job_id} on {nodes}", flush=True)
        return 0 if status.state == "SUCCEEDED" else 1
    except KeyboardInterrupt:
        if job_id is None:
            return 130
        # Later stop signals (DVC's death signal follows the flow's SIGTERM) are held by the launcher's
        # handler (chatpipe.launch._interrupt), so nothing cuts the cancel short. Whoever reads our log
        # may be gone already (a killed flow): a broken pipe must not skip the cancel.
        with contextlib.suppress(OSError):
            print(f"[launch] {stage}: interrupted, cancelling slurm job {job_id}", flush=True)
        status = cancel(job_id)
        with contextlib.suppress(OSError):
            print(f"[launch] {stage}: {status.state if status else 'UNKNOWN'} slurm job {job_id}", flush=True)
        return 130
    finally:
        marker.unlink(missing_ok=True)
