"""Piecewise graphs: steps of any mix of prefills and decodes, every layer's work but attention
replayed per token-count bucket, give the eager engine's tokens.

On the CPU the pieces are replayed eagerly over the same static buffers (`eager_capture`),
which checks everything but the capture itself: the hand-over between pieces and attention,
the buckets and the padding rows. On a GPU the same workload runs through captured graphs."""

from __future__ import annotations

import math

import pytest
import torch

from muse import LLM, SamplingParams
from muse.engine.piecewise_graphs import PiecewiseGraphs, eager_capture, piecewise_buckets
from muse.outputs import CompletionOutput
from tests.conftest import DEVICE
from tests.engine.helpers import assert_same_logprobs, mixed_prompts

MAX_TOKENS = 10
BATCHED_TOKENS = 48


def tiny(**engine_args) -> LLM:
    return LLM("muse-spark-tiny", init_std=0.1, device=DEVICE, dtype="float32",
               max_num_batched_tokens=BATCHED_TOKENS, **engine_args)


def generate(llm: LLM, prompts: list[list[int]]) -> list[CompletionOutput]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=2)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_same(got: list[CompletionOutput], want: list[CompletionOutput]) -> None:
    """Tokens exactly, logprobs within the tests' tolerance (the pieces multiply padded
    rows too, which may block the products differently)."""
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for index, (mine, theirs) in enumerate(zip(got, want)):
        assert_same_logprobs(mine.logprobs, theirs.logprobs, f"prompt {index}")


class PoisonedTails(PiecewiseGraphs):
    """The attention output's padding rows set to NaN where the engine zeroes them: whatever
    a padding row holds must never reach a real one (the CPU's routing, torch.topk, gives
    NaN rows valid experts)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.padded_steps = 0

    def _clear_padding(self, count: int, size: int) -> None:
        if size > count:
            self.padded_steps += 1
        self.buffers["attended"][count:size] = math.nan


def test_buckets_grow_by_half_and_end_at_the_largest():
    assert piecewise_buckets(512) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]
    assert piecewise_buckets(100) == [16, 24, 32, 48, 64, 96, 100]
    assert piecewise_buckets(8) == [8]


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    config = tiny().engine.config
    return mixed_prompts(config.vocab_size, config.sliding_window, count=12)


@pytest.fixture(scope="module")
def eager_outputs(prompts) -> list[CompletionOutput]:
    return generate(tiny(), prompts)


def with_pieces(kind: type[PiecewiseGraphs] = PiecewiseGraphs
                ) -> tuple[LLM, PiecewiseGraphs]:
    """A tiny engine whose steps run through piecewise graphs replayed eagerly."""
    llm = tiny()
    worker = llm.engine.executor.worker
    graphs = kind(worker.model, worker.kv_caches, BATCHED_TOKENS, worker.device)
    graphs.capture(eager_capture)
    worker.piecewise = graphs
    return llm, graphs


def test_mixed_steps_through_the_pieces_give_the_eager_tokens(prompts, eager_outputs):
    want = eager_outputs
    llm, graphs = with_pieces(PoisonedTails)
    assert_same(generate(llm, prompts), want)
    # Steps went through the pieces (no whole-step graph on the CPU), some of them padded.
    assert graphs.steps > 0 and graphs.padded_steps > 0
    # Prefix-cache hits: a second round starts from cached blocks.
    assert_same(generate(llm, prompts), want)


def test_a_broken_hand_over_is_caught(prompts, eager_outputs):
    """Negative control: attention output left out of the pieces changes the tokens."""
    llm, graphs = with_pieces()
    for layer in graphs.layers:
        attend = layer.self_attn.attend
        layer.self_attn.attend = lambda *args, attend=attend: torch.zeros_like(attend(*args))
    assert [o.token_ids for o in generate(llm, prompts)] != \
        [o.token_ids for o in eager_outputs]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
def test_captured_pieces_give_the_eager_tokens(prompts):
    want = generate(tiny(enforce_eager=True), prompts)
    llm = tiny(enable_piecewise_cuda_graph=True)
    assert_same(generate(llm, prompts), want)
    assert llm.engine.executor.worker.piecewise.steps > 0
