"""Small metrics and curve files that DVC compares across commits and experiments.

Each stage writes ``metrics/<stage>.json`` (its headline numbers: val bpb, tokens/s, CORE,
ChatCORE, pass@k, ...) and ``plots/<stage>/<series>.csv`` (``step,<series>`` rows: loss, bpb,
reward). dvc.yaml declares them as uncached outputs of the stage and the top-level ``metrics:``
and ``plots:``, so ``dvc metrics show/diff``, ``dvc plots show/diff`` and ``dvc exp show`` read
them; git keeps them beside ``dvc.lock``. Only rank 0 writes.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from chatpipe.io import atomic_write, write_text_atomic

METRICS_DIR = Path("metrics")
PLOTS_DIR = Path("plots")


def _clean(value: Any) -> Any:
    """JSON-safe numbers: NaN/inf become None (DVC and JSON readers choke on them), floats rounded."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return round(value, 6) if math.isfinite(value) else None
    try:
        return _clean(float(value))  # numpy / torch scalars
    except (TypeError, ValueError):
        return str(value)


def write_metrics(stage: str, values: dict[str, Any], root: Path | None = None) -> Path:
    """Write ``metrics/<stage>.json`` as ``{stage: values}`` (nested dicts allowed); returns its path.

    Nesting under the stage name gives ``dvc metrics`` / ``dvc exp show`` columns such as
    ``pretrain.val_bpb`` and ``eval.sft.ChatCORE`` rather than bare, colliding ``train_seconds``.
    """
    path = (root or METRICS_DIR) / f"{stage}.json"
    write_text_atomic(path, json.dumps({stage: _clean(values)}, indent=2, sort_keys=True) + "\n")
    return path


def series_name(key: str) -> str:
    """``train/loss`` -> ``train_loss`` (a CSV column and file name)."""
    return "".join(c if c.isalnum() else "_" for c in key).strip("_")


class Curves:
    """Forwards step metrics to ``inner`` (the stage's MLflow run, async) and keeps ``keys`` for DVC plots.

    ``metrics = Curves(run, "pretrain", ["train/loss", "val/bpb"], enabled=rt.is_main)``, where
    ``run`` is the :class:`chatpipe.tracking.StageRun`; ``flush()`` flushes its queue and writes one
    ``plots/<stage>/<series>.csv`` per key.
    """

    def __init__(
        self, inner: Any, stage: str, keys: list[str], *, enabled: bool = True, root: Path | None = None
    ) -> None:
        self.inner, self.stage, self.enabled = inner, stage, enabled
        self.series: dict[str, list[tuple[int, float]]] = {k: [] for k in keys}
        self.root = root or PLOTS_DIR

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Send ``metrics`` on to the inner buffer; remember the tracked keys' values at ``step``."""
        if self.inner is not None:
            self.inner.log(metrics, step)
        for key, value in metrics.items():
            if key in self.series and value is not None and math.isfinite(float(value)):
                points = self.series[key]
                if points and points[-1][0] == step:  # a re-logged step (e.g. final eval) replaces the old point
                    points.pop()
                points.append((int(step), float(value)))

    def flush(self) -> None:
        """Flush the inner buffer and write the curve files (rank 0)."""
        if self.inner is not None:
            self.inner.flush()
        if self.enabled:
            self.write()

    def write(self) -> list[Path]:
        """Write ``plots/<stage>/<series>.csv`` for every tracked key; returns the paths."""
        paths = []
        for key, points in self.series.items():
            name = series_name(key)
            path = self.root / self.stage / f"{name}.csv"
            with atomic_write(path, newline="") as f:
                writer = csv.writer(f)
                writer.writerow(["step", name])
                writer.writerows((s, round(v, 6)) for s, v in points)
            paths.append(path)
        return paths
