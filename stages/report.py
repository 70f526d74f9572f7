"""Report stage: report.md + plots from the eval results and MLflow, and the final model registered.

    python -m stages.report
    python -m chatpipe.launch report          # as DVC does (one worker)

Reads ``artifacts/eval/results.json``, ``dvc.lock``, params.yaml and the MLflow runs that produced
the artifacts (the run id each model's meta.json and results.json record; for data and tokenizer,
their newest FINISHED run). Writes ``artifacts/report/`` (report.md, report.json, loss/bpb/reward PNGs),
logs it as artifacts of the parent run (or of its own run without a parent), and registers the
last model stage that exists (rl > sft > mid > base) in the MLflow model registry as a pyfunc model
(chatpipe/serve/pyfunc.py) with its metrics as tags: once per model sha256, aliased ``@latest``, and
``@champion`` when its numbers beat the champion's.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from chatpipe import registry, runtime, tracking
from chatpipe.io import atomic_dir, sha256_file, write_json_atomic
from chatpipe.paths import ARTIFACTS
from chatpipe.report import (
    COLUMNS,
    CURVES,
    artifact_runs,
    dvc_lock_hashes,
    plot_curves,
    render_report,
    reward_model_section,
    rl_section,
    summary_values,
    system_info,
    timing_table,
)
from chatpipe.settings import ReportSettings, pipeline_stages, resolve_params, snapshot

log = logging.getLogger("report")
OUT = ARTIFACTS / "report"


def main(argv: list[str] | None = None) -> None:
    runtime.run_stage(ReportSettings, report, argv, distributed=False)


def report(cfg: ReportSettings) -> None:
    results_path = ARTIFACTS / "eval" / "results.json"
    if not results_path.exists():
        raise FileNotFoundError(f"{results_path} not found: run the eval stage first")
    results = json.loads(results_path.read_text())
    parent_id = os.environ.get(tracking.PARENT_ENV) or None
    with tracking.tracked_run("report", {"report": snapshot(cfg)}) as run:
        with atomic_dir(OUT) as tmp:
            plots = write_report(tmp, cfg, run, results)
        log.info("wrote %s (%d plots)", OUT / "report.md", len(plots))

        # --- MLflow: report on the parent run, final model in the registry
        run.log_artifacts(OUT, "report", run_id=parent_id)
        values = summary_values(results)
        run.log_metrics(
            {f"summary/{row}/{col}": v for row, cols in values.items() for col, v in cols.items() if v is not None}
        )
        if run.enabled and cfg.register_model:
            register_final_model(run, cfg.model_name, results, values)


def write_report(tmp: Path, cfg: ReportSettings, run: tracking.StageRun, results: dict) -> list[str]:
    """Fill the report dir ``tmp``: curve plots and timings from MLflow, report.md, report.json; the plots' names."""
    # --- curves and wall times from MLflow
    plots, timings = [], "(MLflow tracking disabled: no timings)"
    if run.enabled:
        client = run.client
        runs = artifact_runs(client, run.info.experiment_id, ARTIFACTS)  # the runs behind these artifacts
        plots = [f"{name}.png" for name in CURVES if plot_curves(client, runs, name, tmp / f"{name}.png")]
        timings, total_s, total_cost = timing_table(runs, cfg.cost_per_hour)
        run.log_metrics({"pipeline/wall_seconds": total_s, "pipeline/est_cost_usd": total_cost})

    # --- report.md
    resolved = resolve_params()
    params = {s: resolved[s] for s in pipeline_stages() if s in resolved}
    locks = dvc_lock_hashes()
    text = render_report(
        results=results, system=system_info(), locks=locks, params=params, timings=timings, plots=plots
    )
    rm_meta = ARTIFACTS / "reward_model" / "meta.json"
    if rm_meta.exists():
        text += "\n" + "\n".join(reward_model_section(json.loads(rm_meta.read_text())))
    rl_meta = ARTIFACTS / "rl" / "meta.json"
    if rl_meta.exists():
        controls = Path("metrics") / "rl_controls.json"  # bench/rl_controls.py's, when it ran here
        known = json.loads(controls.read_text()) if controls.exists() else None
        text += "\n" + "\n".join(rl_section(json.loads(rl_meta.read_text()), known))
    (tmp / "report.md").write_text(text)
    write_json_atomic(
        tmp / "report.json",
        {
            "summary": summary_values(results),
            "dvc_lock": locks,
            "git_commit": results.get("git_commit"),
            "plots": plots,
        },
    )
    return plots


def register_final_model(run: tracking.StageRun, name: str, results: dict, values: dict) -> None:
    """Log the last model stage as a pyfunc model on ``run`` and register it, once per model sha256.

    Re-running the report on the same weights registers nothing new; a new model becomes a new
    version, ``@latest``, and ``@champion`` when its numbers beat the champion's.
    """
    final = next((s for s in reversed(COLUMNS) if (ARTIFACTS / s / "model.pt").exists()), None)
    if final is None:
        log.warning("no model dir to register")
        return
    r = results.get("stages", {}).get(final, {})
    sha = sha256_file(ARTIFACTS / final / "model.pt")
    if r.get("model_sha256") not in (None, sha):
        log.warning(
            "artifacts/%s/model.pt changed since eval (sha256 %s != %s)", final, sha[:12], r["model_sha256"][:12]
        )
    client = run.client
    version = registry.find_version(client, name, sha)
    if version is not None:
        log.info(
            "%s version %s already holds this %s model (sha256 %s): not registered again",
            name,
            version.version,
            final,
            sha[:12],
        )
    else:
        from chatpipe.serve.pyfunc import log_chat_model  # imports mlflow.pyfunc: only when registering

        info = log_chat_model(ARTIFACTS / final, ARTIFACTS / "tokenizer")
        tags = {
            "stage": final,
            "git_commit": str(r.get("git_commit")),
            "dvc_lock": str(r.get("dvc_lock")),
            registry.SHA_TAG: sha,
            "bpb": f"{r.get('bpb', float('nan')):.4f}",
            **{row: f"{cols[final]:.4f}" for row, cols in values.items() if cols.get(final) is not None},
        }
        version = registry.register(client, name, info.model_uri, run.id, tags)
        log.info("registered %s version %s from artifacts/%s (sha256 %s)", name, version.version, final, sha[:12])
    held = registry.update_aliases(client, name, version)
    run.set_tags({"registered_model": f"models:/{name}/{version.version}", "model_aliases": ",".join(held) or "none"})


if __name__ == "__main__":
    main()
