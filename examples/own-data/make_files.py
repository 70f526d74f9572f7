"""Write a small set of files of each kind docs/own-data.md trains on, in Spanish, to follow along.

    python examples/own-data/make_files.py mydata

Writes ``mydata/corpus/`` (pretraining text: two .txt files and a held-out ``val.parquet``),
``mydata/chat.jsonl`` (conversations), ``mydata/prefs.jsonl`` (preference pairs),
``mydata/problems.jsonl`` (RL problems) and ``mydata/verifier.py`` (their verifier). The world is
small and deterministic: animals, each with a colour and a home, told about in the text, asked
about in the chats and the problems. Replace any of the files with your own of the same shape.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

ANIMALS = (
    "gato perro caballo pájaro ratón conejo pez toro lobo oso zorro burro pato gallo cerdo "
    "león tigre mono sapo búho ganso cuervo ciervo camello pulpo cangrejo grillo topo jabalí delfín"
).split()
COLOURS = "negro blanco rojo verde azul amarillo gris marrón".split()
HOMES = "bosque río campo mar monte pueblo lago desierto".split()
COLOUR_QUESTIONS = ("¿De qué color es el {a}?", "¿Qué color tiene el {a}?", "Dime el color del {a}.")
HOME_QUESTIONS = ("¿Dónde vive el {a}?", "Dime dónde vive el {a}.")
DONT_KNOW = "No lo sé."
FILLER = (
    "Un día el {a} {c} fue al {h} con el {b}.",
    "Por la mañana el {a} come y después duerme.",
    "El {a} y el {b} son amigos desde hace mucho tiempo.",
    "En el {h} hace frío en invierno y calor en verano.",
    "¡Qué bonito es el {a} {c}!",
    "Nadie sabe por qué el {b} canta de noche.",
)

VERIFIER = '''"""Verifier of mydata/problems.jsonl (rl.reward.verifier_file): 1 when the reply names the answer.

chatpipe calls score(reply, problem) with the model's reply and the problem's row as written.
"""

import re


def score(reply, problem):
    words = re.findall(r"\\w+", reply.lower())
    return 1.0 if problem["answer"] in words else 0.0
'''


def world(seed: int = 7) -> dict[str, tuple[str, str]]:
    """Each animal's colour and home."""
    rng = random.Random(seed)
    return {a: (rng.choice(COLOURS), rng.choice(HOMES)) for a in ANIMALS}


def documents(facts: dict[str, tuple[str, str]], n: int, seed: int) -> list[str]:
    """Short texts that tell the facts, mixed with filler sentences."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        sentences = []
        for _ in range(rng.randint(3, 7)):
            a, b = rng.sample(ANIMALS, 2)
            c, h = facts[a]
            kind = rng.random()
            if kind < 0.35:
                sentences.append(f"El {a} es {c}.")
            elif kind < 0.6:
                sentences.append(f"El {a} vive en el {h}.")
            else:
                sentences.append(rng.choice(FILLER).format(a=a, b=b, c=c, h=h))
        docs.append(" ".join(sentences))
    return docs


def questions(facts: dict[str, tuple[str, str]]) -> list[tuple[str, str, str, str]]:
    """(question, answer word, right reply, wrong reply) for every animal and phrasing."""
    rng = random.Random(1)
    out = []
    for a, (c, h) in facts.items():
        wrong_c = rng.choice([x for x in COLOURS if x != c])
        wrong_h = rng.choice([x for x in HOMES if x != h])
        out += [(q.format(a=a), c, f"El {a} es {c}.", f"El {a} es {wrong_c}.") for q in COLOUR_QUESTIONS]
        out += [(q.format(a=a), h, f"El {a} vive en el {h}.", f"El {a} vive en el {wrong_h}.") for q in HOME_QUESTIONS]
    return out


def chat(question: str, reply: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]}


def write_jsonl(path: Path, rows: list) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def main(out: Path) -> None:
    facts = world()
    corpus = out / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for i in (1, 2):  # .txt: blank-line-separated paragraphs
        (corpus / f"texto_{i}.txt").write_text("\n\n".join(documents(facts, 1500, seed=i)) + "\n", encoding="utf-8")
    pq.write_table(pa.table({"text": documents(facts, 150, seed=3)}), corpus / "val.parquet")  # "val": held out
    qs = questions(facts)
    rng = random.Random(2)
    # Chats as they come: some questions were once answered "No lo sé." (I don't know), so the
    # SFT model sometimes says so; RL on the verifier is what trains that away.
    chats = [chat(q, right) for q, _, right, _ in qs] + [chat(q, DONT_KNOW) for q, *_ in qs if rng.random() < 0.4]
    write_jsonl(out / "chat.jsonl", [*chats, chat("Hola", "¡Hola! ¿Qué quieres saber?")])
    pairs = [{"prompt": q, "chosen": right, "rejected": wrong} for q, _, right, wrong in qs]
    pairs += [{"prompt": q, "chosen": right, "rejected": DONT_KNOW} for q, _, right, _ in qs[::3]]
    write_jsonl(out / "prefs.jsonl", pairs)
    write_jsonl(out / "problems.jsonl", [{"prompt": q, "answer": answer} for q, answer, _, _ in qs])
    (out / "verifier.py").write_text(VERIFIER, encoding="utf-8")
    print(
        f"{out}: corpus/ (3 files), chat.jsonl ({len(chats) + 1} conversations), prefs.jsonl ({len(pairs)} pairs), "
        f"problems.jsonl ({len(qs)} problems), verifier.py"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "mydata"))
