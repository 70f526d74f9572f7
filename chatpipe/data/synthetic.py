"""The synthetic "tiny world": offline data for every stage, small enough to learn on 2 CPU cores.

One fixed world (24 people, 10 towns, 12 animals) is built from a constant seed, so every
generator states the same facts; the ``seed`` argument only changes which items are sampled.

    from chatpipe.data import synthetic
    docs = synthetic.pretrain_documents(seed=42, num_docs=4000)        # list[str]
    chats = synthetic.chat_conversations(seed=0, n=500, split="train")  # {"messages": [...]}
    gsm = synthetic.arithmetic_problems(seed=0, n=200, split="test")    # {"question", "answer"}

Held-out splits: every question text belongs to exactly one of train / val / test, decided by a
hash of the text (:func:`split_of`), so no question is ever shared between splits, even across
generators. The facts themselves appear in the pretraining text: evals measure what was learned.

Arithmetic problems of the train split come in two parts (:func:`preference_problem`, a second
hash): ``main`` (what SFT, midtrain and RL read) and ``preferences`` (a quarter of the train
questions, only the reward model's pairs are made from them), so the reward model never trains
on a problem RL prompts with, nor on one any eval asks.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

SPLITS = ("train", "val", "test")
PARTS = ("main", "preferences")  # the train split's arithmetic problems: everyone's, the reward model's
WORLD_SEED = 20240601  # the world never changes; only sampling depends on the caller's seed

# the world's word tables live in a data file; tuples, as the code below unpacks and never changes them
_WORDS = yaml.safe_load(Path(__file__).with_name("tinyworld.yaml").read_text(encoding="utf-8"))
NAMES: list[tuple[str, str]] = [tuple(row) for row in _WORDS["names"]]  # (name, pronoun)
TOWNS: list[str] = _WORDS["towns"]
RIVERS: list[str] = _WORDS["rivers"]
SIZES: list[str] = _WORDS["sizes"]
ANIMALS: dict[str, tuple[str, int, str]] = {k: tuple(v) for k, v in _WORDS["animals"].items()}  # (sound, legs, home)
JOBS: dict[str, tuple[str, str]] = {k: tuple(v) for k, v in _WORDS["jobs"].items()}  # (what they do, what they make)
COLOURS: list[str] = _WORDS["colours"]
FOODS: list[str] = _WORDS["foods"]
PET_NAMES: list[str] = _WORDS["pet_names"]
THINGS: list[str] = _WORDS["things"]


@dataclass(frozen=True)
class Person:
    name: str
    pronoun: str  # "he" / "she"
    age: int
    job: str
    town: str
    pet: str  # animal kind
    pet_name: str
    colour: str
    food: str
    friend: str

    @property
    def his(self) -> str:
        return "his" if self.pronoun == "he" else "her"

    @property
    def him(self) -> str:
        return "him" if self.pronoun == "he" else "her"


@dataclass(frozen=True)
class World:
    people: list[Person]
    river: dict[str, str]  # town -> river
    size: dict[str, str]  # town -> size


def build_world() -> World:
    """The one fixed world (same on every call)."""
    rng = random.Random(WORLD_SEED)
    pets = list(ANIMALS)
    names = [n for n, _ in NAMES]
    people = []
    for i, (name, pronoun) in enumerate(NAMES):
        people.append(
            Person(
                name,
                pronoun,
                rng.randint(19, 78),
                rng.choice(list(JOBS)),
                TOWNS[i % len(TOWNS)],
                rng.choice(pets),
                PET_NAMES[i],
                rng.choice(COLOURS),
                rng.choice(FOODS),
                names[(i + rng.randint(1, len(names) - 1)) % len(names)],
            )
        )
    return World(people, dict(zip(TOWNS, RIVERS)), {t: rng.choice(SIZES) for t in TOWNS})


WORLD = build_world()


def split_of(text: str) -> str:
    """Which split a question belongs to: a stable hash (80% train, 10% val, 10% test)."""
    h = zlib.crc32(text.encode("utf-8")) % 100
    return "test" if h < 10 else "val" if h < 20 else "train"


def preference_problem(text: str) -> bool:
    """Whether a train question belongs to the reward model's part (a quarter of them, by a hash
    independent of :func:`split_of`'s)."""
    return zlib.crc32(b"preferences:" + text.encode("utf-8")) % 4 == 0


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def _a(noun: str) -> str:
    return ("an " if noun[0] in "aeiou" else "a ") + noun


