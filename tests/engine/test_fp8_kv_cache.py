"""The engine with an FP8 KV cache (`kv_cache_dtype="fp8"`): twice the blocks of BF16 in the
same memory, the same answers within FP8's rounding, scales from the checkpoint or from the
first step, and clear errors for values it does not take.

Accuracy bounds. The engine computes exactly what the reference model computes with its keys
and values rounded through FP8 (checked on the tiny preset: tokens equal, logprobs within
the batching tolerance). Against the BF16-KV engine, on the shipped model's chat prompts
below: the FP8 engine's greedy choice along the BF16 engine's greedy replies agrees on at
least 95% of the tokens (measured 98.5% with scales 1.0, 98.9% with calculated scales), and
its own greedy replies to the arithmetic questions equal the BF16 ones on at least 95% of
the tokens (measured 100%). Free-running replies to the other prompts are not bounded: at a
BF16 near tie (top-2 gaps of 0.09 to 0.2 nats on "Write one sentence about rivers." and
"Sort these numbers") FP8's 3-bit mantissa moves the logits by about 0.3 nats, the choice
flips, and the rest of the reply differs (measured 78% to 83% of tokens over all ten).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import muse.reference.layers as reference_layers
from muse import LLM, SamplingParams
from muse.outputs import RequestOutput
from muse.checkpoint.layout import CheckpointError
from muse.cli import build_parser
from muse.config import FULL, SLIDING
from muse.engine.kv_budget import block_bytes, split_blocks
from muse.info import kv_bytes_per_token
from muse.init_checkpoint import init_random_checkpoint
from muse.presets import SHIPPED_CHECKPOINT, get_preset
from muse.server.launch import engine_args_from
from tests.conftest import DEVICE
from tests.engine.helpers import (MIN_GREEDY_GAP, assert_same_logprobs, mixed_prompts,
                                  reference_from_engine, reference_greedy,
                                  reference_token_logprobs, tiny_llm)
from tests.server.test_serve_flags import serve_parser

needs_shipped_model = pytest.mark.skipif(not (SHIPPED_CHECKPOINT / "config.json").is_file(),
                                         reason="no shipped checkpoint in this tree")

# The chat prompts of the FP8-weights test (tests/quantization/test_muse_quantize.py) and more
# of the same kinds: the model's arithmetic, instruction and open questions.
ARITHMETIC = ["What is 23 + 58?", "What is 91 - 47?", "What is 37+45?", "What is 14 + 69?",
              "What is 80 - 26?"]
OTHERS = ["Write one sentence about rivers.", "Sort these numbers: 5, 2, 9, 1.",
          "Reverse the list: a, b, c, d.", "Name three colors.",
          "What is the capital of France?"]
CHAT_TOKENS = 32
KV_BYTES = 32 * 2**20


def chat(texts: list[str]) -> list[list[dict]]:
    return [[{"role": "user", "content": text}] for text in texts]


def shipped_llm(**args) -> LLM:
    return LLM(str(SHIPPED_CHECKPOINT), device=DEVICE, dtype="bfloat16",
               kv_cache_memory_bytes=KV_BYTES, **args)


@pytest.fixture(scope="module")
def shipped():
    """The shipped model with a BF16 KV cache and with an FP8 one, in one memory budget."""
    return {"auto": shipped_llm(), "fp8": shipped_llm(kv_cache_dtype="fp8")}


def agreement(want: list[list[int]], got: list[list[int]]) -> float:
    same = sum(a == b for w, g in zip(want, got) for a, b in zip(w, g))
    return same / sum(len(w) for w in want)


# ---- capacity ----------------------------------------------------------------------------
@needs_shipped_model
def test_fp8_holds_twice_the_blocks_of_bf16(shipped):
    auto, fp8 = shipped["auto"].engine, shipped["fp8"].engine
    assert auto.kv_cache_dtype == torch.bfloat16 and fp8.kv_cache_dtype == torch.float8_e4m3fn
    assert auto.num_blocks == {SLIDING: 512, FULL: 512}  # 32 MiB of BF16 blocks
    assert fp8.num_blocks == {kind: 2 * n for kind, n in auto.num_blocks.items()}
    kv_caches = fp8.runner.executor.worker.kv_caches
    assert all(k.dtype == v.dtype == torch.float8_e4m3fn for k, v in kv_caches)
    used = sum(k.nbytes + v.nbytes for k, v in kv_caches)
    assert used == sum(k.nbytes + v.nbytes for k, v in auto.runner.executor.worker.kv_caches)


def test_the_budget_counts_one_byte_elements():
    """Below the pools' caps (two windows per sequence for sliding layers, `max_num_seqs`
    full-length sequences for global ones), which bind alike for both dtypes."""
    config = get_preset("muse-spark-default").text_config
    for budget, bf16_blocks in ((64 * 2**20, 1024), (256 * 2**20, 4096)):
        blocks = {dtype: split_blocks(config, budget, 16, dtype, 256, 8192, 4096)
                  for dtype in (torch.bfloat16, torch.float8_e4m3fn)}
        assert blocks[torch.bfloat16] == {SLIDING: bf16_blocks, FULL: bf16_blocks}
        assert blocks[torch.float8_e4m3fn] == {SLIDING: 2 * bf16_blocks, FULL: 2 * bf16_blocks}
    # `muse info --kv-dtype fp8` says what the engine allocates per token.
    for name, dtype in (("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn),
                        ("bfloat16", torch.bfloat16)):
        per_block = block_bytes(config, 16, dtype)
        assert {kind: per_block[kind] // 16 for kind in per_block} == \
            kv_bytes_per_token(config, name)


# ---- accuracy ----------------------------------------------------------------------------
@needs_shipped_model
@pytest.mark.parametrize("calculate", [False, True])
def test_greedy_replies_match_the_bf16_cache(shipped, calculate):
    params = SamplingParams(temperature=0.0, max_tokens=CHAT_TOKENS)
    base = shipped["auto"].chat(chat(ARITHMETIC + OTHERS), params, use_tqdm=False)
    fp8 = shipped_llm(kv_cache_dtype="fp8", calculate_kv_scales=True) if calculate \
        else shipped["fp8"]
    got = [o.outputs[0].token_ids for o in fp8.chat(chat(ARITHMETIC), params, use_tqdm=False)]
    want = [o.outputs[0].token_ids for o in base]
    assert agreement(want[:len(ARITHMETIC)], got) >= 0.95
    # Teacher-forced: FP8's next-token choice at every position of the BF16 replies.
    whole = [{"prompt_token_ids": o.prompt_token_ids + o.outputs[0].token_ids} for o in base]
    forced = fp8.generate(whole, SamplingParams(max_tokens=1, prompt_logprobs=1),
                          use_tqdm=False)
    choices = [[entry.token_id if entry.rank == 1 else entry.top[0][0]
                for entry in o.prompt_logprobs[-len(reply):]] for o, reply in zip(forced, want)]
    assert agreement(want, choices) >= 0.95


def rounded_through_fp8(qkv):
    """The reference's q/k/v with k and v rounded to FP8 E4M3 at the layer's `kv_scales`
    (per kv head; default 1.0): fp8(x / scale) * scale."""
    def forward(self, x, cos, sin):
        q, k, v = qkv(self, x, cos, sin)
        rounded = []
        for values, scale in zip((k, v), getattr(self, "kv_scales", (1.0, 1.0))):
            scale = torch.as_tensor(scale, dtype=torch.float32).expand(values.shape[-2])[:, None]
            stored = (values.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            rounded.append((stored.float() * scale).to(values.dtype))
        return q, *rounded
    return forward


# The engine's float32 K/V come from other kernels than the reference's (on the GPU, and on
# CPUs whose matmuls accumulate in another order: 1.2e-3 seen on an AVX2 machine), and a
# value next to an FP8 rounding boundary lands on its other side there (a 6% step of one
# key or value): logprobs then move by about 1e-3 (2.6e-3 measured on the H200).
FP8_LOGPROB_ATOL = 1e-2


def test_the_engine_is_the_reference_with_fp8_keys_and_values(monkeypatch):
    """Tokens exact and logprobs within the batching tolerance, through chunked prefill,
    prefix-cache hits and sliding layers that drop their blocks (prompts over 3 windows)."""
    llm = tiny_llm(kv_cache_dtype="fp8", max_num_batched_tokens=48)
    config = llm.engine.config
    prompts = mixed_prompts(config.vocab_size, config.sliding_window, count=12, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    again = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.kv_cache.stats.hits > 0
    reference = reference_from_engine(llm.engine)
    monkeypatch.setattr(reference_layers.AttentionProjections, "qkv",
                        rounded_through_fp8(reference_layers.AttentionProjections.qkv))
    want, smallest_gap = reference_greedy(reference, prompts, 6)
    assert smallest_gap > MIN_GREEDY_GAP
    for prompt, output, repeat, tokens in zip(prompts, outputs, again, want):
        assert output.outputs[0].token_ids == repeat.outputs[0].token_ids == tokens
        with torch.no_grad():
            logprobs = reference(torch.tensor([prompt + tokens[:-1]])).logits[0] \
                .log_softmax(-1)[len(prompt) - 1:]
        assert_same_logprobs(output.outputs[0].logprobs,
                             [reference_token_logprobs(row, token, 2)
                              for row, token in zip(logprobs, tokens)], atol=FP8_LOGPROB_ATOL)


# ---- scales ------------------------------------------------------------------------------
PROMPT = mixed_prompts(8192, 16, count=1, seed=7)[0][:40]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    init_random_checkpoint(get_preset("muse-spark-tiny"), path, seed=0, std=0.1)
    return path


def with_tensors(source: Path, destination: Path, tensors: dict[str, torch.Tensor]) -> Path:
    shutil.copytree(source, destination)
    weights = load_file(destination / "model.safetensors")
    save_file(weights | tensors, destination / "model.safetensors")
    return destination


CHECKPOINT_SCALES = {
    # compressed-tensors / vLLM: on the attention module, a scalar and a one-element tensor
    # (powers of two: FP8 of x / s, times s, is FP8 of x wherever both are normal numbers)
    "model.layers.0.self_attn.k_scale": torch.tensor(4.0),
    "model.layers.0.self_attn.v_scale": torch.tensor([0.5]),
    "model.layers.0.self_attn.q_scale": torch.tensor(1.0),  # accepted, unused
    # ModelOpt: on the projections
    "model.layers.1.self_attn.k_proj.k_scale": torch.tensor(0.03),
    "model.layers.1.self_attn.v_proj.v_scale": torch.tensor(0.007),
    # per kv head
    "model.layers.2.self_attn.k_scale": torch.tensor([0.02, 0.05]),
    "model.layers.2.self_attn.v_scale": torch.tensor([0.01, 0.004]),
}
LAYER_SCALES = {0: ([4.0] * 2, [0.5] * 2), 1: ([0.03] * 2, [0.007] * 2),
                2: ([0.02, 0.05], [0.01, 0.004]), 3: ([1.0] * 2, [1.0] * 2)}


def run_prompt(path: Path, **args) -> tuple[LLM, RequestOutput]:
    """The prompt's logprobs and next token; the cache holds the prompt's K/V alone."""
    llm = LLM(str(path), device=DEVICE, dtype="float32", kv_cache_memory_bytes=8 * 2**20,
              **args)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=2)
    return llm, llm.generate([PROMPT], params, use_tqdm=False)[0]


def reference_prompt_logprobs(reference, scales=None) -> list:
    """The reference's prompt logprobs (as the engine reports them), K/V rounded to FP8 at
    each layer's `scales` (default 1.0)."""
    for index, layer in enumerate(reference.model.layers):
        layer.self_attn.kv_scales = (scales or {}).get(index, (1.0, 1.0))
    with torch.no_grad():
        rows = reference(torch.tensor([PROMPT])).logits[0].log_softmax(-1)
    return [None] + [reference_token_logprobs(row, token, 2)
                     for row, token in zip(rows, PROMPT[1:])]


