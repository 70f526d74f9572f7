"""RL rollouts: which prompts a rank samples, sampling groups with the engine, per-token log-probs.

    problems = load_problems("tinyworld_arith", "train", n=512, seed=0)
    idx = rank_indices(len(problems), step, per_rank=8, rank=rt.rank, world_size=rt.world_size, seed=0)
    batch = collect_rollouts(engine, [problems[i] for i in idx], group_size=8, max_new_tokens=64, seed=...)
    logp = token_logprobs(model, batch.inputs, batch.targets, micro_batch=16)   # [B, T]

A :class:`Rollouts` batch is aligned for next-token prediction: ``inputs = ids[:, :-1]``,
``targets = ids[:, 1:]`` and ``mask`` is 1 on targets the policy sampled (its actions), 0 on the
prompt, on tool outputs the engine forced in, and on padding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
import torch.nn.functional as F

from chatpipe.inference.precision import linears_in
from chatpipe.inference.scheduler import generate_continuous
from chatpipe.progress import progress
from chatpipe.rl.rewards import RewardFn, exact_answer, get_reward
from chatpipe.rl.verifier import Verifier
from chatpipe.tokenizer import reply_text

# --------------------------------------------------------------------------- problems


@dataclass
class Problem:
    """One RL prompt: the conversation (last message = gold answer), how to score a completion (the
    reward) and whether a completion is right (what pass@k counts).

    The two differ when the reward gives partial credit (``exact_or_format`` pays 0.1 for a wrong
    answer in the right format): a pass is the task's own verdict, never ``score > 0``. Without
    ``correct``, a pass is full credit, ``score >= 1``.
    """

    conversation: dict[str, Any]
    score: Callable[[str], float]
    correct: Callable[[str], bool] | None = None

    def is_correct(self, text: str) -> bool:
        """The task's verdict on ``text`` (full credit when the problem has no checker of its own)."""
        return bool(self.correct(text)) if self.correct is not None else self.score(text) >= 1.0


def gold_text(conversation: dict[str, Any]) -> str:
    """The text of the conversation's final (assistant) message, tool parts included."""
    content = conversation["messages"][-1]["content"]
    return content if isinstance(content, str) else "\n".join(p["text"] for p in content)


def load_problems(
    task: str,
    split: str,
    n: int,
    seed: int = 0,
    reward: str = "exact",
    source: str = "",
    verifier: Verifier | None = None,
    **task_kw: Any,
) -> list[Problem]:
    """``n`` problems of ``task`` ("tinyworld_arith", "gsm8k", ...) from ``split``.

    Uses :func:`chatpipe.data.tasks.build_task` when that package exists (its ``reward`` wins unless a
    reward name other than "exact" is asked for; ``source`` picks hf | local | synthetic where the
    task has sources, "" its default; ``task_kw`` such as ``words`` or ``path`` go to the task).
    Without that package the tiny-world arithmetic comes from the synthetic generator directly
    (``seed`` only matters there). A ``verifier`` of the user's own (:mod:`chatpipe.rl.verifier`)
    scores every problem instead, and a pass is its full score.
    """
    if verifier is not None:
        from chatpipe.data.tasks import build_task

        t = build_task(task, split, limit=n, source=source or None, **task_kw)
        return [_verified(verifier, t[i], i) for i in range(min(n, len(t)))]
    reward_fn = get_reward(reward)
    try:
        from chatpipe.data.tasks import build_task
    except ImportError:
        build_task = None
    if build_task is not None:
        t = build_task(task, split, limit=n, source=source or None, **task_kw)
        convs = [t[i] for i in range(min(n, len(t)))]
        if reward == "exact" and hasattr(t, "reward"):
            return [Problem(c, lambda text, c=c: float(t.reward(c, text)), _task_checker(t, c)) for c in convs]
        return [Problem(c, _gold_scorer(reward_fn, gold_text(c)), _task_checker(t, c)) for c in convs]
    if task != "tinyworld_arith":
        raise ValueError(
            f"task {task!r} needs chatpipe.data.tasks (not installed yet); available without it: tinyworld_arith"
        )
    from chatpipe.data.synthetic import tool_conversations

    convs = tool_conversations(seed, n, split)
    return [Problem(c, _gold_scorer(reward_fn, gold_text(c)), _exact_checker(gold_text(c))) for c in convs]


def _verified(verifier: Verifier, conversation: dict[str, Any], i: int) -> Problem:
    """A problem scored by the user's verifier: it gets the file's row (``problem``) when the task
    keeps one, else the conversation; a failed call scores NaN (:func:`drop_failed`) and is no pass."""
    problem, index = conversation.get("problem", conversation), conversation.get("index", i)

    def score(text: str) -> float:
        got = verifier(text, problem, index)
        return math.nan if got is None else got

    return Problem(conversation, score, lambda text: verifier(text, problem, index) == 1.0)


