"""A small, deterministic, English-like corpus so tests and demos need no network.

Text comes from a seeded probabilistic grammar: scene headings, stage directions, dialogue
lines ("NAME: ...") and prose sentences built from determiners, adjectives, nouns, verbs and
prepositions. The vocabulary is small and the structure regular, so a tiny model learns it
quickly (its loss falls far below the uniform 5.55 nats), yet the text is varied enough to
be worth modelling.
"""

from __future__ import annotations

import random


def _words(text: str) -> tuple[str, ...]:
    """A word list from one space-separated string (compact to read and edit)."""
    return tuple(text.split())


DETERMINERS = _words("the a this that my thy our every no")
ADJECTIVES = _words(
    "old young fair dark noble cruel gentle bold sweet bitter quiet proud golden wretched "
    "loyal strange"
)
NOUNS = _words(
    "king queen lord lady fool ghost sword crown heart night storm letter castle garden "
    "servant brother daughter moon river tongue"
)
TRANSITIVE_VERBS = _words(
    "loved betrayed found kept sought praised feared forgot carried answered followed wronged"
)
INTRANSITIVE_VERBS = _words("wept slept laughed died waited prayed fled sang")
PREPOSITIONS = _words("in upon beneath beyond with before near without")
NAMES = _words("ANTONIO BEATRICE CLAUDIO DESDEMONA EDMUND FLAVIA GONZALO HELENA ISABEL LORENZO")
PLACES = ("A hall in the castle", "A garden", "A street", "The heath", "A room in the palace")
ROMAN = ("I", "II", "III", "IV", "V")


class _Grammar:
    """Expands the grammar's rules with one seeded random stream."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def pick(self, words: tuple[str, ...]) -> str:
        return self.rng.choice(words)

    def noun_phrase(self) -> str:
        if self.rng.random() < 0.15:
            return self.pick(NAMES).capitalize()
        words = [self.pick(DETERMINERS)]
        if self.rng.random() < 0.5:
            words.append(self.pick(ADJECTIVES))
        words.append(self.pick(NOUNS))
        if words[0] == "a" and words[1][0] in "aeiou":
            words[0] = "an"
        return " ".join(words)

    def verb_phrase(self) -> str:
        if self.rng.random() < 0.3:
            return self.pick(INTRANSITIVE_VERBS)
        return f"{self.pick(TRANSITIVE_VERBS)} {self.noun_phrase()}"

    def sentence(self) -> str:
        roll = self.rng.random()
        if roll < 0.1:
            return f"O {self.pick(ADJECTIVES)} {self.pick(NOUNS)}!"
        if roll < 0.2:
            return f"Who {self.verb_phrase()}?"
        text = f"{self.noun_phrase()} {self.verb_phrase()}"
        if self.rng.random() < 0.4:
            text += f" {self.pick(PREPOSITIONS)} {self.noun_phrase()}"
        if self.rng.random() < 0.2:
            text += f", and {self.noun_phrase()} {self.verb_phrase()}"
        return text[0].upper() + text[1:] + "."

    def dialogue(self) -> str:
        count = self.rng.randint(1, 3)
        spoken = " ".join(self.sentence() for _ in range(count))
        return f"{self.pick(NAMES)}: {spoken}\n"

    def stage_direction(self) -> str:
        first, second = self.rng.sample(NAMES, 2)
        return f"Enter {first.capitalize()} and {second.capitalize()}.\n"

    def prose(self) -> str:
        sentences = " ".join(self.sentence() for _ in range(self.rng.randint(2, 5)))
        return f"\n{sentences}\n\n"

    def scene(self, number: int) -> str:
        act = ROMAN[(number // len(ROMAN)) % len(ROMAN)]
        gap = "\n" if number else ""
        heading = f"{gap}ACT {act}. SCENE {ROMAN[number % len(ROMAN)]}. {self.pick(PLACES)}.\n\n"
        parts = [heading, self.stage_direction()]
        for _ in range(self.rng.randint(6, 14)):
            parts.append(self.dialogue() if self.rng.random() < 0.75 else self.prose())
        return "".join(parts)


def generated_corpus(num_bytes: int = 200_000, seed: int = 0) -> bytes:
    """Exactly ``num_bytes`` of ASCII play-like text; the same seed gives the same bytes."""
    if num_bytes < 1:
        raise ValueError(f"num_bytes must be >= 1, got {num_bytes}")
    grammar = _Grammar(seed)
    parts: list[str] = []
    size = 0
    number = 0
    while size < num_bytes:
        scene = grammar.scene(number)
        parts.append(scene)
        size += len(scene)
        number += 1
    return "".join(parts).encode("ascii")[:num_bytes]
