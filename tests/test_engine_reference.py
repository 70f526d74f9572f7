"""The one engine gives the tokens of the engines it replaced (f18dbe9: the static batch for the chat
CLI, the pyfunc and the evals; the continuous batch for rollouts), read from a fixture that
f18dbe9's code wrote with this file's ``cases()``:

    PYTHONPATH=<f18dbe9's tree> python tests/test_engine_reference.py > tests/data/engine_f18dbe9.json

A differing greedy token is allowed only where the reference's top two logits are within ``TIE``
(a matmul's rounding at another batch size), and such cases are counted, as tests/test_scheduler.py does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

FIXTURE = Path(__file__).with_name("data") / "engine_f18dbe9.json"
TIE = 1e-4
PROMPTS = ["hello there", "ab", "what is 2+3?", "x" * 40, "q"]


def model_and_engine(seed: int, **options):
    from chatpipe.inference.engine import Engine
    from tests.test_engine import TOK, random_model

    model = random_model(seed, **options)
    with torch.no_grad():  # bytes only: replies decode, and stop tokens come rarely
        model.lm_head.weight[256:] *= 0.1
    return model, Engine(model, TOK)


def cases() -> dict[str, list[list[int]]]:
    """Generated tokens of each caller's kind of request, on a fixed random model."""
    from chatpipe.inference.scheduler import generate_continuous
    from tests.test_engine import TOK, S

    prompts = [[S["<|bos|>"], *TOK.encode(p)] for p in PROMPTS]
    out: dict[str, list[list[int]]] = {}
    for name, options in (("plain", {}), ("smear_ve", {"smear": True, "value_embeds": True})):
        model, engine = model_and_engine(3, **options)
        # the chat CLI and the pyfunc: one sample of one prompt, seeded, top-k sampling
        out[f"{name}/chat"] = [
            engine.generate_batch(p, max_tokens=40, temperature=0.8, top_k=50, seed=7 + i)[0][0][len(p) :]
            for i, p in enumerate(prompts)
        ]
        # the evals at temperature 0 (ChatCORE's default): many prompts at once, greedy
        greedy = engine.generate_many(prompts, num_samples=1, max_tokens=40, temperature=0.0)
        out[f"{name}/evals"] = [seqs[0][len(p) :] for p, (seqs, _) in zip(prompts, greedy)]
        # rollouts: several samples per prompt on the continuous batch, seeded
        rolled = generate_continuous(engine, prompts, 4, seed=11, max_tokens=30, temperature=1.0, top_k=50)
        out[f"{name}/rollouts"] = [s[len(p) :] for p, (seqs, _) in zip(prompts, rolled) for s in seqs]
    return out


def test_every_caller_gets_the_tokens_of_the_engine_it_replaced():
    from tests.test_engine import TOK, S

    want = json.loads(FIXTURE.read_text())
    got = cases()
    assert set(got) == set(want)
    prompts = [[S["<|bos|>"], *TOK.encode(p)] for p in PROMPTS]
    ties = 0
    for key, rows in want.items():
        model, _ = model_and_engine(3, **({} if key.startswith("plain") else {"smear": True, "value_embeds": True}))
        row_prompts = prompts if len(rows) == len(prompts) else [p for p in prompts for _ in range(4)]
        for prompt, ref, mine in zip(row_prompts, rows, got[key]):
            if mine == ref:
                continue
            i = next((k for k, (a, b) in enumerate(zip(ref, mine)) if a != b), min(len(ref), len(mine)))
            with torch.no_grad():
                top = model(torch.tensor([prompt + ref[:i]]))[0, -1].topk(2).values
            gap = float(top[0] - top[1])
            assert key.endswith("evals") and gap < TIE, (
                f"{key}: tokens differ at {i} where the top two logits are {gap} apart"
            )
            ties += 1
    assert ties <= 1, f"{ties} near-ties"


if __name__ == "__main__":
    sys.path.insert(0, str(Path.cwd()))
    json.dump(cases(), sys.stdout)
