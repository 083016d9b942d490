"""How often does the FP8 KV cache change the shipped model's greedy replies? Free-running
greedy replies with `--kv-cache-dtype fp8` (scales 1.0, and `--calculate-kv-scales`) against
the BF16 KV cache's, and, as the noise floor of any change of rounding, the same model run in
float32 against bf16.

Prompt sets:

* `heldout`: every assistant turn of the 24 held-out conversations of
  `benchmarks/data/quant_heldout.jsonl` (the task families the model was trained on:
  arithmetic, tool calls, instructions), the conversation up to that turn as the prompt;
* `calibration`: the 40 varied lines of `muse/assets/calibration_prompts.txt` (arithmetic,
  code, tool requests, prose, other languages: many outside what the model was taught), each
  a user message;
* `fp8-test`: the ten chat prompts of `tests/engine/test_fp8_kv_cache.py`;
* `eval`: every prompt `muse eval` asks in its arithmetic, tool-call and instruction sections
  (`--eval-num` held-out problems per category, each reply capped as `muse eval` caps it),
  with each configuration's `muse eval` scores beside its agreement.

Agreement: over each pair of replies, the positions where both have the same token, divided
by the longer reply's length (a reply that parts from the other counts every later position
as a miss, also where the two happen to realign). "identical" counts whole replies.

    python benchmarks/kv_fp8_agreement.py --out kv-fp8-agreement.json   # CPU: ~10 minutes
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.options import parse_list, resolve_device  # noqa: E402
from benchmarks.report import environment, table, write_json  # noqa: E402
from muse import LLM, SamplingParams  # noqa: E402
from muse.eval.options import EvalSettings  # noqa: E402
from muse.eval.run import metric, score  # noqa: E402
from muse.presets import SHIPPED_CHECKPOINT  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ASSISTANT = "<|assistant|>"
FP8_TEST_PROMPTS = [
    "What is 23 + 58?", "What is 91 - 47?", "What is 37+45?", "What is 14 + 69?",
    "What is 80 - 26?", "Write one sentence about rivers.", "Sort these numbers: 5, 2, 9, 1.",
    "Reverse the list: a, b, c, d.", "Name three colors.", "What is the capital of France?"]
# (name, engine arguments); the first is the reference the others are compared with.
CONFIGS = [("bf16", {"dtype": "bfloat16"}),
           ("fp8", {"dtype": "bfloat16", "kv_cache_dtype": "fp8"}),
           ("fp8-calculated", {"dtype": "bfloat16", "kv_cache_dtype": "fp8",
                               "calculate_kv_scales": True}),
           ("float32", {"dtype": "float32"})]


def heldout_prompts() -> list[dict]:
    """Each assistant turn of the held-out conversations, as a text prompt ending at it."""
    prompts = []
    for line in (ROOT / "benchmarks/data/quant_heldout.jsonl").read_text().splitlines():
        text = json.loads(line)["text"]
        start = text.find(ASSISTANT)
        while start >= 0:
            prompts.append({"prompt": text[:start + len(ASSISTANT)]})
            start = text.find(ASSISTANT, start + 1)
    return prompts


def chats(lines: list[str]) -> list[list[dict]]:
    return [[{"role": "user", "content": line}] for line in lines]


def prompt_sets() -> dict[str, tuple[str, list]]:
    calibration = [line.strip() for line in
                   (ROOT / "muse/assets/calibration_prompts.txt").read_text().splitlines()
                   if line.strip()]
    return {"heldout": ("generate", heldout_prompts()),
            "calibration": ("chat", chats(calibration)),
            "fp8-test": ("chat", chats(FP8_TEST_PROMPTS))}


SETS = ("heldout", "calibration", "fp8-test", "eval")
EVAL_SECTIONS = ("arithmetic", "tools", "instructions")
# The `muse eval` scores shown beside the agreement (instructions: over all kinds).
EVAL_SCORES = ("arithmetic.overall.exact", "tools.valid", "tools.correct", "instructions")


class RecordingLLM:
    """An `LLM` that keeps the token ids of every reply it generates, in order, so that the
    replies `muse eval` asks for can be compared between configurations."""

    def __init__(self, llm: LLM) -> None:
        self._llm = llm
        self.replies: list[list[int]] = []

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        outputs = self._llm.generate(*args, **kwargs)
        self.replies.extend(list(o.outputs[0].token_ids) for o in outputs)
        return outputs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)


def eval_replies(llm: LLM, num: int) -> tuple[list[list[int]], dict[str, float | None]]:
    """The replies to `muse eval`'s text sections and the scores they earn."""
    recorder = RecordingLLM(llm)
    report = score(recorder, EvalSettings(num=num, sections=EVAL_SECTIONS), progress=False)
    kinds = report["instructions"].values()
    scores = {path: metric(report, path) for path in EVAL_SCORES[:-1]}
    scores["instructions"] = (sum(kind["exact"] * kind["count"] for kind in kinds)
                              / sum(kind["count"] for kind in kinds))
    return recorder.replies, scores


