"""Where the narrowing reasoning of unseen-tool replies goes wrong, step by step, and how well a
model answers held-out name lookups (`muse.train.data.name_lookup`).

    python scripts/unseen_tool_narrowing.py MODEL [--num 240] [--lookups 100] [--json OUT]

Each of `muse eval`'s first `--num` held-out unseen-tool cases is answered greedily, as the
section asks it, and its reasoning is read in order: the restated request, the verb looked
for ('Those named "fetch_...":'), the tools found by it (step 1), the whole name then looked
for among them (step 2), and the reply. A case is counted at the first step that is wrong.
`--lookups` held-out lookups (half by prefix, half by whole name) are scored by whether the
reply's reasoning holds the expected lookup sentence, split by whether the name is there.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from muse import LLM, SamplingParams  # noqa: E402
from muse.eval.options import EvalSettings  # noqa: E402
from muse.eval.unseen_tools import evaluate_tool_cases, held_out_cases, score_reply  # noqa: E402
from muse.train.data import name_lookup, unseen_tools  # noqa: E402
from muse.train.data.split import HELD_OUT  # noqa: E402
from muse.train.data.unseen_tools import UnseenToolCase  # noqa: E402

NARROWING = re.compile(r'Those named "([^"]*)\.\.\.": (none|.*?)\.'
                       r'(?: "([^"]*)" is (not among|among) them\.)?(?: |$)')


def narrowing_step(case: UnseenToolCase, reasoning: str, right: bool) -> str:
    """The first step of `reasoning` that is wrong for `case`, or "right"."""
    asked = reasoning.startswith(f"The user asks to {case.requested.action}.")
    match = NARROWING.search(reasoning)
    if not match:
        return "no narrowing" if asked else "restatement wrong, no narrowing"
    key, found, name, among = match.groups()
    found_names = [] if found == "none" else re.findall(r'"([^"]+)"', found)
    true_names = [tool.name for tool in case.offered if tool.name.startswith(key)]
    if not asked:
        return "restatement wrong"
    if key != case.requested.verb.replace(" ", "_") + "_":
        return "verb not the request's"
    if found_names != true_names:
        kind = "missed" if not found_names else "added" if not true_names else "other"
        return f"step 1 list wrong ({kind})"
    if found_names and name != case.requested.name:
        return "step 2 name wrong"
    if found_names and (among == "among") != (name in found_names):
        return "step 2 decision wrong"
    return "right" if right else "steps right, reply wrong"


def narrowing_steps(llm: LLM, num: int) -> dict[str, Any]:
    cases = held_out_cases(0, num)
    result = evaluate_tool_cases(llm, cases, "eval-unseen-tools/0", "unseen tools",
                                 EvalSettings.max_tokens, progress=False)
    steps: dict[str, Counter] = {kind: Counter() for kind in unseen_tools.KINDS}
    misses: list[dict[str, Any]] = []
    for case, reply in zip(cases, result.replies):
        step = narrowing_step(case, reply.reasoning or "", score_reply(reply, case)["right"])
        steps[case.kind][step] += 1
        if step.startswith("step") and len(misses) < 12:
            misses.append({"kind": case.kind, "step": step, "request": case.request,
                           "offered": [tool.name for tool in case.offered],
                           "reasoning": reply.reasoning})
    return {"metrics": result.metrics, "steps": {kind: dict(sorted(counts.items()))
                                                  for kind, counts in steps.items()},
            "first_misses": misses}


def lookup_skill(llm: LLM, num: int) -> dict[str, Any]:
    rng = random.Random("name-lookup-skill")
    cases = [name_lookup.sample_case(rng, HELD_OUT, name_lookup.KINDS[index % 2])
             for index in range(num)]
    outputs = llm.chat([name_lookup.exchange(case)[:1] for case in cases],
                       SamplingParams(temperature=0, max_tokens=96), use_tqdm=False)
    right: Counter = Counter()
    count: Counter = Counter()
    for case, output in zip(cases, outputs):
        cell = f"{case.kind}, {'there' if case.found else 'not there'}"
        count[cell] += 1
        right[cell] += name_lookup.answer_sentence(case) in (output.outputs[0].reasoning_content
                                                             or "")
    return {cell: {"count": count[cell], "right": right[cell] / count[cell]}
            for cell in sorted(count)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a checkpoint folder")
    parser.add_argument("--num", type=int, default=240, help="held-out unseen-tool cases")
    parser.add_argument("--lookups", type=int, default=100, help="held-out name lookups")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    llm = LLM(args.model)
    report = {"model": args.model, "lookups": lookup_skill(llm, args.lookups),
              **narrowing_steps(llm, args.num)}
    print("lookups:", {cell: f"{value['right']:.2f} of {value['count']}"
                       for cell, value in report["lookups"].items()})
    for kind, counts in report["steps"].items():
        print(f"{kind}: right {report['metrics']['by_kind'][kind]['right']:.3f};", counts)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
