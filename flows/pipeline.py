"""The chatpipe pipeline as a Prefect flow: one task per stage, each running its DVC stage.

    python -m flows.pipeline                               # all stages, profile from params.yaml
    python -m flows.pipeline --profile tiny --stages tokenizer pretrain
    python -m flows.pipeline --resume-from pretrain        # skip earlier tasks entirely

Each task runs ``dvc repro --single-item <stage>``: DVC skips the stage when its code, params
and inputs are unchanged, and otherwise runs its command, which launches the stage's torchrun
workers through torchx. A failed task is retried; the retry resumes the stage from its newest
checkpoint. The flow owns the MLflow parent run; every stage run nests under it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

# A loaded laptop can take longer than Prefect's default 20 s to start the temporary API server.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

from prefect import flow, get_run_logger, task  # noqa: E402

from chatpipe import tracking
from chatpipe.settings import ParamsError, TrackingSettings, active_profile, load_section, validate_all, write_profile
from flows import prefect_api


def dvc_stages(path: Path = Path("dvc.yaml")) -> list[str]:
    """Stage names in dvc.yaml order, which is the pipeline order."""
    import yaml

    return list((yaml.safe_load(path.read_text()) or {}).get("stages", {}))


STAGES = dvc_stages(Path(__file__).resolve().parents[1] / "dvc.yaml")


# `dvc repro` children of this flow: a SIGTERM to the flow (Prefect cancel, CI timeout) is passed
# on to them, and DVC's death reaches the launcher and its workers (PR_SET_PDEATHSIG).
_DVC_CHILDREN: set[subprocess.Popen] = set()


def _terminate_children(signum, frame) -> None:
    for proc in list(_DVC_CHILDREN):
        proc.terminate()
    raise KeyboardInterrupt(f"signal {signum}")


def _die_with_flow() -> None:
    """preexec_fn of a `dvc repro` child: SIGTERM when the flow process dies, even by kill -9."""
    import ctypes
    import signal

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1: PR_SET_PDEATHSIG


def _bin(name: str) -> str:
    """A console script of the Python running the flow (so the venv's dvc is used)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


@task(name="stage", retries=2, retry_delay_seconds=[1, 5], task_run_name="{stage}")
def run_stage(stage: str, parent_run_id: str | None) -> str:
    """Bring one DVC stage up to date; raises when its workers fail (Prefect then retries)."""
    logger = get_run_logger()
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if parent_run_id:
        env[tracking.PARENT_ENV] = parent_run_id
    proc = subprocess.Popen(
        [_bin("dvc"), "repro", "--single-item", stage],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_die_with_flow,
    )
    _DVC_CHILDREN.add(proc)
    skipped = False
    try:
        for line in proc.stdout:
            line = line.rstrip()
            skipped |= "didn't change, skipping" in line
            logger.info(line)
        proc.wait()
    finally:
        _DVC_CHILDREN.discard(proc)
        if proc.poll() is None:  # interrupted: stop DVC, which stops the launcher and workers
            proc.terminate()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"stage {stage!r} failed (dvc repro exit {proc.returncode}); see the log above")
    if parent_run_id and not skipped:
        tracking.tag_stage_runs(
            parent_run_id,
            stage,
            {"dvc_stage_hash": tracking.dvc_stage_hash(stage), "dvc_lock": tracking.dvc_lock_hash()},
        )
    return "skipped" if skipped else "ran"


@flow(name="chatpipe", log_prints=True)
def pipeline(profile: str | None = None, stages: list[str] | None = None, resume_from: str | None = None) -> dict:
    """Run the stages in order under one MLflow parent run; returns {stage: "ran" | "skipped"}."""
    unknown = set(stages or []) - set(STAGES)
    if unknown:
        raise ValueError(f"unknown stage(s) {sorted(unknown)}; allowed: {', '.join(STAGES)}")
    if resume_from and resume_from not in STAGES:
        raise ValueError(f"resume_from = {resume_from!r}; allowed: {', '.join(STAGES)}")
    selected = [
        s
        for s in STAGES
        if (not stages or s in stages) and (not resume_from or STAGES.index(s) >= STAGES.index(resume_from))
    ]
    logger = get_run_logger()
    if profile:
        write_profile(profile)
    validate_all()  # bad params stop the flow before any stage writes anything

    track = load_section(TrackingSettings)
    parent_id = None
    if track.enabled:
        import mlflow

        experiment_id = tracking.configure(track)
        tracking.close_stale_runs(mlflow.MlflowClient(), experiment_id, "pipeline")
        tags = {
            **tracking.base_tags("pipeline", active_profile()),
            **tracking.process_tags(),
            "stages": ",".join(selected),
        }
        parent_id = mlflow.MlflowClient().create_run(experiment_id, run_name="pipeline", tags=tags).info.run_id
    results: dict[str, str] = {}
    status = "FAILED"
    try:
        for stage in selected:
            results[stage] = run_stage(stage, parent_id)
            logger.info("stage %s: %s", stage, results[stage])
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        if parent_id:
            import mlflow

            client = mlflow.MlflowClient()
            client.set_tag(parent_id, "dvc_lock", tracking.dvc_lock_hash())
            client.log_dict(parent_id, results, "stages.json")
            client.set_terminated(parent_id, status=status)
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Run the chatpipe pipeline (Prefect flow over DVC stages).")
    p.add_argument("--profile", help="params profile (tiny, speedrun, ...); default: params.yaml's")
    p.add_argument("--stages", nargs="+", choices=STAGES, help="run only these stages")
    p.add_argument("--resume-from", choices=STAGES, help="start at this stage")
    args = p.parse_args(argv)
    if args.profile:
        os.environ["CHATPIPE_PROFILE"] = args.profile
    try:  # fail fast, before the Prefect server starts or any stage writes anything
        validate_all()
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    # Without a configured Prefect server, start the temporary one now so that it boots while
    # this process opens (or creates) the MLflow store, the other slow part of starting a run.
    import signal

    signal.signal(signal.SIGTERM, _terminate_children)  # unwinds: DVC stopped, parent run KILLED, server stopped
    server = None if prefect_api.configured() else prefect_api.TemporaryServer()
    try:
        track = load_section(TrackingSettings)
        if track.enabled:
            tracking.configure(track)
        with prefect_api.pointed_at(server):
            print(pipeline(profile=args.profile, stages=args.stages, resume_from=args.resume_from))
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
