"""RL tasks of tools never seen in training: the model must read the offered schemas and call
the one that fits with the right arguments, or decline when none fits (the `unseen_tools`
eval section's cases; the shipped model is weak at them).

"train" tasks draw from the SFT data's training split and "test" ones from its held-out split
(tool names, argument names and phrasings differ), so a gain on "test" is a gain on tools
neither SFT nor RL showed. One reply per task: the first assistant turn is scored.
"""

from __future__ import annotations

import json
import random
from typing import Any

from muse.chat_format import END_OF_TURN_TOKEN
from muse.eval.tools import call_is_valid
from muse.eval.unseen_tools import expected_reply, right_arguments
from muse.rl.tool_env import reply_tool_calls
from muse.train.data import unseen_tools
from muse.train.data.split import HELD_OUT, TRAIN

SPLITS = {"train": TRAIN, "test": HELD_OUT}


def unseen_tool_tasks(n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    """`n` cases, the kinds (call, choose, no_tool) in turn."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    rng = random.Random(f"rl-unseen-tools/{split}/{seed}")
    kinds = unseen_tools.KINDS
    tasks = []
    for index in range(n):
        case = unseen_tools.sample_case(rng, SPLITS[split], kinds[index % len(kinds)])
        tasks.append({
            "messages": [unseen_tools.exchange(case)[0]],
            "tools": unseen_tools.offered_schemas(case),
            "answer": json.dumps(expected_reply(case).get("tool_calls")),
            "key": case.request,
            "reward": "unseen_tool_call",
            "case": case,
            "max_turns": 1,
        })
    return tasks


def unseen_tool_reward(completion: str, task: dict[str, Any]) -> float:
    """1.0 for the eval's "right": exactly one valid call of the fitting offered tool with
    exactly the expected arguments, or, when no offered tool fits, a finished reply without
    a call."""
    case = task["case"]
    calls = reply_tool_calls(completion, task["tools"])
    if calls is None:  # a malformed block, or a tool that was not offered
        return 0.0
    if case.tool is None:
        # Only a finished reply declines: one cut off by its token budget must not be paid,
        # or the policy learns to ramble whenever it is unsure.
        return float(not calls and END_OF_TURN_TOKEN in completion)
    if len(calls) != 1:
        return 0.0
    try:
        arguments = json.loads(calls[0].arguments)
    except json.JSONDecodeError:
        return 0.0
    call = {"name": calls[0].name, "arguments": arguments}
    return float(call_is_valid(call, task["tools"]) and call["name"] == case.tool.name
                 and right_arguments(arguments, case))
