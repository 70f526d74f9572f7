"""Launch a stage through torchx: a ``dist.ddp`` AppDef built from the `launch` params.

    python -m chatpipe.launch pretrain                    # what dvc.yaml runs
    python -m chatpipe.launch pretrain -- --max_steps=20  # overrides go to the stage
    python -m chatpipe.launch pretrain --dryrun           # print the scheduler request only
    python -m chatpipe.launch pretrain --scheduler slurm --dryrun
    python -m chatpipe.launch reward_model --if-read      # dvc.yaml's: a marker when RL reads no reward model

Every scheduler (``local_cwd``, ``slurm``, ``kubernetes``) runs the same
``torchrun -m stages.<stage>`` command (plain ``python -m`` for a single process); only the
topology and scheduler options differ.
The worker log is streamed to this process's stdout and the exit code says whether the app
succeeded, so DVC and Prefect see a crashed or killed worker as a failed stage.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import secrets
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path

from chatpipe.io import write_text_atomic
from chatpipe.paths import ARTIFACTS, REWARD_MODEL_NOT_READ
from chatpipe.procs import die_with_parent, parent_gone, process_start
from chatpipe.settings import (
    RL_EXCHANGE_ENV,
    RL_ROLE_ENV,
    RL_STORE_ENV,
    RL_THREADS_AFTER_ENV,
    RL_WORKER_ENV,
    RL_WORKER_OFFSET_ENV,
    LaunchSettings,
    ParamsError,
    RewardModelSettings,
    RLSettings,
    check_env_keeps_stages,
    load_section,
    pipeline_stages,
    reward_model_unread,
    validate_all,
)
from chatpipe.stage_metrics import write_metrics

# Stages whose work is inherently one process (data prep, tokenizer training, the report, the export).
SINGLE_WORKER_STAGES = frozenset({"data", "tokenizer", "report", "export"})
# what a stage reads and writes beside the code (relative to the repo): stage outputs, in-progress
# checkpoints, the MLflow store. On Kubernetes they must outlive the pod, so each gets a volume.
PERSISTENT_DIRS = ("artifacts", "checkpoints", "mlruns")


def stage_env(scheduler: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment handed to workers: chatpipe/MLflow/HF settings; locally also this Python's bin dir as PATH.

    ``DVC_EXP_*`` (set by ``dvc exp run``) passes too, so the stage's MLflow run names its DVC experiment.

    Remote schedulers keep the node's own PATH (the image or cluster module provides torchrun).
    """
    env = {k: v for k, v in os.environ.items() if k.startswith(("CHATPIPE_", "MLFLOW_", "HF_", "DVC_EXP_"))}
    if scheduler == "local_cwd":
        env["PATH"] = str(Path(sys.executable).parent)
    return {k: v for k, v in {**env, **(extra or {})}.items() if v != ""}


def worker_threads(launch: LaunchSettings, workers: int) -> tuple[int, str]:
    """Each worker's intra-op threads (and why): the cores of its node shared among its ``workers``.

    Locally the node is this machine: the cores this process may use, or the share a sweep gave its
    point (``CHATPIPE_CORES``). Elsewhere it is what the scheduler is asked for, ``launch.cpus_per_node``
    (Slurm's ``--cpus-per-task``). A user's ``OMP_NUM_THREADS`` or ``launch.threads`` wins.
    """
    from chatpipe.runtime import CORES_ENV, choose_threads, usable_cores

    cores = launch.cpus_per_node
    if launch.scheduler == "local_cwd":
        given = os.environ.get(CORES_ENV, "").strip()
        if given and (not given.isdigit() or int(given) < 1):
            raise ParamsError(f"{CORES_ENV}={given!r}: expected a positive number of cores, or unset it")
        cores = int(given) if given else usable_cores()
    try:
        return choose_threads(workers, setting=launch.threads, cores=cores)
    except ValueError as e:
        raise ParamsError(str(e)) from None