def _gold_scorer(fn: RewardFn, gold: str) -> Callable[[str], float]:
    return lambda text: fn(text, gold)


def _exact_checker(gold: str) -> Callable[[str], bool]:
    return lambda text: exact_answer(text, gold) == 1.0


def _task_checker(task: Any, conversation: dict[str, Any]) -> Callable[[str], bool]:
    """The task's own ``evaluate``; a task without one is checked by the exact ``####`` answer."""
    from chatpipe.data.tasks.base import Task

    if type(task).evaluate is Task.evaluate:
        return _exact_checker(gold_text(conversation))
    return lambda text: bool(task.evaluate(conversation, text))


def rank_indices(num_items: int, step: int, per_rank: int, rank: int, world_size: int, seed: int) -> list[int]:
    """Problem indices this rank samples at ``step``: disjoint across ranks, a fresh shuffle every epoch.

    The global batch (``per_rank * world_size``) walks a per-epoch permutation; the items left
    over at the end of an epoch are skipped, so one step never holds a problem twice.
    """
    global_batch = per_rank * world_size
    if global_batch > num_items:
        raise ValueError(
            f"{global_batch} prompts per step (x{world_size} ranks) but only {num_items} problems; "
            "lower prompts_per_step or raise num_train_problems"
        )
    steps_per_epoch = num_items // global_batch
    epoch, offset = divmod(step, steps_per_epoch)
    perm = torch.randperm(num_items, generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    start = offset * global_batch + rank * per_rank
    return perm[start : start + per_rank].tolist()


# --------------------------------------------------------------------------- rollouts


@dataclass
class Rollouts:
    """A batch of sampled responses, padded and aligned for next-token log-probs."""

    inputs: torch.Tensor  # [B, T] long
    targets: torch.Tensor  # [B, T] long
    mask: torch.Tensor  # [B, T] float, 1 = sampled (action) token
    scores: torch.Tensor  # [B] float, verifier reward
    ended: torch.Tensor  # [B] bool, stopped with <|assistant_end|>
    lengths: torch.Tensor  # [B] long, number of action tokens
    groups: torch.Tensor  # [B] long, which prompt (within this batch) the row answers
    completions: list[str] = field(default_factory=list)
    correct: torch.Tensor | None = None  # [B] bool, the task's verdict (what pass@k and filter_solved count)
    # [B, T] the sampling policy's log-probs of the targets, where an older policy than the trainer's
    # sampled the batch (asynchronous RL): the updates then weigh each token (losses.behaviour_weights)
    behav_logp: torch.Tensor | None = None
    # [B] the reward model's normalised scores (reward.source model|both; chatpipe.rl.scoring), kept
    # beside ``scores``, which under win_rate hold win rates: a group's win rates average 0.5, so no
    # threshold on them can say a reply is good, where its normalised score can
    model_scores: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        """Generated tokens (sampled + forced) in the batch."""
        return int(self.lengths.sum())

    def to_dict(self) -> dict:
        """The batch as plain tensors, strings and lists (what ``torch.load(weights_only=True)`` reads back)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict) -> Rollouts:
        """The batch :meth:`to_dict` wrote (other keys beside it are left alone)."""
        return cls(**{f.name: data[f.name] for f in fields(cls)})

    def select(self, rows: torch.Tensor) -> Rollouts:
        """The sub-batch of ``rows`` (for minibatches)."""
        picked = [self.completions[i] for i in rows.tolist()] if self.completions else []
        return Rollouts(
            self.inputs[rows],
            self.targets[rows],
            self.mask[rows],
            self.scores[rows],
            self.ended[rows],
            self.lengths[rows],
            self.groups[rows],
            picked,
            None if self.correct is None else self.correct[rows],
            None if self.behav_logp is None else self.behav_logp[rows],
            None if self.model_scores is None else self.model_scores[rows],
        )

    def solved(self, solved_score: float | None = None) -> torch.Tensor:
        """[B] bool, the responses ``filter_solved`` counts as solved: with ``solved_score`` (a run the
        reward model alone trains), those whose normalised reward-model score reaches it, whatever
        ``rl.reward.model_scores`` trains on; else the task's verdict."""
        if solved_score is None:
            return self.correct
        if self.model_scores is None:
            raise ValueError("solved_score counts reward-model scores, but no reward model scored this batch")
        return self.model_scores >= solved_score

    def without_unfinished(self) -> Rollouts:
        """The batch with the action mask of every response cut at max_new_tokens set to 0 (``mask_too_long``):
        their tokens leave the loss, their scores still count in their group's mean."""
        return replace(self, mask=self.mask * self.ended[:, None].to(self.mask.dtype))


def best_of_n(scores: list[float], keep: int) -> list[int]:
    """Indices of the ``keep`` highest ``scores`` (ties: the earlier sample), in sampling order.

    ``generation_size`` samples per prompt, ``group_size`` kept: the best-scored responses.
    """
    ranked = sorted(range(len(scores)), key=lambda i: (-scores[i] if scores[i] == scores[i] else math.inf, i))
    return sorted(ranked[:keep])


def keep_best(batch: Rollouts, keep: int) -> Rollouts:
    """Best-of-n after scoring: of each prompt's responses (consecutive rows of one group) the ``keep``
    with the highest ``batch.scores`` (:func:`best_of_n`), in sampling order."""
    rows = []
    for g in batch.groups.unique(sorted=True).tolist():
        members = (batch.groups == g).nonzero().flatten().tolist()
        rows += [members[i] for i in best_of_n([batch.scores[r].item() for r in members], keep)]
    return batch.select(torch.tensor(rows, dtype=torch.long, device=batch.groups.device))


def pad_batch(
    seqs: list[list[int]], masks: list[list[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad sequences; return (inputs, targets, action mask) shifted by one for next-token targets."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    m = torch.zeros((len(seqs), width), dtype=torch.float32)
    for i, (s, mk) in enumerate(zip(seqs, masks)):
        ids[i, : len(s)] = torch.tensor(s)
        m[i, : len(mk)] = torch.tensor(mk, dtype=torch.float32)
    return ids[:, :-1], ids[:, 1:], m[:, 1:]


@torch.no_grad()
def collect_rollouts(
    engine: Any,
    problems: list[Problem],
    *,
    group_size: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
    generation_size: int = 0,
    max_rows: int = 128,
    behaviour_logprobs: bool = False,
    matmul_dtype: torch.dtype | None = None,
) -> Rollouts:
    """Sample ``group_size`` responses per problem (tool use on) and score them with each problem's verifier.

    With ``generation_size`` > ``group_size``, that many are sampled per problem and the
    ``group_size`` best-scored are kept (:func:`best_of_n`). ``seed`` makes the batch reproducible.
    Samples on one continuous batch of ``max_rows`` rows
    (:func:`chatpipe.inference.scheduler.generate_continuous`: when a row finishes, the next
    prompt's samples take its place). ``behaviour_logprobs`` keeps the sampler's log-prob of every
    target in ``behav_logp``, for updates on
    rollouts an older policy sampled. ``matmul_dtype`` (e.g. bf16) samples with the linear layers in
    that precision (:func:`chatpipe.inference.precision.linears_in`); None: the weights' own.
    """
    tok = engine.tokenizer
    rows: dict[str, list] = {k: [] for k in ("seqs", "masks", "scores", "ended", "lengths", "groups", "texts", "ok")}
    prompts = [tok.render_for_completion(problem.conversation) for problem in problems]
    sample = dict(max_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed, max_rows=max_rows)
    num_samples = max(generation_size, group_size)
    with linears_in(engine.model, matmul_dtype):
        generated = generate_continuous(engine, prompts, num_samples, logprobs=behaviour_logprobs, **sample)
    logps = []
    for j, (problem, prompt, (out, out_masks, *lps)) in enumerate(zip(problems, prompts, generated)):
        samples = [_read_sample(engine, problem, s, mk, len(prompt)) for s, mk in zip(out, out_masks)]
        for i in best_of_n([sample[2] for sample in samples], group_size):
            for key, value in zip(rows, (*samples[i][:5], j, *samples[i][5:])):  # the prompt's index after length
                rows[key].append(value)
            logps += [lps[0][i]] if lps else []
    inputs, targets, mask = pad_batch(rows["seqs"], rows["masks"], tok.bos_id)
    return drop_failed(
        Rollouts(
            inputs.to(device),
            targets.to(device),
            mask.to(device),
            torch.tensor(rows["scores"], dtype=torch.float32, device=device),
            torch.tensor(rows["ended"], dtype=torch.bool, device=device),
            torch.tensor(rows["lengths"], dtype=torch.long, device=device),
            torch.tensor(rows["groups"], dtype=torch.long, device=device),
            rows["texts"],
            torch.tensor(rows["ok"], dtype=torch.bool, device=device),
            pad_logprobs(logps, targets.size(1)).to(device) if behaviour_logprobs else None,
        )
    )


def drop_failed(batch: Rollouts) -> Rollouts:
    """Rows whose verifier call failed (score NaN, :mod:`chatpipe.rl.verifier`) leave the update: their
    action mask is 0 and their score is their group's mean over the rows that were scored (0 when none
    was), so they move neither the loss nor their group's baseline."""
    failed = batch.scores.isnan()
    if not failed.any():
        return batch
    scores = batch.scores.clone()
    for g in batch.groups[failed].unique().tolist():
        members = batch.groups == g
        good = members & ~failed
        scores[members & failed] = batch.scores[good].mean() if good.any() else 0.0
    mask = batch.mask * (~failed)[:, None].to(batch.mask.dtype)
    return replace(batch, scores=scores, mask=mask)


def pad_logprobs(logps: list[list[float]], width: int) -> torch.Tensor:
    """Per-token log-probs of full sequences, aligned with :func:`pad_batch`'s targets [B, width]."""
    out = torch.zeros(len(logps), width + 1)
    for i, lp in enumerate(logps):
        out[i, : len(lp)] = torch.tensor(lp)
    return out[:, 1:]


def _read_sample(engine: Any, problem: Problem, seq: list[int], mask: list[int], prompt_len: int) -> tuple:
    """(ids, mask, score, ended, action tokens, text, correct) of one sampled sequence."""
    text, stopped = reply_text(engine.tokenizer, seq[prompt_len:], mask[prompt_len:])
    return seq, mask, problem.score(text), stopped, sum(mask[prompt_len:]), text, problem.is_correct(text)


# --------------------------------------------------------------------------- model passes


def token_logprobs(
    model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, micro_batch: int = 0, temperature: float = 1.0
) -> torch.Tensor:
    """log p(target | prefix) for every position [B, T] at sampling ``temperature``, ``micro_batch`` rows at a time.

    Gradients flow when called outside ``no_grad``. See :func:`sampled_logprobs`.
    """
    step = micro_batch if micro_batch > 0 else inputs.size(0)
    parts = [
        sampled_logprobs(model, inputs[i : i + step], targets[i : i + step], temperature)
        for i in range(0, inputs.size(0), step)
    ]
    return torch.cat(parts)


def sampled_logprobs(
    model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log softmax(logits / temperature)[target] [B, T]: the log-prob of each token under the policy that sampled it.

    The engine samples from logits / T, so the PPO ratio, the KL to the reference and the policy
    gradient all use the same tempered distribution (top-k is not applied: its cut changes with
    every step's logits). At T = 1 the model's own per-token cross-entropy gives it directly.
    """
    if temperature == 1.0:
        return -model(inputs, targets, loss_reduction="none")
    logits = model(inputs).float() / temperature
    return -F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1), reduction="none").view(targets.shape)


@dataclass
class Sampled:
    """One problem's samples: its prompt ids, each sampled sequence (prompt included) and each reply's text."""

    prompt: list[int]
    seqs: list[list[int]]
    texts: list[str]


def sample_problems(
    engine: Any,
    problems: list[Problem],
    *,
    num_samples: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    desc: str = "sampling",
) -> list[Sampled]:
    """``num_samples`` replies to each problem on one continuous batch, as the rollouts, each read by
    :func:`chatpipe.tokenizer.reply_text`; callers judge them (:func:`evaluate_problems`, the reward
    model's sampled pairs). Finished samples count on a :mod:`chatpipe.progress` line named ``desc``."""
    tok = engine.tokenizer
    prompts = [tok.render_for_completion(problem.conversation) for problem in problems]
    with progress(len(prompts) * num_samples, desc, unit="sample") as bar:
        generated = generate_continuous(
            engine,
            prompts,
            num_samples,
            max_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            seed=seed,
            on_done=lambda sample, reason: bar.update(),  # called by the scheduler as each sample ends
        )
    return [
        Sampled(prompt, seqs, [reply_text(tok, s[len(prompt) :], m[len(prompt) :])[0] for s, m in zip(seqs, masks)])
        for prompt, (seqs, masks) in zip(prompts, generated)
    ]


def evaluate_problems(engine: Any, problems: list[Problem], **sampling: Any) -> list[list[bool]]:
    """Per-problem lists of sample correctness (the task's verdict, :meth:`Problem.is_correct`), for pass@k;
    ``sampling`` as :func:`sample_problems` takes it."""
    sampled = sample_problems(engine, problems, **{"desc": "pass@k sampling", **sampling})
    return [[p.is_correct(t) for t in s.texts] for p, s in zip(problems, sampled)]