def test_checkpoint_scales_load_and_are_used(tiny_checkpoint, tmp_path, monkeypatch):
    scaled = with_tensors(tiny_checkpoint, tmp_path / "scaled", CHECKPOINT_SCALES)
    plain, _ = run_prompt(tiny_checkpoint, kv_cache_dtype="fp8")
    llm, output = run_prompt(scaled, kv_cache_dtype="fp8")
    layers = llm.engine.model.model.layers
    for index, (k_scale, v_scale) in LAYER_SCALES.items():
        attention = layers[str(index)].self_attn
        torch.testing.assert_close(attention.k_scale.tolist(), k_scale, atol=0, rtol=1e-7)
        torch.testing.assert_close(attention.v_scale.tolist(), v_scale, atol=0, rtol=1e-7)
    # The store: layer 0's keys and values do not depend on the cache, and its entries are
    # FP8 of them over the checkpoint's scales, which times the scale are the unscaled
    # cache's entries.
    k_scaled, v_scaled = llm.engine.runner.executor.worker.kv_caches[0]
    k_plain, v_plain = plain.engine.runner.executor.worker.kv_caches[0]
    for scaled_cache, plain_cache, scale in ((k_scaled, k_plain, 4.0), (v_scaled, v_plain, 0.5)):
        normal = plain_cache.float().abs() >= max(scale, 1.0) * 2.0 ** -6
        assert normal.sum() > 100
        assert torch.equal((scaled_cache.float() * scale)[normal], plain_cache.float()[normal])
    # Store and attention together: the engine is the reference with K/V rounded through FP8
    # at those scales (within the FP8 rounding tolerance: on a GPU the K/V before rounding
    # come from other kernels), which differs from the reference at scale 1.0 by far more than
    # that tolerance (0.54 at most on the CPU).
    reference = reference_from_engine(plain.engine)
    monkeypatch.setattr(reference_layers.AttentionProjections, "qkv",
                        rounded_through_fp8(reference_layers.AttentionProjections.qkv))
    want = reference_prompt_logprobs(reference, LAYER_SCALES)
    assert_same_logprobs(output.prompt_logprobs, want, atol=FP8_LOGPROB_ATOL)
    unscaled = reference_prompt_logprobs(reference)
    assert max(abs(a.logprob - b.logprob)
               for a, b in zip(want[1:], unscaled[1:])) > 10 * FP8_LOGPROB_ATOL


