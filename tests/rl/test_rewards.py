"""Rewards on replies in the shipped model's format, the tool environment and reward loading."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest

from muse.chat_format import ASSISTANT_TOKEN, BOS_TOKEN
from muse.rl.rewards import (arithmetic_reward, exact_answer_reward, list_positions_reward,
                              load_reward, tool_call_reward)
from muse.rl.tasks import tool_tasks
from muse.rl.tool_env import ToolEnvironment, reply_tool_calls
from muse.rl.unseen_tool_tasks import unseen_tool_reward, unseen_tool_tasks
from muse.tokenizer import MuseTokenizer


@pytest.fixture(scope="module")
def tokenizer() -> MuseTokenizer:
    return MuseTokenizer.base()


def rendered_reply(tokenizer: MuseTokenizer, reasoning: str | None, content: str,
                   calls: Sequence[tuple[str, dict[str, Any]]] = ()) -> str:
    """An assistant turn exactly as the chat template writes it (what SFT taught the model to
    emit), from `<think>` to `<|end|>`."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": name,
                                                                   "arguments": arguments}}
                                 for name, arguments in calls]
    text = tokenizer.apply_chat_template([message])
    return text.removeprefix(BOS_TOKEN + ASSISTANT_TOKEN).rstrip("\n")


ADDITION = {"answer": 579}


@pytest.mark.parametrize("reply, reward", [
    ("<think>3+6=9, write 9. 2+5=7, write 7. 1+4=5, write 5. So 579.</think>579<|end|>", 1.0),
    ("579", 1.0),
    ("The answer is 579.", 1.0),
    ("<think>So 578.</think>The sum is 579", 1.0),
    ("<think>So 579.</think>578<|end|>", 0.0),
    ("<think>3+6=9, write 9. So 579.", 0.0),  # cut off inside its reasoning
    ("<think>So 579.</think><|end|>", 0.0),
    ("five hundred seventy-nine", 0.0),
    ("579.5", 0.0),
    ("579.0", 1.0),
    ("", 0.0),
])
def test_arithmetic_reward(reply: str, reward: float) -> None:
    assert arithmetic_reward(reply, ADDITION) == reward


def test_arithmetic_reward_reads_separators_and_signs() -> None:
    assert arithmetic_reward("<think></think>1,234", {"answer": 1234}) == 1.0
    assert arithmetic_reward("It is 12,345,678.", {"answer": "12345678"}) == 1.0
    assert arithmetic_reward("<think>So -42.</think>-42", {"answer": -42}) == 1.0
    assert arithmetic_reward("42", {"answer": -42}) == 0.0


def test_arithmetic_reward_of_the_template_rendered_answer(tokenizer: MuseTokenizer) -> None:
    reply = rendered_reply(tokenizer, "7+5=12, write 2 carry 1. 3+4+1=8, write 8. So 82.", "82")
    assert reply.startswith("<think>") and reply.endswith("<|end|>")
    assert arithmetic_reward(reply, {"answer": 82}) == 1.0
    assert arithmetic_reward(reply, {"answer": 12}) == 0.0


@pytest.mark.parametrize("reply, reward", [
    ("<think>First letters: c, a, b.</think>apple, bread, cloud<|end|>", 1.0),
    ("apple, bread, cloud", 1.0),
    ("<think>First letters.</think> apple, bread, cloud \n<|end|>", 1.0),
    ("<think>First letters.</think>apple, bread, cloud.<|end|>", 0.0),
    ("<think>First letters.</think>apple, cloud, bread<|end|>", 0.0),
    ("<think>First letters.</think>apple, bread<|end|>", 0.0),
    ("<think>apple, bread, cloud", 0.0),  # cut off inside its reasoning
    ("<think>apple, bread, cloud</think><|end|>", 0.0),
    ("", 0.0),
])
def test_exact_answer_reward(reply: str, reward: float) -> None:
    assert exact_answer_reward(reply, {"answer": "apple, bread, cloud"}) == reward
    assert load_reward("exact_answer") is exact_answer_reward


@pytest.mark.parametrize("reply, reward", [
    ("<think>First letters.</think>apple, bread, cloud, delta<|end|>", 1.0),
    ("<think>First letters.</think>apple, cloud, bread, delta<|end|>", 0.5),  # a swap
    ("<think>First letters.</think>apple, bread, bread, delta<|end|>", 0.75),  # a duplicate
    ("<think>First letters.</think>apple, cloud, delta<|end|>", 0.25),  # one left out
    ("<think>First letters.</think>apple, bread, cloud, delta, delta<|end|>", 0.8),
    ("<think>apple, bread, cloud, delta", 0.0),  # cut off inside its reasoning
    ("<think>First letters.</think><|end|>", 0.0),
])
def test_list_positions_reward(reply: str, reward: float) -> None:
    task = {"answer": "apple, bread, cloud, delta"}
    assert list_positions_reward(reply, task) == pytest.approx(reward)
    assert (list_positions_reward(reply, task) == 1.0) == (exact_answer_reward(reply, task) == 1.0)


