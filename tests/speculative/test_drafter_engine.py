"""The block-diffusion drafter in the engine: the target's hidden states at the drafter's
layers are the reference's, each proposal is the drafter's own over the committed context
(read from the draft KV pages), and whatever the drafter proposes the output is plain
decoding's."""

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
from tests.speculative.graph_layout import GraphLayoutWorker

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


def reference_hidden(llm: LLM, tokens: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """The reference model's outputs of `layers`, concatenated per token: [len(tokens), K*d]."""
    reference = MuseForCausalLM(llm.engine.config)
    reference.init_weights(0, 0.1)
    with torch.no_grad():
        states = reference(torch.tensor([tokens]), hidden_layers=layers).hidden_states
    return torch.cat([states[i][0] for i in layers], dim=-1)


def test_the_context_writer_gets_the_reference_layer_outputs(drafter_dir):
    llm = engine(speculative_config=spec(drafter_dir))
    model = llm.engine.model
    layers = model.capture_layers
    assert layers == tuple(DrafterConfig.load(drafter_dir).target_layer_ids)
    written = []
    writer = model.context_writer
    model.context_writer = lambda features, meta: (written.append(features.clone()),
                                                   writer(features, meta))
    prompt = [11, 12, 13, 14, 15, 16, 17]
    # max_tokens 1 drafts nothing: the one step is the prompt's prefill.
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))
    assert len(written) == 1
    torch.testing.assert_close(written[0], reference_hidden(llm, prompt, layers),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("on_device", [True, False], ids=["device-drafts", "host-drafts"])
def test_paged_drafts_are_the_drafters_over_the_reference_context(drafter_dir, on_device):
    """Greedy output equals plain decoding's, and every proposal equals the drafter's own
    (`MuseDrafter.propose`, per-request context) over the reference's hidden states of the
    request's committed tokens: the pages hold each position's row, rejected drafts never
    leak into a context, and a prefix served by the prefix cache has its rows too. Drafts
    left on the device (the default for greedy drafts) feed the verify step there."""
    plain = engine()
    drafted = engine(speculative_config=spec(drafter_dir),
                     max_num_batched_tokens=24, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    shared = mixed_prompts(8192, 20, count=1, seed=9)[0]
    prompts = mixed_prompts(8192, 16, count=4, seed=5) + [shared + [40, 41], shared + [42]]
    want = plain.generate(prompts, params)
    proposer = drafted.engine.proposer
    assert isinstance(proposer, DrafterProposer) and proposer.drafts_on_device
    proposer.drafts_on_device = on_device
    drafter, layers = proposer.drafter, drafted.engine.model.capture_layers
    checked = []
    original = proposer.propose

    def checking(requests, rooms):
        proposals = original(requests, rooms)
        for request, room, drafts in zip(requests, rooms, proposals):
            if room == 0:
                continue
            tokens = request.token_ids(0, request.num_tokens)
            anchor = request.num_tokens - 1
            cache = drafter.new_cache()
            own = drafter.propose(reference_hidden(drafted, tokens[:anchor], layers),
                                  torch.arange(anchor), [anchor], torch.tensor([tokens[-1]]),
                                  torch.tensor([anchor]), [cache])
            if on_device:
                tensor, row = drafts.device
                assert tensor[row, :room].tolist() == own.tokens[0, :room].tolist()
                assert drafts.tokens == [0] * room and drafts.confidence is None
            else:
                assert drafts.device is None
                assert drafts.tokens == own.tokens[0, :room].tolist()
                torch.testing.assert_close(torch.tensor(drafts.confidence),
                                           own.confidence[0, :room], atol=1e-4, rtol=1e-4)
            checked.append(request.num_cached_tokens)
        return proposals

    proposer.propose = checking
    assert_same_outputs(drafted.generate(prompts, params), want)
    stats = drafted.engine.spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0
    assert len(checked) > 10 and max(checked) > 0  # a prefix-cache hit was among them
    # Device drafts are queued behind the step before (`draft_ahead`) while the batch keeps
    # its requests, and drafted afresh when it changes.
    assert (proposer.steps_drafted_ahead > 0) == on_device


@pytest.mark.parametrize("method,logprobs", [("dspark", None), ("ngram", None),
                                             ("dspark", 2)])
def test_a_verification_made_in_the_graph_gives_plain_decodings_output(drafter_dir, monkeypatch,
                                                                       method, logprobs):
    """The engine's side of a verify graph's greedy verification, on the CPU: a worker asked
    for it (`greedy_verify`: every request greedy, no logprobs) answers `GreedyVerified`, made
    here from the step's logits in a graph's layout (query rows padded past each request's
    own with rows that would extend its accepted run if they were counted), with the drafter's
    next drafts made from it as the graph makes them (`DrafterProposer.draft_next`); the
    output is plain decoding's, those drafts feed the next step (the drafter's own pass runs
    only after prefills), and a step that wants logprobs is never asked."""
    layout = GraphLayoutWorker(monkeypatch, draft=method == "dspark")
    own_passes = []
    prompts = mixed_prompts(8192, 16, count=5, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=logprobs)
    # The random drafter's drafts are all rejected; n-grams of the random model's looping
    # replies are accepted.
    config = spec(drafter_dir) if method == "dspark" else \
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    drafted = engine(speculative_config=config, max_num_seqs=4)
    proposer = layout.proposer = drafted.engine.proposer
    if method == "dspark":
        own_draft = proposer._draft
        monkeypatch.setattr(proposer, "_draft",
                            lambda *args: own_passes.append(1) or own_draft(*args))
    got = drafted.generate(prompts, params)
    assert_same_outputs(got, engine().generate(prompts, params))
    stats = drafted.engine.spec_stats
    assert stats.num_drafts > 0
    if logprobs is not None:
        assert not layout.asked
    else:
        assert len(layout.asked) > 5
        assert (stats.num_accepted_tokens > 0) == (method == "ngram")
        if method == "dspark":
            # Chained steps take the drafts made ahead on the device directly.
            assert proposer.steps_drafted_ahead + drafted.engine.chained_steps \
                >= len(layout.asked) - len(prompts)
            assert len(own_passes) <= 2 * len(prompts)  # after prefills, not after verifies


@pytest.mark.parametrize("method", ["token", "block"])
def test_probabilistic_drafts_reproduce_with_a_seed(drafter_dir, method):
    # The second run finds the prompts in the prefix cache, and the drafter their rows.
    llm = engine(speculative_config=spec(drafter_dir, draft_sample_method="probabilistic",
                                         rejection_sample_method=method))
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



@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("logprobs", [2, None])
def test_graphs_for_draft_and_verify_passes_give_the_eager_output(drafter_dir, logprobs):
    """Also the greedy verification the verify graphs hold, taken when no logprobs are
    asked for."""
    prompts = mixed_prompts(8192, 16, count=6, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                            logprobs=logprobs)
    outputs = {}
    for eager in (True, False):
        llm = LLM("muse-spark-tiny", init_std=0.1, dtype="float32", enforce_eager=eager,
                  speculative_config=spec(drafter_dir), max_num_seqs=8)
        outputs[eager] = llm.generate(prompts, params)
        worker = llm.engine.executor.worker
        if not eager:
            verify = [g for g in worker.graphs if 1 < g.query_len <= 5]
            assert sum(g.replays for g in verify) > 0
            assert (sum(g.verified_replays for g in verify) > 0) == (logprobs is None)
            assert llm.engine.proposer.graphs.replays > 0
    assert_same_outputs(outputs[False], outputs[True])
    plain = LLM("muse-spark-tiny", init_std=0.1, dtype="float32", max_num_seqs=8)
    assert_same_outputs(outputs[False], plain.generate(prompts, params))
