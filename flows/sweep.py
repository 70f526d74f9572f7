"""A sweep (``sweeps/*.yaml``) as a Prefect flow: one task per point, ``concurrency`` at a time.

    python -m flows.sweep sweeps/isoflop_tiny.yaml             # run it (locally, or Slurm with profile: slurm)
    python -m flows.sweep sweeps/isoflop_speedrun.yaml --plan  # validate and price it; trains nothing

Every point is a content-addressed work directory (chatpipe.sweep.points) whose stages run through
the torchx launcher; a finished point is never trained again, a killed one resumes. The flow owns one
MLflow parent run per sweep run with one child per point (cached points too, marked ``cached``), and
logs the results table, the isoFLOP fit and its plots to the parent as artifacts.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")

from prefect import flow, get_run_logger, task  # noqa: E402
from prefect.cache_policies import NONE  # noqa: E402
from prefect.task_runners import ThreadPoolTaskRunner  # noqa: E402

from chatpipe import tracking  # noqa: E402
from chatpipe.runtime import CORES_ENV, thread_share, usable_cores  # noqa: E402
from chatpipe.settings import ParamsError, TrackingSettings, load_section  # noqa: E402
from chatpipe.sweep import fit as fitting  # noqa: E402
from chatpipe.sweep.points import (  # noqa: E402
    PREP_STAGES,
    WorkDir,
    code_fingerprint,
    collect_metrics,
    point_env,
    snapshot_code,
)
from chatpipe.sweep.spec import Point, SweepSettings, expand, format_plan, load_sweep  # noqa: E402
from flows import prefect_api  # noqa: E402
from flows.pipeline import _stop_group  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RUNS_DIR = Path("sweeps/runs")
# launcher processes of running points: a SIGTERM to the flow stops each group (workers, Slurm jobs)
_CHILDREN: set[subprocess.Popen] = set()
_LOCK = threading.Lock()
# (parent run, point key) -> child run: a retried point keeps its one child run
_CHILD_RUNS: dict[tuple[str, str], str] = {}
# set by a stop signal: no point starts and none is retried after it (a killed stage is not a failure)
_STOPPING = threading.Event()


def _retry_unless_stopping(task, task_run, state) -> bool:
    return not _STOPPING.is_set()


class RdzvPorts:
    """Rendezvous ports handed to running points, so that two multi-process points running at once
    (torchrun, or Slurm jobs on the same nodes) never share one.

    A point gets the lowest port from its base up that no other running point holds and that nothing
    on this host is bound to now: another program (or another test) may hold ``base + 1``, and a
    rendezvous on a taken port fails with EADDRINUSE after torchrun's retries. On a cluster whose
    rendezvous host is not this one, the check against this host's ports is harmless.
    """

    def __init__(self) -> None:
        self._held: set[int] = set()
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def take(self, base: int):
        with self._lock:
            port = base
            while port in self._held or not _bindable(port):
                port += 1
                if port > 65535:
                    raise ParamsError(f"launch.rdzv_port: no free port from {base} to 65535 on this host")
            self._held.add(port)
        try:
            yield port
        finally:
            with self._lock:
                self._held.discard(port)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


_PORTS = RdzvPorts()


def rdzv_base(point: Point) -> int:
    """The point's base rendezvous port: the env override, else its params' ``launch.rdzv_port``."""
    base = os.environ.get("CHATPIPE_LAUNCH__RDZV_PORT") or (point.params.get("launch") or {}).get("rdzv_port", 29500)
    return int(base)


def _track(proc: subprocess.Popen) -> None:
    with _LOCK:
        _CHILDREN.add(proc)


def stop_points() -> None:
    """No point starts or retries from now on; SIGTERM every running launcher's group (it cancels its workers)."""
    _STOPPING.set()
    with _LOCK:
        procs = list(_CHILDREN)
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)


def _terminate_children(signum, frame) -> None:
    stop_points()
    raise KeyboardInterrupt(f"signal {signum}")


