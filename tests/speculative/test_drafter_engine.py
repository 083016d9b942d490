"""The block-diffusion drafter in the engine: the target's hidden states at the drafter's
layers are the reference's, each request's drafter context holds its committed positions in
order, and whatever the drafter proposes the output is plain decoding's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from muse import LLM, SamplingParams
from muse.presets import get_preset
from muse.reference.model import MuseForCausalLM
from muse.speculative.drafter import MuseDrafter, save_drafter
from muse.speculative.drafter_config import DrafterConfig
from muse.speculative.proposer import DrafterProposer
from tests.engine.helpers import assert_same_outputs, mixed_prompts

MASK_TOKEN = 3  # a special token the tiny model's prompts here never contain


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = get_preset("muse-spark-tiny").text_config
    config = DrafterConfig.for_target(target, MASK_TOKEN, num_target_features=2,
                                      method="dspark", block_size=5, confidence_head=True)
    drafter = MuseDrafter(config)
    drafter.init_weights(0)
    folder = tmp_path_factory.mktemp("drafter")
    save_drafter(drafter, folder)
    return folder


def engine(**args) -> LLM:
    return LLM("muse-spark-tiny", init_std=0.1, device="cpu", dtype="float32",
               kv_cache_memory_bytes=32 * 2**20, **args)


def spec(folder: Path, **extra) -> dict:
    return {"method": "dspark", "model": str(folder), "num_speculative_tokens": 4} | extra


def test_captured_hidden_states_are_the_reference_layer_outputs(drafter_dir):
    llm = engine(speculative_config=spec(drafter_dir))
    model = llm.engine.model
    layers = model.capture_layers
    assert layers == tuple(DrafterConfig.load(drafter_dir).target_layer_ids)
    prompt = [11, 12, 13, 14, 15, 16, 17]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    # The first step was the prompt's prefill: its rows are the prompt's positions.
    reference = MuseForCausalLM(llm.engine.config)
    reference.init_weights(0, 0.1)
    with torch.no_grad():
        states = reference(torch.tensor([prompt]), hidden_layers=layers).hidden_states
    want = torch.cat([states[i][0] for i in layers], dim=-1)
    # The last step ran the prompt only (max_tokens 1 drafts nothing).
    torch.testing.assert_close(model.captured_hidden, want, atol=1e-4, rtol=1e-4)


def test_greedy_output_equals_plain_and_contexts_follow_positions(drafter_dir):
    plain = engine()
    drafted = engine(speculative_config=spec(drafter_dir),
                     max_num_batched_tokens=24, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = mixed_prompts(8192, 16, count=6, seed=5)
    want = plain.generate(prompts, params)
    proposer = drafted.engine.proposer
    assert isinstance(proposer, DrafterProposer)
    seen = {}
    original = proposer.propose

    def recording(requests, rooms):
        for request in requests:
            context = proposer.contexts.get(request.request_id)
            if context is not None:
                pending = sum(f.shape[0] for f, _ in context.pending)
                seen[request.request_id] = (context.cache.num_rows + pending,
                                            request.num_computed_tokens
                                            - request.num_cached_tokens)
        return original(requests, rooms)

    proposer.propose = recording
    assert_same_outputs(drafted.generate(prompts, params), want)
    stats = drafted.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0
    # Before each proposal a request's context (cached + pending rows) holds one row per
    # position it computed: every committed token, nothing rejected, nothing twice (a prefix
    # served by the prefix cache was never computed, so the drafter has no rows for it).
    assert seen and all(rows == computed for rows, computed in seen.values())


@pytest.mark.parametrize("method", ["token", "block"])
def test_probabilistic_drafts_reproduce_with_a_seed(drafter_dir, method):
    # No prefix cache: the second run would find the prompts cached, and the drafter, which
    # has no rows for a cached prefix, would draft (losslessly) something else.
    llm = engine(speculative_config=spec(drafter_dir, draft_sample_method="probabilistic",
                                         rejection_sample_method=method),
                 enable_prefix_caching=False)
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=3, ignore_eos=True)
    prompts = mixed_prompts(8192, 16, count=3, seed=2)
    first = llm.generate(prompts, params)
    assert_same_outputs(llm.generate(prompts, params), first)
    assert llm.engine.spec_stats.num_draft_tokens > 0


def test_a_missing_or_mismatched_drafter_is_refused(tmp_path, drafter_dir):
    with pytest.raises(ValueError, match="needs a drafter checkpoint"):
        engine(speculative_config={"method": "dspark", "model": str(tmp_path)})
    with pytest.raises(ValueError, match="dspark"):
        engine(speculative_config={"method": "dflash", "model": str(drafter_dir)})

