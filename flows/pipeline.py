"""The chatpipe pipeline as a Prefect flow: one task per stage, each running its DVC stage.

    python -m flows.pipeline                               # all stages, profile from params.yaml
    python -m flows.pipeline --profile tiny --stages tokenizer pretrain
    python -m flows.pipeline --resume-from pretrain        # skip earlier tasks entirely
    python -m flows.pipeline --commit-lock                 # then git-commit dvc.lock + metrics/plots

Each task runs ``dvc repro --single-item <stage>``: DVC skips the stage when its code, params
and inputs are unchanged, and otherwise runs its command, which launches the stage's torchrun
workers through torchx. A failed task is retried; the retry resumes the stage from its newest
checkpoint. The flow owns the MLflow parent run; every stage run nests under it. The parent run
carries the Prefect flow run's id, name and URL as tags; the flow run carries the tag
``mlflow_run:<parent run id>``, and each stage run the tag ``prefect.task_run_id`` of its task run.
A run in which every stage was up to date keeps no MLflow run.
The ``profile`` stage (the active profile's overlay files) always runs first.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

# A loaded laptop can take longer than Prefect's default 20 s to start the temporary API server.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

from prefect import flow, get_run_logger, task  # noqa: E402

from chatpipe import tracking
from chatpipe.owndata import check_user_files
from chatpipe.settings import (
    PROFILE_STAGE,  # writes profile/<section>.yaml, which every other stage depends on
    ParamsError,
    RewardModelSettings,
    RLSettings,
    TrackingSettings,
    active_profile,
    check_env_keeps_stages,
    dvc_stages,
    load_section,
    reward_model_unread,
    validate_all,
    write_profile,
)
from flows import prefect_api

# what a stage leaves for git beside its DVC-cached outputs (committed with --commit-lock)
LOCK_PATHS = ["dvc.lock", "profile", "metrics", "plots"]

# Lines of `dvc repro` and stage output a person does not need in the flow's log.
_NOISE = re.compile(
    r"^\s*$"
    r"|To track the changes with git, run:"
    r"|^\s*git add .*dvc\.lock"
    r"|To enable auto staging, run:"
    r"|dvc config core\.autostage true"
    r"|Use `dvc push` to send your updates to remote storage\."
    r"|Progress: \d+% \(\d+/\d+ merges\)"  # rustbpe, one line per 1% of merges
)
# tiktoken's offline failure to fetch the GPT-2/GPT-4 reference encodings: a very long ConnectionError.
_TIKTOKEN_ERROR = re.compile(r"(could not load tiktoken encoding '[^']+'): [^\"]*")  # up to the repr's closing "


def console_line(line: str) -> str | None:
    """The line as the flow's log shows it, or None to drop it (DVC's git advice, progress spam)."""
    if _NOISE.search(line):
        return None
    return _TIKTOKEN_ERROR.sub(r"\1 (offline)", line)


# `dvc repro` children of this flow: a SIGTERM to the flow (Prefect cancel, CI timeout) is passed
# on to them, and DVC's death reaches the launcher and its workers (PR_SET_PDEATHSIG).
_DVC_CHILDREN: set[subprocess.Popen] = set()


def _terminate_children(signum, frame) -> None:
    for proc in list(_DVC_CHILDREN):
        with contextlib.suppress(ProcessLookupError):  # SIGTERM its group; the run_stage that owns it waits
            os.killpg(proc.pid, signum)
    raise KeyboardInterrupt(f"signal {signum}")


def _die_with_flow() -> None:
    """preexec_fn of a `dvc repro` child: SIGTERM when the flow process dies, even by kill -9."""
    import signal

    from chatpipe.procs import die_with_parent

    die_with_parent(signal.SIGTERM)


def _bin(name: str) -> str:
    """A console script of the Python running the flow (so the venv's dvc is used)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def _stop_group(proc: subprocess.Popen, grace_s: float = 90.0) -> None:
    """SIGTERM ``proc``'s process group and wait until none of it is left; SIGKILL it after ``grace_s``.

    Waiting for DVC alone is not enough: DVC may die while the launcher under it is still
    cancelling its workers or Slurm job, and a flow that exited then would close the pipe the
    launcher logs to.
    """
    import signal

    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    for sig, wait_s in ((signal.SIGKILL, grace_s), (None, 10.0)):  # after SIGKILL, gone within moments
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()  # reap DVC, so a dead leader does not keep the group alive
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        if sig is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)


