"""The sampler: next tokens from logits, per row: argmax, temperature, top-k, top-p, log-probs.

Every draw in chatpipe goes through :func:`draw`: each request's rows take their noise from the
request's own generator, so a request's tokens depend on its seed, not on its neighbours.
"""

from __future__ import annotations

import torch


def sample_next(
    logits: torch.Tensor,
    rng: torch.Generator,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """Next token per row from logits [B, V]: argmax when temperature is 0, else top-k / top-p sampling.

    ``top_p`` (nucleus) keeps the most likely tokens whose probabilities, after top-k, sum to at
    least ``top_p`` (the first token always stays).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    # a temperature below float32's smallest normal number is 0 or a denormal there: dividing
    # by it gives inf - inf = NaN. Its distribution is the argmax's, so take the argmax.
    if temperature < torch.finfo(torch.float32).tiny:
        return logits.argmax(dim=-1)
    probs, ids = sampling_candidates(logits, temperature, top_k, top_p)
    drawn = draw(probs, [(probs.size(0), rng)])
    return drawn if ids is None else ids.gather(1, drawn[:, None]).squeeze(1)


def draw(probs: torch.Tensor, groups: list[tuple[int, torch.Generator]]) -> torch.Tensor:
    """One index per row of ``probs`` [B, K], drawn in proportion to it: ``groups`` splits the rows, in
    order, into runs of ``count`` rows that draw from one generator each.

    The same numbers as ``torch.multinomial(probs[run], 1, generator=g)`` run by run, which draws
    as ``argmax(probs / q)`` with ``q`` exponential noise from ``g``. Here each run's noise still
    comes from its own generator, but the division and the argmax run once over every row: a batch
    of 16 requests makes one kernel of each instead of 16 multinomial calls (the draw 1.7x faster at
    16 rows, 3x at 8 groups of 8: bench/README.md, rollouts round seven).
    """
    covered = sum(count for count, _ in groups)
    if covered != probs.size(0):  # refused before any generator moves
        raise ValueError(f"the draw's groups cover {covered} rows of {probs.size(0)}")
    if not bool(torch.isfinite(probs).all()):  # multinomial refuses these; an argmax would not
        raise ValueError("the sampling probabilities hold inf or NaN: the model's logits are not finite")
    noise = torch.empty_like(probs)
    start = 0
    for count, rng in groups:
        noise[start : start + count].exponential_(generator=rng)
        start += count
    return probs.div(noise).argmax(dim=-1)


def sampling_probs(
    logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """The distribution :func:`sample_next` draws from, per row of ``logits`` [B, V] (``temperature`` > 0)."""
    # shifted so the best logit is 0: a tiny temperature sends the others to -inf, never to +inf
    logits = logits.float()
    logits = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    if top_k is not None and top_k > 0:
        k = min(top_k, logits.size(-1))
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        p_sorted = torch.softmax(sorted_logits, dim=-1)
        drop = p_sorted.cumsum(dim=-1) - p_sorted >= top_p  # the more likely tokens already hold top_p
        drop[:, 0] = False  # a top_p that is 0 in float32 would otherwise drop every token
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.softmax(logits, dim=-1)


def sampling_candidates(
    logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(probabilities [B, K], their token ids [B, K] or None for the whole vocabulary): what every
    draw (:func:`sample_next`, the continuous batch) samples from. It is :func:`sampling_probs`'s
    distribution, with a ``top_k`` below the vocabulary's size cut to its ``top_k`` best tokens first,
    so a draw looks at K numbers per row instead of V (at top-k 50 of a 1k vocabulary, the draw over
    tokens it could never pick was ~10% of a rollout's time). Ties at the k-th logit, which
    :func:`sampling_probs` keeps, are cut to k here."""
    if top_k is None or top_k <= 0 or top_k >= logits.size(-1):
        return sampling_probs(logits, temperature, None, top_p), None
    best, ids = torch.topk(logits.float(), top_k, dim=-1)  # sorted, best first: top_p reads them in order
    return sampling_probs(best, temperature, None, top_p), ids


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """[B]: each row's log-prob of ``tokens`` [B] under log softmax(logits / temperature) (before top-k
    and top-p): the behaviour policy's log-probs as a trainer recomputes them."""
    logp = torch.log_softmax(logits.float() / temperatures[:, None], dim=-1)
    return logp.gather(1, tokens[:, None]).squeeze(1)


def top_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, k: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """The raw model distribution's (log softmax of the logits, temperature 1) log-prob of each row's
    token, and its ``k`` most likely tokens with theirs: what an OpenAI client's ``logprobs`` and
    ``top_logprobs`` report."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens[:, None]).squeeze(1).tolist()
    if k <= 0:
        return chosen, [[] for _ in chosen]
    values, ids = logp.topk(min(k, logp.size(-1)), dim=-1)
    return chosen, [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