def _plural(animal: str) -> str:
    return animal if animal == "sheep" else animal + "s"


def _legs(animal: str) -> str:
    n = ANIMALS[animal][1]
    return f"{_a(animal)} has no legs" if n == 0 else f"{_a(animal)} has {n} legs"


def _residents(town: str) -> list[str]:
    return [p.name for p in WORLD.people if p.town == town]


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


# ---------------------------------------------------------------------- facts as Q/A pairs


def qa_pairs() -> list[tuple[str, str, str, str]]:
    """Every (question, answer sentence, short answer, domain) the world supports."""
    out = []
    for p in WORLD.people:
        n, does = p.name, JOBS[p.job][0]
        facts = [
            (
                ["How old is {n}?", "What is {n}'s age?", "Do you know how old {n} is?"],
                f"{n} is {p.age} years old.",
                str(p.age),
                "age",
            ),
            (
                ["What does {n} do for a living?", "What is {n}'s job?", "What work does {n} do?"],
                f"{n} is {_a(p.job)}. {_cap(p.pronoun)} {does}.",
                p.job,
                "job",
            ),
            (
                ["Where does {n} live?", "Which town is {n} from?", "What is {n}'s home town?"],
                f"{n} lives in {p.town}.",
                p.town,
                "town",
            ),
            (
                ["What pet does {n} have?", "What kind of animal is {n}'s pet?"],
                f"{n} has {_a(p.pet)} called {p.pet_name}.",
                p.pet,
                "animal",
            ),
            (
                ["What is the name of {n}'s pet?", "What is {n}'s pet called?"],
                f"{n}'s {p.pet} is called {p.pet_name}.",
                p.pet_name,
                "pet_name",
            ),
            (
                ["What is {n}'s favourite colour?", "Which colour does {n} like best?"],
                f"{n}'s favourite colour is {p.colour}.",
                p.colour,
                "colour",
            ),
            (
                ["What is {n}'s favourite food?", "What does {n} like to eat most?"],
                f"{n}'s favourite food is {p.food}.",
                p.food,
                "food",
            ),
            (
                ["Who is {n}'s best friend?", "Who is {n} best friends with?"],
                f"{n}'s best friend is {p.friend}.",
                p.friend,
                "name",
            ),
        ]
        out += [(q.format(n=n), a, short, dom) for qs, a, short, dom in facts for q in qs]
    for t in TOWNS:
        r, s = WORLD.river[t], WORLD.size[t]
        out += [
            (q, f"The river {r} flows through {t}.", r, "river")
            for q in (f"Which river flows through {t}?", f"What river is {t} on?")
        ]
        out += [(q, f"{t} is {_a(s)}.", s, "size") for q in (f"How big is {t}?", f"What kind of place is {t}?")]
        out.append((f"Who lives in {t}?", f"{_join(_residents(t))} live in {t}.", _join(_residents(t)), "people"))
    for animal, (sound, legs, home) in ANIMALS.items():
        out += [
            (q, f"{_cap(_a(animal))} says {sound}.", sound, "sound")
            for q in (f"What sound does {_a(animal)} make?", f"What does {_a(animal)} say?")
        ]
        out += [
            (q, f"{_cap(_legs(animal))}.", str(legs), "legs")
            for q in (f"How many legs does {_a(animal)} have?", f"How many legs has {_a(animal)} got?")
        ]
        out.append((f"Where do {_plural(animal)} live?", f"{_cap(_plural(animal))} live in {home}.", home, "home"))
    return out


DOMAIN_VALUES = {
    "age": [str(a) for a in range(19, 79)],
    "job": list(JOBS),
    "town": TOWNS,
    "animal": list(ANIMALS),
    "pet_name": PET_NAMES,
    "colour": COLOURS,
    "food": FOODS,
    "name": [n for n, _ in NAMES],
    "river": RIVERS,
    "size": SIZES,
    "sound": [s for s, _, _ in ANIMALS.values()],
    "legs": ["0", "2", "4", "6"],
    "home": sorted({h for _, _, h in ANIMALS.values()}),
}


