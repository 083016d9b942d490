"""Finding names in a list: which names start with a given verb, and whether a given name is
among them, for tool-style names the model has never seen (`unseen_tools.random_tool`).

These are the two lookups of the unseen-tool reasoning's narrowing (`unseen_tools.narrowed`):
'Those named "fetch_...": "fetch_kiosk" and "fetch_vault".' and '"fetch_vault" is among
them.'. Inside a tool conversation each lookup is one sentence a case; here it is the whole
exchange, drawn from the same vocabularies (made-up, pieced and common words in training),
with lists that hold near misses (the same verb, the same object, another qualifier), so
that the model learns to find a run of tokens among names rather than a name it knows.

    User: Names: "check_vault", "fetch_kiosk" and "fetch_vault". Which are named "fetch_..."?
    Assistant: <think>Those named "fetch_...": "fetch_kiosk" and "fetch_vault".</think>
               "fetch_kiosk" and "fetch_vault".
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from muse.train.data.split import split_items
from muse.train.data.tools import listed, quoted
from muse.train.data.unseen_tools import Tool, random_tool

KINDS = ("prefix", "member")
PREFIX_QUESTIONS = ("Which are named {key}?", "Which of them start with {key}?",
                    "List the names that begin with {key}.", "Which names match {key}?",
                    "Pick out the ones named {key}.", "Find every name of the form {key}.",
                    "Which of these start with {key}?", "Which ones are {key}?",
                    "Give the names starting {key}.", "Name those that look like {key}.")
MEMBER_QUESTIONS = ("Is {name} among them?", "Is {name} one of them?",
                    "Does the list hold {name}?", "Is {name} in the list?",
                    "Can you find {name} there?", "Is there a {name}?",
                    "Does {name} appear?", "Is {name} listed?",
                    "Do the names include {name}?", "Is {name} one of these names?")
MOST_NAMES = 5


@dataclass(frozen=True)
class LookupCase:
    kind: str  # one of KINDS
    names: tuple[str, ...]
    wanted: Tool  # the name looked for ("member"), or whose verb starts the key ("prefix")
    question: str

    @property
    def key(self) -> str:
        """The start of a name looked for: the verb and its underscore, '"fetch_..."'."""
        return self.wanted.verb.replace(" ", "_") + "_"

    @property
    def found(self) -> list[str]:
        if self.kind == "prefix":
            return [name for name in self.names if name.startswith(self.key)]
        return [self.wanted.name] if self.wanted.name in self.names else []


def _near_miss(rng: random.Random, split: str, wanted: Tool) -> Tool:
    draw = rng.random()
    if draw < 0.35:
        return random_tool(rng, split, verb=wanted.verb)
    if draw < 0.7:
        return random_tool(rng, split, noun=wanted.noun)
    if draw < 0.8 and wanted.qualifier:
        return random_tool(rng, split, verb=wanted.verb, noun=wanted.noun)
    return random_tool(rng, split)


def sample_case(rng: random.Random, split: str, kind: str | None = None) -> LookupCase:
    """A list of one to MOST_NAMES names and a lookup in it, from `split`'s vocabularies; the
    name (or a name of the verb) looked for is there about half the time."""
    kind = kind or rng.choice(KINDS)
    wanted = random_tool(rng, split)
    names: list[str] = [wanted.name] if rng.random() < 0.5 else []
    count = rng.randint(max(1, len(names)), MOST_NAMES)
    while len(names) < count:
        other = _near_miss(rng, split, wanted).name
        if other not in names and other != wanted.name:
            names.append(other)
    rng.shuffle(names)
    questions = PREFIX_QUESTIONS if kind == "prefix" else MEMBER_QUESTIONS
    question = rng.choice(split_items(questions, split))
    return LookupCase(kind, tuple(names), wanted, question)


def answer_sentence(case: LookupCase) -> str:
    """The reasoning: the narrowing's sentence for this lookup."""
    if case.kind == "prefix":
        found = listed(case.found) if case.found else "none"
        return f"Those named {quoted(case.key + '...')}: {found}."
    among = "among" if case.found else "not among"
    return f"{quoted(case.wanted.name)} is {among} them."


def exchange(case: LookupCase) -> list[dict[str, Any]]:
    noun = "Name" if len(case.names) == 1 else "Names"
    question = case.question.format(key=quoted(case.key + "..."),
                                    name=quoted(case.wanted.name))
    user = f"{noun}: {listed(case.names)}. {question}"
    if case.kind == "prefix":
        answer = f"{listed(case.found)}." if case.found else "None of them."
    else:
        answer = "Yes." if case.found else "No."
    return [{"role": "user", "content": user},
            {"role": "assistant", "reasoning_content": answer_sentence(case), "content": answer}]