def build_app(stage: str, launch: LaunchSettings, stage_args: list[str], env: dict[str, str] | None = None):
    """The torchx AppDef that runs ``stages.<stage>`` on the configured topology.

    More than one process: ``torchrun`` (torchx ``dist.ddp``) starts and rendezvous the workers.
    Exactly one process: plain ``python -m`` (torchx ``utils.python``); torchrun would add a second
    interpreter and torch import (~2-3 s a stage on a laptop) and nothing else.
    """
    from torchx.components.dist import ddp
    from torchx.components.utils import python
    from torchx.specs import macros

    if stage not in pipeline_stages():
        raise ParamsError(f"unknown stage {stage!r}; allowed: {', '.join(pipeline_stages())}")
    single = stage in SINGLE_WORKER_STAGES
    nnodes, nproc = (1, 1) if single else (launch.nnodes, launch.nproc_per_node)
    gpu = 0 if single else launch.gpus_per_node
    # an explicit count for every worker: torch's default (every core) oversubscribes the node
    # as soon as two processes share it, and torchrun's own default for several workers is 1
    env = {**(env or {}), "OMP_NUM_THREADS": str(worker_threads(launch, nproc)[0])}
    rl = load_section(RLSettings, stage_args) if stage == "rl" else None
    rollout = rollout_role_threads(rl, launch, nnodes * nproc) if rl is not None else None
    if rollout:
        from chatpipe.rl.exchange import launch_dir  # here: the launcher imports no torch otherwise

        # a dir of this launch's own; beyond local_cwd the roles may land on two nodes, whose shared
        # memory is not shared (launch_dir then picks the project's checkpoints dir, which is)
        root = launch_dir(rl.rollout.exchange_dir, secrets.token_hex(6), one_host=launch.scheduler == "local_cwd")
        env |= {"OMP_NUM_THREADS": str(rollout[0]), RL_EXCHANGE_ENV: str(root)}
        if launch.nnodes == 1:  # once the workers beside it have sampled the last step, their cores are the trainer's
            beside = rl.rollout.workers if launch.scheduler == "local_cwd" else 1
            env[RL_THREADS_AFTER_ENV] = str(rollout[0] + rollout[1] * beside)
        if rl.rollout.workers > 1:  # weights over torch.distributed: the trainer's TCPStore, on its host
            env[RL_STORE_ENV] = f"{macros.rank0_env}:{free_port()}"
    if nnodes * nproc == 1:
        app = python(
            *stage_args,
            m=f"stages.{stage}",
            name=stage,
            image=launch.image,
            cpu=launch.cpus_per_node,
            gpu=gpu,
            memMB=launch.mem_mb,
        )
        app.roles[0].env.update(stage_env(launch.scheduler, env))
        app.roles[0].max_retries = launch.max_retries
        app.roles[0].mounts = volume_mounts(launch)
        if rollout:
            app.roles.append(rollout_role(app.roles[0], rollout[1], rl.rollout.workers, launch))
        return app
    app = ddp(
        *stage_args,
        m=f"stages.{stage}",
        name=f"chatpipe/{stage}",
        image=launch.image,
        cpu=launch.cpus_per_node,
        gpu=gpu,
        memMB=launch.mem_mb,
        j=f"{nnodes}x{nproc}",
        env=stage_env(launch.scheduler, env),
        max_retries=launch.max_retries,
        rdzv_port=launch.rdzv_port,
        rdzv_backend=launch.rdzv_backend,
    )
    app.roles[0].mounts = volume_mounts(launch)
    return app


def rollout_role_threads(rl: RLSettings, launch: LaunchSettings, workers: int) -> tuple[int, int] | None:
    """(trainer threads, threads of each rollout worker) when the RL stage runs its rollout role
    (``rl.rollout.role``), the node's cores split between them; None otherwise. Locally the trainer
    shares its node with every worker; on a cluster with one (worker 0, in its component; the others
    have a node each). Refused before any work when the workers would
    leave the trainer no core, or the trainer has more than one process."""
    if not rl.rollout.role:
        return None
    if workers > 1:
        raise ParamsError(f"rl.rollout.role samples for one trainer process; launch asks for {workers}")
    cores, why = worker_threads(launch, 1)
    if why in ("OMP_NUM_THREADS", "launch.threads"):  # the user chose the trainer's count
        return cores, rl.rollout.threads
    beside = rl.rollout.threads * (rl.rollout.workers if launch.scheduler == "local_cwd" else 1)
    if launch.nnodes == 1 and cores - beside < 1:
        if rl.rollout.workers == 1:
            raise ParamsError(
                f"rl.rollout.threads = {rl.rollout.threads} leaves the trainer none of this node's {cores} cores; "
                f"set it to at most {cores - 1}"
            )
        raise ParamsError(
            f"rl.rollout.workers = {rl.rollout.workers} x rl.rollout.threads = {rl.rollout.threads} leaves the "
            f"trainer none of this node's {cores} cores; ask for at most {cores - 1} threads in all"
        )
    return max(1, cores - beside), rl.rollout.threads