def dvc_status(stage: str) -> dict:
    """What ``dvc status --json <stage>`` prints, as data (no log text is read), from DVC's Python
    API in this process: a ``dvc`` child would cost an interpreter and DVC's imports (~1 s) per stage."""
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    try:
        with Repo(".") as repo:
            return repo.status(targets=[stage])
    except DvcException as e:
        raise RuntimeError(f"dvc status {stage!r} failed: {e}") from e


def stage_is_current(status: dict, stage: str) -> bool:
    """Whether ``dvc repro --single-item <stage>`` will skip it: ``status --json`` lists a stage only
    when its command, params, deps or outs changed (or it is always_changed), and then repro runs it
    (or restores it from the run cache, which also brings new outputs: "ran" too)."""
    return stage not in status


def repro(stage: str, env: dict[str, str], log) -> str:
    """``dvc repro --single-item <stage>``, its output to ``log``; returns "ran" or "skipped".

    Whether the stage ran comes from DVC's status just before, not from the wording of
    DVC's log ("didn't change, skipping" is a message, free to change between releases).
    """
    skipped = stage_is_current(dvc_status(stage), stage)
    proc = subprocess.Popen(
        [_bin("dvc"), "repro", "--single-item", stage],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # a group of its own, so a stop below reaches the launcher under DVC too
        preexec_fn=_die_with_flow,
    )
    _DVC_CHILDREN.add(proc)
    try:
        for raw in proc.stdout:
            line = console_line(raw.rstrip())
            if line is not None:
                log(line)
        proc.wait()
    finally:
        _DVC_CHILDREN.discard(proc)
        # Interrupted (SIGTERM/SIGINT raise here): DVC does not pass a SIGTERM on to its command, so
        # signal the whole group and wait for the launcher to cancel its workers or Slurm job. After a
        # normal end the group is already empty.
        _stop_group(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"stage {stage!r} failed (dvc repro exit {proc.returncode}); see the log above")
    return "skipped" if skipped else "ran"


@task(name="stage", retries=2, retry_delay_seconds=[1, 5], task_run_name="{stage}")
def run_stage(stage: str, parent_run_id: str | None) -> str:
    """Bring one DVC stage up to date; raises when its workers fail (Prefect then retries)."""
    logger = get_run_logger()
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if parent_run_id:
        env[tracking.PARENT_ENV] = parent_run_id
    result = repro(stage, env, logger.info)
    if parent_run_id and result == "ran":
        from prefect.runtime import task_run

        stage_tags = {"dvc_stage_hash": tracking.dvc_stage_hash(stage), "dvc_lock": tracking.dvc_lock_hash()}
        if task_run.id:
            stage_tags["prefect.task_run_id"] = task_run.id
        tracking.tag_stage_runs(parent_run_id, stage, stage_tags)
    return result


def link_prefect_run(parent_id: str) -> None:
    """Tag the MLflow parent run with this Prefect flow run, and the flow run with the MLflow run."""
    import mlflow
    from prefect.runtime import deployment, flow_run

    if not flow_run.id:
        return
    client = mlflow.MlflowClient()
    client.set_tag(parent_id, "prefect.flow_run_id", flow_run.id)
    client.set_tag(parent_id, "prefect.flow_run_name", flow_run.name or "")
    if flow_run.ui_url:
        client.set_tag(parent_id, "prefect.flow_run_url", flow_run.ui_url)
    if deployment.id:
        client.set_tag(parent_id, "prefect.deployment", f"{flow_run.flow_name}/{deployment.name}")
    add_flow_run_tags(f"mlflow_run:{parent_id}")


