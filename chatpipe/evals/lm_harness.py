"""lm-evaluation-harness on an exported model, over the CORE bundle's local files, next to our CORE.

    python -m chatpipe.evals.lm_harness --model base --bundle ../shared/data/core --rows 200

exports ``--model`` to a temp transformers dir, runs lm-eval's HF backend on the task YAMLs in
``chatpipe/evals/lm_eval_tasks/`` (local jsonl only: ``HF_DATASETS_OFFLINE=1``, no hub) and our
CORE evaluator on the same items (the first ``--rows`` rows of each file) and prints both.

How the two relate (what must be equal, what may differ):

- Both are 0-shot here. CORE's ARC-Easy is 10-shot with demos drawn by ``random.Random(1234 + i)``;
  lm-eval draws its own few-shot sample, so only 0-shot compares item for item.
- Both score the same strings with BOS first: context ``query + "\\nAnswer:"`` (ARC) or ``query``
  (COPA) and each choice after a space; lm-eval moves the context's trailing space to the
  continuation, which with our split regex tokenizes like CORE's common-prefix split.
- Multiple choice: lm-eval's ``acc`` picks the largest *summed* log-likelihood; CORE picks the lowest
  *mean* loss per continuation token. On an item whose choices all have the same number of
  continuation tokens the two rules are the same rule (also when a common prefix of the choices is
  dropped, which removes the same count from each), so accuracy over those items is equal. Over
  all items the difference is at most the share of items whose choice lengths differ, and exactly
  the share where the two rules pick differently (reported as ``rule_disagreements``).
- Language modelling (LAMBADA): both count an item correct when the greedy prediction reproduces
  every continuation token, so accuracies are equal.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from chatpipe.io import env_set
from chatpipe.progress import progress

TASKS_DIR = Path(__file__).with_name("lm_eval_tasks")
# lm-eval task name -> CORE task label (chatpipe/evals/core_tasks.yaml)
CORE_LABELS = {"chatpipe_arc_easy": "arc_easy", "chatpipe_copa": "copa", "chatpipe_lambada_openai": "lambada_openai"}


def write_tasks(out_dir: Path, bundle_dir: Path, rows: int | None = None) -> Path:
    """Copy the task YAMLs to ``out_dir`` with absolute data paths under ``bundle_dir``.

    With ``rows``, each task reads a copy of the first ``rows`` lines of its file (in
    ``out_dir/data``), so lm-eval and CORE evaluate exactly the same items.
    """
    out_dir, bundle_dir = Path(out_dir), Path(bundle_dir)
    (out_dir / "data").mkdir(parents=True, exist_ok=True)
    for path in sorted(TASKS_DIR.glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        src = bundle_dir / Path(cfg["dataset_kwargs"]["data_files"]["test"]).name
        if not src.is_file():
            raise FileNotFoundError(f"{path.name}: task data {src} not found (bundle dir {bundle_dir})")
        if rows is not None:
            lines = src.read_text().splitlines(keepends=True)[:rows]
            dst = out_dir / "data" / src.name
            dst.write_text("".join(lines))
            src = dst
        cfg["dataset_kwargs"]["data_files"]["test"] = str(src.resolve())
        (out_dir / path.name).write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out_dir


@contextlib.contextmanager
def hub_offline() -> Iterator[None]:
    """``HF_HUB_OFFLINE`` and ``HF_DATASETS_OFFLINE`` set to 1 inside, and put back as they were after.

    Setting them for good would leak into everything the process starts later: a pipeline run
    from the same process (a test, a notebook) would then fail to download anything.
    """
    with env_set(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"):
        yield


def run_lm_eval(
    hf_dir: Path, tasks: list[str], include_path: Path, *, max_length: int, device: str = "cpu", batch_size: int = 1
) -> dict[str, Any]:
    """lm-eval's HF backend on ``hf_dir`` (fp32, BOS first); returns its results dict (with samples).

    ``trust_remote_code`` is passed when the export ships its own modeling file."""
    # an export with our own modeling file (config.json auto_map) loads only with remote code allowed
    remote = "auto_map" in json.loads((Path(hf_dir) / "config.json").read_text())
    # lm-eval runs as one call: the timer's line every 30 s says it is still going
    with hub_offline(), progress(len(tasks), f"lm-eval {', '.join(tasks)}", unit="task"):
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        return simple_evaluate(
            model="hf",
            model_args={
                "pretrained": str(hf_dir),
                "dtype": "float32",
                "add_bos_token": True,
                "max_length": max_length,
                "device": device,
                "trust_remote_code": remote,
            },
            tasks=tasks,
            batch_size=batch_size,
            task_manager=TaskManager(include_path=str(include_path), include_defaults=False),
            log_samples=True,
            bootstrap_iters=0,
        )


def _pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], int]:
    """BOS + context + continuation ids and where the continuation starts, split as lm-eval splits:
    the context's trailing spaces move to the continuation, the whole string is encoded once."""
    stripped = context.rstrip()
    whole = tokenizer.encode(context + continuation, prepend=tokenizer.bos_id)
    return whole, len(tokenizer.encode(stripped, prepend=tokenizer.bos_id))


def _loglik(model: Any, ids: list[int], start: int) -> float:
    """Our model's summed log-probability of ``ids[start:]`` given what precedes it (fp32)."""
    import torch

    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)
    return float(logp[torch.arange(start - 1, len(ids) - 1), torch.tensor(ids[start:])].sum())


