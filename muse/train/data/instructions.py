"""Short instructions with one right answer: sort, reverse, count, copy, answer from a context.

The reasoning spells out the mechanical part (letters one by one, items numbered) so a small
model has the intermediate steps written down before it answers.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from muse.train.data.split import draw_from_split

WORDS = ["apple", "river", "stone", "cloud", "tiger", "paper", "music", "green", "bread", "light",
         "house", "ocean", "plant", "chair", "lemon", "night", "robot", "sugar", "train", "zebra",
         "mango", "pilot", "quiet", "eagle", "dance", "frost", "grape", "honey", "ivory", "jelly",
         "kite", "lunar", "maple", "noble", "olive", "piano", "queen", "solar", "tulip", "urban",
         "vivid", "wheat", "yacht", "amber", "bison", "cedar", "delta", "ember", "fjord", "glow"]
PEOPLE = ["Alice", "Bruno", "Carmen", "Dmitri", "Elena", "Femi", "Gita", "Hassan", "Ivy", "Jonas",
          "Keiko", "Luis", "Mira", "Nikolai", "Olga", "Pablo", "Rana", "Sven", "Tomas", "Yara"]
PLACES = ["Oslo", "Lima", "Kyoto", "Quito", "Porto", "Accra", "Hanoi", "Perth", "Bergen", "Cusco"]
JOBS = ["teacher", "baker", "pilot", "nurse", "farmer", "chemist", "painter", "lawyer", "doctor"]
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "silver"]
SNIPPETS = ["x = y + 1", "for i in range(3):", "return a * b", "print('hello')", "if n > 0:",
            "total += price", "def main():", "import os", "while True:", "data = []"]


@dataclass(frozen=True)
class InstructionCase:
    kind: str
    request: str
    reasoning: str
    answer: str

    @property
    def key(self) -> str:
        return f"{self.kind}:{self.request}"


def _words(rng: random.Random, low: int = 3, high: int = 6) -> list[str]:
    return rng.sample(WORDS, rng.randint(low, high))


def _sort_words(rng: random.Random, items: int | None = None) -> InstructionCase:
    words = rng.sample(WORDS, items) if items else _words(rng)
    request = rng.choice(["Sort these words alphabetically: {items}.",
                          "Put in alphabetical order: {items}.",
                          "Alphabetize: {items}."]).format(items=", ".join(words))
    ordered = sorted(words)
    reasoning = "First letters: " + ", ".join(w[0] for w in words) + "."
    return InstructionCase("sort", request, reasoning, ", ".join(ordered))


def _sort_numbers(rng: random.Random, items: int | None = None) -> InstructionCase:
    numbers = rng.sample(range(100), items or rng.randint(3, 6))
    descending = rng.random() < 0.3
    order = "descending" if descending else "ascending"
    request = rng.choice(["Sort in {order} order: {items}.",
                          "Order these numbers, {order}: {items}."]).format(
        order=order, items=", ".join(map(str, numbers)))
    ordered = sorted(numbers, reverse=descending)
    reasoning = f"{'Largest' if descending else 'Smallest'} first: {ordered[0]}."
    return InstructionCase("sort", request, reasoning, ", ".join(map(str, ordered)))


def _reverse_list(rng: random.Random) -> InstructionCase:
    words = _words(rng)
    request = rng.choice(["Reverse this list: {items}.", "Write these in reverse order: {items}."]
                         ).format(items=", ".join(words))
    reasoning = f"The last item is {words[-1]}, the first is {words[0]}."
    return InstructionCase("reverse", request, reasoning, ", ".join(reversed(words)))


def _reverse_word(rng: random.Random) -> InstructionCase:
    word = rng.choice(WORDS)
    request = rng.choice(["Reverse the letters of '{word}'.", "Spell '{word}' backwards."]
                         ).format(word=word)
    reasoning = f"Letters: {' '.join(word)}. Reversed: {' '.join(reversed(word))}."
    return InstructionCase("reverse", request, reasoning, word[::-1])


def _count_items(rng: random.Random) -> InstructionCase:
    words = _words(rng, 2, 8)
    request = rng.choice(["How many items are in this list: {items}?",
                          "Count the words: {items}."]).format(items=", ".join(words))
    reasoning = " ".join(f"{i} {w}." for i, w in enumerate(words, 1))
    return InstructionCase("count", request, reasoning, str(len(words)))


def _count_letter(rng: random.Random) -> InstructionCase:
    word = rng.choice(WORDS)
    letter = rng.choice(sorted(set(word))) if rng.random() < 0.8 else rng.choice("aeiou")
    request = f"How many times does the letter '{letter}' appear in '{word}'?"
    seen, steps = 0, []
    for character in word:
        if character == letter:
            seen += 1
            steps.append(f"{character} {seen}")
        else:
            steps.append(character)
    reasoning = ", ".join(steps) + f". So {seen}."
    return InstructionCase("count", request, reasoning, str(seen))


def _copy(rng: random.Random) -> InstructionCase:
    text = rng.choice(SNIPPETS) if rng.random() < 0.5 else " ".join(_words(rng, 2, 5))
    request = rng.choice(["Repeat exactly: {text}", "Copy this text: {text}",
                          "Echo back: {text}"]).format(text=text)
    return InstructionCase("copy", request, "I repeat the text as given.", text)


_FACTS: dict[str, tuple[str, str, list[str]]] = {
    # attribute: (fact template, question template, values)
    "city": ("{name} lives in {value}.", "Where does {name} live?", PLACES),
    "age": ("{name} is {value} years old.", "How old is {name}?",
            [str(n) for n in range(18, 80)]),
    "job": ("{name} works as a {value}.", "What is {name}'s job?", JOBS),
    "color": ("{name}'s favorite color is {value}.", "What is {name}'s favorite color?", COLORS),
}


def _context_question(rng: random.Random) -> InstructionCase:
    people = rng.sample(PEOPLE, rng.randint(2, 3))
    facts = []
    for person in people:
        for attribute in rng.sample(sorted(_FACTS), 2):
            template, _, values = _FACTS[attribute]
            facts.append((person, attribute, rng.choice(values)))
    rng.shuffle(facts)
    person, attribute, value = rng.choice(facts)
    context = " ".join(_FACTS[a][0].format(name=p, value=v) for p, a, v in facts)
    question = _FACTS[attribute][1].format(name=person)
    request = f"Context: {context}\nQuestion: {question}"
    reasoning = "The context says: " + _FACTS[attribute][0].format(name=person, value=value)
    return InstructionCase("context", request, reasoning, value)


MAKERS: dict[str, list[Callable[[random.Random], InstructionCase]]] = {
    "sort": [_sort_words, _sort_numbers],
    "reverse": [_reverse_list, _reverse_word],
    "count": [_count_items, _count_letter],
    "copy": [_copy],
    "context": [_context_question],
}
KINDS = tuple(MAKERS)
# The most items a sorting case can hold: every word of WORDS.
MAX_SORT_ITEMS = len(WORDS)


def sample_case(rng: random.Random, split: str, kind: str | None = None) -> InstructionCase:
    makers = MAKERS[kind or rng.choice(KINDS)]
    return draw_from_split(lambda: rng.choice(makers)(rng), lambda case: case.key, split)


def sort_case(rng: random.Random, split: str, items: int) -> InstructionCase:
    """A sorting case of exactly `items` words or numbers (either, at random) from `split`.

    Training lists hold 3-6 items; longer ones measure how far the skill reaches (the
    `sorting` eval section, the RL `sort:N` task)."""
    if not 2 <= items <= MAX_SORT_ITEMS:
        raise ValueError(f"a sorting case holds 2 to {MAX_SORT_ITEMS} items, not {items}")
    return draw_from_split(lambda: rng.choice(MAKERS["sort"])(rng, items), lambda case: case.key,
                           split)


def exchange(case: InstructionCase) -> list[dict[str, Any]]:
    return [{"role": "user", "content": case.request},
            {"role": "assistant", "reasoning_content": case.reasoning, "content": case.answer}]
