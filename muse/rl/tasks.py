"""Seeded RL tasks: chat messages to roll out plus what a reward needs to score the reply.

A task is a dict: `messages` (chat messages up to the user's request), `answer`, `key` (the
identity the train/test split is decided on), `reward` (the `load_reward` spec that scores
it) and, for tool tasks, `tools` (OpenAI schemas to offer), `facts` (the lookup table of
the task's `ToolEnvironment`) and `expected_call` (the last call that produces the answer).

Splits reuse the SFT data's hash partition (`muse.train.data.split`): "test" draws only
held-out keys and "train" only the others, so the two never overlap whatever the seeds, and
"test" addition problems are the ones the arithmetic eval section draws from.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from typing import Any

from muse.rl.tool_env import ToolEnvironment, convert_units
from muse.rl.unseen_tool_tasks import unseen_tool_tasks
from muse.train.data import arithmetic, instructions
from muse.train.data.split import HELD_OUT, TRAIN, draw_from_split

SPLITS = {"train": TRAIN, "test": HELD_OUT}
# Draws per wanted task before a category is taken to be exhausted.
DRAWS_PER_TASK = 50

ITEMS = ["notebook", "pencil", "lamp", "mug", "chair", "backpack", "candle", "kettle",
         "stapler", "towel"]
PLACES = ["Blue", "Red", "Cedar", "Summit", "Lake", "Pine", "Coast", "Valley", "Falcon", "Maple",
          "Granite", "Harbor"]
# (fact key template, unit stored, unit asked, question template); keys are quoted in the
# request so the call copies them verbatim, as the SFT tool data taught.
CONVERSIONS = [
    ("length of the {place} trail in km", "km", "m",
     'How many meters long is the {place} trail? Look up "{key}" and convert it from km to m.'),
    ("weight of the {place} crate in kg", "kg", "g",
     'How many grams does the {place} crate weigh? Look up "{key}" and convert it from kg to g.'),
    ("duration of the {place} tour in hours", "hours", "minutes",
     'How many minutes does the {place} tour take? Look up "{key}" and convert it from hours '
     'to minutes.'),
]


def _data_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    return SPLITS[split]


def _distinct(draw: Callable[[], dict[str, Any]], n: int, what: str) -> list[dict[str, Any]]:
    """`n` tasks with distinct keys; a clear error when the generator runs out of them."""
    found: dict[str, dict[str, Any]] = {}
    for _ in range(n * DRAWS_PER_TASK):
        if len(found) == n:
            break
        task = draw()
        found.setdefault(task["key"], task)
    if len(found) < n:
        raise ValueError(f"only {len(found)} distinct {what} tasks found, {n} asked")
    return list(found.values())


def arithmetic_tasks(n: int, operation: str = "add", digits: int = 3, seed: int = 0,
                     split: str = "train") -> list[dict[str, Any]]:
    """`n` distinct problems of `operation` ("add", "sub", "mul") on two `digits`-digit
    numbers, asked in the phrasings the shipped model was trained on ("What is 123 + 456?");
    `answer` is the result (an int)."""
    data_split = _data_split(split)
    rng = random.Random(f"rl-{operation}/{split}/{seed}")

    def draw() -> dict[str, Any]:
        problem = arithmetic.sample_problem(rng, data_split, operation, digits)
        return {"messages": [{"role": "user", "content": arithmetic.question(problem, rng)}],
                "answer": problem.answer, "key": problem.key, "reward": "arithmetic"}

    name = next(name for name, (op, _) in ARITHMETIC.items() if op == operation)
    return _distinct(draw, n, f"{split} {digits}-digit {name}")


def addition_tasks(n: int, digits: int = 3, seed: int = 0, split: str = "train"
                   ) -> list[dict[str, Any]]:
    return arithmetic_tasks(n, "add", digits, seed, split)


def sort_tasks(n: int, items: int | None = None, seed: int = 0, split: str = "train"
               ) -> list[dict[str, Any]]:
    """`n` distinct sorting requests of `items` words or numbers (3-6, as in training, when
    None), in the training phrasings; `answer` is the sorted list as the reply must write it."""
    data_split = _data_split(split)
    rng = random.Random(f"rl-sort/{split}/{seed}")

    def draw() -> dict[str, Any]:
        case = (instructions.sample_case(rng, data_split, "sort") if items is None
                else instructions.sort_case(rng, data_split, items))
        return {"messages": [{"role": "user", "content": case.request}], "answer": case.answer,
                "key": case.key, "reward": "exact_answer"}

    return _distinct(draw, n, f"{split} sorting")


def _price_task(rng: random.Random) -> dict[str, Any]:
    item, *others = rng.sample(ITEMS, 3)
    quantity = rng.randint(2, 12)
    facts = {f"price of a {name}": rng.randint(2, 99) for name in [item, *others]}
    key = f"price of a {item}"
    request = (f'What do {quantity} {item}s cost in total? Look up "{key}" and multiply it '
               f"by {quantity}.")
    price = facts[key]
    return {"request": request, "facts": facts, "answer": price * quantity,
            "expected_call": {"name": "multiply_numbers",
                              "arguments": {"a": price, "b": quantity}}}


def _conversion_task(rng: random.Random) -> dict[str, Any]:
    key_template, stored, asked, question = rng.choice(CONVERSIONS)
    place, *others = rng.sample(PLACES, 3)
    facts = {key_template.format(place=name): rng.randint(2, 200) for name in [place, *others]}
    key = key_template.format(place=place)
    value = facts[key]
    return {"request": question.format(place=place, key=key), "facts": facts,
            "answer": convert_units(value, stored, asked),
            "expected_call": {"name": "convert_units",
                              "arguments": {"value": value, "from_unit": stored,
                                            "to_unit": asked}}}


TOOL_TASK_MAKERS: dict[str, Callable[[random.Random], dict[str, Any]]] = {
    "price_total": _price_task, "unit_conversion": _conversion_task}


def _tool_task(rng: random.Random, kind: str, data_split: str) -> dict[str, Any]:
    def make() -> dict[str, Any]:
        made = TOOL_TASK_MAKERS[kind](rng)
        # The request and the final call (which holds the looked-up value) identify the
        # problem; distractor facts do not change it.
        call = json.dumps(made["expected_call"]["arguments"], sort_keys=True)
        return {**made, "key": f"{kind}:{made['request']}:{call}"}

    made = draw_from_split(make, lambda task: task["key"], data_split)
    return {"messages": [{"role": "user", "content": made["request"]}],
            "tools": ToolEnvironment(made["facts"]).tools, "facts": made["facts"],
            "answer": made["answer"], "expected_call": made["expected_call"],
            "key": made["key"], "kind": kind, "reward": "tool_call"}


def tool_tasks(n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    """`n` distinct two-step tool tasks, the kinds in turn: `lookup_fact` of a value only the
    task's facts hold, then `multiply_numbers` or `convert_units` on that value.

    The looked-up value is random per task, so no reply reaches the answer without the
    first call's result; `answer` is the second call's result.
    """
    data_split = _data_split(split)
    rng = random.Random(f"rl-tools/{split}/{seed}")
    kinds = itertools.cycle(sorted(TOOL_TASK_MAKERS))
    return _distinct(lambda: _tool_task(rng, next(kinds), data_split), n, f"{split} tool")


TASKS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "addition": addition_tasks, "tools": tool_tasks, "unseen_tools": unseen_tool_tasks,
    "sort": sort_tasks}
# Arithmetic task names and their default operand digits ("multiplication:4" sets them).
ARITHMETIC = {"addition": ("add", 3), "subtraction": ("sub", 3), "multiplication": ("mul", 4)}


def load_tasks(name: str, n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    """`n` tasks of the generator `name` from `split` ("train" or "test"): one of TASKS, an
    arithmetic operation of ARITHMETIC with an optional digit count ("multiplication:4"), or
    sorting with an optional list length ("sort:6")."""
    base, _, size = name.partition(":")
    if base in ARITHMETIC:
        operation, default = ARITHMETIC[base]
        if size and not (size.isdigit() and 1 <= int(size) <= arithmetic.MAX_DIGITS + 4):
            raise ValueError(f"task {name!r}: the digit count must be a small positive integer")
        return arithmetic_tasks(n, operation, int(size) if size else default, seed, split)
    if base == "sort" and size:
        if not (size.isdigit() and 2 <= int(size) <= instructions.MAX_SORT_ITEMS):
            raise ValueError(f"task {name!r}: the list length must be an integer from 2 to "
                             f"{instructions.MAX_SORT_ITEMS}")
        return sort_tasks(n, int(size), seed, split)
    if name not in TASKS:
        raise ValueError(f"unknown task set {name!r}; expected one of "
                         f"{sorted(set(TASKS) | set(ARITHMETIC))} (arithmetic ones may add "
                         f"':DIGITS', sort ':ITEMS')")
    return TASKS[name](n, seed=seed, split=split)