def rollout_role(trainer, threads: int, replicas: int = 1, launch: LaunchSettings | None = None):
    """The RL stage's second role: the trainer's command and mounts, ``replicas`` processes, marked as the
    rollout role, with ``threads`` intra-op threads each; Slurm may place them on other nodes. With several,
    each knows its replica id. On a cluster worker 0 runs beside the trainer, in its component
    (:func:`with_worker_beside`): a heterogeneous job's components never share a node, so the role's
    replicas are workers 1 to N-1, a node each."""
    role = copy.deepcopy(trainer)
    role.name = "rl_rollout"
    role.env |= {"OMP_NUM_THREADS": str(threads), RL_ROLE_ENV: "rollout"}
    role.env.pop(RL_THREADS_AFTER_ENV, None)
    role.num_replicas = replicas
    if replicas > 1:
        from torchx.specs import macros

        role.env[RL_WORKER_ENV] = macros.replica_id
        if launch is not None and launch.scheduler != "local_cwd":
            with_worker_beside(trainer, threads)
            role.env[RL_WORKER_OFFSET_ENV] = "1"
            role.num_replicas = replicas - 1
    return role


def with_worker_beside(trainer, threads: int) -> None:
    """Make ``trainer``'s command also start rollout worker 0 on its node, in the background: the
    component fails with the first of the two that fails (a failed trainer stops the worker)."""
    stage = shlex.join([trainer.entrypoint, *trainer.args])
    worker = f"{RL_ROLE_ENV}=rollout {RL_WORKER_ENV}=0 OMP_NUM_THREADS={threads} {stage}"
    trainer.entrypoint = "bash"
    trainer.args = [
        "-c",
        # in braces: chatpipe/slurm.py puts "cd <repo> && " in front, which must cover both processes
        f"{{ {worker} & worker=$!; {stage}; rc=$?; if [ $rc -ne 0 ]; then kill $worker 2>/dev/null; fi; "
        "wait $worker; wrc=$?; exit $(( rc ? rc : wrc )); }",
    ]


def free_port() -> int:
    """A TCP port free on this host now (for the trainer's TCPStore; on a cluster, likely free on its node)."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def threads_note(launch: LaunchSettings, stage: str) -> str:
    """The log line saying how many intra-op threads each worker of ``stage`` got, and why."""
    workers = 1 if stage in SINGLE_WORKER_STAGES else launch.nproc_per_node
    count, why = worker_threads(launch, workers)
    return f"{count} intra-op thread{'s' if count > 1 else ''} per worker ({why})"


def volume_mounts(launch: LaunchSettings) -> list:
    """Kubernetes mounts for :data:`PERSISTENT_DIRS` under ``launch.workdir`` (none elsewhere or without a volume).

    ``launch.volume`` is a PVC name prefix (claims ``<volume>-artifacts`` etc.; ReadWriteMany for
    more than one node) or an absolute hostPath directory holding the three folders.
    """
    from torchx.specs import BindMount, VolumeMount

    if launch.scheduler != "kubernetes" or not launch.volume:
        return []
    dst = launch.workdir.rstrip("/")
    if launch.volume.startswith("/"):
        return [BindMount(f"{launch.volume.rstrip('/')}/{d}", f"{dst}/{d}") for d in PERSISTENT_DIRS]
    return [VolumeMount(f"{launch.volume}-{d}", f"{dst}/{d}") for d in PERSISTENT_DIRS]


def scheduler_cfg(launch: LaunchSettings) -> dict[str, object]:
    """Scheduler run options from params (only the keys that scheduler understands)."""
    if launch.scheduler == "local_cwd":
        return {"log_dir": str(Path(launch.log_dir).resolve())}
    if launch.scheduler == "slurm":
        return {k: v for k, v in {"partition": launch.partition, "job_dir": None}.items() if v}
    return {k: v for k, v in {"namespace": launch.namespace, "queue": launch.queue}.items() if v}


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _interrupt(signum, frame) -> None:
    """The first stop signal raises KeyboardInterrupt (the launcher then cancels its app); later ones do nothing.

    A stop brings several at once (the flow's SIGTERM to the group, then DVC's death signal): a second
    KeyboardInterrupt raised while the first is being handled would end the launcher before its cancel.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # held pending for good: the launcher is stopping
    if getattr(_interrupt, "fired", False):
        return
    _interrupt.fired = True
    raise KeyboardInterrupt(f"signal {signum}")