def stage_tracking_env(child_id: str | None) -> dict[str, str]:
    """Env that makes a point's stage runs log to this project's MLflow store, nested under its child run."""
    track = load_section(TrackingSettings)
    if not track.enabled or not child_id:
        return {"CHATPIPE_TRACKING__ENABLED": "false"}
    uri = track.uri
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + str(Path(uri.removeprefix("sqlite:///")).resolve())
    return {
        "CHATPIPE_TRACKING__URI": uri,
        "CHATPIPE_TRACKING__ARTIFACT_ROOT": str(Path(track.artifact_root).resolve()),
        "CHATPIPE_TRACKING__EXPERIMENT": track.experiment,
        tracking.PARENT_ENV: child_id,
    }


RETRIES = {"retries": 2, "retry_delay_seconds": [1, 5], "retry_condition_fn": _retry_unless_stopping}


class SweepStopped(RuntimeError):
    """A point that was not started (or not finished) because the sweep is stopping."""


def _check_stopping() -> None:
    if _STOPPING.is_set():
        raise SweepStopped("the sweep is stopping")


@task(name="sweep-prep", **RETRIES, cache_policy=NONE, task_run_name="prep-{key}")
def run_prep(workdir: WorkDir, key: str, source: Path, cores: int) -> str:
    """Data and tokenizer for every point that shares their settings (once; skipped when finished)."""
    if workdir.done is None:
        _check_stopping()
        workdir.prepare(source)
        env = point_env({"CHATPIPE_TRACKING__ENABLED": "false", CORES_ENV: str(cores)})
        workdir.run_stages(env, on_start=_track)
        workdir.finish({"prep": True})
    return str(workdir.path)


@task(name="sweep-point", **RETRIES, cache_policy=NONE, task_run_name="{name}")
def run_point(
    name: str,
    point: Point,
    workdir: WorkDir,
    links: dict,
    metrics: list[str],
    parent: str | None,
    source: Path,
    cores: int,
) -> dict:
    """Train one point (or reuse its finished record) on ``cores`` cores; returns its row of the results table."""
    record = workdir.done
    if record is not None:
        if parent:
            log_child(parent, point, workdir, record, cached=True)
        return {**record, "cached": True}
    _check_stopping()
    child = open_child(parent, point, workdir) if parent else None
    start = time.time()
    try:
        workdir.prepare(source, links)
        with _PORTS.take(rdzv_base(point)) as port:
            env = point_env(
                {**stage_tracking_env(child), "CHATPIPE_LAUNCH__RDZV_PORT": str(port), CORES_ENV: str(cores)}
            )
            ran = workdir.run_stages(env, on_start=_track)
        end = time.time()
        record = {
            "point": point.name,
            "values": point.values,
            **point.counts,
            "metrics": collect_metrics(workdir.path, metrics),
            "start": start,
            "end": end,
            "wall_seconds": end - start,
            "stages_ran": ran,
            "dir": str(workdir.path),
        }
        workdir.finish(record)
    except BaseException as e:
        if child:
            stopped = _STOPPING.is_set() or isinstance(e, (KeyboardInterrupt, SystemExit))
            status = "KILLED" if stopped else "FAILED"
            _client().set_terminated(child, status=status)
        raise
    if child:
        log_child(parent, point, workdir, record, cached=False, run_id=child)
    get_run_logger().info("%s: %s", point.name, record["metrics"])
    return {**record, "cached": False}


def _client():
    import mlflow

    return mlflow.MlflowClient()


def child_tags(parent: str, point: Point, workdir: WorkDir) -> dict[str, str]:
    """The tags that make a run the point's child of the sweep's parent run."""
    return {"mlflow.parentRunId": parent, "sweep.point": point.name, "sweep.key": workdir.key, "stage": "sweep-point"}


def open_child(parent: str, point: Point, workdir: WorkDir) -> str:
    """The point's child run under ``parent`` (created once; a retry reuses it)."""
    key = (parent, workdir.key)
    if key not in _CHILD_RUNS:
        client = _client()
        exp = client.get_run(parent).info.experiment_id
        tags = child_tags(parent, point, workdir)
        _CHILD_RUNS[key] = client.create_run(exp, run_name=point.name, tags=tags).info.run_id
    return _CHILD_RUNS[key]


