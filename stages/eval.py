"""Eval stage: bits per byte, CORE and ChatCORE of every model stage that exists.

    python -m stages.eval                                       # one process
    torchrun --nproc_per_node=2 -m stages.eval                  # items split across ranks
    python -m chatpipe.launch eval -- --max_per_task=20         # through torchx, as DVC does
    CHATPIPE_EVAL__CORE_BUNDLE_DIR=../shared/data/core CHATPIPE_EVAL__MODEL_DIRS='["base"]' python -m stages.eval

For each of ``artifacts/{base,mid,sft,rl}`` that holds a model (``eval.model_dirs``):
- bpb on the pretraining val text (``eval.eval_tokens`` tokens),
- CORE (``eval.core_stages``): the tasks of ``eval.core_config`` found in ``eval.core_bundle_dir``
  (fetched from ``eval.core_bundle_url`` when missing; speedrun fetches the published bundle) and,
  with ``eval.core_tinyworld``, the synthetic tiny-world tasks (chatpipe/evals/core_tinyworld.py),
- ChatCORE (``eval.chatcore_stages``): ``eval.chatcore_tasks`` from chatpipe.data.tasks.

Writes ``artifacts/eval/results.json`` (every number with the git commit and the dvc.lock hash
of the model stage it came from) and logs the same numbers as MLflow metrics.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from chatpipe import runtime, tracking
from chatpipe.data.fetch import fetch_zip
from chatpipe.data.loader import RowLoader, TokenDocs, tokenize_shards
from chatpipe.evals.chatcore import evaluate_chatcore
from chatpipe.evals.core import DEFAULT_CONFIG, evaluate_core, load_core_config
from chatpipe.evals.core_tinyworld import write_tinyworld_bundle
from chatpipe.evals.metrics import chatcore_label
from chatpipe.io import atomic_dir, fingerprint, sha256_file, write_json_atomic
from chatpipe.model.files import load_model
from chatpipe.paths import ARTIFACTS, WORK
from chatpipe.progress import iterate
from chatpipe.settings import MODEL_STAGES, EvalSettings, active_profile, snapshot
from chatpipe.stage_metrics import write_metrics
from chatpipe.tokenizer import Tokenizer
from chatpipe.train.step import evaluate_bpb, fixed_batches

log = logging.getLogger("eval")
OUT = ARTIFACTS / "eval"


def main(argv: list[str] | None = None) -> None:
    runtime.run_stage(EvalSettings, evaluate, argv)


def val_docs(tok: Tokenizer, work: Path, rt: runtime.Runtime) -> TokenDocs:
    """The pretraining val split, tokenized once into ``work`` (train shards are left alone)."""
    data_dir, text_dir = ARTIFACTS / "data", work / "val_text"
    manifest = json.loads((data_dir / "manifest.json").read_text())
    if rt.is_main:  # a dir of links to the val shards only, so tokenize_shards skips the train text
        text_dir.mkdir(parents=True, exist_ok=True)
        for old in text_dir.glob("*.parquet"):
            old.unlink()
        for shard in sorted(data_dir.glob("val_*.parquet")):
            (text_dir / shard.name).symlink_to(shard.resolve())
    runtime.barrier()
    fp = fingerprint({"tokenizer": sha256_file(ARTIFACTS / "tokenizer" / "tokenizer.json"), "data": manifest})
    tokenize_shards(text_dir, tok, work / "tokens", fingerprint=fp, rank=rt.rank, world_size=rt.world_size)
    return TokenDocs(work / "tokens", "val")


def core_suites(cfg: EvalSettings, work: Path, rt: runtime.Runtime) -> list[tuple[str, list, Path]]:
    """(results key, task configs, bundle dir) to run: the DCLM bundle as ``core`` and the tiny-world
    tasks as ``core_tinyworld`` -- two different metrics, never averaged into one number."""
    suites = []
    if cfg.core_bundle_dir:
        config = load_core_config(Path(cfg.core_config) if cfg.core_config else DEFAULT_CONFIG)
        if cfg.core_tasks:
            known = {t.label for t in config}
            unknown = [x for x in cfg.core_tasks if x not in known]
            if unknown:
                raise ValueError(f"eval.core_tasks = {unknown}: not in the CORE config; allowed: {sorted(known)}")
            # tasks asked for by name must be there: a missing file fails instead of being skipped
            config = [dataclasses.replace(t, required=True) for t in config if t.label in cfg.core_tasks]
        bundle = Path(cfg.core_bundle_dir)
        if cfg.core_bundle_url and rt.is_main and not bundle.is_dir():
            print(f"eval: fetching the CORE bundle {cfg.core_bundle_url} -> {bundle}", flush=True)
            fetch_zip(cfg.core_bundle_url, bundle)
        runtime.barrier()
        if not bundle.is_dir():
            raise FileNotFoundError(
                f"eval.core_bundle_dir = {cfg.core_bundle_dir!r}: no such directory "
                "(set eval.core_bundle_url to fetch it)"
            )
        suites.append(("core", config, bundle))
    if cfg.core_tinyworld:
        if rt.is_main:
            write_tinyworld_bundle(work / "tinyworld", seed=cfg.seed, n=cfg.tinyworld_examples)
        runtime.barrier()
        suites.append(("core_tinyworld", load_core_config(work / "tinyworld" / "core_tasks.yaml"), work / "tinyworld"))
    return suites


def chat_tasks(cfg: EvalSettings) -> tuple[dict, dict[str, str]]:
    """The ChatCORE tasks to run, and {label: reason} for those whose data is not available here
    (a stand-in under its own name, as its results would be)."""
    from chatpipe.data.tasks import build_task  # only chat stages need the task package

    tasks, skipped = {}, {}
    for name, spec in cfg.chatcore_tasks.items():
        kw = {k: v for k, v in spec.items() if k != "task"}
        kw.setdefault("split", cfg.chatcore_split)
        try:
            tasks[name] = build_task(spec["task"], **kw)
        except (FileNotFoundError, ImportError, OSError) as e:
            skipped[chatcore_label(name, spec["task"])] = f"{spec['task']}: {e}"
            log.warning("ChatCORE task %s skipped: %s", name, e)
    return tasks, skipped


@dataclasses.dataclass
class EvalInputs:
    """What every model stage is evaluated on: built once, shared by all of them."""

    tok: Tokenizer
    token_bytes: torch.Tensor
    docs: TokenDocs  # the pretraining val split, for bpb
    suites: list[tuple[str, list, Path]]  # CORE suites (core_suites); empty when no CORE stage is present
    chat_tasks: dict  # ChatCORE tasks; empty when no ChatCORE stage is present
    chat_skipped: dict[str, str]  # ChatCORE tasks whose data is missing, with the reason


def evaluate(cfg: EvalSettings, rt: runtime.Runtime) -> None:
    """bpb, CORE and ChatCORE of every model stage present; results.json, ``dvc metrics`` and MLflow."""
    work = WORK / "eval"
    tok = Tokenizer.load(ARTIFACTS / "tokenizer")
    token_bytes = torch.load(ARTIFACTS / "tokenizer" / "token_bytes.pt", weights_only=True).to(rt.device)
    present = [s for s in cfg.model_dirs if (ARTIFACTS / s / "meta.json").exists()]
    if not present:
        raise FileNotFoundError(
            f"none of {[str(ARTIFACTS / s) for s in cfg.model_dirs]} holds a model; run pretrain first"
        )
    log.info("evaluating %s", ", ".join(present))

    # --- inputs shared by every model
    docs = val_docs(tok, work, rt)
    suites = core_suites(cfg, work, rt) if set(present) & set(cfg.core_stages) else []
    tasks, chat_skipped = chat_tasks(cfg) if set(present) & set(cfg.chatcore_stages) else ({}, {})
    inputs = EvalInputs(tok, token_bytes, docs, suites, tasks, chat_skipped)
    provenance = {"git_commit": tracking.git_commit(), "dvc_lock": tracking.dvc_lock_hash()}

    results: dict[str, dict] = {}
    with tracking.tracked_run("eval", {"eval": snapshot(cfg), "stages": present}, rt) as run:
        for stage in present:
            results[stage] = evaluate_model(stage, cfg, inputs, provenance, rt)
            run.log_metrics(flat_metrics(stage, results[stage]))
        if rt.is_main:
            write_results(cfg, results, provenance, run)
    runtime.barrier()


def evaluate_model(stage: str, cfg: EvalSettings, inputs: EvalInputs, provenance: dict, rt: runtime.Runtime) -> dict:
    """The results of the model in ``artifacts/<stage>``: bpb, and CORE / ChatCORE where ``cfg`` asks."""
    model, meta = load_model(ARTIFACTS / stage, rt.device)
    r: dict = {
        "model_sha256": meta.get("files", {}).get("model.pt"),
        **provenance,
        "dvc_stage_hash": tracking.dvc_stage_hash(MODEL_STAGES[stage]),
    }

    # --- bits per byte on val text
    seq_len = model.config.sequence_len
    steps = max(1, cfg.eval_tokens // (cfg.device_batch_size * seq_len * rt.world_size))
    loader = RowLoader(inputs.docs, batch_size=cfg.device_batch_size, seq_len=seq_len, **rt.shard)
    batches = iterate(fixed_batches(loader.next_batch, steps), f"eval {stage} bpb", total=steps, unit="batch")
    r["bpb"] = evaluate_bpb(model, batches, inputs.token_bytes, rt)
    log.info("%s | val bpb %.4f", stage, r["bpb"])

    # --- CORE, each suite under its own key
    if stage in cfg.core_stages:
        for key, config, bundle in inputs.suites:
            r[key] = run_core(stage, key, model, inputs.tok, config, bundle, cfg, rt)

    # --- ChatCORE
    if stage in cfg.chatcore_stages and inputs.chat_tasks:
        r["chatcore"] = {**run_chatcore(stage, model, inputs, cfg, rt), "skipped": inputs.chat_skipped}
    return r


def run_core(
    stage: str, key: str, model, tok: Tokenizer, config: list, bundle: Path, cfg: EvalSettings, rt: runtime.Runtime
) -> dict:
    """One CORE suite (``key``: ``core`` or ``core_tinyworld``) on ``model``, logged task by task."""
    with rt.autocast():
        out = evaluate_core(
            model,
            tok,
            config,
            bundle,
            device=rt.device,
            max_seq_len=model.config.sequence_len,
            max_per_task=cfg.max_per_task or None,
            rank=rt.rank,
            world_size=rt.world_size,
        )
    log_tasks(f"{stage} | {key}", out["tasks"], width=28)
    log.info("%s | %s %s over %d tasks (%d skipped)", stage, key, out["core"], len(out["tasks"]), len(out["skipped"]))
    return out


def run_chatcore(stage: str, model, inputs: EvalInputs, cfg: EvalSettings, rt: runtime.Runtime) -> dict:
    """ChatCORE of ``model`` over the tasks in ``inputs``, logged task by task."""
    with rt.autocast():
        out = evaluate_chatcore(
            model, inputs.tok, inputs.chat_tasks, cfg, device=rt.device, rank=rt.rank, world_size=rt.world_size
        )
    log_tasks(stage, out["tasks"], width=13)
    log.info("%s | ChatCORE %.4f", stage, out["chatcore"])
    return out


def log_tasks(prefix: str, tasks: dict[str, dict], width: int) -> None:
    """One log line per task: accuracy, centered accuracy, items and seconds."""
    for name, t in tasks.items():
        log.info(
            "%s | %-*s acc %.3f centered %+.3f (%d items, %.1fs)",
            prefix, width, name, t["accuracy"], t["centered"], t["num_examples"], t["seconds"],
        )  # fmt: skip


def write_results(cfg: EvalSettings, results: dict[str, dict], provenance: dict, run: tracking.StageRun) -> None:
    """``artifacts/eval/results.json`` (the DVC out, swapped in whole), the headline numbers per
    model for ``dvc metrics``, and results.json attached to the MLflow run. Rank 0 only."""
    doc = {
        **provenance,
        "profile": active_profile(),
        "settings": snapshot(cfg),
        "stages": results,
        "mlflow_run_id": run.id,  # the report credits this run (None without tracking)
    }
    with atomic_dir(OUT) as tmp:
        write_json_atomic(tmp / "results.json", doc)
    # headline numbers per model (bpb, CORE, ChatCORE, each ChatCORE task): the metric names with one "/"
    write_metrics(
        "eval",
        {
            s: {k.split("/", 1)[1]: v for k, v in flat_metrics(s, r).items() if k.count("/") == 1}
            for s, r in results.items()
        },
    )
    run.log_artifact(OUT / "results.json")
    log.info("wrote %s", OUT / "results.json")


def flat_metrics(stage: str, r: dict) -> dict[str, float]:
    """One model's results as flat MLflow metric names, e.g. ``base/bpb``, ``base/CORE``, ``sft/GSM8K``
    (``sft/tinyworld_gsm`` where that task stood in for GSM8K: ChatCORE results are keyed by the task run)."""
    m = {f"{stage}/bpb": r["bpb"]}
    for key, name in (("core", "CORE"), ("core_tinyworld", "tinyworld_CORE")):
        core = r.get(key) or {}
        if core.get("core") is not None:
            m[f"{stage}/{name}"] = core["core"]
        for label, t in core.get("tasks", {}).items():
            m[f"{stage}/{key}/{label}"] = t["centered"]
    chat = r.get("chatcore") or {}
    if chat.get("chatcore") is not None:
        m[f"{stage}/ChatCORE"] = chat["chatcore"]
    for name, t in chat.get("tasks", {}).items():
        m[f"{stage}/{name}"] = t["accuracy"]
    return m


if __name__ == "__main__":
    main()