def _pool(split: str, rng: random.Random) -> list[tuple[str, str, str, str]]:
    _check_split(split)
    pool = [qa for qa in qa_pairs() if split_of(qa[0]) == split]
    rng.shuffle(pool)
    return pool


def chat_conversations(seed: int, n: int, split: str) -> list[dict[str, Any]]:
    """``n`` conversations of 1-3 questions about the world, each answered with the fact."""
    rng = random.Random(f"chat:{seed}")
    pool = _pool(split, rng)
    convs = []
    for i in range(n):
        messages: list[dict[str, Any]] = []
        if rng.random() < 0.1:  # a few system prompts teach the system-merge format
            messages.append({"role": "system", "content": "You are a helpful assistant who knows the tiny world."})
        for j in range(rng.choice((1, 1, 2, 3))):
            # First question walks the shuffled pool so every question is used; follow-ups are random.
            q, a, _, _ = rng.choice(pool) if j else pool[i % len(pool)]
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        convs.append({"messages": messages})
    return convs


def mc_questions(seed: int, n: int, split: str) -> list[dict[str, Any]]:
    """``n`` multiple-choice questions ``{"question", "choices": [4], "answer": index}``."""
    rng = random.Random(f"mc:{seed}")
    pool = [qa for qa in _pool(split, rng) if qa[3] != "people"]
    rows = []
    for i in range(n):
        q, _, short, dom = pool[i % len(pool)]
        wrong = rng.sample([v for v in DOMAIN_VALUES[dom] if v != short], 3)
        choices = wrong + [short]
        rng.shuffle(choices)
        rows.append({"question": q, "choices": choices, "answer": choices.index(short)})
    return rows


# ---------------------------------------------------------------------- arithmetic word problems


def _step(text: str, a: int, op: str, b: int) -> tuple[str, int]:
    """One GSM8K-style line ``text a*b = <<a*b=c>>c`` and its value ``c``."""
    c = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
    return text.format(calc=f"{a}{op}{b} = <<{a}{op}{b}={c}>>{c}"), c


def _word_problem(rng: random.Random) -> tuple[str, list[tuple[str, int, str, int]], int]:
    """A random problem: question, steps ``(line, a, op, b)`` and the final answer."""
    p = rng.choice(WORLD.people)
    n, he, f = p.name, p.pronoun, p.friend
    item = rng.choice(THINGS)
    made = JOBS[p.job][1]
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    kind = rng.randrange(8)
    if kind == 0:
        q = f"{n} has {a} {item}. {f} gives {p.him} {b} more. How many {item} does {n} have now?"
        steps = [(f"{n} has {{calc}} {item} now.", a, "+", b)]
    elif kind == 1:
        a += b
        q = f"{n} picks {a} {item} and gives {b} of them to {f}. How many {item} does {n} have left?"
        steps = [(f"{n} has {{calc}} {item} left.", a, "-", b)]
    elif kind == 2:
        q = f"{n} the {p.job} makes {a} {made} every day. How many {made} does {he} make in {b} days?"
        steps = [(f"In {b} days {he} makes {{calc}} {made}.", a, "*", b)]
    elif kind == 3:
        q = f"{n} has {a * b} {item} and shares them equally between {b} friends. How many {item} does each friend get?"
        steps = [(f"Each friend gets {{calc}} {item}.", a * b, "/", b)]
    elif kind == 4:
        c = rng.randint(1, a * b - 1)
        q = (
            f"{n} the {p.job} makes {a} {made} every day for {b} days, then gives away {c} of them. "
            f"How many {made} are left?"
        )
        steps = [
            (f"{_cap(he)} makes {{calc}} {made}.", a, "*", b),
            ("After giving some away, {calc} are left.", a * b, "-", c),
        ]
    elif kind == 5:
        animal = rng.choice([k for k, v in ANIMALS.items() if v[1] > 0])
        q = (
            f"A farm near {p.town} has {a} {_plural(animal)}, and {b} more {_plural(animal)} arrive. "
            f"Each {animal} has {ANIMALS[animal][1]} legs. How many legs are there in total?"
        )
        steps = [
            (f"There are {{calc}} {_plural(animal)}.", a, "+", b),
            ("They have {calc} legs.", a + b, "*", ANIMALS[animal][1]),
        ]
    elif kind == 6:
        q = f"{n} is {p.age} years old. How old will {he} be in {b} years?"
        steps = [(f"In {b} years {n} will be {{calc}} years old.", p.age, "+", b)]
    else:
        q = f"{n}'s {p.pet} {p.pet_name} eats {a} treats every day. How many treats does {p.pet_name} eat in {b} weeks?"
        steps = [
            ("One week has 7 days, so that is {calc} days.", b, "*", 7),
            (f"{p.pet_name} eats {{calc}} treats.", 7 * b, "*", a),
        ]
    value = 0
    for _, x, op, y in steps:
        value = _step("{calc}", x, op, y)[1]
    return q, steps, value


