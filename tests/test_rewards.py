"""Answer extraction and reward functions (chatpipe/rl/rewards.py)."""

from __future__ import annotations

import pytest

from chatpipe.data.synthetic import arithmetic_problems, tool_conversations
from chatpipe.rl import rewards


@pytest.mark.parametrize(
    "text, want",
    [
        ("He has 5+7 = <<5+7=12>>12 apples.\n#### 12", "12"),
        ("#### 1,234", "1234"),
        ("####-7", "-7"),
        ("#### 3.50 dollars", "3.5"),
        ("#### 4.0", "4"),
        ("The answer is 12.", None),
        ("#### twelve", None),
    ],
)
def test_extract_answer(text, want):
    assert rewards.extract_answer(text) == want


def test_fallback_last_number_only_when_asked():
    assert rewards.extract_answer("so 3 then 41") is None
    assert rewards.extract_answer("so 3 then 41", fallback_last_number=True) == "41"


def test_exact_answer_against_gold_text_or_number():
    assert rewards.exact_answer("bla\n#### 1,000", "1000") == 1.0
    assert rewards.exact_answer("#### 12", "Some work.\n#### 12") == 1.0
    assert rewards.exact_answer("#### 13", "#### 12") == 0.0
    assert rewards.exact_answer("12", "#### 12") == 0.0  # no committed answer, no reward
    assert rewards.exact_or_format("#### 13", "12") == pytest.approx(0.1)
    assert rewards.exact_or_format("thirteen", "12") == 0.0


def test_gold_answers_of_synthetic_data_score_one():
    for row in arithmetic_problems(0, 20, "train"):
        assert rewards.exact_answer(row["answer"], row["answer"]) == 1.0
    for conv in tool_conversations(0, 20, "val"):
        final = conv["messages"][-1]["content"][-1]["text"]
        assert rewards.extract_answer(final) is not None


def test_registry():
    rewards.register("always", lambda completion, gold: 1.0)
    assert rewards.get_reward("always")("x", "y") == 1.0
    with pytest.raises(ValueError, match="allowed: .*exact"):
        rewards.get_reward("nope")
    del rewards.REWARDS["always"]
