"""Data stage: write the pretraining text shards to ``artifacts/data``.

    python -m stages.data                  # or through torchx: python -m chatpipe.launch data
    python -m stages.data --source=local --local_dir=/data/fineweb

``data.source`` picks the origin: ``synthetic`` (the offline tiny world), ``hf`` (parquet shards
from the Hugging Face hub, cached in ``data.cache_dir``) or ``local`` (a directory laid out like
the hub files). Output: ``train_*.parquet`` + ``val_*.parquet`` with a ``text`` column and
``manifest.json``, written atomically.
"""

from __future__ import annotations

import time

from chatpipe import runtime, tracking
from chatpipe.data.sources import prepare_text
from chatpipe.paths import ARTIFACTS
from chatpipe.settings import DataSettings, snapshot


def main(argv: list[str] | None = None) -> None:
    runtime.run_stage(DataSettings, write_data, argv, distributed=False)


def write_data(cfg: DataSettings) -> None:
    out_dir = ARTIFACTS / "data"
    t0 = time.time()
    with tracking.tracked_run("data", {"data": snapshot(cfg)}) as run:
        manifest = prepare_text(out_dir, **cfg.model_dump())  # its keywords are the settings' fields
        run.log_metrics({**tracking.numeric_leaves(manifest), "seconds": time.time() - t0})
    print(f"data: {manifest}")


if __name__ == "__main__":
    main()
