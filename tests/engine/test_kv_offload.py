"""The prefix cache's host-memory and disk tiers: a prefix evicted from the GPU pools comes
back with exactly the outputs of a fresh prefill (also after a restart, from disk), and a
long mixed run leaks nothing in any tier."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from muse import LLM, SamplingParams
from muse.engine.kv_budget import block_bytes
from muse.engine.args import EngineArgs
from muse.engine.kv_offload import DISK, HOST, WRITE_POLICIES, KVOffload, SlotTier
from muse.presets import get_preset
from tests.conftest import DEVICE
from tests.engine.helpers import assert_same_outputs, random_prompt, tiny_llm
from tests.engine.test_kv_cache import assert_all_released

PROMPT = random_prompt(70, 1)  # 4 full blocks of 16 can be reused: 64 tokens
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
# Enough other 70-token prompts to push PROMPT out of 24 GPU blocks a kind.
OTHERS = [random_prompt(70, seed) for seed in range(2, 10)]


def tiers(block_set_bytes: int, host_blocks: int, **extra) -> dict:
    """Engine arguments: 24 GPU blocks of each kind and about `host_blocks` host slots."""
    return dict(max_num_seqs=4, max_num_batched_tokens=32,
                kv_cache_memory_bytes=24 * block_set_bytes,
                kv_offload_gb=host_blocks * block_set_bytes / 2**30, **extra)


def tiny_block_set_bytes() -> int:
    """One block of every kind of the tiny preset, float32."""
    return sum(block_bytes(get_preset("muse-spark-tiny").text_config, 16,
                           torch.float32).values())


def generate(llm: LLM, prompt: list[int]):
    (output,) = llm.generate([{"prompt_token_ids": prompt}], PARAMS, use_tqdm=False)
    return output


def assert_tiers_settled(offload: KVOffload) -> None:
    """Every host slot either free or holding one prefix, no copy pending."""
    assert offload.take() is None
    for tier in offload.host.values():
        assert not tier.pinned
        slots = sorted([*tier.free, *tier.entries.values()])
        assert slots == list(range(tier.num_slots))


@pytest.fixture(scope="module")
def fresh() -> object:
    return generate(tiny_llm(enable_prefix_caching=False), PROMPT)


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_a_prefix_evicted_from_the_gpu_reloads_from_host_memory(policy, fresh):
    llm = tiny_llm(**tiers(tiny_block_set_bytes(), 64, kv_offload_write_policy=policy))
    offload = llm.engine.kv_cache.offload
    first = generate(llm, PROMPT)
    for prompt in OTHERS:
        generate(llm, prompt)
    again = generate(llm, PROMPT)
    assert first.num_cached_tokens == 0
    # All 64 reusable tokens, and all from host memory: the GPU pools had lost them.
    assert again.num_cached_tokens == 64
    assert offload.stats.hit_tokens == {HOST: 64, DISK: 0}
    assert_same_outputs([first, again], [fresh, fresh])
    assert_all_released(llm.engine.kv_cache)
    assert_tiers_settled(offload)


def test_the_reload_really_copies(fresh, monkeypatch):
    # Negative control: loads that leave the fresh GPU blocks as they were change the output.
    from muse.engine.host_kv_store import HostKVStore

    monkeypatch.setattr(HostKVStore, "_scatter", lambda self, group: self.pending.pop(group))
    llm = tiny_llm(**tiers(tiny_block_set_bytes(), 64))
    generate(llm, PROMPT)
    for prompt in OTHERS:
        generate(llm, prompt)
    again = generate(llm, PROMPT)
    assert again.num_cached_tokens == 64
    with pytest.raises(AssertionError):
        assert_same_outputs([again], [fresh])


def test_a_prefix_on_disk_reloads_after_a_restart(tmp_path: Path, fresh):
    # 16 host slots a kind: the other prompts push PROMPT's blocks on to disk.
    args = tiers(tiny_block_set_bytes(), 16, kv_offload_disk=str(tmp_path))
    llm = tiny_llm(**args)
    generate(llm, PROMPT)
    for prompt in OTHERS:
        generate(llm, prompt)
    assert llm.engine.kv_cache.offload.disk.used_bytes > 0
    files = list(tmp_path.rglob("*.kv"))
    assert files and not list(tmp_path.rglob("*.partial"))
    del llm
    restarted = tiny_llm(**args)
    again = generate(restarted, PROMPT)
    assert again.num_cached_tokens == 64
    assert restarted.engine.kv_cache.offload.stats.hit_tokens[DISK] == 64
    assert_same_outputs([again], [fresh])
    # Another model's engine in the same directory finds nothing of this one's.
    other = tiny_llm(seed=1, **args)
    assert generate(other, PROMPT).num_cached_tokens == 0
    restarted.reset_prefix_cache()
    generate(restarted, OTHERS[0])  # a step runs the deletions
    assert not list(tmp_path.rglob(f"*/{files[0].name}"))


def test_a_transformers_checkpoint_reloads_from_host_memory(tmp_path: Path):
    pytest.importorskip("transformers")
    from tests.test_hf_equivalence import moe_model

    model = moe_model(norm_topk_prob=False, sliding=True)
    model.save_pretrained(tmp_path)
    vocab = model.config.vocab_size
    prompt, *others = [[t % vocab for t in p] for p in (PROMPT, *OTHERS)]
    token_bytes = 4 * 2 * 2 * 16 * 4  # one token's K and V in all 4 layers, fp32
    args = dict(device=DEVICE, dtype="float32", max_num_batched_tokens=32, max_num_seqs=4)
    want = generate(LLM(str(tmp_path), enable_prefix_caching=False, **args), prompt)
    llm = LLM(str(tmp_path), kv_cache_memory_bytes=24 * 16 * token_bytes,
              kv_offload_gb=64 * 16 * token_bytes / 2**30, **args)
    first = generate(llm, prompt)
    for other in others:
        generate(llm, other)
    again = generate(llm, prompt)
    assert again.num_cached_tokens == 64
    # Every layer slides (window 8): only the block before the reuse point is needed.
    assert llm.engine.kv_cache.offload.stats.hit_tokens[HOST] == 16
    assert_same_outputs([first, again], [want, want])


def test_no_block_leaks_after_a_thousand_mixed_requests_with_aborts(tmp_path: Path):
    llm = tiny_llm(**tiers(tiny_block_set_bytes(), 24, kv_offload_write_policy="write_back",
                           kv_offload_disk=str(tmp_path), kv_offload_disk_gb=1e-3))
    engine, rng = llm.engine, random.Random(0)
    prefixes = [random_prompt(40, 100 + i) for i in range(6)]
    added = 0
    while added < 1000 or engine.has_unfinished():
        for _ in range(min(rng.randint(0, 12), 1000 - added)):
            prompt = rng.choice(prefixes) + random_prompt(rng.randint(0, 30), added)
            params = SamplingParams(max_tokens=rng.randint(1, 5), n=rng.choice((1, 1, 2)),
                                    temperature=rng.choice((0.0, 1.0)), ignore_eos=True)
            engine.add_request(str(added), prompt, params)
            added += 1
        engine.step()
        for request_id in list(engine.requests):
            if rng.random() < 0.03:
                engine.abort(request_id)
    offload = engine.kv_cache.offload
    assert offload.stats.hit_tokens[HOST] > 0 and offload.stats.hit_tokens[DISK] > 0
    assert_all_released(engine.kv_cache)
    assert_tiers_settled(offload)


def test_host_slots_a_step_uses_are_not_evicted_and_the_least_recent_go_first():
    tier = SlotTier(2)
    a, b, c = (bytes([n]) * 32 for n in range(3))
    first, second = tier.reserve(a), tier.reserve(b)
    assert {first[0], second[0]} == {0, 1} and first[1] is second[1] is None
    assert tier.reserve(c) is None  # both pinned by this step's copies
    tier.unpin()
    assert tier.lookup(a) == first[0]  # a is now the most recent
    assert tier.reserve(c) == (second[0], b)
    assert tier.lookup(b) is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"kv_offload_gb": -1}, "kv_offload_gb"),
    ({"kv_offload_gb": 1, "kv_offload_write_policy": "sometimes"}, "kv_offload_write_policy"),
    ({"kv_offload_gb": 1, "enable_prefix_caching": False}, "prefix caching"),
    ({"kv_offload_disk": "/tmp/kv"}, "set `kv_offload_gb` too"),
])
def test_bad_offload_settings_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**fields).validate()