def _mc_prompts(task: Any, item: dict) -> tuple[str, list[str]]:
    """CORE's context (query + delimiter) and the choices of a multiple-choice item."""
    return item["query"] + task.continuation_delimiter, item["choices"]


def compare(
    model: Any, tokenizer: Any, hf_dir: Path, bundle_dir: Path, work_dir: Path, *, rows: int, max_seq_len: int
) -> dict[str, dict[str, Any]]:
    """lm-eval and CORE accuracies on the same items, with the numbers that explain any difference.

    Per task: ``lm_eval_acc`` and ``core_acc`` over all items; ``max_loglik_diff``, the largest gap
    between a log-likelihood lm-eval computed and ours for the same tokens. Multiple choice also:
    ``mean_rule_acc`` (lm-eval's log-likelihoods decided by CORE's mean-per-token rule),
    ``rule_disagreements`` (items where the sum and mean rules pick differently), the subset
    ``distinct_start`` of items whose choices share no first continuation token (where any
    common-prefix span definition scores the whole choice) with both accuracies on it, and
    ``bound``: the share of items where the two evaluators may pick differently (the sum and mean
    rules disagree, or the choices share a first token so the span definition matters), which
    bounds |lm_eval_acc - core_acc| whichever span definition CORE uses.
    """
    from chatpipe.evals.core import DEFAULT_CONFIG, evaluate_task, load_core_config, read_task_rows

    include = write_tasks(Path(work_dir) / "tasks", bundle_dir, rows)
    results = run_lm_eval(hf_dir, list(CORE_LABELS), include, max_length=max_seq_len)
    core_tasks = {t.label: t for t in load_core_config(DEFAULT_CONFIG)}
    out: dict[str, dict[str, Any]] = {}
    for name, label in CORE_LABELS.items():
        task = dataclasses.replace(core_tasks[label], num_fewshot=0)  # 0-shot: lm-eval's draw is its own
        data = Path(yaml.safe_load((include / f"{name}.yaml").read_text())["dataset_kwargs"]["data_files"]["test"])
        items = read_task_rows(data, task)
        samples = sorted(results["samples"][name], key=lambda s: s["doc_id"])
        assert len(samples) == len(items), f"{name}: lm-eval scored {len(samples)} of {len(items)} items"

        def core_acc(subset: list[dict], task=task) -> float | None:
            if not subset:
                return None
            path = Path(work_dir) / f"{task.label}.subset.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in subset))
            rows_ = read_task_rows(path, task)
            return evaluate_task(model, tokenizer, task, rows_, device="cpu", max_seq_len=max_seq_len)

        row: dict[str, Any] = {"items": len(items), "lm_eval_acc": results["results"][name]["acc,none"]}
        row["core_acc"] = core_acc(items)
        diff = 0.0
        if task.type == "language_modeling":
            for item, s in zip(items, samples):
                ids, start = _pair(tokenizer, item["context"] + task.continuation_delimiter, item["continuation"])
                diff = max(diff, abs(_loglik(model, ids, start) - float(s["filtered_resps"][0][0])))
        else:
            row["lm_eval_acc_norm"] = results["results"][name]["acc_norm,none"]
            disagree, mean_right, distinct, unexplained = 0, 0, [], 0
            for item, s in zip(items, samples):
                context, choices = _mc_prompts(task, item)
                pairs = [_pair(tokenizer, context, c) for c in choices]
                logliks = [float(r[0]) for r in s["filtered_resps"]]
                diff = max(diff, *(abs(_loglik(model, ids, st) - ll) for (ids, st), ll in zip(pairs, logliks)))
                lengths = [len(ids) - st for ids, st in pairs]
                by_sum = max(range(len(logliks)), key=lambda i: logliks[i])
                by_mean = max(range(len(logliks)), key=lambda i: logliks[i] / lengths[i])
                disagree += by_sum != by_mean
                mean_right += by_mean == item["gold"]
                if len({ids[st] for ids, st in pairs}) == len(pairs):
                    distinct.append((item, s, by_mean == item["gold"]))
                    unexplained += by_sum == by_mean
            row.update(
                mean_rule_acc=mean_right / len(items),
                rule_disagreements=disagree,
                distinct_start_items=len(distinct),
                mean_rule_acc_distinct_start=sum(ok for *_, ok in distinct) / len(distinct) if distinct else None,
                core_acc_distinct_start=core_acc([item for item, *_ in distinct]),
                bound=(len(items) - unexplained) / len(items),
            )
        row["max_loglik_diff"] = diff
        out[name] = row
    return out


def main(argv: list[str] | None = None) -> int:
    """Print lm-eval vs CORE accuracies for a model (see the module docstring)."""
    from chatpipe.export.hf import export_model
    from chatpipe.model.loading import load_chat_model

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="base", help="base | mid | sft | rl | latest | models:/... | a model dir")
    p.add_argument("--bundle", default="../shared/data/core", help="dir with the CORE jsonl files")
    p.add_argument("--rows", type=int, default=200, help="first N rows of each task file")
    p.add_argument("--max-seq-len", type=int, default=1024)
    args = p.parse_args(argv)
    loaded = load_chat_model(args.model, device="cpu")
    with tempfile.TemporaryDirectory(prefix="chatpipe-lm-eval-") as tmp:
        hf_dir = export_model(loaded.model, loaded.tokenizer, loaded.meta, Path(tmp) / "hf", source=args.model)
        numbers = compare(
            loaded.model,
            loaded.tokenizer,
            hf_dir,
            Path(args.bundle),
            Path(tmp),
            rows=args.rows,
            max_seq_len=args.max_seq_len,
        )
    print(json.dumps(numbers, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