def add_flow_run_tags(*new: str, drop_prefix: str | None = None) -> None:
    """Add tags to the current Prefect flow run (optionally dropping those starting with ``drop_prefix``)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    if not flow_run.id:
        return
    with get_client(sync_client=True) as client:
        current = client.read_flow_run(flow_run.id).tags or []
        kept = [t for t in current if not (drop_prefix and t.startswith(drop_prefix))]
        client.update_flow_run(flow_run.id, tags=list(dict.fromkeys([*kept, *new])))


def commit_lock(message: str) -> str | None:
    """``git commit`` dvc.lock and the stages' git-tracked outputs (only those paths); the new sha or None."""
    paths = [p for p in LOCK_PATHS if Path(p).exists()]
    git = ["git", "-c", "user.name=chatpipe", "-c", "user.email=chatpipe@localhost"]
    if not paths or subprocess.run(["git", "rev-parse", "--git-dir"], capture_output=True).returncode != 0:
        raise RuntimeError("--commit-lock: not in a git repository (or no dvc.lock yet)")
    subprocess.run(["git", "add", "--", *paths], check=True)
    if subprocess.run(["git", "diff", "--cached", "--quiet", "--", *paths]).returncode == 0:
        return None  # nothing changed since the last commit
    # user identity from git config when set; the -c values only fill in where none is configured
    has_identity = subprocess.run(["git", "config", "user.email"], capture_output=True).returncode == 0
    cmd = (["git"] if has_identity else git) + ["commit", "-q", "-m", message, "--", *paths]
    subprocess.run(cmd, check=True)
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()


def log_headline_numbers(client, parent_id: str, stages: list[str]) -> None:
    """Put the stages' resolved params and metrics/<stage>.json numbers (ran or up to date) on the parent run.

    Then MLflow's compare view of two pipeline runs shows what changed and what it did
    (``pretrain.max_steps`` beside ``pretrain.val_bpb``) without opening the nested runs.
    """
    import json

    from mlflow.entities import Metric, Param

    from chatpipe.settings import resolve_params

    resolved = resolve_params()
    params = {
        k: str(v)[:6000]
        for s in stages
        for k, v in tracking.flatten({s: resolved.get(s) or {}}).items()
        if not isinstance(v, list)
    }
    metrics = {}
    for s in stages:
        path = Path("metrics") / f"{s}.json"
        if path.exists():
            metrics.update(tracking.numeric_leaves(json.loads(path.read_text())))
    now = int(time.time() * 1000)
    items = [Param(k, v) for k, v in params.items()]
    for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
        client.log_batch(parent_id, params=items[i : i + 100])
    client.log_batch(parent_id, metrics=[Metric(k, v, now, 0) for k, v in metrics.items()])


def flow_stages(stages: list[str] | None = None, resume_from: str | None = None) -> list[str]:
    """The stages the flow runs, in order: dvc.yaml's (``profile`` first, always), or those named, from
    ``resume_from`` on. With none named, exactly what ``dvc repro`` runs: whether the reward model trains
    is its own stage command's call (``--if-read``), never a stage the flow leaves out."""
    every = list(dvc_stages())  # dvc.yaml's, `profile` included: the flow runs what `dvc repro` runs
    unknown = set(stages or []) - set(every)
    if unknown:
        raise ValueError(f"unknown stage(s) {sorted(unknown)}; allowed: {', '.join(every)}")
    if resume_from and resume_from not in every:
        raise ValueError(f"resume_from = {resume_from!r}; allowed: {', '.join(every)}")
    selected = [
        s
        for s in every
        if (not stages or s in stages) and (not resume_from or every.index(s) >= every.index(resume_from))
    ]
    if PROFILE_STAGE in every and PROFILE_STAGE not in selected:
        selected.insert(0, PROFILE_STAGE)  # the others depend on its files: keep them current
    return selected


