"""Tools as users write them, from scenarios training never shows: held-out scenarios of
`muse.train.data.natural_tools` (their tools, argument names and sentences), asked and scored
as the `unseen_tools` section asks and scores its cases. Between the generated unseen tools
(every value behind its argument's name) and the 22 fixed users' tools cases, with `--num`
cases, the kinds (call, choose, no_tool) in turn.
"""

from __future__ import annotations

import random

from muse.eval.generation import SectionResult
from muse.eval.unseen_tools import cases_in_turn, evaluate_tool_cases
from muse.llm import LLM
from muse.train.data import natural_tools
from muse.train.data.split import HELD_OUT
from muse.train.data.unseen_tools import UnseenToolCase


def held_out_natural_cases(seed: int, num: int) -> list[UnseenToolCase]:
    """`num` cases of the held-out scenarios, the kinds in turn."""
    return cases_in_turn(random.Random(f"eval-natural-tools/{seed}"), HELD_OUT, num,
                         natural_tools.sample_case)


def evaluate_natural_tools(llm: LLM, num: int, seed: int, max_tokens: int,
                           progress: bool | None = None, strict_tools: bool = False
                           ) -> SectionResult:
    return evaluate_tool_cases(llm, held_out_natural_cases(seed, num),
                               f"eval-natural-tools/{seed}", "natural tools", max_tokens,
                               progress, strict_tools)