# --------------------------------------------------------------------------- local process lifetime
# A worker must never outlive the launcher that started it: DVC's lock is released when the
# launcher exits, and a worker left running would keep writing checkpoints/ and artifacts/
# beside the next run. chatpipe.procs.die_with_parent (PR_SET_PDEATHSIG) covers that.
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "fish", "ksh"})

# Runs in each local worker before its real command: ask for SIGKILL when the launcher dies,
# make sure the launcher is still there (it may have died before the prctl), then exec.
WORKER_GUARD = (
    "import os, signal, sys\n"
    "from chatpipe.procs import die_with_parent, parent_gone\n"
    "die_with_parent(signal.SIGKILL)\n"
    "if parent_gone(int(sys.argv[1])):\n"
    "    sys.exit('chatpipe.launch: launcher gone before the worker started')\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def _process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def follow_parent(poll_s: float = 0.5) -> None:
    """Make this launcher stop (SIGTERM, so it cancels its app) when whoever started it goes away.

    The parent is covered by PR_SET_PDEATHSIG. DVC runs the stage cmd as ``$SHELL -c cmd``; shells
    usually exec a single command, but when one stays in between, it outlives a killed DVC, so
    the shell's parent is watched too, by a daemon thread polling its PID and start time.
    """
    import threading

    parent = os.getppid()
    if not die_with_parent(signal.SIGTERM):
        return
    if parent_gone(parent):
        os.kill(os.getpid(), signal.SIGTERM)
        return
    if _process_name(parent) not in SHELLS:
        return
    grandparent = int(Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[1])
    started = process_start(grandparent)
    if grandparent <= 1 or started is None:
        return

    def watch() -> None:
        while process_start(grandparent) == started:
            time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="follow-parent", daemon=True).start()


def guard_local_workers(app) -> None:
    """Wrap each role's command in :data:`WORKER_GUARD`, so local workers die with this launcher.

    Only for ``local_cwd``, where torchx starts the workers as children of this process (each in
    a session of its own, so a signal to our process group would not reach them).
    """
    for role in app.roles:
        role.args = ["-c", WORKER_GUARD, str(os.getpid()), role.entrypoint, *role.args]
        role.entrypoint = sys.executable
        role.env["CHATPIPE_PDEATHSIG"] = "1"  # workers torchrun starts set it for themselves


def run_stage(
    stage: str,
    stage_args: list[str] | None = None,
    *,
    dryrun: bool = False,
    launch: LaunchSettings | None = None,
    env: dict[str, str] | None = None,
) -> int:
    """Launch ``stage`` and stream its log; returns 0 on success, 1 on failure, 130 when interrupted.

    With ``dryrun`` it only prints the scheduler request.
    """
    from torchx.runner import get_runner
    from torchx.schedulers.local_scheduler import SignalException  # its SIGTERM/SIGINT handler raises this
    from torchx.specs import AppState

    launch = launch or load_section(LaunchSettings)
    app = build_app(stage, launch, list(stage_args or []), env)
    cfg = scheduler_cfg(launch)
    runner = get_runner()
    # torchx starts local workers in their own session: a SIGTERM/SIGHUP sent to DVC or Prefect would
    # not reach them, so turn those signals into the KeyboardInterrupt path below, which cancels the app.
    for sig in STOP_SIGNALS:
        signal.signal(sig, _interrupt)
    try:
        if not dryrun:
            print(f"[launch] {stage}: {threads_note(launch, stage)}", flush=True)
        if launch.scheduler == "slurm":  # own job watching, logs, cancel (chatpipe/slurm.py)
            return run_slurm_stage(runner, app, cfg, stage, launch, dryrun)
        if dryrun:
            print(runner.dryrun(app, launch.scheduler, cfg=cfg))
            return 0
        started = time.perf_counter()
        if launch.scheduler == "local_cwd":
            guard_local_workers(app)
        handle = runner.run(app, launch.scheduler, cfg=cfg)
        print(f"[launch] {stage}: {handle}", flush=True)
        try:
            for line in runner.log_lines(handle, app.roles[0].name, k=0, should_tail=True):
                print(line, end="" if line.endswith("\n") else "\n", flush=True)
        except SignalException:
            raise
        except Exception as e:  # remote schedulers may not serve logs; status still tells the outcome
            print(f"[launch] log streaming unavailable: {e}", flush=True)
        status = runner.wait(handle, wait_interval=0.5)
        ok = status is not None and status.state == AppState.SUCCEEDED
        if not ok:  # a role still running (the RL rollout role after its trainer failed) goes too
            runner.cancel(handle)
            print_other_roles_tail(runner, handle, app)
        seconds = time.perf_counter() - started  # the app's own wall time, start to end, for overhead accounting
        print(f"[launch] {stage}: {status.state if status else 'UNKNOWN'} ({seconds:.1f} s)", flush=True)
        return 0 if ok else 1
    except (KeyboardInterrupt, SignalException):
        if not dryrun and "handle" in locals():
            with contextlib.suppress(OSError):  # a broken log pipe (killed flow) must not skip the cancel
                print(f"[launch] {stage}: interrupted, cancelling {handle}", flush=True)
            runner.cancel(handle)
        return 130  # the conventional exit status of an interrupted command
    finally:
        runner.close()


