"""Unseen-tool cases scored on the training split beside the held-out one: a kind a model
misses on both is not learned (more of it, or other data), one it misses on held-out cases
alone does not generalize (other words, other phrasings).

    python scripts/unseen_tool_splits.py MODEL [MODEL ...] [--num 60] [--splits train,held_out]
                                         [--json OUT]

`--num` cases of each split, the kinds (call, choose, no_tool) in turn, asked and scored as
`muse eval --sections unseen_tools` asks and scores its own (greedy, the same measures).
Ninety cases tell two models apart by about 0.15 (30 a kind); a comparison of probes wants
several hundred held-out cases (`--splits held_out --num 300`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from muse import LLM  # noqa: E402
from muse.eval.options import EvalSettings  # noqa: E402
from muse.eval.unseen_tools import cases_in_turn, evaluate_tool_cases  # noqa: E402
from muse.train.data.split import HELD_OUT, TRAIN  # noqa: E402
from muse.train.data.unseen_tools import UnseenToolCase  # noqa: E402


def split_cases(split: str, num: int, seed: int = 0) -> list[UnseenToolCase]:
    """`num` cases of `split`, the kinds in turn (as `muse eval` draws its held-out ones)."""
    return cases_in_turn(random.Random(f"unseen-tool-splits/{split}/{seed}"), split, num)


def score_model(model: str, num: int, splits: tuple[str, ...] = (TRAIN, HELD_OUT)
                ) -> dict[str, Any]:
    """The section's metrics (overall and by kind) on each split."""
    llm = LLM(model)
    scored: dict[str, Any] = {"model": model}
    for split in splits:
        result = evaluate_tool_cases(llm, split_cases(split, num), f"splits/{split}",
                                     f"unseen tools ({split})", EvalSettings.max_tokens,
                                     progress=False)
        scored[split] = result.metrics
    return scored


def _splits(text: str) -> tuple[str, ...]:
    splits = tuple(part.strip() for part in text.split(","))
    unknown = [split for split in splits if split not in (TRAIN, HELD_OUT)]
    if unknown:
        raise argparse.ArgumentTypeError(f"splits are {TRAIN} and {HELD_OUT}, got {text!r}")
    return splits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("models", nargs="+", help="checkpoint folders")
    parser.add_argument("--num", type=int, default=60, help="cases of each split")
    parser.add_argument("--splits", type=_splits, default=(TRAIN, HELD_OUT),
                        help="comma-separated, of train and held_out (default: both)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = []
    for model in args.models:
        scored = score_model(model, args.num, args.splits)
        results.append(scored)
        for split in args.splits:
            metrics = scored[split]
            kinds = ", ".join(f"{kind} {cell['right']:.2f}"
                              for kind, cell in metrics["by_kind"].items())
            print(f"{model} {split}: valid {metrics['valid']:.3f} right {metrics['right']:.3f}"
                  f" ({kinds})")
    if args.json:
        args.json.write_text(json.dumps({"num": args.num, "models": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
