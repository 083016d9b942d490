"""The drafter shipped with the default model: found without a `model` path, and on held-out
chat prompts greedy decoding with it equals greedy decoding without, token for token, while
it gets most of its drafts accepted."""

from __future__ import annotations

import pytest

from muse import LLM, SamplingParams
from tests.live_server import REPO_ROOT

SHIPPED = REPO_ROOT / "checkpoints" / "muse-spark-default"
QUESTIONS = ["What is 37+45?", "What is 512-129?", "Compute 13*7.",
             "Name three colours.", "Write one sentence about the sea."]


@pytest.mark.skipif(not (SHIPPED / "drafter" / "config.json").is_file(),
                    reason="no shipped drafter")
def test_shipped_drafter_is_lossless_and_accepted():
    params = SamplingParams(temperature=0.0, max_tokens=64)
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    plain = LLM(str(SHIPPED), device="cpu", dtype="float32")
    want = [o.outputs[0].token_ids for o in plain.chat(messages, params)]
    drafted = LLM(str(SHIPPED), device="cpu", dtype="float32",
                  speculative_config={"method": "dspark", "num_speculative_tokens": 7})
    got = [o.outputs[0].token_ids for o in drafted.chat(messages, params)]
    assert got == want
    stats = drafted.engine.spec_stats
    # Held-out acceptance on the H200 run was 5.07 tokens per target forward (greedy);
    # these few prompts must at least show a drafter that works.
    assert stats.mean_acceptance_length > 3.0, stats
