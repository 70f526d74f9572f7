"""Load a model to talk to, by name, with its tokenizer, on the best device here.

A name is one of:

- a stage: ``base`` (pretrain), ``mid`` (midtrain), ``sft``, ``rl`` -> ``artifacts/<dir>/``, the
  stage's final model as DVC tracks it; ``latest`` is the most advanced of these that exists;
- ``models:/<name>/<version>`` (or ``models:/<name>@<alias>``): a version in the MLflow model
  registry. The report stage registers the model directory written by
  :func:`chatpipe.model.files.save_model_dir` under the artifact path ``model``;
- a path to such a model directory.

The tokenizer is the model directory's own ``tokenizer/`` (every stage writes one, checked with the
directory's manifest), so a copy of the directory loads anywhere; a directory written before models
carried their tokenizer falls back to its project's ``artifacts/tokenizer/``.

    from chatpipe.model.loading import load_chat_model
    loaded = load_chat_model("sft")            # Loaded(model, tokenizer, name, stage, meta, device)
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from chatpipe.io import sha256_file
from chatpipe.model.files import TOKENIZER, load_model
from chatpipe.paths import ARTIFACTS
from chatpipe.settings import MODEL_STAGES
from chatpipe.tokenizer import CONFIG_FILE, Tokenizer

log = logging.getLogger(__name__)

# stage name -> artifacts/ dir; pipeline order, so the last one present is the most advanced
STAGE_DIRS = {stage: stage for stage in MODEL_STAGES}  # artifacts/<model stage>/
ALIASES = {trainer: stage for stage, trainer in MODEL_STAGES.items() if trainer != stage}  # pretrain -> base


@dataclass
class Loaded:
    """A model ready for :class:`chatpipe.inference.engine.Engine`, and where it came from."""

    model: torch.nn.Module
    tokenizer: Tokenizer
    name: str  # what was asked for, resolved ("sft", "models:/chatpipe/3", a path)
    stage: str  # the stage that produced the weights (meta.json "stage")
    meta: dict[str, Any]
    device: torch.device

    def describe(self) -> str:
        """One line for banners and the web UI: name, stage, step, size."""
        step = self.meta.get("step")
        params = sum(p.numel() for p in self.model.parameters())
        return (
            f"{self.name} (stage {self.stage}{f', step {step}' if step is not None else ''}, "
            f"{params / 1e6:.1f}M params, {self.device.type})"
        )


def pick_device(device: str = "auto") -> torch.device:
    """``auto``: the first CUDA GPU when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"device={device} requested but CUDA is not available on this machine")
    return torch.device(device)


def stage_dir(name: str, artifacts: Path = ARTIFACTS) -> Path:
    """The artifacts dir of a stage name (or ``latest``), with a clear error when it has not run."""
    name = ALIASES.get(name, name)
    if name == "latest":
        present = [s for s in STAGE_DIRS if (artifacts / STAGE_DIRS[s] / "meta.json").exists()]
        if not present:
            raise FileNotFoundError(
                f"no trained model under {artifacts}/ (looked for "
                f"{', '.join(STAGE_DIRS.values())}): run the pipeline first"
            )
        return artifacts / STAGE_DIRS[present[-1]]
    path = artifacts / STAGE_DIRS[name]
    if not (path / "meta.json").exists():
        raise FileNotFoundError(
            f"{path}/meta.json not found: run the `{name}` stage first "
            f"(or pick another of: latest, {', '.join(STAGE_DIRS)})"
        )
    return path


def download_registered(uri: str, tracking_uri: str | None = None, dst: Path | None = None) -> Path:
    """Download a registered model version (``models:/name/version``) into ``dst`` and return its model dir.

    ``dst`` None: a new temporary directory, which the caller removes (on failure it is removed here).
    ``tracking_uri`` defaults to the ``tracking`` section of params.yaml.
    """
    own = dst is None
    dst = Path(tempfile.mkdtemp(prefix="chatpipe-model-")) if own else dst
    try:
        return _download_model_dir(uri, tracking_uri, dst)
    except BaseException:
        if own:
            shutil.rmtree(dst, ignore_errors=True)
        raise


