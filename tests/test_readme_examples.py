"""The default tiny pipeline's final (rl) model answers the README's kind of chat question.

Ten two-number +, - and x questions phrased like the README's examples ("What is 12 + 7?",
"What is 6 times 8?") are asked greedily through the chat CLI's prompt path and engine (calculator
tool on); at least 9 must end with the right number.

The model comes from ``CHATPIPE_TRAINED_PROJECT`` (a project dir whose ``artifacts/`` holds
``tokenizer`` and ``rl``, e.g. a scratch copy where ``python -m flows.pipeline`` ran) or, without
it, from the session's tiny SFT run (shared with the other slow tests that start from it) taken
through the default RL stage here.

    CHATPIPE_TRAINED_PROJECT=/tmp/proj python -m pytest tests/test_readme_examples.py -q
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from chatpipe.testing.project import rl_ready_project, run

QUESTIONS = [
    ("What is 12 + 7?", 19),
    ("What is 6 times 8?", 48),
    ("What is 25 - 9?", 16),
    ("What is 3 + 4?", 7),
    ("What is 7 times 9?", 63),
    ("What is 40 minus 15?", 25),
    ("What is 11 * 3?", 33),
    ("What is 56 + 38?", 94),
    ("What is 9 - 2?", 7),
    ("What is 14 times 5?", 70),
]


def final_number(reply: str) -> int | None:
    """The ``#### n`` answer, else the last integer of the reply."""
    m = re.search(r"####\s*(-?\d+)", reply) or None
    if m:
        return int(m.group(1))
    nums = re.findall(r"-?\d+", reply)
    return int(nums[-1]) if nums else None


def trained_project(tmp_path: Path, tiny_sft: Path) -> Path:
    """``CHATPIPE_TRAINED_PROJECT`` when it holds the RL model; else the session's tiny SFT run
    (:func:`chatpipe.testing.project.tiny_sft_project`) taken through the RL stage here."""
    given = os.environ.get("CHATPIPE_TRAINED_PROJECT")
    if given:
        project = Path(given)
        if not (project / "artifacts" / "rl" / "model.pt").is_file():
            pytest.fail(f"CHATPIPE_TRAINED_PROJECT={given}: no artifacts/rl/model.pt there")
        return project
    project = rl_ready_project(tmp_path / "p", tiny_sft)
    run(project, "python", "-m", "stages.rl", CHATPIPE_TRACKING__ENABLED="false")
    return project


@pytest.mark.slow
def test_rl_model_answers_readme_style_arithmetic(tmp_path: Path, tiny_sft: Path) -> None:
    from chatpipe.inference.engine import Engine
    from chatpipe.model.files import load_model
    from chatpipe.serve.chat import prompt_for
    from chatpipe.tokenizer import Tokenizer

    project = trained_project(tmp_path, tiny_sft)
    tok = Tokenizer.load(project / "artifacts" / "tokenizer")
    model, _ = load_model(project / "artifacts" / "rl", "cpu")
    model.eval()
    engine = Engine(model, tok)
    right, replies = 0, []
    for question, answer in QUESTIONS:
        ids = prompt_for(tok, model, [{"role": "user", "content": question}], max_tokens=64)
        reply = "".join(text for _, text in engine.stream(ids, max_tokens=64, temperature=0.0))
        replies.append(f"{question} -> {reply!r}")
        right += final_number(reply) == answer
    assert right >= 9, "\n".join(replies)
    assert engine.tool_stats["cut"] == 0, "\n".join(replies)
