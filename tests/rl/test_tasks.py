"""RL task generators: deterministic, solvable, phrased as in SFT and split train/test."""

from __future__ import annotations

import json
import re

import pytest

from muse.rl.rewards import load_reward
from muse.rl.tasks import addition_tasks, load_tasks, sort_tasks, tool_tasks
from muse.rl.tool_env import ToolEnvironment
from muse.train.data import arithmetic
from muse.train.data.split import HELD_OUT, TRAIN, in_split


def test_tasks_are_deterministic_per_seed() -> None:
    assert addition_tasks(20, seed=3) == addition_tasks(20, seed=3)
    assert addition_tasks(20, seed=3) != addition_tasks(20, seed=4)
    assert tool_tasks(10, seed=3) == tool_tasks(10, seed=3)
    assert load_tasks("tools", 10, seed=3) == tool_tasks(10, seed=3)


def test_addition_tasks_are_asked_like_the_sft_data() -> None:
    patterns = [re.escape(template).replace(r"\{a\}", r"(\d+)").replace(r"\{b\}", r"(\d+)")
                for template in arithmetic.QUESTIONS["add"]]
    for task in addition_tasks(50, digits=3, seed=1):
        (message,) = task["messages"]
        assert message["role"] == "user"
        match = next(m for p in patterns if (m := re.fullmatch(p, message["content"])))
        a, b = map(int, match.groups())
        assert 100 <= a <= 999 and 100 <= b <= 999
        assert task["answer"] == a + b
        assert load_reward(task["reward"])(str(a + b), task) == 1.0


@pytest.mark.parametrize("make", [lambda n, seed, split: addition_tasks(n, 2, seed, split),
                                  tool_tasks,
                                  lambda n, seed, split: sort_tasks(n, 6, seed, split)])
def test_train_and_test_splits_are_disjoint(make) -> None:
    train = {task["key"] for seed in range(3) for task in make(200, seed, "train")}
    test = {task["key"] for seed in range(3) for task in make(60, seed, "test")}
    assert len(test) >= 60
    assert not train & test
    assert all(in_split(key, TRAIN) for key in train)
    assert all(in_split(key, HELD_OUT) for key in test)


def test_a_split_that_runs_out_is_a_clear_error() -> None:
    # 4 of the 100 one-digit additions are held out.
    assert len(addition_tasks(4, digits=1, split="test")) == 4
    with pytest.raises(ValueError, match="only 4 distinct test 1-digit addition tasks"):
        addition_tasks(10, digits=1, split="test")


def test_tool_tasks_need_both_calls_and_the_expected_call_answers() -> None:
    tasks = tool_tasks(40, seed=2)
    assert {task["kind"] for task in tasks} == {"price_total", "unit_conversion"}
    for task in tasks:
        key = task["messages"][0]["content"].split('"')[1]
        environment = ToolEnvironment(task["facts"])
        assert [tool["function"]["name"] for tool in task["tools"]] == \
            [tool["function"]["name"] for tool in environment.tools]
        looked_up = json.loads(environment.execute("lookup_fact", {"key": key}))["result"]
        expected = task["expected_call"]
        assert looked_up in expected["arguments"].values()
        result = json.loads(environment.execute(expected["name"], expected["arguments"]))
        assert result == {"result": task["answer"]}
        assert len(task["facts"]) == 3  # two distractors: the key must be copied right


def test_sort_tasks_have_the_asked_length_and_score_the_exact_list() -> None:
    tasks = load_tasks("sort:6", 30, seed=2)
    assert tasks == sort_tasks(30, 6, seed=2)
    for task in tasks:
        assert len(task["answer"].split(", ")) == 6
        reward = load_reward(task["reward"])
        assert reward(f"<think>First letters.</think>{task['answer']}<|end|>", task) == 1.0
        shuffled = ", ".join(reversed(task["answer"].split(", ")))
        assert reward(f"<think>First letters.</think>{shuffled}<|end|>", task) == 0.0
    # Without a length, as in training: 3 to 6 items.
    assert {len(task["answer"].split(", ")) for task in load_tasks("sort", 60)} == {3, 4, 5, 6}
    for bad in ("sort:1", "sort:x", "sort:51"):
        with pytest.raises(ValueError, match="list length"):
            load_tasks(bad, 2)


def test_unknown_names_and_splits_are_errors() -> None:
    with pytest.raises(ValueError, match="unknown task set 'gsm8k'"):
        load_tasks("gsm8k", 3)
    with pytest.raises(ValueError, match="split must be one of"):
        addition_tasks(3, split="held_out")