def print_other_roles_tail(runner, handle, app, lines: int = 15) -> None:
    """The last ``lines`` of every role but the first (whose log was streamed), after a failure: the
    RL rollout role's own reason, without opening torchx's log dir."""
    for role in app.roles[1:]:
        try:
            tail = list(runner.log_lines(handle, role.name, k=0))[-lines:]
        except Exception as e:  # a scheduler that serves no logs
            tail = [f"(its log is not available here: {e})"]
        for line in tail:
            print(f"[{role.name}] {line.rstrip()}", flush=True)


def run_slurm_stage(runner, app, cfg: dict[str, object], stage: str, launch: LaunchSettings, dryrun: bool) -> int:
    """The Slurm path: submit, stream the rank-0 log, report the failed worker, scancel when interrupted."""
    from chatpipe import slurm

    if dryrun:
        info, *_ = slurm.prepare(runner, app, cfg, stage, Path(launch.log_dir), Path.cwd().resolve())
        print(info)
        return 0
    return slurm.run(runner, app, cfg, stage, Path(launch.log_dir))


def write_not_read(why: str) -> Path:
    """The reward_model stage's outputs when RL reads no reward model (``--if-read``): in place of the
    model a marker saying why, and the metrics file and plots dir DVC expects of the stage. Returns the
    marker's path."""
    out = ARTIFACTS / "reward_model"
    shutil.rmtree(out, ignore_errors=True)  # DVC removed it already; by hand, an older model would mislead
    out.mkdir(parents=True)
    marker = out / REWARD_MODEL_NOT_READ
    write_text_atomic(marker, json.dumps({"trained": False, "why": why}, indent=2) + "\n")
    write_metrics("reward_model", {"trained": 0})
    Path("plots", "reward_model").mkdir(parents=True, exist_ok=True)
    return marker


def main(argv: list[str] | None = None) -> int:
    """CLI entry: validate all params, then launch one stage."""
    argv = list(sys.argv[1:] if argv is None else argv)
    stage_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, stage_args = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description="Launch a chatpipe stage through torchx.")
    p.add_argument("stage", choices=pipeline_stages())
    p.add_argument("--dryrun", action="store_true", help="print the scheduler request, run nothing")
    p.add_argument("--scheduler", choices=["local_cwd", "slurm", "kubernetes"])
    p.add_argument("--nnodes", type=int)
    p.add_argument("--nproc_per_node", type=int)
    p.add_argument(
        "--if-read",
        action="store_true",
        help="reward_model only: train it only when RL reads a reward model, else write a marker saying why",
    )
    args = p.parse_args(argv)
    if args.if_read and args.stage != "reward_model":
        p.error(f"--if-read is for the reward_model stage (RL may read it or not), not {args.stage}")
    try:
        validate_all()  # a bad value anywhere stops here, before any stage writes anything
        check_env_keeps_stages()  # ...and so does a variable that would change what DVC's record says ran
        why = reward_model_unread(load_section(RLSettings), load_section(RewardModelSettings)) if args.if_read else ""
        overrides = {
            k: v for k, v in vars(args).items() if k in ("scheduler", "nnodes", "nproc_per_node") and v is not None
        }  # 0 is a value to validate (and reject), not "not given"
        launch = load_section(LaunchSettings, overrides)
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if why:  # the same test the flow goes by (chatpipe.settings.reward_model_unread)
        done = "would write a marker" if args.dryrun else f"wrote {write_not_read(why)}"
        print(f"[launch] reward_model: not trained ({why}); {done}", flush=True)
        return 0
    return run_stage(args.stage, stage_args, dryrun=args.dryrun, launch=launch)


if __name__ == "__main__":
    follow_parent()  # a killed `dvc repro` / flow stops this launcher, which cancels its workers
    sys.exit(main())
