"""Speculation's overlapped schedule: a greedy verify step followed by the next one, made on
the device before the first is read back (`muse.speculative.chained_step`). The step made
there is the one the scheduler would have made, and the engine's output and acceptance
counters are those of the schedule that reads every step back."""

from __future__ import annotations

import random

import pytest
import torch

from muse import LLM, SamplingParams
from muse.engine.kv_cache import SLIDING, window_start_block
from muse.engine.metadata import BatchEntry, build_host_batch
from muse.speculative.chained_step import chained_batch
from tests.conftest import REPO_ROOT
from tests.speculative.graph_layout import GraphLayoutWorker

SHIPPED = REPO_ROOT / "checkpoints" / "muse-spark-default"
needs_drafter = pytest.mark.skipif(not (SHIPPED / "drafter" / "config.json").is_file(),
                                   reason="no shipped drafter")
SPEC = {"method": "dspark", "num_speculative_tokens": 7}
QUESTIONS = ["What is 37+45?", "What is 512-129?", "Compute 13*7.",
             "Name three colours.", "Write one sentence about the sea."]


@pytest.mark.parametrize("seed", range(4))
def test_the_step_made_on_the_device_is_the_host_batch_at_the_accepted_start(seed):
    """Random requests, windows, tables and acceptances: the chained batch's tokens,
    positions, cache slots and context lengths are `build_host_batch`'s for the starts the
    acceptances give, and its tables reach every block those queries can read. The step
    before verified q - 1 drafts a request, or none (a prompt's last chunk)."""
    rng = random.Random(seed)
    block_size, window, q = rng.choice([(4, 9), (16, 40), (2, 5)]) + (rng.randint(2, 8),)
    before = q if seed % 2 else 1  # the tokens the step before emits at most
    kinds = ["global", SLIDING]
    requests = rng.randint(1, 5)
    starts = [rng.randint(0, 90) for _ in range(requests)]
    accepted = [rng.randint(0, before - 1) for _ in range(requests)]
    emitted = torch.tensor([[rng.randrange(1000) for _ in range(before)]
                            for _ in range(requests)])
    drafts = torch.tensor([[rng.randrange(1000) for _ in range(q - 1)] for _ in range(requests)])
    full = [{kind: rng.sample(range(1, 500), -(-(start + before + q) // block_size))
             for kind in kinds} for start in starts]
    tables, firsts = {kind: [] for kind in kinds}, {kind: [] for kind in kinds}
    for start, table in zip(starts, full):
        for kind in kinds:
            first = window_start_block(kind, start + 1, window, block_size)
            tables[kind].append(table[kind][first:])
            firsts[kind].append(first)
    chained = chained_batch(torch.tensor(accepted), emitted, drafts, starts, tables, firsts,
                            block_size)
    entries = []
    for r, (start, t) in enumerate(zip(starts, accepted)):
        tokens = [int(emitted[r, t])] + drafts[r].tolist()
        entries.append(BatchEntry(tokens, start + t + 1, q, full[r]))
    want = build_host_batch(kinds, block_size, window, entries)
    assert chained.input_ids.tolist() == want.input_ids
    assert chained.positions.tolist() == want.positions
    assert chained.seq_lens.tolist() == want.seq_lens
    for kind in kinds:
        assert chained.slots[kind].tolist() == want.slots[kind]
        for r in range(requests):
            first = int(chained.first_blocks[kind][r])
            assert first <= want.first_blocks[kind][r]  # the table starts no later
            held = chained.tables[kind][r].tolist()
            needed = range(want.first_blocks[kind][r],
                           want.first_blocks[kind][r] + len(want.tables[kind][r]))
            assert [held[b - first] for b in needed] == want.tables[kind][r]
    meta = chained.metadata()
    assert meta.query_start.tolist() == want.query_start
    assert meta.token_request.tolist() == want.token_request


def run(questions: list[str], params: SamplingParams, overlap: bool, monkeypatch=None
        ) -> tuple[list, tuple, int]:
    """Each question's output tokens, the acceptance counters and the chained steps."""
    layout = GraphLayoutWorker(monkeypatch, draft=True) if monkeypatch is not None else None
    llm = LLM(str(SHIPPED), device="cpu", dtype="float32", speculative_config=SPEC,
              overlap_schedule=overlap)
    if layout is not None:
        layout.proposer = llm.engine.proposer
    messages = [[{"role": "user", "content": q}] for q in questions]
    outputs = [o.outputs[0].token_ids for o in llm.chat(messages, params)]
    stats = llm.engine.spec_stats
    counters = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                list(stats.accepted_per_position))
    chained = llm.engine.chained_steps
    assert llm.engine.kv_cache.usage() == 0.0  # every block back, the chained steps' too
    llm.shutdown()
    return outputs, counters, chained


@needs_drafter
@pytest.mark.parametrize("max_tokens,in_graph", [(64, False), (64, True), (17, False)])
def test_chained_verify_steps_give_the_output_and_counters_of_read_back_steps(
        monkeypatch, max_tokens, in_graph):
    """A batch whose requests end at different steps (end of turn, max_tokens: a chained step
    only where even full acceptance leaves room for it), with the verify steps answered
    eagerly or as a verify graph answers them (then followed by chained steps run eagerly)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    want = run(QUESTIONS, params, overlap=False)
    with monkeypatch.context() as patch:
        got = run(QUESTIONS, params, overlap=True, monkeypatch=patch if in_graph else None)
    assert got[:2] == want[:2]
    assert want[2] == 0 and got[2] > 0


@needs_drafter
def test_a_request_alone_chains_every_steady_step_and_stops_at_its_end():
    params = SamplingParams(temperature=0.0, max_tokens=100, stop=["sea"])
    for question in ("What is 37+45?", "Write one sentence about the sea."):
        want = run([question], params, overlap=False)
        got = run([question], params, overlap=True)
        assert got[:2] == want[:2]
        # Every verify step is chained, the first behind the prompt's last chunk, plus one
        # made behind the last before it was read back.
        assert got[2] == want[1][0] + 1


@needs_drafter
def test_a_request_that_joins_or_leaves_while_a_chained_step_runs():
    """An abort while a chained step is in flight frees the request's blocks and the next
    request's output is its output alone; a request that arrives then joins the next step
    that is not chained, and both outputs are each one's alone."""
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    llm = LLM(str(SHIPPED), device="cpu", dtype="float32", speculative_config=SPEC)
    engine, tokenizer = llm.engine, llm.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=True,
                                             add_generation_prompt=True) for q in QUESTIONS[:3]]
    alone = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params)]

    def until_chained(request_id: str) -> None:
        """Step until a chained step of `request_id` is in flight."""
        before = engine.chained_steps
        for _ in range(50):
            engine.step()
            if engine.chained_steps > before:
                assert [r.request_id for r in engine.in_flight.sampled] == [request_id]
                return
        raise AssertionError("no chained step")

    engine.add_request("a", prompts[0], params)
    until_chained("a")
    engine.abort("a")
    while engine.has_unfinished():
        engine.step()
    assert engine.kv_cache.usage() == 0.0

    finished = {}
    engine.add_request("b", prompts[1], params)
    until_chained("b")
    engine.add_request("c", prompts[2], params)
    while engine.has_unfinished():
        for request in engine.step():
            if request.is_finished:
                finished[request.request_id] = list(request.output_token_ids)
    assert [finished["b"], finished["c"]] == alone[1:]
    assert engine.kv_cache.usage() == 0.0
    llm.shutdown()
