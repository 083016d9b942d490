"""Which tokens of held-out unseen-tool names training names never write, and how well a model
writes them when they are the next token of the expected reply.

A model copies a name token by token; a token it never wrote inside a name it hardly writes
when copying one (run 8 wrote "trggle" for "trailer" = "tr" + "ailer"). This script counts,
over generated cases, the tokens of held-out names (tool names, actions, argument names) and
how often training names write each, then (given models) the teacher-forced probability of
the held-out cases' expected first assistant turn (reasoning and call), over all its tokens
and over the rare ones alone. Prints and optionally writes JSON.

    python scripts/unseen_tool_pieces.py [MODEL ...] --num 120 [--shares 0.3,0,0.3] [--json OUT]

`--shares` sets the training names' made-up, pieced and everyday-word shares for the count
(0.3,0,0.3: the names run 8 and run 9 trained on, before the pieces).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from muse import LLM, SamplingParams  # noqa: E402
from muse.eval.unseen_tools import held_out_cases  # noqa: E402
from muse.tokenizer import MuseTokenizer  # noqa: E402
from muse.train.data import unseen_tools  # noqa: E402
from muse.train.data.split import HELD_OUT, TRAIN  # noqa: E402

# A token is rare if training names write it fewer times than this in `--train-cases` cases.
RARE_BELOW = 5


def name_token_counts(tokenizer: MuseTokenizer, split: str, cases: int, seed: int
                      ) -> collections.Counter:
    """How often each token is written in the names of `cases` cases of `split`: the quoted
    tool name, the action after a space, the quoted argument names (as a reply writes them)."""
    rng = random.Random(seed)
    counts: collections.Counter = collections.Counter()
    for _ in range(cases):
        case = unseen_tools.sample_case(rng, split)
        for tool in {*case.offered, case.requested}:
            for text in (f'"{tool.name}"', f" {tool.action}",
                         *(f'"{argument.name}"' for argument in tool.arguments)):
                counts.update(tokenizer.encode(text))
    return counts


def reply_probabilities(model: str, num: int, rare: set[int]) -> dict[str, Any]:
    """Mean log-probability of the expected first assistant turn of `num` held-out cases,
    teacher-forced, over all its tokens and over the `rare` ones."""
    llm = LLM(model)
    tokenizer = llm.tokenizer
    documents, starts = [], []
    for case in held_out_cases(1, num):
        messages, tools = unseen_tools.exchange(case)[:2], unseen_tools.offered_schemas(case)
        head = tokenizer.apply_chat_template(messages[:1], tools=tools,
                                             add_generation_prompt=True, tokenize=True)
        documents.append(tokenizer.apply_chat_template(messages, tools=tools, tokenize=True))
        starts.append(len(head))
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in documents],
                           SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)
    every, rare_only = [], []
    for ids, start, output in zip(documents, starts, outputs):
        for token, entry in zip(ids[start:], output.prompt_logprobs[start:]):
            every.append(entry.logprob)
            if token in rare:
                rare_only.append(entry.logprob)
    mean = sum(every) / len(every)
    rare_mean = sum(rare_only) / len(rare_only) if rare_only else float("nan")
    return {"model": model, "reply_tokens": len(every), "reply_nll": -mean,
            "rare_tokens": len(rare_only), "rare_nll": -rare_mean,
            "rare_probability": math.exp(rare_mean)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="*", help="checkpoint folders to score")
    parser.add_argument("--num", type=int, default=120, help="held-out cases to score")
    parser.add_argument("--train-cases", type=int, default=20000)
    parser.add_argument("--shares", help="MADE_UP,PIECE,COMMON word shares of training names "
                        "(default: the data's own)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.shares:
        (unseen_tools.MADE_UP_SHARE, unseen_tools.PIECE_WORD_SHARE,
         unseen_tools.COMMON_WORD_SHARE) = (float(share) for share in args.shares.split(","))

    tokenizer = MuseTokenizer.base()
    trained = name_token_counts(tokenizer, TRAIN, args.train_cases, seed=0)
    held_out = name_token_counts(tokenizer, HELD_OUT, 2000, seed=0)
    rare = {token for token in held_out if trained[token] < RARE_BELOW}
    print(f"training names write {len(trained)} distinct tokens; held-out names {len(held_out)}"
          f", of which {len(rare)} fewer than {RARE_BELOW} times in {args.train_cases} "
          f"training cases: {sorted(tokenizer.decode([token]) for token in rare)}")
    results = {"train_cases": args.train_cases, "rare_below": RARE_BELOW,
               "shares": [unseen_tools.MADE_UP_SHARE, unseen_tools.PIECE_WORD_SHARE,
                          unseen_tools.COMMON_WORD_SHARE],
               "rare_tokens": sorted(tokenizer.decode([token]) for token in rare),
               "models": []}
    for model in args.models:
        scored = reply_probabilities(model, args.num, rare)
        results["models"].append(scored)
        print(f"{model}: expected reply NLL {scored['reply_nll']:.4f} a token "
              f"({scored['reply_tokens']} tokens); rare tokens NLL {scored['rare_nll']:.3f} "
              f"(p = {scored['rare_probability']:.3f}, {scored['rare_tokens']} tokens)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