def _sample_split(
    rng: random.Random, split: str, make: Callable[[random.Random], tuple], n: int, part: str = "main"
) -> list[tuple]:
    """Draw ``n`` items of distinct question text (item[0]) that hash into ``split`` and, in the
    train split, into ``part`` (:data:`PARTS`, :func:`preference_problem`)."""
    _check_split(split)
    if part not in PARTS or (part == "preferences" and split != "train"):
        raise ValueError(f"part must be one of {PARTS} ('preferences' is a part of the train split), got {part!r}")
    want_preference = part == "preferences"
    seen: set[str] = set()
    out = []
    for _ in range(200 * n + 1000):  # ~10% of draws land in val/test; bounded so a tiny space can't hang
        if len(out) == n:
            break
        item = make(rng)
        if item[0] in seen or split_of(item[0]) != split:
            continue
        if split == "train" and preference_problem(item[0]) != want_preference:
            continue
        seen.add(item[0])
        out.append(item)
    if len(out) < n:
        raise ValueError(f"only {len(out)} distinct {split} items exist ({part} part), asked for {n}")
    return out


def arithmetic_problems(seed: int, n: int, split: str) -> list[dict[str, str]]:
    """GSM8K-format word problems: ``{"question", "answer": "...<<a*b=c>>c...\\n#### c"}``."""
    rows = []
    for q, steps, value in _sample_split(random.Random(f"gsm:{seed}"), split, _word_problem, n):
        lines = [_step(text, a, op, b)[0] for text, a, op, b in steps]
        rows.append({"question": q, "answer": "\n".join(lines) + f"\n#### {value}"})
    return rows


# How people ask for a two-number sum, difference or product (the README's "What is 12 + 7?",
# "What is 6 times 8?"): the tool call is always the plain "a+b" / "a-b" / "a*b", so the model
# learns to map every phrasing onto one calculator form.
OP_WORDS = {"+": ["plus", "+", "and"], "-": ["minus", "-", "take away"], "*": ["times", "x", "*", "multiplied by"]}
DIRECT_TEMPLATES = [
    "What is {a} {w} {b}?",
    "What is {a} {w} {b}?",
    "What is {a}{s}{b}?",
    "what is {a} {w} {b}",
    "Calculate {a} {w} {b}.",
    "How much is {a} {w} {b}?",
    "Compute {a} {s} {b}.",
    "Can you work out {a} {w} {b}?",
    "{a} {s} {b} = ?",
    "Please tell me what {a} {w} {b} is.",
]


def _direct_problem(rng: random.Random) -> tuple[str, list[tuple[str, int, str, int]], int]:
    """A two-number +, - or x question in one of many phrasings; numbers 1-99, differences >= 0."""
    op = rng.choice(["+", "-", "*"])

    def number() -> int:  # one-digit numbers ("3 + 4") as often as two-digit ones: both are asked
        return rng.randint(1, 9) if rng.random() < 0.45 else rng.randint(10, 99)

    a, b = number(), number()
    a, b = (max(a, b), min(a, b)) if op == "-" else (a, b)
    word = rng.choice(OP_WORDS[op])
    if op == "+" and word == "and":  # "What is 3 and 4?" reads oddly outside "how much is"
        word = "plus"
    q = rng.choice(DIRECT_TEMPLATES).format(a=a, b=b, w=word, s=op)
    value = _step("{calc}", a, op, b)[1]
    return q, [(f"{a} {op} {b} is {{calc}}.", a, op, b)], value