def _download_model_dir(uri: str, tracking_uri: str | None, dst: Path) -> Path:
    import mlflow

    if tracking_uri is None:  # the project's store (params.yaml `tracking.uri`), not MLflow's ./mlruns default
        from chatpipe.settings import TrackingSettings, load_section

        tracking_uri = load_section(TrackingSettings).uri
    mlflow.set_tracking_uri(tracking_uri)
    try:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(dst)))
    except Exception as e:  # mlflow raises several types; all mean "not there"
        raise FileNotFoundError(
            f"{uri}: cannot download from the MLflow registry at {mlflow.get_tracking_uri()}: {e}"
        ) from None
    # the version source may be the run, its "model" dir, or a pyfunc model (model files under artifacts/model)
    for candidate in (local, local / "model", local / "artifacts" / "model"):
        if (candidate / "meta.json").exists():
            return candidate
    raise FileNotFoundError(
        f"{uri}: downloaded to {local} but it holds no meta.json + model.pt "
        "(expected the dir written by save_model_dir, logged as artifact path 'model')"
    )


def resolve(
    name: str, artifacts: Path = ARTIFACTS, tracking_uri: str | None = None, download_to: Path | None = None
) -> Path:
    """The local model directory a name refers to (registered models downloaded into ``download_to``,
    or into a new temporary directory the caller removes)."""
    if name.startswith("models:/"):
        return download_registered(name, tracking_uri, download_to)
    if name == "latest" or ALIASES.get(name, name) in STAGE_DIRS:
        return stage_dir(name, artifacts)
    path = Path(name)
    if (path / "meta.json").exists():
        return path
    raise FileNotFoundError(
        f"model {name!r}: not a stage (latest, {', '.join(STAGE_DIRS)}), "
        "not models:/<name>/<version>, and not a directory with meta.json"
    )


def check_tokenizer(meta: dict[str, Any], tokenizer_dir: Path, model_dir: Path) -> None:
    """The tokenizer is the one the model was trained with: the sha256 of its ``tokenizer.json`` (which
    records the hashes of the ranks and the split pattern) equals the one ``meta.json`` records in
    ``inputs.tokenizer``. Another tokenizer, or one edited since, would silently change every answer."""
    inputs = meta.get("inputs")
    recorded = inputs.get("tokenizer") if isinstance(inputs, dict) else None
    if recorded is None:
        return  # a model made outside the pipeline (tests, imports) records no tokenizer
    config = tokenizer_dir / CONFIG_FILE
    actual = sha256_file(config)
    if actual != recorded:
        raise ValueError(
            f"{config}: sha256 {actual[:12]}... is not the tokenizer {model_dir / 'meta.json'} records "
            f"({str(recorded)[:12]}...): the tokenizer was changed or comes from another run"
        )


def load_chat_model(
    name: str = "latest",
    *,
    artifacts: Path = ARTIFACTS,
    tokenizer_dir: Path | None = None,
    device: str = "auto",
    tracking_uri: str | None = None,
) -> Loaded:
    """Load model + tokenizer by name (see the module docstring) onto ``device``."""
    dev = pick_device(device)
    # a registered model is downloaded for as long as it takes to read it into memory
    with tempfile.TemporaryDirectory(prefix="chatpipe-model-") as download:
        model_dir = resolve(name, Path(artifacts), tracking_uri, download_to=Path(download))
        # first: the manifest vouches for the directory's own tokenizer before it is read
        model, meta = load_model(model_dir, device=dev)
        if tokenizer_dir is None:
            own = model_dir / TOKENIZER
            tokenizer_dir = own if own.is_dir() else Path(artifacts) / "tokenizer"
        tokenizer = Tokenizer.load(tokenizer_dir)
        check_tokenizer(meta, Path(tokenizer_dir), model_dir)
    vocab = model.config.vocab_size
    if tokenizer.vocab_size > vocab:
        raise ValueError(
            f"{tokenizer_dir}: tokenizer has {tokenizer.vocab_size} ids but the model in "
            f"{model_dir} only {vocab}: they come from different runs"
        )
    shown = name if name.startswith("models:/") or name not in (*STAGE_DIRS, *ALIASES, "latest") else model_dir.name
    log.info("loaded %s from %s on %s", shown, model_dir, dev)
    return Loaded(model, tokenizer, shown, str(meta.get("stage", "?")), meta, dev)