def agreement(want: list[list[int]], got: list[list[int]]) -> dict[str, Any]:
    same = sum(a == b for w, g in zip(want, got) for a, b in zip(w, g))
    total = sum(max(len(w), len(g)) for w, g in zip(want, got))
    return {"same_tokens": same, "tokens": total, "agreement": same / total,
            "identical_replies": sum(w == g for w, g in zip(want, got)), "replies": len(want)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(SHIPPED_CHECKPOINT))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sets", default=",".join(SETS), type=lambda text: parse_list(text, str),
                        help=f"comma separated, of {', '.join(SETS)}")
    parser.add_argument("--eval-num", type=int, default=20,
                        help="`muse eval` problems per category of the eval set")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    if unknown := set(args.sets) - set(SETS):
        parser.error(f"--sets: unknown {sorted(unknown)}; choose among {', '.join(SETS)}")
    device = resolve_device(args.device)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    sets = {name: prompts for name, prompts in prompt_sets().items() if name in args.sets}
    replies: dict[str, dict[str, list[list[int]]]] = {}
    scores: dict[str, dict[str, float | None]] = {}
    for name, engine_args in CONFIGS:
        llm = LLM(args.model, device=str(device), kv_cache_memory_bytes=64 * 2**20,
                  **engine_args)
        replies[name] = {}
        for set_name, (method, prompts) in sets.items():
            run = llm.chat if method == "chat" else llm.generate
            outputs = run(prompts, params, use_tqdm=False)
            replies[name][set_name] = [list(o.outputs[0].token_ids) for o in outputs]
        if "eval" in args.sets:
            replies[name]["eval"], scores[name] = eval_replies(llm, args.eval_num)
        llm.shutdown()
        del llm
    reference = CONFIGS[0][0]
    results = {set_name: {name: agreement(replies[reference][set_name], replies[name][set_name])
                          for name, _ in CONFIGS[1:]} for set_name in replies[reference]}
    record = {"environment": environment(device), "model": args.model,
              "max_tokens": args.max_tokens, "eval_num": args.eval_num, "reference": reference,
              "results": results, "eval_scores": scores}
    write_json(args.out, record)
    rows = [[set_name, name, f"{r['agreement']:.3f}", f"{r['same_tokens']}/{r['tokens']}",
             f"{r['identical_replies']}/{r['replies']}"]
            for set_name, by_name in results.items() for name, r in by_name.items()]
    print(table(["prompts", f"against {reference}", "agreement", "tokens", "identical"], rows))
    if scores:
        print(table(["muse eval", *EVAL_SCORES],
                    [[name, *(f"{value:.3f}" if value is not None else "-"
                              for value in by_path.values())]
                     for name, by_path in scores.items()]))
    return record


if __name__ == "__main__":
    main()