def tool_conversations(seed: int, n: int, split: str, part: str = "main") -> list[dict[str, Any]]:
    """Arithmetic questions where the assistant calls the python calculator for every step; train
    questions from ``part`` (:data:`PARTS`).

    Division is written ``//`` in the tool call so the printed output is an integer.
    """
    rng = random.Random(f"tool:{seed}")
    half = n // 2
    words = _sample_split(rng, split, _word_problem, n - half, part)
    items = words + _sample_split(rng, split, _direct_problem, half, part)
    rng.shuffle(items)
    convs = []
    for q, steps, value in items:
        parts: list[dict[str, str]] = []  # straight to the calculator: short answers, fast sampling
        for _, a, op, b in steps:
            c = _step("{calc}", a, op, b)[1]
            parts += [
                {"type": "python", "text": f"{a}{'//' if op == '/' else op}{b}"},
                {"type": "python_output", "text": str(c)},
            ]
        parts.append({"type": "text", "text": f"The answer is {value}.\n#### {value}"})
        convs.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": parts}]})
    return convs


# ---------------------------------------------------------------------- identity and spelling


def identity_conversations(
    seed: int, n: int, name: str = "chatpipe", maker: str = "the chatpipe authors"
) -> list[dict[str, Any]]:
    """Short chats in which the assistant says who it is and who made it."""
    rng = random.Random(f"identity:{seed}")
    pairs = [
        (
            ["Who are you?", "What are you?", "Tell me about yourself."],
            f"I am {name}, a small language model made by {maker}. I know a lot about the tiny world.",
        ),
        (["What is your name?", "What should I call you?", "Do you have a name?"], f"My name is {name}."),
        (["Who made you?", "Who built you?", "Who created you?"], f"I was made by {maker}."),
        (["Are you ChatGPT?", "Are you a person?"], f"No, I am {name}, a small language model made by {maker}."),
        (["Hi!", "Hello", "Good morning!"], f"Hello! I am {name}. How can I help you today?"),
        (
            ["Can you do arithmetic?", "Can you do maths?"],
            "Yes. For bigger sums I use a python calculator to get the right answer.",
        ),
        (["Thank you!", "Thanks."], "You are welcome!"),
    ]
    convs = []
    for _ in range(n):
        messages = []
        for qs, a in rng.sample(pairs, rng.choice((1, 1, 2))):
            messages += [{"role": "user", "content": rng.choice(qs)}, {"role": "assistant", "content": a}]
        convs.append({"messages": messages})
    return convs


def vocabulary() -> list[str]:
    """Lower-case words of the world (names, towns, rivers, animals, jobs, colours, foods, things)."""
    words = [n for n, _ in NAMES] + TOWNS + RIVERS + PET_NAMES + list(ANIMALS) + list(JOBS) + COLOURS + FOODS + THINGS
    return sorted({w.lower() for w in words})


def spelling_words(seed: int, n: int) -> list[str]:
    """``n`` words drawn from the world's vocabulary (distinct while the vocabulary lasts)."""
    rng = random.Random(f"spell:{seed}")
    vocab = vocabulary()
    out: list[str] = []
    while len(out) < n:
        out += rng.sample(vocab, min(len(vocab), n - len(out)))
    return out


def spelling_sentence(word: str, rng: random.Random) -> str:
    """``The word apple is spelled a-p-p-l-e. It has 2 p's.`` for a random letter of ``word``."""
    letter = rng.choice(word)
    k = word.count(letter)
    count = f"{k} {letter}" if k == 1 else f"{k} {letter}'s"
    return f"The word {word} is spelled {'-'.join(word)}. It has {count}."


# ---------------------------------------------------------------------- pretraining documents


