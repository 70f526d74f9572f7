"""lm-evaluation-harness (HF backend) on the exported model vs our CORE evaluator, same items, 0-shot."""

from __future__ import annotations

import os

import pytest

from chatpipe.evals.lm_harness import CORE_LABELS, _loglik, _pair, compare, hub_offline, run_lm_eval, write_tasks
from chatpipe.export.hf import export_model
from chatpipe.model.loading import load_chat_model
from tests.conftest import require_shared_data
from tests.trained import speedrun_model, train_artifacts

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")
ROWS = 60


@pytest.fixture(scope="module")
def numbers(tmp_path_factory):
    bundle = require_shared_data() / "core"
    root = tmp_path_factory.mktemp("lm_eval")
    loaded = load_chat_model("base", artifacts=train_artifacts(root / "artifacts"), device="cpu")
    hf_dir = export_model(loaded.model, loaded.tokenizer, loaded.meta, root / "hf", source="base")
    out = compare(loaded.model, loaded.tokenizer, hf_dir, bundle, root, rows=ROWS, max_seq_len=1024)
    print(out)  # the numbers for the closing note (pytest -s)
    return out


def test_task_yamls_point_at_local_files_only(tmp_path):
    include = write_tasks(tmp_path, require_shared_data() / "core", rows=5)
    for name in CORE_LABELS:
        text = (include / f"{name}.yaml").read_text()
        assert str(tmp_path.resolve()) in text and "hf.co" not in text and "huggingface" not in text
        assert len((tmp_path / "data" / f"{CORE_LABELS[name]}.jsonl").read_text().splitlines()) == 5


@pytest.mark.slow
def test_lm_eval_scores_the_same_model_and_items_as_core(numbers):
    assert "HF_DATASETS_OFFLINE" not in os.environ  # run_lm_eval ran offline inside hub_offline(), and put it back
    for name, row in numbers.items():
        assert row["items"] == ROWS
        # lm-eval's log-likelihoods are our model's, token for token (fp32)
        assert row["max_loglik_diff"] <= 1e-4, (name, row)
    # language modelling: the same greedy rule, so the same accuracy
    lam = numbers["chatpipe_lambada_openai"]
    assert lam["lm_eval_acc"] == lam["core_acc"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["chatpipe_arc_easy", "chatpipe_copa"])
def test_multiple_choice_differs_only_by_the_length_rule(numbers, name):
    row = numbers[name]
    # where the span is the whole choice under any definition, lm-eval's log-likelihoods decided by
    # CORE's mean-per-token rule give exactly CORE's accuracy
    assert row["distinct_start_items"] > 0
    assert row["mean_rule_acc_distinct_start"] == row["core_acc_distinct_start"]
    # and lm-eval's own acc (summed log-likelihood) is off by at most the items where rules may differ
    assert abs(row["lm_eval_acc"] - row["core_acc"]) <= row["bound"] + 1e-12
    assert row["bound"] < 1.0


def test_lm_eval_scores_a_remote_code_export_with_our_log_likelihoods(tmp_path):
    # every speedrun option: the export ships modeling_chatpipe.py, lm-eval must trust it
    bundle = require_shared_data() / "core"
    loaded = load_chat_model("base", artifacts=train_artifacts(tmp_path / "artifacts", steps=1), device="cpu")
    model = speedrun_model(loaded.tokenizer.vocab_size)
    hf_dir = export_model(model, loaded.tokenizer, {}, tmp_path / "hf", report_path=None)
    assert (hf_dir / "modeling_chatpipe.py").exists()
    include = write_tasks(tmp_path / "tasks", bundle, rows=4)
    results = run_lm_eval(hf_dir, ["chatpipe_copa"], include, max_length=512)
    samples = sorted(results["samples"]["chatpipe_copa"], key=lambda s: s["doc_id"])
    assert len(samples) == 4 and 0.0 <= results["results"]["chatpipe_copa"]["acc,none"] <= 1.0
    for s in samples:  # lm-eval's log-likelihood of each choice is our model's, token for token
        doc = s["doc"]
        for choice, resp in zip(doc["choices"], s["filtered_resps"]):
            ids, start = _pair(loaded.tokenizer, doc["query"] + " ", choice)
            assert abs(_loglik(model, ids, start) - float(resp[0])) <= 1e-4


def test_hub_offline_puts_the_environment_back(monkeypatch):
    """run_lm_eval's offline switch must not outlive it: a flow started later from the same process
    (the rehearsal test after the lm-eval one, on one xdist worker) inherited HF_HUB_OFFLINE=1 and
    could not download its data."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    with hub_offline():
        assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["HF_DATASETS_OFFLINE"] == "1"
    assert "HF_HUB_OFFLINE" not in os.environ and os.environ["HF_DATASETS_OFFLINE"] == "0"
    with pytest.raises(RuntimeError), hub_offline():
        raise RuntimeError("lm-eval failed")
    assert "HF_HUB_OFFLINE" not in os.environ
