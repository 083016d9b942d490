"""The tasks a GRPO run rolls out: a built-in generator's train split, or a JSONL file cycled
in a seeded order; and the held-out tasks it is evaluated on."""

from __future__ import annotations

import json
import random
from typing import Any


from muse.rl.rewards import load_reward
from muse.rl.tasks import load_tasks
from muse.rl.trainer_options import GRPOTrainArgs


def _read_tasks_file(path: str) -> list[dict[str, Any]]:
    tasks = []
    with open(path) as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON ({error})") from None
            if not isinstance(task, dict) or not isinstance(task.get("messages"), list):
                raise ValueError(f"{path}:{number}: a task is a JSON object with \"messages\" "
                                 f"(a list of chat messages)")
            tasks.append(task)
    if not tasks:
        raise ValueError(f"{path}: no tasks")
    return tasks


class TaskStream:
    """The training tasks of each step and round, the same in every process for a seed, and
    the held-out tasks of the evaluations."""

    def __init__(self, args: GRPOTrainArgs) -> None:
        self.args = args
        self.file_tasks = _read_tasks_file(args.tasks_file) if args.tasks_file else None
        self.order: list[int] = []
        self.epoch = 0
        if args.reward is not None:
            load_reward(args.reward)  # a bad spec fails now, not after the first rollout

    def _with_reward(self, tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.args.reward is not None:
            return [{**task, "reward": self.args.reward} for task in tasks]
        unscored = [index for index, task in enumerate(tasks) if not task.get("reward")]
        if unscored:
            raise ValueError(f"task {unscored[0]} has no \"reward\": give --reward")
        return tasks

    def draw(self, n: int, step: int, round_index: int) -> list[dict[str, Any]]:
        if self.file_tasks is None:
            seed = (self.args.seed * 1_000_003 + step) * 101 + round_index
            return self._with_reward(load_tasks(self.args.task, n, seed=seed, split="train"))
        drawn = []
        while len(drawn) < n:
            if not self.order:
                self.order = list(range(len(self.file_tasks)))
                random.Random(f"grpo-tasks/{self.args.seed}/{self.epoch}").shuffle(self.order)
                self.epoch += 1
            drawn.append(self.file_tasks[self.order.pop(0)])
        return self._with_reward(drawn)

    def held_out(self) -> list[dict[str, Any]] | None:
        if self.file_tasks is not None:
            if self.args.eval_tasks_file is None:
                return None
            return self._with_reward(_read_tasks_file(self.args.eval_tasks_file)
                                     [:self.args.eval_tasks])
        return self._with_reward(load_tasks(self.args.task, self.args.eval_tasks,
                                            seed=self.args.seed, split="test"))
