"""Tools never seen in training: held-out cases of `muse.train.data.unseen_tools`, whose tool
names, argument names and phrasings training never shows, so a model that recalls its
training tools instead of reading the offered schemas fails.

Each case is rendered up to the user's request with its offered tools (as the `tools` section
does, with the same share of system prompts) and the first reply is generated greedily.
Per case:

- `valid`: for `call` and `choose`, exactly one `<tool_call>` whose JSON parses, names an
  offered tool and whose arguments satisfy its schema (`tools.call_is_valid`); for
  `no_tool`, a finished reply (it ends its turn) with no tool call at all: a reply cut off
  by its token budget has declined nothing.
- `right_tool`: the one call names the expected tool (whether or not its arguments fit);
  for `no_tool`, no call.
- `right_arguments`: the call's arguments have exactly the expected names and every value
  equals the expected one as a JSON value of the schema's type (`same_value`); for
  `no_tool`, no call.
- `right`: valid, right tool and right arguments; for `no_tool`, no call.

Cases are spread evenly over the kinds (call, choose, no_tool) and reported per kind and
overall.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import Any

from muse.eval.generation import (ChatPrompt, SectionResult, example, generate_replies,
                                  reply_budget, strict)
from muse.eval.replies import Reply
from muse.eval.tools import call_is_valid, single_call
from muse.llm import LLM
from muse.train.data import unseen_tools
from muse.train.data.conversations import SYSTEM_PROMPT_SHARE, SYSTEM_PROMPTS
from muse.train.data.split import HELD_OUT
from muse.train.data.unseen_tools import UnseenToolCase

MEASURES = ("valid", "right_tool", "right_arguments", "right")
NUMBER_TOLERANCE = 1e-9


def same_value(value: Any, expected: Any, kind: str) -> bool:
    """Whether a call's argument `value` is the `expected` one for an argument of type `kind`
    (one of `unseen_tools.ARGUMENT_TYPES`).

    Strings and enum values: exact, case-sensitive, no trimming (the request spells them
    verbatim). Integers: an int (not a bool) of the same value. Numbers: an int or a float
    (not a bool) within 1e-9 of the expected value, so `12` and `12.0` or `12.5` and `12.50`
    are the same JSON number. Booleans: true or false, not 0, 1 or "true".
    """
    if kind in ("string", "enum"):
        return isinstance(value, str) and value == expected
    if kind == "boolean":
        return isinstance(value, bool) and value == expected
    if isinstance(value, bool):
        return False
    if kind == "integer":
        return isinstance(value, int) and value == expected
    if kind == "number":
        return isinstance(value, (int, float)) and abs(value - expected) <= NUMBER_TOLERANCE
    raise ValueError(f"unknown argument type {kind!r}")


def right_arguments(arguments: Any, case: UnseenToolCase) -> bool:
    """Exactly the expected argument names, each with the expected value."""
    if not isinstance(arguments, dict) or set(arguments) != set(case.arguments):
        return False
    kinds = {argument.name: argument.type for argument in case.requested.arguments}
    return all(same_value(arguments[name], expected, kinds[name])
               for name, expected in case.arguments.items())


def score_reply(reply: Reply, case: UnseenToolCase) -> dict[str, bool]:
    """`MEASURES` of one reply to `case`'s request."""
    if case.tool is None:
        declined = not reply.tool_calls and reply.ends_with_end_of_turn
        return {measure: declined for measure in MEASURES}
    call = single_call(reply)
    valid = call_is_valid(call, unseen_tools.offered_schemas(case))
    tool = call is not None and call.get("name") == case.tool.name
    arguments = call is not None and tool and right_arguments(call.get("arguments"), case)
    return {"valid": valid, "right_tool": tool, "right_arguments": arguments,
            "right": valid and tool and arguments}


def cases_in_turn(rng: random.Random, split: str, num: int,
                  sample: Callable[[random.Random, str, str], UnseenToolCase]
                  = unseen_tools.sample_case) -> list[UnseenToolCase]:
    """`num` cases of `split` drawn by `sample`, the kinds in turn (call, choose, no_tool,
    call, ...)."""
    kinds = unseen_tools.KINDS
    return [sample(rng, split, kinds[index % len(kinds)]) for index in range(num)]


def held_out_cases(seed: int, num: int) -> list[UnseenToolCase]:
    """`num` held-out cases, the kinds in turn."""
    return cases_in_turn(random.Random(f"eval-unseen-tools/{seed}"), HELD_OUT, num)


def expected_reply(case: UnseenToolCase) -> dict[str, Any]:
    """The assistant message training would give: the call, or the direct answer."""
    return unseen_tools.exchange(case)[1]


def _rates(cells: list[dict[str, bool]]) -> dict[str, float]:
    count = len(cells)
    return {"count": count, **{measure: sum(cell[measure] for cell in cells) / count
                               if count else 0.0 for measure in MEASURES}}


def summarize(cases: list[UnseenToolCase], scores: list[dict[str, bool]]) -> dict[str, Any]:
    """Overall rates of `MEASURES` (plus `count`) and the same per kind under `by_kind`."""
    by_kind = {kind: _rates([score for case, score in zip(cases, scores) if case.kind == kind])
               for kind in unseen_tools.KINDS}
    return {**_rates(scores), "by_kind": {kind: cell for kind, cell in by_kind.items()
                                          if cell["count"]}}


def evaluate_unseen_tools(llm: LLM, num: int, seed: int, max_tokens: int,
                          progress: bool | None = None, strict_tools: bool = False
                          ) -> SectionResult:
    return evaluate_tool_cases(llm, held_out_cases(seed, num), f"eval-unseen-tools/{seed}",
                               "unseen tools", max_tokens, progress, strict_tools)


def evaluate_tool_cases(llm: LLM, cases: list[UnseenToolCase], seed: str, label: str,
                        max_tokens: int, progress: bool | None = None,
                        strict_tools: bool = False) -> SectionResult:
    """Each case's first reply, scored by `score_reply`; `seed` draws the system prompts;
    `strict_tools` offers every function as `"strict": true`."""
    system_rng = random.Random(f"{seed}/system")
    prompts = []
    for case in cases:
        system = [{"role": "system", "content": system_rng.choice(SYSTEM_PROMPTS)}] \
            if system_rng.random() < SYSTEM_PROMPT_SHARE else []
        user = unseen_tools.exchange(case)[0]
        prompts.append(ChatPrompt(system + [user],
                                  strict(unseen_tools.offered_schemas(case), strict_tools),
                                  reply_budget(llm, expected_reply(case), max_tokens)))
    replies = generate_replies(llm, prompts, label, progress)
    scores = [score_reply(reply, case) for case, reply in zip(cases, replies)]
    examples = []
    for kind in unseen_tools.KINDS:  # the first case of each kind, and the first miss
        shown = [index for index, case in enumerate(cases) if case.kind == kind][:1]
        shown += [index for index, (case, score) in enumerate(zip(cases, scores))
                  if case.kind == kind and not score["right"]][:1]
        for index in dict.fromkeys(shown):
            case = cases[index]
            expected = "no tool call" if case.tool is None else json.dumps(
                {"name": case.tool.name, "arguments": case.arguments})
            examples.append({"kind": kind, **example(prompts[index], replies[index], expected,
                                                     scores[index]["right"])})
    return SectionResult(summarize(cases, scores), replies, examples)
