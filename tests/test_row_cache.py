"""RowKVCache (chatpipe.model.row_cache): rows that share a prompt slot attend as rows holding it whole."""

from __future__ import annotations

import pytest
import torch

from chatpipe.model.gpt import KVCache
from chatpipe.model.row_cache import RowKVCache
from tests.test_engine import random_model


def prefill(model, prompt: list[int]) -> tuple[KVCache, torch.Tensor]:
    cache = KVCache.from_config(model.config, batch_size=1, max_len=len(prompt))
    logits = model(torch.tensor([prompt]), kv_cache=cache)[0, -1]
    return cache, logits


@pytest.mark.parametrize("options", [{}, {"smear": True, "value_embeds": True}], ids=["plain", "smear+ve"])
@torch.no_grad()
def test_shared_prompt_rows_give_the_logits_of_whole_rows(options):
    """Two prompts with 3 and 2 samples (shared) beside a prompt alone, decoded 30 steps (past the
    16-key sliding window of the 'S' layer, grouped-query heads): every step's logits equal those of
    a cache holding each row whole, also after rows leave and others move into their places."""
    model = random_model(3, **options)
    prompts = [list(range(5, 25)), list(range(30, 39)), list(range(40, 53))]
    samples = [3, 1, 2]
    whole = RowKVCache.from_config(model.config, rows=8, context=64)
    shared = RowKVCache.from_config(model.config, rows=8, context=64)
    row = 0
    for p, s in zip(prompts, samples):
        cache, _ = prefill(model, p)
        slot = shared.add_prompt(cache) if s > 1 else None
        for _ in range(s):
            whole.load(row, cache)
            shared.join(row, slot, cache) if slot is not None else shared.load(row, cache)
            row += 1
            whole.n = shared.n = row
    assert shared.pk is not None and sum(1 for r in range(row) if shared.slot[r] >= 0) == 5
    gen = torch.Generator().manual_seed(0)
    for step in range(30):
        column = torch.randint(0, 200, (whole.n, 1), generator=gen)
        a = model(column, kv_cache=whole)[:, -1]
        b = model(column, kv_cache=shared)[:, -1]
        assert torch.allclose(a, b, atol=1e-5), (step, (a - b).abs().max())
        if step == 10:  # row 0 and the row alone (3) leave: the last rows move into their gaps, as the scheduler does
            for cache in (whole, shared):
                cache.move(5, 0)
                cache.move(4, 3)
                cache.n = 4
    assert shared.slot[: shared.n] == [1, 0, 0, 1]  # the row alone left: every row now shares (the other path)


def test_prompt_slots_are_freed_with_their_last_row_and_bounded():
    model = random_model(1)
    cache = RowKVCache.from_config(model.config, rows=4, context=32)
    kv, _ = prefill(model, [1, 2, 3])
    first = cache.add_prompt(kv)
    cache.join(0, first, kv)
    cache.join(1, first, kv)
    cache.n = 2
    second = cache.add_prompt(kv)
    cache.join(2, second, kv)
    cache.join(3, second, kv)
    cache.n = 4
    assert (first, second) == (0, 1)
    with pytest.raises(ValueError, match="all 2 prompt slots are taken"):
        cache.add_prompt(kv)
    cache.move(3, 0)
    cache.move(2, 1)
    cache.n = 2  # the first prompt's rows left: its slot is free again
    assert cache.add_prompt(kv) == 0