@pytest.fixture(scope="module")
def price_task() -> dict[str, Any]:
    return next(task for task in tool_tasks(4, seed=5) if task["kind"] == "price_total")


def _rollout(tokenizer: MuseTokenizer, task: dict[str, Any], key: str | None = None,
             factor: int | None = None) -> list[str]:
    """The assistant turns of a two-call rollout of a price task, run against the task's
    environment as a trainer would (the second call uses the first call's result)."""
    environment = ToolEnvironment(task["facts"])
    if key is None:  # the request quotes the key to look up
        key = task["messages"][0]["content"].split('"')[1]
    first = rendered_reply(tokenizer, "I should call lookup_fact.", "",
                           [("lookup_fact", {"key": key})])
    (result,) = environment.respond(first, task["tools"])
    price = json.loads(result["content"]).get("result", 0)
    quantity = task["expected_call"]["arguments"]["b"]
    second = rendered_reply(tokenizer, "Now multiply.", "",
                            [("multiply_numbers", {"a": price, "b": factor or quantity})])
    environment.respond(second, task["tools"])
    final = rendered_reply(tokenizer, "The tool answered.", "They cost 42 in total.")
    return [first, second, final]


def test_tool_call_reward_of_a_correct_rollout(tokenizer: MuseTokenizer,
                                               price_task: dict[str, Any]) -> None:
    turns = _rollout(tokenizer, price_task)
    assert tool_call_reward("".join(turns), price_task) == 1.0
    # The turn that makes the last call alone scores the same: the tools are deterministic.
    assert tool_call_reward(turns[1], price_task) == 1.0


def test_tool_call_reward_of_wrong_rollouts(tokenizer: MuseTokenizer,
                                            price_task: dict[str, Any]) -> None:
    # A key the facts do not hold: the lookup fails, so the rollout fails.
    assert tool_call_reward("".join(_rollout(tokenizer, price_task, key="price of gold")),
                            price_task) == 0.0
    # Multiplying by the wrong quantity.
    assert tool_call_reward("".join(_rollout(tokenizer, price_task, factor=1000)),
                            price_task) == 0.0
    # Stopping after the lookup: the last call is not the expected one.
    assert tool_call_reward(_rollout(tokenizer, price_task)[0], price_task) == 0.0
    # Answering without any call.
    answer = price_task["answer"]
    assert tool_call_reward(f"<think>I know it.</think>{answer}<|end|>", price_task) == 0.0


def test_tool_call_reward_of_malformed_calls(price_task: dict[str, Any]) -> None:
    arguments = json.dumps(price_task["expected_call"]["arguments"])
    good = f'<tool_call>{{"name": "multiply_numbers", "arguments": {arguments}}}</tool_call>'
    assert tool_call_reward(f"<think>x</think>{good}<|end|>", price_task) == 1.0
    assert tool_call_reward(good, price_task) == 1.0  # no reasoning block
    for reply in [
        f'<think>x</think><tool_call>{{"name": "multiply_numbers", "arguments": {arguments}'
        "</tool_call>",  # unbalanced JSON
        f'<tool_call>{{"name": "multiply_numbers", "arguments": "{arguments}"}}</tool_call>',
        f'<tool_call>{{"name": "power", "arguments": {arguments}}}</tool_call>',  # not offered
        f"<think>{good}</think>",  # a call only thought about is not made
        f"<think>I will call it. {good}",  # cut off inside its reasoning
        good + "<tool_call>{}</tool_call>",  # one good call and one broken block
        '<tool_call>{"name": "multiply_numbers", "arguments": {"a": 1}}</tool_call>',
    ]:
        assert tool_call_reward(reply, price_task) == 0.0, reply


