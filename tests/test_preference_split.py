"""The reward model's problems are its own: never an RL prompt, never an eval problem, never SFT data."""

from __future__ import annotations

import pytest

from chatpipe.data import synthetic
from chatpipe.data.tasks import build_task


def questions(convs) -> set[str]:
    return {c["messages"][0]["content"] for c in convs}


def test_no_reward_model_problem_is_an_rl_prompt_an_eval_problem_or_sft_data(params_file):
    """The stage's own train problems (default tiny_prompts) against RL's prompts as the stage loads
    them (default settings, and a pool eight times the default), every held-out split the evals read,
    and the SFT mixture's arithmetic."""
    from chatpipe import runtime
    from chatpipe.data import preferences as prefs
    from chatpipe.rl import problems as rl
    from chatpipe.settings import RewardModelSettings, RLSettings, load_section

    cfg = load_section(RewardModelSettings, [])
    preference = questions(prefs.tiny_problems("train", cfg.tiny_prompts))
    assert len(preference) == cfg.tiny_prompts
    rt = runtime.Runtime(0, 0, 1, None, None)
    for flags in ([], ["--num_train_problems=4096"]):
        train, held_out = rl.load_rl_problems(load_section(RLSettings, flags), rt)
        assert not preference & questions(p.conversation for p in train)
        assert not preference & questions(p.conversation for p in held_out)
    for name in ("tinyworld_arith", "tinyworld_gsm"):
        for split in ("val", "test"):
            task = build_task(name, split, limit=200)
            asked = {task[i]["messages"][0]["content"] for i in range(len(task))}
            assert not preference & asked, (name, split)
    sft_arith = build_task("tinyworld_arith", "train", limit=2500)  # midtrain's and SFT's limits are 2500, 2000
    assert not preference & questions(sft_arith[i] for i in range(len(sft_arith)))


def test_the_preference_part_is_a_quarter_of_the_train_questions_and_only_of_train():
    convs = synthetic.tool_conversations(0, 2000, "train")
    assert not any(synthetic.preference_problem(q) for q in questions(convs))
    share = sum(synthetic.preference_problem(f"question {i}") for i in range(20_000)) / 20_000
    assert 0.23 < share < 0.27
    with pytest.raises(ValueError, match="'preferences' is a part of the train split"):
        synthetic.tool_conversations(0, 10, "val", part="preferences")


class QuestionTok:
    """A stand-in tokenizer: a conversation renders as one id, its question's, so a pair names its problem."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def render_conversation(self, conv, max_tokens):
        self.texts.append(conv["messages"][0]["content"])
        return [len(self.texts) - 1], []


def test_the_reward_models_held_out_problems_are_not_rls_eval_problems(params_file):
    """With the default settings, the reward model's held-out pairs (made by the stage's own
    tiny_pairs) share no problem with RL's val or test problems, nor with its own train pairs. Before
    this, held-out pairs came from the val split: 139 of the 256 RL eval problems were among them."""
    from chatpipe.data import preferences as prefs
    from chatpipe.rl.rollout import load_problems
    from chatpipe.settings import RewardModelSettings, RLSettings, load_section

    cfg, rl = load_section(RewardModelSettings, []), load_section(RLSettings, [])
    tok = QuestionTok()
    pairs = prefs.tiny_pairs(cfg, tok, None)  # contrasts only: sampling needs a model, the problems do not
    held = {tok.texts[p.chosen[0]] for p in pairs.val}
    trained = {tok.texts[p.chosen[0]] for p in pairs.train}
    assert len(held) >= cfg.val_pairs // 4 and not held & trained  # 3 contrasts a problem, some left out
    for split in ("val", "test"):
        evaluated = questions(p.conversation for p in load_problems(rl.task, split, rl.eval_problems, rl.seed))
        assert len(evaluated) == rl.eval_problems
        assert not held & evaluated, f"{len(held & evaluated)} RL {split} problems are reward-model held-out ones"
