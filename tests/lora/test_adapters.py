"""The engine's adapters: prefix-cache entries keyed by adapter and version, slots shared by
more adapters than fit (evicting idle ones), an in-memory hand-over equal to a folder, and
clear refusals of adapters it cannot serve."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from muse import LLM, SamplingParams  # noqa: E402
from muse.engine.errors import InvalidRequestError  # noqa: E402
from muse.lora import LoRARequest  # noqa: E402
from tests.lora.helpers import TINY, muse_adapter  # noqa: E402

PROMPT = list(range(100, 140))  # 40 tokens: two full blocks of 16 can be cached
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: muse_adapter(root / name, seed) for seed, name in enumerate(("a", "b"), 1)}


def engine(**args) -> LLM:
    return LLM(TINY, device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8,
               block_size=16, **args)


def run(llm: LLM, lora_request: LoRARequest | None = None):
    return llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False,
                        lora_request=lora_request)[0]


def test_prefix_cache_entries_belong_to_one_adapter_version(adapters) -> None:
    llm = engine(max_loras=2)
    a1 = LoRARequest("a", 1, str(adapters["a"]))
    assert run(llm).num_cached_tokens == 0
    assert run(llm).num_cached_tokens == 32
    first = run(llm, a1)
    assert first.num_cached_tokens == 0  # the base model's blocks are not the adapter's
    again = run(llm, a1)
    assert again.num_cached_tokens == 32 and again.lora_version == 1
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    # New weights under the same name: the next version, which reuses none of the old blocks.
    replaced = run(llm, LoRARequest("a", 2, str(adapters["b"])))
    assert replaced.num_cached_tokens == 0 and replaced.lora_version == 2
    assert replaced.outputs[0].token_ids == run(engine(max_loras=1), LoRARequest(
        "b", 1, str(adapters["b"]))).outputs[0].token_ids


def test_more_adapters_than_slots_take_turns(adapters) -> None:
    alone = {name: run(engine(max_loras=1), LoRARequest(name, 1, str(path))).outputs[0].token_ids
             for name, path in adapters.items()}
    assert alone["a"] != alone["b"]
    llm = engine(max_loras=1)
    requests = {name: LoRARequest(name, 1, str(path)) for name, path in adapters.items()}
    for name in ("a", "b", "a", "b"):
        assert run(llm, requests[name]).outputs[0].token_ids == alone[name]
    # In one batch the second adapter finds the only slot taken by a running request.
    with pytest.raises(InvalidRequestError, match="--max-loras"):
        llm.generate([{"prompt_token_ids": PROMPT}] * 2, GREEDY, use_tqdm=False,
                     lora_request=[requests["a"], requests["b"]])


def test_an_in_memory_hand_over_equals_the_folder(adapters) -> None:
    folder = adapters["a"]
    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    llm = engine(max_loras=2)
    from_folder = run(llm, LoRARequest("disk", 1, str(folder))).outputs[0].token_ids
    in_memory = run(llm, LoRARequest("memory", 1, config=config, tensors=tensors))
    assert in_memory.outputs[0].token_ids == from_folder
    assert llm.list_loras() == ["disk", "memory"]


def test_adapters_the_engine_cannot_serve_are_refused(adapters, tmp_path) -> None:
    llm = engine(max_loras=1)
    with pytest.raises(InvalidRequestError, match="adapter_config.json"):
        run(llm, LoRARequest("missing", 1, str(tmp_path / "nothing")))
    big = muse_adapter(tmp_path / "big", 3, rank=16)
    with pytest.raises(InvalidRequestError, match="max-lora-rank"):
        run(llm, LoRARequest("big", 1, str(big)))
    dora = muse_adapter(tmp_path / "dora", 4, use_dora=True, target_parameters=None)
    with pytest.raises(InvalidRequestError, match="DoRA"):
        run(llm, LoRARequest("dora", 1, str(dora)))
    head = muse_adapter(tmp_path / "head", 5, target_modules=["lm_head"],
                        target_parameters=None)
    with pytest.raises(InvalidRequestError, match="lm_head"):
        run(llm, LoRARequest("head", 1, str(head)))
    # The engine still serves the base model and good adapters.
    assert run(llm).outputs[0].finish_reason == "length"
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        LLM(TINY, device="cpu").generate([PROMPT], GREEDY, use_tqdm=False,
                                         lora_request=LoRARequest("a", 1, str(adapters["a"])))


def test_peft_zero_initialised_adapter_is_the_base_model(tmp_path) -> None:
    """PEFT's default initialisation (B = 0): the adapted model is the base model."""
    zero = muse_adapter(tmp_path / "zero", 6, scale=0.0)
    for tensor in load_file(str(zero / "adapter_model.safetensors")).values():
        assert not torch.any(tensor)
    llm = engine(max_loras=1)
    assert run(llm, LoRARequest("zero", 1, str(zero))).outputs[0].token_ids \
        == run(llm).outputs[0].token_ids