@flow(name="chatpipe", log_prints=True)
def pipeline(
    profile: str | None = None,
    stages: list[str] | None = None,
    resume_from: str | None = None,
    commit_lock_file: bool = False,
) -> dict:
    """Run the stages in order under one MLflow parent run; returns {stage: "ran" | "skipped"}.

    ``commit_lock_file``: after a successful run, git-commit dvc.lock, profile/, metrics/ and plots/
    (only those paths), so the next ``dvc metrics diff`` / ``dvc exp show`` compares against it.
    """
    selected = flow_stages(stages, resume_from)
    logger = get_run_logger()
    if profile:
        write_profile(profile)
    settings = validate_all()  # bad params stop the flow before any stage writes anything
    check_env_keeps_stages()  # ...and so does a variable that would change which stages train
    check_user_files(settings)  # ...and so does a bad file of the user's (docs/own-data.md)
    # every stage runs as `dvc repro` runs it: the reward_model stage's own command decides, by the same
    # test, to write a marker instead of a model when RL reads none (rl depends on either in dvc.yaml)
    unread = reward_model_unread(load_section(RLSettings), load_section(RewardModelSettings))
    if unread and "reward_model" in selected:
        logger.info("stage reward_model: a marker, not a model (%s)", unread)

    track = load_section(TrackingSettings)
    parent_id = None
    if track.enabled:
        import mlflow

        experiment_id = tracking.configure(track)
        tracking.close_stale_runs(mlflow.MlflowClient(), experiment_id, "pipeline")
        tags_ = {
            **tracking.base_tags("pipeline", active_profile()),
            **tracking.process_tags(),
            "stages": ",".join(selected),
        }
        name = tracking.pipeline_run_name(active_profile())
        parent_id = mlflow.MlflowClient().create_run(experiment_id, run_name=name, tags=tags_).info.run_id
        link_prefect_run(parent_id)
    results: dict[str, str] = {}
    status = "FAILED"
    try:
        # The link to MLflow is a tag of the flow run, not of its task runs: Prefect treats every task
        # tag as a concurrency limit to lease from the server before the task starts, which cost
        # ~1.3 s a stage (up to 2.5 s). Each stage run names its task run instead (run_stage).
        for stage in selected:
            results[stage] = run_stage(stage, parent_id)
            logger.info("stage %s: %s", stage, results[stage])
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if parent_id:
            finish_parent_run(parent_id, results, status, logger)
    if commit_lock_file and status == "FINISHED":
        from prefect.runtime import flow_run

        sha = commit_lock(f"chatpipe pipeline run {flow_run.name or 'from the command line'}: dvc.lock, metrics, plots")
        logger.info("committed dvc.lock as %s" if sha else "dvc.lock unchanged: nothing to commit%s", sha or "")
    return results


def finish_parent_run(parent_id: str, results: dict[str, str], status: str, logger) -> None:
    """Close the MLflow parent run; delete it when the run finished and no stage ran (nothing to show)."""
    import mlflow

    client = mlflow.MlflowClient()
    ran = [s for s, r in results.items() if r == "ran" and s != PROFILE_STAGE]
    client.set_tag(parent_id, "dvc_lock", tracking.dvc_lock_hash())
    client.set_tag(parent_id, "stages_ran", ",".join(ran) or "none")
    client.log_dict(parent_id, results, "stages.json")
    log_headline_numbers(client, parent_id, [s for s in results if s != PROFILE_STAGE])
    client.set_terminated(parent_id, status=status)
    if status == "FINISHED" and not ran:
        # a nightly schedule over unchanged inputs would otherwise add an empty run every night
        client.delete_run(parent_id)
        add_flow_run_tags("all-skipped", drop_prefix="mlflow_run:")
        logger.info("every stage was up to date: no MLflow run kept")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Run the chatpipe pipeline (Prefect flow over DVC stages).")
    p.add_argument("--profile", help="params profile (tiny, speedrun, ...); default: params.yaml's")
    p.add_argument("--stages", nargs="+", choices=dvc_stages(), help="run only these stages")
    p.add_argument("--resume-from", choices=dvc_stages(), help="start at this stage")
    p.add_argument(
        "--commit-lock",
        action="store_true",
        help="after a successful run, git-commit dvc.lock, profile/, metrics/ and plots/ (only those paths)",
    )
    args = p.parse_args(argv)
    if args.profile:
        os.environ["CHATPIPE_PROFILE"] = args.profile
    try:  # fail fast, before the Prefect server starts or any stage writes anything
        check_user_files(validate_all())
        check_env_keeps_stages()
    except (ParamsError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    # Without a configured Prefect server, start the temporary one now so that it boots while
    # this process opens (or creates) the MLflow store, the other slow part of starting a run.
    import signal

    signal.signal(signal.SIGTERM, _terminate_children)  # unwinds: DVC stopped, parent run KILLED, server stopped
    server = None if prefect_api.configured() else prefect_api.TemporaryServer(prefect_api.SERVER_LOG)
    try:
        track = load_section(TrackingSettings)
        if track.enabled:
            tracking.configure(track)
        with prefect_api.pointed_at(server):
            print(
                pipeline(
                    profile=args.profile,
                    stages=args.stages,
                    resume_from=args.resume_from,
                    commit_lock_file=args.commit_lock,
                )
            )
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
