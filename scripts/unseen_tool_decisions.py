"""The decision of unseen-tool replies, read teacher-forced: at the point where the reasoning
says "I should call ..." or declines ("It cannot ...", "None of them can ..."), the model's
probability of calling against declining, for cases grouped by kind, by how close an offered
tool that does not fit comes to taking an argument the request names (`argument_overlap`) and
by the number of offered tools.

    python scripts/unseen_tool_decisions.py MODEL [--num 240] [--split held_out] [--json OUT]

A decision is right when the model puts more probability on the fitting choice (calling for
`call` and `choose`, declining for `no_tool`). Reading the decision rather than generating a
reply separates it from the restatement and the arguments before and after it, and takes a
few seconds a hundred cases on a CPU. The cases are `scripts/unseen_tool_splits.py`'s (the
kinds in turn).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from muse.checkpoint.loading import load_reference_model  # noqa: E402
from muse.tokenizer import MuseTokenizer  # noqa: E402
from muse.train.data.split import HELD_OUT, TRAIN  # noqa: E402
from muse.train.data.unseen_tools import (UnseenToolCase, argument_word, exchange,  # noqa: E402
                                          offered_schemas, reasoning, verdict)
from unseen_tool_splits import split_cases  # noqa: E402


def decision_prefix(case: UnseenToolCase) -> str:
    """The reasoning up to its decision (the request restated, the offered tools listed)."""
    return reasoning(case).removesuffix(" " + verdict(case))


def _verdict_as(case: UnseenToolCase, kind: str) -> str:
    """The verdict the case's reasoning would end with were it of `kind`: for a declined
    case, the call of the tool it asks for; for a call, the decline."""
    return verdict(replace(case, kind=kind))


def argument_overlap(case: UnseenToolCase) -> str:
    """How an offered tool other than the fitting one comes closest to taking an argument the
    request names: "same name", "same word" (`max_budget` for `budget`), "prefix only"
    (`max_depth` for `max_budget`) or "none"."""
    asked = set(case.arguments)
    words = {argument_word(name) for name in asked}
    prefixes = {word for name in asked for word in name.split("_")} - words
    others = [argument.name for tool in case.offered if tool is not case.tool
              for argument in tool.arguments]
    if asked & set(others):
        return "same name"
    if words & {argument_word(name) for name in others}:
        return "same word"
    if prefixes & {word for name in others for word in name.split("_")}:
        return "prefix only"
    return "none"


def _next_token(tokenizer: MuseTokenizer, prefix_ids: list[int], text: str) -> int:
    ids = tokenizer.encode(text)
    if ids[:len(prefix_ids)] != prefix_ids:
        raise ValueError(f"the decision does not start a token after {text[-40:]!r}")
    return ids[len(prefix_ids)]


@torch.inference_mode()
def call_probability(model: torch.nn.Module, tokenizer: MuseTokenizer,
                     case: UnseenToolCase) -> float:
    """P(calling) / (P(calling) + P(declining)) at the first token of the decision."""
    prompt = tokenizer.apply_chat_template(exchange(case)[:1], tools=offered_schemas(case),
                                           add_generation_prompt=True)
    prefix = prompt + "<think>" + decision_prefix(case)
    prefix_ids = tokenizer.encode(prefix)
    calling = _next_token(tokenizer, prefix_ids, prefix + " " + _verdict_as(case, "call"))
    declining = _next_token(tokenizer, prefix_ids, prefix + " " + _verdict_as(case, "no_tool"))
    probabilities = model(torch.tensor([prefix_ids])).logits[0, -1].float().softmax(-1)
    return float(probabilities[calling] / (probabilities[calling] + probabilities[declining]))


def decisions(model: torch.nn.Module, tokenizer: MuseTokenizer,
              cases: list[UnseenToolCase]) -> dict[str, dict[str, Any]]:
    """Right decisions by kind, by argument overlap and by the number of offered tools:
    {"no_tool, same word": {"count", "right"}, "no_tool, 3 offered": ..., ...}, with "all"
    per kind."""
    groups: dict[str, list[bool]] = defaultdict(list)
    for case in cases:
        right = (call_probability(model, tokenizer, case) > 0.5) == (case.tool is not None)
        groups[f"{case.kind}, {argument_overlap(case)}"].append(right)
        groups[f"{case.kind}, {len(case.offered)} offered"].append(right)
        groups[f"{case.kind}, all"].append(right)
    return {key: {"count": len(values), "right": sum(values) / len(values)}
            for key, values in sorted(groups.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a checkpoint folder")
    parser.add_argument("--num", type=int, default=240, help="cases, the kinds in turn")
    parser.add_argument("--split", choices=(HELD_OUT, TRAIN), default=HELD_OUT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()
    tokenizer = MuseTokenizer.from_pretrained(args.model)
    model = load_reference_model(args.model).eval()
    result = decisions(model, tokenizer, split_cases(args.split, args.num, args.seed))
    for key, cell in result.items():
        print(f"{key:24s} {cell['right']:.3f} ({cell['count']})")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "split": args.split,
                                               "seed": args.seed, "decisions": result},
                                              indent=1) + "\n")


if __name__ == "__main__":
    main()