def test_checkpoint_scales_are_ignored_by_a_model_dtype_cache(tiny_checkpoint, tmp_path):
    scaled = with_tensors(tiny_checkpoint, tmp_path / "scaled", CHECKPOINT_SCALES)
    _, output = run_prompt(scaled)
    _, plain = run_prompt(tiny_checkpoint)
    assert output.outputs[0].token_ids == plain.outputs[0].token_ids
    assert_same_logprobs(output.prompt_logprobs, plain.prompt_logprobs, atol=0, rtol=0)


@pytest.mark.parametrize(("value", "problem"), [
    (torch.tensor([1.0, 2.0, 3.0]), "one value or one per kv head"),
    (torch.tensor(0.0), "positive and finite")])
def test_a_bad_checkpoint_scale_is_a_clear_error(tiny_checkpoint, tmp_path, value, problem):
    bad = with_tensors(tiny_checkpoint, tmp_path / "bad",
                       {"model.layers.1.self_attn.v_scale": value})
    with pytest.raises(CheckpointError, match=f"model.layers.1.self_attn.v_scale.*{problem}"):
        LLM(str(bad), device=DEVICE, kv_cache_dtype="fp8", kv_cache_memory_bytes=8 * 2**20)


def test_calculated_scales_come_from_the_first_step_and_stay():
    llm = tiny_llm(kv_cache_dtype="fp8", calculate_kv_scales=True)
    model = llm.engine.model
    assert model.kv_scales_pending
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([PROMPT, PROMPT[::-1]], params, use_tqdm=False)  # one prefill step
    assert not model.kv_scales_pending
    scales = {i: (layer.self_attn.k_scale.clone(), layer.self_attn.v_scale.clone())
              for i, layer in enumerate(model.model.layers.values())}
    kv_caches = llm.engine.runner.executor.worker.kv_caches
    for (k_scale, v_scale), (k_cache, v_cache) in zip(scales.values(), kv_caches):
        for scale in (k_scale, v_scale):
            assert (scale == scale[0]).all() and 0 < float(scale[0]) != 1.0
        # The step's largest |K| is 200 x the K scale (|V|: 100 x), stored as FP8 neighbours.
        assert float(k_cache.float().abs().max()) in (192.0, 208.0)
        assert float(v_cache.float().abs().max()) in (96.0, 104.0)
    assert len({float(k[0]) for k, _ in scales.values()}) > 1  # each layer its own
    llm.generate(mixed_prompts(8192, 16, count=4), SamplingParams(max_tokens=4),
                 use_tqdm=False)
    for layer, (k_scale, v_scale) in zip(model.model.layers.values(), scales.values()):
        assert torch.equal(layer.self_attn.k_scale, k_scale)
        assert torch.equal(layer.self_attn.v_scale, v_scale)