def test_tool_environment_runs_calls_and_reports_errors() -> None:
    environment = ToolEnvironment({"price of a lamp": 12})
    assert json.loads(environment.execute("lookup_fact", {"key": "price of a lamp"})) == \
        {"result": 12}
    assert json.loads(environment.execute("multiply_numbers", {"a": 12, "b": 3})) == {"result": 36}
    assert json.loads(environment.execute("convert_units", {
        "value": 1.5, "from_unit": "hours", "to_unit": "minutes"})) == {"result": 90}
    assert json.loads(environment.execute("convert_units", {
        "value": 5, "from_unit": "cm", "to_unit": "m"})) == {"result": 0.05}
    assert not environment.failed
    failures = [
        ("send_email", {"to": "a@b.c"}, "unknown tool 'send_email'"),
        ("lookup_fact", {"key": "price of a mug"}, "no fact with key 'price of a mug'"),
        ("multiply_numbers", {"a": 2}, "misses required `b`"),
        ("multiply_numbers", {"a": "2", "b": 3}, "arguments.a must be of type number"),
        ("multiply_numbers", {"a": True, "b": 3}, "arguments.a must be of type number"),
        ("multiply_numbers", {"a": 2, "b": 3, "c": 4}, "unknown property `c`"),
        ("multiply_numbers", [2, 3], "arguments must be of type object"),
        ("multiply_numbers", {"a": 1e308, "b": 10.0}, "ValueError"),  # inf is not JSON
        ("convert_units", {"value": 1, "from_unit": "kg", "to_unit": "m"},
         "cannot convert kg (mass) to m (length)"),
        ("convert_units", {"value": 1, "from_unit": "lb", "to_unit": "kg"}, "must be one of"),
    ]
    for name, arguments, message in failures:
        fresh = ToolEnvironment({"price of a lamp": 12})
        text = fresh.execute(name, arguments)
        assert message in json.loads(text)["error"], text
        assert fresh.failed and not fresh.history[-1].ok


def test_tool_environment_answers_replies_with_tool_messages(tokenizer: MuseTokenizer) -> None:
    environment = ToolEnvironment({"k": 7})
    reply = rendered_reply(tokenizer, "Two calls.", "",
                           [("lookup_fact", {"key": "k"}), ("add_numbers", {"a": 1, "b": 2})])
    assert [(call.name, json.loads(call.arguments)) for call in reply_tool_calls(reply)] == \
        [("lookup_fact", {"key": "k"}), ("add_numbers", {"a": 1, "b": 2})]
    assert environment.respond(reply, environment.tools) == [
        {"role": "tool", "content": '{"result": 7}'}, {"role": "tool", "content": '{"result": 3}'}]
    assert environment.respond("<think>none</think>Hello.") == []
    broken = environment.respond("<tool_call>{not json</tool_call>")
    assert len(broken) == 1 and "error" in json.loads(broken[0]["content"])
    assert environment.failed


def test_load_reward() -> None:
    assert load_reward("arithmetic") is arithmetic_reward
    assert load_reward("tool_call") is tool_call_reward
    assert load_reward("muse.rl.rewards:arithmetic_reward") is arithmetic_reward
    with pytest.raises(ValueError, match="'no_such_package.rewards:score'.*cannot import"):
        load_reward("no_such_package.rewards:score")
    with pytest.raises(ValueError, match="'muse.rl.rewards:missing'.*no callable 'missing'"):
        load_reward("muse.rl.rewards:missing")
    with pytest.raises(ValueError, match="'exact_match' is neither a built-in reward"):
        load_reward("exact_match")


def test_unseen_tool_reward_pays_the_right_call_and_only_a_finished_decline(
        tokenizer: MuseTokenizer) -> None:
    """A no_tool task pays a reply that ends its turn without a call; one cut off by its token
    budget (no `<|end|>`) declined nothing, or a policy learns to ramble when unsure."""
    tasks = unseen_tool_tasks(6, seed=2)
    call_task = next(task for task in tasks if task["case"].tool is not None)
    decline_task = next(task for task in tasks if task["case"].tool is None)
    case = call_task["case"]
    right = rendered_reply(tokenizer, "x", "", [(case.tool.name, case.arguments)])
    assert unseen_tool_reward(right, call_task) == 1.0
    wrong = {name: "made up" for name in case.arguments}
    assert unseen_tool_reward(rendered_reply(tokenizer, "x", "", [(case.tool.name, wrong)]),
                              call_task) == 0.0
    declined = rendered_reply(tokenizer, "None of them can.", "I can't do that.")
    assert declined.endswith("<|end|>")
    assert unseen_tool_reward(declined, decline_task) == 1.0
    assert unseen_tool_reward(declined.removesuffix("<|end|>"), decline_task) == 0.0
    assert unseen_tool_reward("<think>The user asks to", decline_task) == 0.0
    offered = decline_task["case"].offered[0]
    called = rendered_reply(tokenizer, "x", "", [(offered.name, {})])
    assert unseen_tool_reward(called, decline_task) == 0.0