def log_child(
    parent: str, point: Point, workdir: WorkDir, record: dict, *, cached: bool, run_id: str | None = None
) -> None:
    """Params (grid values, counts), metrics, times of one point on its child run, then close it."""
    from mlflow.entities import Metric, Param

    client = _client()
    if run_id is None:  # a cached point: a child run spanning the original training's times
        exp = client.get_run(parent).info.experiment_id
        tags = child_tags(parent, point, workdir)
        run_id = client.create_run(
            exp, run_name=point.name, tags=tags, start_time=int(record["start"] * 1000)
        ).info.run_id
    client.set_tag(run_id, "cached", str(cached).lower())
    params = {**point.values, "dir": workdir.path.name}
    now = int(time.time() * 1000)
    numbers = {
        k: float(record[k])
        for k in ("scaling_params", "total_params", "flops_per_token", "tokens", "flops", "wall_seconds")
    }
    numbers.update({k.replace(".", "/"): v for k, v in record["metrics"].items()})
    client.log_batch(
        run_id,
        params=[Param(k, str(v)) for k, v in params.items()],
        metrics=[Metric(k, v, now, 0) for k, v in numbers.items()],
    )
    client.set_terminated(run_id, status="FINISHED", end_time=int(record["end"] * 1000))


def plan_dirs(sweep: SweepSettings, points: list[Point], runs: Path) -> tuple[dict[str, WorkDir], list, Path]:
    """The prep directories (by key), each point's directory with its prep's key, and the code snapshot."""
    code = code_fingerprint(REPO, sweep.stages)
    source = snapshot_code(REPO, runs, code)
    preps: dict[str, WorkDir] = {}
    placed = []
    own = [s for s in sweep.stages if s not in PREP_STAGES]
    # a grid over data/tokenizer settings alone: each point prepares (and is) its own inputs
    prep_stages = [s for s in sweep.stages if s in PREP_STAGES] if own else []
    for point in points:
        prep_key = None
        if prep_stages:
            prep = WorkDir(runs, "prep", point.params, prep_stages, code)
            prep_key = preps.setdefault(prep.key, prep).key
        placed.append((point, WorkDir(runs, point.name, point.params, own or sweep.stages, code), prep_key))
    return preps, placed, source


@flow(name="chatpipe-sweep", log_prints=True)
def sweep_flow(path: str, runs_dir: str = str(RUNS_DIR)) -> dict:
    """Run every point of the sweep file at ``path``; returns the fit (and the failed points)."""
    logger = get_run_logger()
    sweep = load_sweep(Path(path))
    points = expand(sweep)  # validated again: the file may have changed since the command line looked
    runs = Path(runs_dir).resolve()
    runs.mkdir(parents=True, exist_ok=True)
    preps, placed, source = plan_dirs(sweep, points, runs)
    parent = open_parent(sweep, len(points))
    # at most `concurrency` points (or preps) run at once, each on its share of the cores: left to
    # torch's default, each would take every core, and two points on 2 cores ran 10-19x slower
    # (a single prep runs alone: every point waits for it). On Slurm each job has its own CPUs instead.
    cores = thread_share(usable_cores(), sweep.concurrency)
    prep_cores = usable_cores() if len(preps) == 1 else cores
    logger.info("%d point(s) at a time, each on %d of this host's cores", sweep.concurrency, cores)
    rows, failed, status = [], {}, "FAILED"
    try:
        prep_futures = {k: run_prep.submit(w, k, source, prep_cores) for k, w in preps.items()}
        futures = []
        for point, workdir, prep_key in placed:
            links = {}
            if prep_key:
                links = {f"artifacts/{s}": preps[prep_key].path / "artifacts" / s for s in PREP_STAGES}
            wait = [prep_futures[prep_key]] if prep_key else []
            args = (point.name, point, workdir, links, sweep.metrics, parent, source, cores)
            fut = run_point.submit(*args, wait_for=wait)
            futures.append((point, fut))
        for point, fut in futures:
            try:
                rows.append(fut.result())
            except Exception as e:  # reported, and left out of the fit; the other points go on
                failed[point.name] = str(e).splitlines()[0][:500]
                logger.error("point %s failed: %s", point.name, failed[point.name])
        status = "FAILED" if failed else "FINISHED"
    except BaseException as e:
        if not isinstance(e, Exception):
            # a stop: inside a flow run Prefect's own SIGTERM handler raises its TerminationSignal here
            # (and re-sends the signal to ours later); Ctrl-C raises KeyboardInterrupt
            stop_points()
            status = "KILLED"
        raise
    finally:
        if _STOPPING.is_set():  # points failing because their launchers were stopped are not failures
            status = "KILLED"
        result = finish_parent(parent, sweep, rows, failed, status, runs)
    if failed:
        raise RuntimeError(f"{len(failed)} point(s) failed: {', '.join(failed)}; re-run to retry only them")
    return result