class RecordingGraphs:
    """Stands in for captured graphs (CPU): records the steps offered to it, covers none."""

    query_len = 1

    def __init__(self) -> None:
        self.offered = 0

    def prepare(self, batch) -> None:
        self.offered += 1
        return None


def test_the_step_that_calculates_scales_runs_eagerly():
    llm = tiny_llm(kv_cache_dtype="fp8", calculate_kv_scales=True)
    worker = llm.engine.runner.executor.worker
    graphs = RecordingGraphs()
    worker.graphs = [graphs]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    llm.generate([PROMPT[:1]], params, use_tqdm=False)  # a one-token prompt: a decode shape
    # Three steps; the first, which set the scales, never looked at the graphs.
    assert graphs.offered == 2
    assert float(llm.engine.model.model.layers["0"].self_attn.k_scale[0]) != 1.0


# ---- settings ----------------------------------------------------------------------------
def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match=r"`kv_cache_dtype` must be one of \['auto', 'fp8', "
                                         r"'fp8_e4m3'\], got 'int3'"):
        LLM("muse-spark-tiny", device="cpu", kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="`calculate_kv_scales` needs an FP8 KV cache"):
        LLM("muse-spark-tiny", device="cpu", calculate_kv_scales=True)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "hi", "--kv-cache-dtype", "int3"])
    with pytest.raises(SystemExit, match="MUSE_KV_CACHE_DTYPE"):
        serve_parser({"MUSE_KV_CACHE_DTYPE": "int3"})


def test_flags_reach_the_engine():
    for parsed in (serve_parser().parse_args(["--kv-cache-dtype", "fp8_e4m3",
                                              "--calculate-kv-scales"]),
                   serve_parser({"MUSE_KV_CACHE_DTYPE": "fp8_e4m3",
                                 "MUSE_CALCULATE_KV_SCALES": "1"}).parse_args([])):
        args = engine_args_from(parsed)
        assert (args.kv_cache_dtype, args.calculate_kv_scales) == ("fp8_e4m3", True)
        assert args.resolve_kv_cache_dtype(torch.bfloat16) == torch.float8_e4m3fn
    assert engine_args_from(serve_parser().parse_args([])).resolve_kv_cache_dtype(
        torch.bfloat16) == torch.bfloat16
    from muse.cli import _engine_args

    generate = build_parser().parse_args(["generate", "--prompt", "hi", "--kv-cache-dtype",
                                          "fp8", "--calculate-kv-scales"])
    assert {key: _engine_args(generate)[key] for key in
            ("kv_cache_dtype", "calculate_kv_scales")} == {"kv_cache_dtype": "fp8",
                                                            "calculate_kv_scales": True}