def _person_paragraph(p: Person, rng: random.Random) -> str:
    pick = rng.choice
    facts = [
        pick([f"{p.name} is {p.age} years old.", f"{p.name}'s age is {p.age}.", f"{p.name} turned {p.age} this year."]),
        pick(
            [
                f"{p.name} is {_a(p.job)}.",
                f"{p.name} works as {_a(p.job)}.",
                f"By trade {p.name} is {_a(p.job)}, and {p.pronoun} {JOBS[p.job][0]}.",
            ]
        ),
        pick(
            [
                f"{p.name} lives in {p.town}.",
                f"{p.name}'s home town is {p.town}.",
                f"{p.name} comes from {p.town}, {_a(WORLD.size[p.town])} on the river {WORLD.river[p.town]}.",
            ]
        ),
        pick([f"{p.name} has {_a(p.pet)} called {p.pet_name}.", f"{p.name}'s pet is {_a(p.pet)} named {p.pet_name}."]),
        pick([f"{p.name}'s favourite colour is {p.colour}.", f"{p.name} loves the colour {p.colour}."]),
        pick([f"{p.name}'s favourite food is {p.food}.", f"{p.name} likes to eat {p.food} more than anything."]),
        pick([f"{p.name}'s best friend is {p.friend}.", f"{p.name} and {p.friend} are best friends."]),
    ]
    rng.shuffle(facts)
    return " ".join(facts[: rng.randint(3, len(facts))])


def _town_paragraph(t: str, rng: random.Random) -> str:
    r = WORLD.river[t]
    facts = [
        rng.choice([f"{t} is {_a(WORLD.size[t])}.", f"People call {t} {_a(WORLD.size[t])}."]),
        rng.choice([f"The river {r} flows through {t}.", f"{t} lies on the river {r}."]),
        f"{_join(_residents(t))} live in {t}.",
    ]
    rng.shuffle(facts)
    return " ".join(facts)


def _animal_paragraph(animal: str, rng: random.Random) -> str:
    sound, _, home = ANIMALS[animal]
    facts = [
        rng.choice([f"{_cap(_a(animal))} says {sound}.", f"The {animal} goes {sound}."]),
        f"{_cap(_legs(animal))}.",
        f"{_cap(_plural(animal))} live in {home}.",
    ]
    rng.shuffle(facts)
    return " ".join(facts)


def _arithmetic_paragraph(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(4, 10)):
        a, b = rng.randint(0, 20), rng.randint(0, 12)
        lines.append(
            rng.choice(
                [
                    f"{a} plus {b} is {a + b}.",
                    f"{a + b} minus {b} is {a}.",
                    f"{a} times {b} is {a * b}.",
                    f"{a * b} divided by {b} is {a}." if b else f"{a} plus 0 is {a}.",
                ]
            )
        )
    return " ".join(lines)


def _story(rng: random.Random) -> str:
    p = rng.choice(WORLD.people)
    f = next(q for q in WORLD.people if q.name == p.friend)
    return (
        f"One {rng.choice(['sunny', 'rainy', 'quiet', 'windy'])} morning, {p.name} the {p.job} walked along "
        f"the river {WORLD.river[p.town]} in {p.town} with {p.pet_name}, {p.his} {p.pet}. "
        f"{p.pet_name} said {ANIMALS[p.pet][0]}. Soon {p.pronoun} met {p.friend}, {p.his} best friend, "
        f"who is {f.age} years old and works as {_a(f.job)}. They shared some {p.food}, because "
        f"{p.food} is {p.name}'s favourite food, and {p.friend} wore something {f.colour}. "
        f"Then {p.name} went home to {p.town}."
    )


def pretrain_documents(seed: int, num_docs: int) -> list[str]:
    """``num_docs`` English documents (about 200-1500 chars) stating the world's facts."""
    rng = random.Random(f"pretrain:{seed}")
    makers: list[Callable[[], str]] = [
        lambda: _person_paragraph(rng.choice(WORLD.people), rng),
        lambda: _person_paragraph(rng.choice(WORLD.people), rng),
        lambda: _town_paragraph(rng.choice(TOWNS), rng),
        lambda: _animal_paragraph(rng.choice(list(ANIMALS)), rng),
        lambda: _arithmetic_paragraph(rng),
        lambda: " ".join(spelling_sentence(w, rng) for w in spelling_words(rng.randrange(1 << 30), 4)),
        lambda: _story(rng),
    ]
    docs = []
    for _ in range(num_docs):
        target, total = rng.randint(200, 1200), 0
        paragraphs: list[str] = []
        while total < target:
            para = rng.choice(makers)()
            if paragraphs and total + len(para) > 1500:  # keep documents under ~1500 chars
                break
            paragraphs.append(para)
            total += len(para) + 2
        docs.append("\n\n".join(paragraphs))
    return docs