def open_parent(sweep: SweepSettings, n_points: int) -> str | None:
    """The sweep run's MLflow parent run (None when tracking is off)."""
    track = load_section(TrackingSettings)
    if not track.enabled:
        return None
    import mlflow

    exp = tracking.configure(track)
    tags = {**tracking.base_tags("sweep", sweep.profile), **tracking.process_tags(), "sweep": sweep.name}
    tags["sweep.points"] = str(n_points)
    run = mlflow.MlflowClient().create_run(exp, run_name=f"sweep {sweep.name}", tags=tags)
    with contextlib.suppress(Exception):  # outside a Prefect flow run there is nothing to link
        from flows.pipeline import link_prefect_run

        link_prefect_run(run.info.run_id)
    return run.info.run_id


def finish_parent(parent, sweep: SweepSettings, rows: list[dict], failed: dict, status: str, runs: Path) -> dict:
    """Write the results table and the fit (``<runs>/<sweep>-results/``), log them to the parent, close it."""
    out = runs / f"{sweep.name}-results"
    out.mkdir(parents=True, exist_ok=True)
    write_table(out / "results.csv", rows, failed, sweep.metrics)
    result: dict = {"failed": failed}
    if status != "KILLED":
        result = {**fitting.fit_and_plot(fitting.rows_for_fit(rows, sweep), out), "failed": failed}
    if parent:
        client = _client()
        client.log_artifacts(parent, str(out), "sweep")
        client.log_dict(parent, result, "sweep/result.json")
        nums = {k: v for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for k, v in nums.items():
            client.log_metric(parent, f"fit/{k}", float(v))
        client.set_tag(parent, "sweep.failed", ",".join(failed) or "none")
        client.set_terminated(parent, status=status)
    return result


def write_table(path: Path, rows: list[dict], failed: dict, metrics: list[str]) -> None:
    """One line per point: grid values, counts, metrics, wall time, cached or trained; failed points last."""
    keys = sorted({k for r in rows for k in r["values"]})
    counts = ["scaling_params", "total_params", "flops_per_token", "tokens", "flops", "wall_seconds"]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["point", "status", *keys, *counts, *metrics, "start", "end", "dir"])
        for r in rows:
            status = "cached" if r.get("cached") else "trained"
            w.writerow(
                [r["point"], status, *(r["values"].get(k) for k in keys), *(r[c] for c in counts)]
                + [r["metrics"].get(m) for m in metrics]
                + [r["start"], r["end"], r["dir"]]
            )
        for name, why in failed.items():
            w.writerow([name, f"failed: {why}"])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Run a sweep file as a Prefect flow (or --plan it).")
    p.add_argument("sweep", help="sweeps/<name>.yaml")
    p.add_argument("--runs-dir", default=str(RUNS_DIR), help="where the point directories live")
    p.add_argument("--plan", action="store_true", help="validate and price the points; train nothing")
    p.add_argument("--gpu", default="H100")
    p.add_argument("--mfu", type=float, default=0.4)
    args = p.parse_args(argv)
    try:  # every point validated (settings, horizon) before the Prefect server starts or anything trains
        sweep = load_sweep(Path(args.sweep))
        points = expand(sweep)
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if args.plan:
        print(format_plan(sweep, points, args.gpu, args.mfu))
        return
    signal.signal(signal.SIGTERM, _terminate_children)
    server = None if prefect_api.configured() else prefect_api.TemporaryServer(prefect_api.SERVER_LOG)
    try:
        track = load_section(TrackingSettings)
        if track.enabled:
            tracking.configure(track)
        runner = ThreadPoolTaskRunner(max_workers=sweep.concurrency)
        with prefect_api.pointed_at(server):
            print(sweep_flow.with_options(task_runner=runner)(args.sweep, args.runs_dir))
    finally:
        stop_children()
        if server is not None:
            server.stop()


def stop_children() -> None:
    """Wait until every launcher group a point started is gone (a stop must not leave workers behind)."""
    with _LOCK:
        procs = list(_CHILDREN)
    for proc in procs:
        if proc.poll() is None:
            _stop_group(proc)


if __name__ == "__main__":
    main()
