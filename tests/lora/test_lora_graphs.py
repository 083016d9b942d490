"""Decode CUDA graphs with LoRA adapters: each request's adapter slot is a static row of the
graph's inputs (-1 for the base model and for padding), so the bucket-padded inputs, run as a
replay would, give each request the hidden states of the eager step. Adapters of routed
experts keep their steps eager (their path asks the host for expert counts)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")

from muse import LLM, SamplingParams  # noqa: E402
from muse.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from muse.lora import LoRARequest  # noqa: E402
from tests.engine.helpers import mixed_prompts  # noqa: E402
from tests.engine.test_cuda_graphs import eager_step  # noqa: E402
from tests.lora.helpers import TINY, muse_adapter  # noqa: E402


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("graph_adapters")
    return {"a": str(muse_adapter(root / "a", 1, scale=0.1, target_parameters=None)),
            "b": str(muse_adapter(root / "b", 2, scale=0.1, target_parameters=None)),
            "experts": str(muse_adapter(root / "experts", 3))}


def test_padded_graph_inputs_with_adapters_give_the_eager_hidden_states(adapters) -> None:
    llm = LLM(TINY, init_std=0.1, dtype="float32", device="cpu", enforce_eager=True,
              max_num_seqs=8, enable_lora=True, max_loras=3, max_lora_rank=8)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    choices = [LoRARequest("a", 1, adapters["a"]), None, LoRARequest("b", 2, adapters["b"])]
    for index, (prompt, lora) in enumerate(zip(mixed_prompts(8192, 16, count=3), choices)):
        engine.add_request(f"r{index}", prompt, params, lora_request=lora)
    for _ in range(4):
        engine.step()
    assert not engine.model.lora_context.experts_adapted
    scheduled = engine.scheduler.schedule().scheduled
    assert [item.num_new_tokens for item in scheduled] == [1, 1, 1]
    runner, kv_caches, batch, eager = eager_step(engine, scheduled)
    assert sorted(batch.lora_slots) == [-1, 0, 1]

    widths = {kind: 40 for kind in engine.kv_cache.pools}
    graphs = DecodeGraphs(engine.model, kv_caches, widths, 8, runner.block_size, engine.device)
    size = graphs.prepare(batch)
    assert size == 4 and graphs.lora_slots[:4].tolist() == batch.lora_slots + [-1]
    with torch.inference_mode():
        padded = engine.model(*graphs._inputs(size), kv_caches)
    torch.testing.assert_close(padded[:3], eager, atol=1e-5, rtol=1e-5)
    # The adapters change the hidden states (so the comparison can fail): the base model's
    # slots for every request give other rows for the adapted ones.
    graphs.lora_slots.fill_(-1)
    with torch.inference_mode():
        base = engine.model(*graphs._inputs(size), kv_caches)
    adapted = [i for i, slot in enumerate(batch.lora_slots) if slot >= 0]
    assert not torch.allclose(base[adapted], eager[adapted], atol=1e-3)

    llm.add_lora(LoRARequest("experts", 3, adapters["experts"]))
    engine.add_request("r3", mixed_prompts(8192, 16, count=1, seed=9)[0], params,
                       lora_request=LoRARequest("experts", 3, adapters["experts"]))
    assert engine.model.lora_context.experts_adapted


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_replays_with_adapters_match_eager_steps(adapters) -> None:
    prompts = mixed_prompts(8192, 16, count=9)
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3, ignore_eos=True)
    loras = [LoRARequest("a", 1, adapters["a"]), LoRARequest("b", 2, adapters["b"]), None] * 3
    outputs = {}
    for eager in (True, False):
        llm = LLM(TINY, init_std=0.1, dtype="float32", enforce_eager=eager, max_num_seqs=16,
                  enable_lora=True, max_loras=2, max_lora_rank=8)
        outputs[eager] = [o.outputs[0].token_ids
                          for o in llm.generate(prompts, params, lora_request=loras)]
        graphs = llm.engine.runner.executor.worker.decode_graphs
        assert (graphs is None) if eager else graphs.replays >= 9
    assert outputs[False] == outputs[True]
