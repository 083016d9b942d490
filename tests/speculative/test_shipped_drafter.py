"""The drafter shipped with the default model: found without a `model` path, and on held-out
chat prompts greedy decoding with it equals greedy decoding without, token for token, while
it gets most of its drafts accepted."""

from __future__ import annotations

import pytest
import torch

from muse import LLM, SamplingParams
from tests.conftest import REPO_ROOT
from tests.speculative.graph_layout import GraphLayoutWorker

SHIPPED = REPO_ROOT / "checkpoints" / "muse-spark-default"
# Questions of the tasks the drafter is trained on (its data is the target's answers to
# training prompts): open questions outside them get one-word replies from the default model,
# where no drafter has much to accept.
QUESTIONS = ["What is 37+45?", "What is 512-129?", "Compute 13*7.", "What is 64+29?",
             "What is 803-356?"]


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
    # Held-out offline acceptance of the shipped drafter is 4.0 tokens per target forward
    # (5.2 on arithmetic; docs/training.md); these few prompts must show a drafter that works.
    assert stats.mean_acceptance_length > 3.0, stats


@pytest.mark.skipif(not (SHIPPED / "drafter" / "config.json").is_file(),
                    reason="no shipped drafter")
def test_drafts_made_after_the_verification_are_the_drafters_own(monkeypatch):
    """Where a verify graph verifies greedily and drafts the next blocks itself, the drafts
    are the ones the drafter's own pass would make after the step: with a worker answering
    in the graph's layout (on the CPU), the output and every acceptance counter equal those
    of the eager path, and the drafter's own pass runs only after prefills."""
    params = SamplingParams(temperature=0.0, max_tokens=48)
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    spec = {"method": "dspark", "num_speculative_tokens": 7}
    results = []
    for in_graph in (False, True):
        with monkeypatch.context() as patch:
            layout = GraphLayoutWorker(patch, draft=True) if in_graph else None
            llm = LLM(str(SHIPPED), device="cpu", dtype="float32", speculative_config=spec)
            proposer = llm.engine.proposer
            if layout is not None:
                layout.proposer = proposer
            outputs = [o.outputs[0].token_ids for o in llm.chat(messages, params)]
            stats = llm.engine.spec_stats
            results.append((outputs, stats.num_drafts, stats.num_accepted_tokens,
                            list(stats.accepted_per_position)))
            if layout is not None:
                assert sum(layout.asked) >= stats.num_drafts  # every verify step answered so
            llm.shutdown()
    assert results[0] == results[1]
    assert results[0][2] > results[0][1]  # more than one accepted draft a step on average


@pytest.mark.skipif(not (SHIPPED / "drafter" / "config.json").is_file()
                    or not torch.cuda.is_available(), reason="needs the drafter and a GPU")
def test_verify_graphs_that_draft_accept_what_the_eager_path_accepts():
    """On the GPU (float32, so padding cannot flip a near tie): the verify graphs' greedy
    verification and their next drafts give the eager engine's output and acceptance
    counters, and the drafter's own graphs replay only after prefills; so do verify steps
    made on the device from the step before (the overlapped schedule), copied into the same
    graphs (padding rows included: 5 requests in a bucket of 8)."""
    params = SamplingParams(temperature=0.0, max_tokens=48)
    messages = [[{"role": "user", "content": q}] for q in QUESTIONS]
    spec = {"method": "dspark", "num_speculative_tokens": 7}
    results = []
    for eager, overlap in ((True, False), (False, False), (False, True)):
        llm = LLM(str(SHIPPED), dtype="float32", enforce_eager=eager, speculative_config=spec,
                  overlap_schedule=overlap)
        outputs = [o.outputs[0].token_ids for o in llm.chat(messages, params)]
        stats = llm.engine.spec_stats
        results.append((outputs, stats.num_drafts, stats.num_accepted_tokens,
                        list(stats.accepted_per_position)))
        if not eager:
            worker, proposer = llm.engine.executor.worker, llm.engine.proposer
            assert sum(g.verified_replays for g in worker.graphs) > 0
            assert proposer.graphs.replays <= 2 * len(QUESTIONS)
            # Short chats draft over the narrowest tables captured, not max_model_len's.
            verify = next(g for g in worker.graphs if g.greedy_replay_widths)
            assert min(verify.greedy_replay_widths) < verify.full_width
        assert (llm.engine.chained_steps > 0) == overlap
        assert llm.engine.kv_cache.usage() == 0.0
        llm.shutdown()
    assert results[0] == results[1] == results[2]
