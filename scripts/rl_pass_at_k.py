"""How far GRPO's sharpening can take a model on an RL task: greedy accuracy, the mean reward
of K samples per held-out task at a temperature, and pass@K (the share of tasks with a fully
right sample: the greedy accuracy reached if every such task's right reply became the greedy
one). Prints and optionally writes JSON.

    python scripts/rl_pass_at_k.py [MODEL] --task sort --num 256 --k 8 [--lora ADAPTER]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from muse import LLM, SamplingParams  # noqa: E402
from muse.lora import LoRARequest  # noqa: E402
from muse.presets import SHIPPED_CHECKPOINT  # noqa: E402
from muse.rl.grpo import pass_at_k  # noqa: E402
from muse.rl.rollout import rollout  # noqa: E402
from muse.rl.tasks import load_tasks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", default=str(SHIPPED_CHECKPOINT))
    parser.add_argument("--task", default="sort", help="an RL task name (muse.rl.tasks)")
    parser.add_argument("--num", type=int, default=256, help="held-out tasks (split=test)")
    parser.add_argument("--k", type=int, default=8, help="samples per task")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--seed", type=int, default=0, help="seeds the tasks and the samples")
    parser.add_argument("--lora", default=None, help="a PEFT adapter folder")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args()

    tasks = load_tasks(args.task, args.num, seed=args.seed, split="test")
    llm = LLM(args.model, enable_lora=args.lora is not None, max_lora_rank=64)
    lora = LoRARequest("adapter", 1, args.lora) if args.lora else None
    # Rolled out and scored as the trainer does: each task's tools offered, replies read with
    # their special tokens, tool results answered.
    greedy = rollout(llm, tasks, SamplingParams(temperature=0.0, max_tokens=args.max_tokens),
                     lora_request=lora)
    sampled = rollout(llm, tasks, SamplingParams(temperature=args.temperature,
                                                 max_tokens=args.max_tokens, seed=args.seed),
                      group_size=args.k, lora_request=lora)
    rewards = [[trajectory.reward for trajectory in group] for group in sampled]
    figures = {"model": args.model, "lora": args.lora, "task": args.task, "num": args.num,
               "k": args.k, "temperature": args.temperature,
               "greedy": sum(group[0].reward for group in greedy) / len(tasks),
               **pass_at_k(rewards)}
    print(json.dumps(figures, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
