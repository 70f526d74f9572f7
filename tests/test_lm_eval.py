"""lm-evaluation-harness (HF backend) on the exported model vs our CORE evaluator, same items, 0-shot."""

from __future__ import annotations

import os

import pytest

from chatpipe.evals.lm_harness import CORE_LABELS, compare, write_tasks
from chatpipe.export.hf import export_model
from chatpipe.model.loading import load_chat_model
from tests.conftest import require_shared_data
from tests.trained import train_artifacts

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
    assert os.environ["HF_DATASETS_OFFLINE"] == "1"
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
