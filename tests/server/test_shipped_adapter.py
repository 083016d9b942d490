"""The GRPO adapter shipped beside the default model (`checkpoints/muse-spark-default-sort-lora`,
docs/training.md "GRPO on sorting") is served with `--lora-modules`: `model` selects it, its
greedy replies are the offline engine's with the same adapter, and it changes the base's
replies on held-out sorting requests."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from muse import LLM, SamplingParams
from muse.lora import LoRARequest
from muse.presets import SHIPPED_CHECKPOINT
from muse.rl.rewards import exact_answer_reward
from muse.rl.tasks import load_tasks
from tests.live_server import LiveServer, start_server, stop_server

ADAPTER = SHIPPED_CHECKPOINT.parent / "muse-spark-default-sort-lora"
NAME = "sort"
BASE = "muse-spark-default"
TASKS = load_tasks("sort", 24, seed=3, split="test")
GREEDY = SamplingParams(temperature=0.0, max_tokens=120)


@pytest.fixture(scope="module")
def offline() -> dict[str | None, list[str]]:
    """Greedy answers of the base and the adapter, in this process."""
    llm = LLM(str(SHIPPED_CHECKPOINT), device="cpu", enable_lora=True, max_lora_rank=32,
              kv_cache_memory_bytes=64 * 2**20)
    conversations = [task["messages"] for task in TASKS]
    replies = {None: llm.chat(conversations, GREEDY, use_tqdm=False),
               NAME: llm.chat(conversations, GREEDY, use_tqdm=False,
                              lora_request=LoRARequest(NAME, 1, str(ADAPTER)))}
    return {name: [out.outputs[0].text for out in outs] for name, outs in replies.items()}


@pytest.fixture(scope="module")
def served(server_logs: Path) -> Iterator[LiveServer]:
    live = start_server(server_logs, "--device", "cpu", "--max-model-len", "1024",
                        "--reasoning-parser", "muse", "--enable-lora", "--max-lora-rank", "32",
                        "--lora-modules", f"{NAME}={ADAPTER}", model=str(SHIPPED_CHECKPOINT))
    yield live
    stop_server(live)


def test_the_adapter_is_in_the_peft_layout_and_adapts_the_dense_layers() -> None:
    config = json.loads((ADAPTER / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 32 and config["lora_alpha"] == 64
    assert {"q_proj", "o_proj", "pooler", "unpooler"} <= set(config["target_modules"])
    assert (ADAPTER / "adapter_model.safetensors").is_file()


def test_the_served_adapter_answers_as_the_offline_engine(served, offline) -> None:
    with served.client() as client:
        assert {m.id for m in client.models.list().data} == {BASE, NAME}
        answers = [client.chat.completions.create(model=NAME, messages=task["messages"],
                                                  temperature=0, max_tokens=120
                                                  ).choices[0].message.content
                   for task in TASKS[:6]]
    assert answers == offline[NAME][:6]


def test_the_adapter_changes_the_base_replies(offline) -> None:
    assert offline[NAME] != offline[None]
    for name in (None, NAME):  # both stay a sorting policy: most answers are right
        right = sum(exact_answer_reward(text, task) for text, task in zip(offline[name], TASKS))
        assert right >= len(TASKS) // 2, name
