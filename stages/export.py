"""Export stage: the final model as a Hugging Face transformers directory, after the report.

    python -m stages.export
    python -m chatpipe.launch export            # as DVC does (one worker)
    CHATPIPE_EXPORT__MODEL=sft python -m stages.export

Writes ``artifacts/export/`` (safetensors, config, tokenizer, chat template, model card; see
chatpipe/export/hf.py) from ``export.model`` (default: the most advanced stage), logs it as the
``hf`` artifact of the pipeline's parent run (or of its own run without a parent) and adds it to
the newest registered version of ``report.model_name`` under ``model/hf``. With
``export.push_to_hub`` set it also uploads the directory to that Hub repo.
"""

from __future__ import annotations

import logging
import os
import shutil

from chatpipe import runtime, tracking
from chatpipe.export.hf import ExportError, export_by_name, log_to_mlflow, push_to_hub
from chatpipe.paths import ARTIFACTS
from chatpipe.progress import progress
from chatpipe.settings import ExportSettings, ReportSettings, load_section, snapshot

log = logging.getLogger("export")
OUT = ARTIFACTS / "export"


def main(argv: list[str] | None = None) -> None:
    runtime.run_stage(ExportSettings, export, argv, distributed=False)


def export(cfg: ExportSettings) -> None:
    report = load_section(ReportSettings)
    with tracking.tracked_run("export", {"export": snapshot(cfg)}) as run:
        # --- the transformers directory (or, on request, the reason there is none)
        try:
            with progress(1, "export", unit="model"):  # one call; the timer's line every 30 s says it runs
                out = export_by_name(cfg.model, OUT, dtype=cfg.dtype, artifacts=ARTIFACTS)
        except ExportError as e:
            if cfg.on_unsupported == "fail":
                raise
            log.warning("export skipped: %s", e)
            shutil.rmtree(OUT, ignore_errors=True)  # no stale export next to the reason
            OUT.mkdir(parents=True)
            (OUT / "SKIPPED.md").write_text(f"# export skipped\n\n{e}\n")
            return

        # --- MLflow: the pipeline run's artifact and the registered version's files
        if run.enabled:
            parent_id = os.environ.get(tracking.PARENT_ENV) or run.id
            version = log_to_mlflow(run.client, parent_id, out, report.model_name if report.register_model else None)
            log.info("logged %s as artifact 'hf' of run %s (registered version: %s)", out, parent_id, version)

        # --- the Hub, when asked
        if cfg.push_to_hub:
            log.info("pushed to %s", push_to_hub(out, cfg.push_to_hub, private=cfg.hub_private))


if __name__ == "__main__":
    main()
