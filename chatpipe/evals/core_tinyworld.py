"""CORE-format tasks about the synthetic tiny world, so the `tiny` profile's CORE shows learning.

    from chatpipe.evals.core_tinyworld import write_tinyworld_bundle
    config = write_tinyworld_bundle(Path("checkpoints/eval/tinyworld"), seed=0, n=200)
    evaluate_core(model, tok, config, config.parent, ...)

Writes one jsonl per task plus ``core_tasks.yaml`` in the same format as the real DCLM bundle,
so the ordinary CORE evaluator scores them (one task of each CORE type, plus two LM tasks):

- ``tinyworld_facts_mc`` (multiple_choice): "Alice lives in" -> 4 towns, one true.
- ``tinyworld_rivers_schema`` (schema): "The river X flows through" for 4 rivers -> same town.
- ``tinyworld_facts_lm`` (language_modeling): "Alice's favourite colour is" -> "red".
- ``tinyworld_arith_lm`` / ``tinyworld_spell_lm`` (language_modeling): "7 plus 5 is" -> "12.",
  "The word cat is spelled" -> "c-a-t.".

The texts follow the sentence templates of the pretraining documents (chatpipe/data/synthetic.py).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import yaml

from chatpipe.data.synthetic import DOMAIN_VALUES, TOWNS, WORLD, qa_pairs, vocabulary
from chatpipe.io import write_text_atomic

# label, type, num_fewshot, random_baseline
TASKS = [
    ("tinyworld_facts_mc", "multiple_choice", 3, 0.25),
    ("tinyworld_rivers_schema", "schema", 0, 0.25),
    ("tinyworld_facts_lm", "language_modeling", 3, 0.0),
    ("tinyworld_arith_lm", "language_modeling", 5, 0.0),
    ("tinyworld_spell_lm", "language_modeling", 3, 0.0),
]


def _fact_rows(rng: random.Random, n: int) -> tuple[list[dict], list[dict]]:
    """(MC rows, LM rows) from answer sentences of the world's facts that end in the short answer."""
    mc, lm = [], []
    facts = [(a, short, dom) for _, a, short, dom in qa_pairs() if dom in DOMAIN_VALUES and a.endswith(f" {short}.")]
    facts = sorted(set(facts))
    rng.shuffle(facts)
    for a, short, dom in facts[:n]:
        context = a[: -len(short) - 2]  # drop " <short>."
        wrong = rng.sample([v for v in DOMAIN_VALUES[dom] if v != short], 3)
        choices = wrong + [short]
        rng.shuffle(choices)
        mc.append({"query": context, "choices": [f"{c}." for c in choices], "gold": choices.index(short)})
        lm.append({"context": context, "continuation": f"{short}."})
    return mc, lm


def _river_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        town = rng.choice(TOWNS)
        river = WORLD.river[town]
        others = rng.sample([r for t, r in WORLD.river.items() if r != river], 3)
        options = others + [river]
        rng.shuffle(options)
        rows.append(
            {
                "context_options": [f"The river {r} flows through" for r in options],
                "continuation": f"{town}.",
                "gold": options.index(river),
            }
        )
    return rows


def _arith_rows(rng: random.Random, n: int) -> list[dict]:
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 12)
        rows.append({"context": f"{a} plus {b} is", "continuation": f"{a + b}."})
    return rows


def _spell_rows(rng: random.Random, n: int) -> list[dict]:
    words = [w for w in vocabulary() if w.isalpha()]
    return [
        {"context": f"The word {w} is spelled", "continuation": f"{'-'.join(w)}."}
        for w in rng.sample(words, min(n, len(words)))
    ]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def write_tinyworld_bundle(out_dir: Path, seed: int = 0, n: int = 200) -> Path:
    """Write the tiny-world CORE tasks (up to ``n`` rows each) into ``out_dir``; returns the config path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"core-tinyworld:{seed}")
    mc, lm = _fact_rows(rng, n)
    rows = {
        "tinyworld_facts_mc": mc,
        "tinyworld_rivers_schema": _river_rows(rng, n),
        "tinyworld_facts_lm": lm,
        "tinyworld_arith_lm": _arith_rows(rng, n),
        "tinyworld_spell_lm": _spell_rows(rng, n),
    }
    entries = []
    for label, type_, shots, baseline in TASKS:
        _write_jsonl(out_dir / f"{label}.jsonl", rows[label])
        entries.append(
            {
                "label": label,
                "file": f"{label}.jsonl",
                "type": type_,
                "num_fewshot": shots,
                "continuation_delimiter": " ",
                "random_baseline": baseline,
            }
        )
    config = out_dir / "core_tasks.yaml"
    write_text_atomic(config, yaml.safe_dump({"tasks": entries}, sort_keys=False))
    return config
