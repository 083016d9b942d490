"""Quantized checkpoints as users' tools write them load into the engine and run as their
dequantized weights would: compressed-tensors FP8 (per tensor with static activation scales,
per channel, 128 x 128 blocks) and NVFP4 (W4A16), made by compressed-tensors itself; Hugging
Face's block `fp8` (`weight_scale_inv`); ModelOpt FP8 and NVFP4 (`hf_quant_config.json`).
Modules the tool left out (router, LM head, a whole layer's MLP) stay unquantized.

Bounds: greedy tokens equal the dequantized reference's exactly, logprobs within the engine's
batching tolerance (`assert_same_outputs`): the engine multiplies by exactly the dequantized
weights. Against the original float32 model the rounding itself moves the top-20 next-token
logprobs by at most 0.25 with FP8 (measured 0.12 per tensor, 0.12 per channel, 0.14 per
block on this random model) and at most 1.25 with NVFP4 (measured 0.83).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from muse import LLM, SamplingParams
from muse.checkpoint.layout import CheckpointError
from muse.layers.linear import QKVParallelLinear, RowParallelLinear
from muse.layers.quantization import (UnquantizedFusedMoEMethod, UnquantizedLinearMethod,
                                      process_weights_after_loading)
from muse.quantization.config import load_quantization_config
from muse.quantization.fp8 import Fp8LinearMethod, Fp8MoEMethod
from muse.quantization.nvfp4 import Nvfp4LinearMethod, Nvfp4MoEMethod
from tests.engine.helpers import assert_same_outputs
from tests.layers.common import as_tp_rank
from tests.quantization.ct_checkpoints import (dequantized_copy, tiny_qwen3_moe,
                                               write_quantized_checkpoint)

PROMPTS = [[5, 17, 99, 230, 41, 7, 300], [12, 12, 480, 3, 77], list(range(40, 70))]
NVFP4_BOUND = 1.25  # measured 0.83: 16-value blocks of 4-bit floats on random weights
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3,
                        prompt_logprobs=2)


@pytest.fixture(scope="module")
def source():
    return tiny_qwen3_moe()


@pytest.fixture(scope="module")
def checkpoints(source, tmp_path_factory):
    """scheme -> (compressed-tensors checkpoint, its dequantized copy)."""
    root = tmp_path_factory.mktemp("fp8")
    ids = torch.tensor([PROMPTS[2]])
    made = {}
    for scheme in ("tensor", "channel", "block", "nvfp4"):
        quantized = write_quantized_checkpoint(source, scheme, root / scheme, ids)
        made[scheme] = (quantized, dequantized_copy(quantized, root / f"{scheme}-dequantized"))
    return made


def engine(path: Path, **args) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", kv_cache_memory_bytes=16 * 2**20,
               **args)


def methods(llm: LLM) -> dict[str, type]:
    layers = llm.engine.model.model.layers
    return {"qkv": type(layers["0"].self_attn.qkv_proj.quant_method),
            "o": type(layers["0"].self_attn.o_proj.quant_method),
            "router": type(layers["0"].mlp.gate.quant_method),
            "experts": type(layers["0"].mlp.experts.quant_method),
            "ignored_experts": type(layers["1"].mlp.experts.quant_method),
            "layer1_qkv": type(layers["1"].self_attn.qkv_proj.quant_method),
            "lm_head": llm.engine.model.lm_head.weight.dtype}


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_compressed_tensors_fp8_runs_as_its_dequantized_weights(checkpoints, scheme):
    quantized, reference = checkpoints[scheme]
    settings = json.loads((quantized / "config.json").read_text())["quantization_config"]
    assert settings["quant_method"] == "compressed-tensors"
    assert settings["format"] == "float-quantized"
    llm = engine(quantized)
    assert methods(llm) == {"qkv": Fp8LinearMethod, "o": Fp8LinearMethod,
                            "router": UnquantizedLinearMethod, "experts": Fp8MoEMethod,
                            "ignored_experts": UnquantizedFusedMoEMethod,
                            "layer1_qkv": Fp8LinearMethod, "lm_head": torch.float32}
    layer = llm.engine.model.model.layers["0"]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert_same_outputs(llm.generate(PROMPTS, PARAMS), engine(reference).generate(PROMPTS, PARAMS))


def rounding_error(source, quantized: Path) -> float:
    """The largest change of a top-20 next-token logprob against the original model."""
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        want = source(ids).logits[0, -1].log_softmax(-1)
    got = engine(quantized).generate([PROMPTS[2]], SamplingParams(
        max_tokens=1, logprobs=20, temperature=0.0))[0].outputs[0].logprobs[0]
    return max(abs(logprob - want[token].item()) for token, logprob in got.top)


@pytest.mark.parametrize("scheme", ["tensor", "channel", "block"])
def test_fp8_rounding_stays_close_to_the_original_model(source, checkpoints, scheme):
    assert rounding_error(source, checkpoints[scheme][0]) < 0.25


def test_nvfp4_rounding_stays_close_to_the_original_model(source, checkpoints):
    assert rounding_error(source, checkpoints["nvfp4"][0]) < NVFP4_BOUND


def test_compressed_tensors_nvfp4_runs_as_its_dequantized_weights(checkpoints):
    quantized, reference = checkpoints["nvfp4"]
    settings = json.loads((quantized / "config.json").read_text())["quantization_config"]
    assert settings["format"] == "nvfp4-pack-quantized"
    llm = engine(quantized)
    found = methods(llm)
    assert (found["qkv"], found["experts"], found["ignored_experts"], found["router"]) == \
        (Nvfp4LinearMethod, Nvfp4MoEMethod, UnquantizedFusedMoEMethod, UnquantizedLinearMethod)
    layer = llm.engine.model.model.layers["0"]
    assert layer.self_attn.qkv_proj.weight_packed.dtype == torch.uint8
    assert layer.mlp.experts.gate_up_proj_weight_packed.dtype == torch.uint8
    assert_same_outputs(llm.generate(PROMPTS, PARAMS), engine(reference).generate(PROMPTS, PARAMS))


def test_modelopt_nvfp4_reads_weight_scale_2(checkpoints, tmp_path):
    quantized, reference = checkpoints["nvfp4"]
    converted = _rewrite(quantized, tmp_path / "modelopt-nvfp4",
                         rename={"weight_packed": "weight"}, settings=None)
    tensors = load_file(converted / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".weight_global_scale")]:
        module = name[:-len(".weight_global_scale")]
        # ModelOpt stores the per-tensor factor as a multiplier, and activation scales.
        tensors[module + ".weight_scale_2"] = 1.0 / tensors.pop(name)
        tensors[module + ".input_scale"] = torch.ones(())
    save_file(tensors, converted / "model.safetensors")
    write_modelopt_config(converted, {"quant_algo": "NVFP4", "group_size": 16})
    llm = engine(converted)
    assert methods(llm)["experts"] is Nvfp4MoEMethod
    assert_same_outputs(llm.generate(PROMPTS, PARAMS), engine(reference).generate(PROMPTS, PARAMS))


def test_hugging_face_block_fp8_reads_weight_scale_inv(checkpoints, tmp_path):
    quantized, reference = checkpoints["block"]
    converted = _rewrite(quantized, tmp_path / "hf-fp8", rename={"weight_scale": "weight_scale_inv"},
                         settings={"quant_method": "fp8", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128]})
    assert_same_outputs(engine(converted).generate(PROMPTS, PARAMS),
                        engine(reference).generate(PROMPTS, PARAMS))


def test_modelopt_fp8_from_hf_quant_config(checkpoints, tmp_path):
    quantized, reference = checkpoints["tensor"]
    converted = _rewrite(quantized, tmp_path / "modelopt", rename={}, settings=None)
    write_modelopt_config(converted, {"quant_algo": "FP8", "kv_cache_quant_algo": None})
    llm = engine(converted)
    assert methods(llm)["experts"] is Fp8MoEMethod
    assert_same_outputs(llm.generate(PROMPTS, PARAMS), engine(reference).generate(PROMPTS, PARAMS))


def test_a_fused_layer_with_parts_quantized_differently_is_refused(checkpoints, tmp_path):
    quantized, _ = checkpoints["channel"]
    tensors = load_file(quantized / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.weight"
    tensors[name] = tensors[name].float() * tensors.pop(name + "_scale").float()
    broken = _rewrite(quantized, tmp_path / "broken", rename={}, settings=...)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match="k_proj"):
        engine(broken)


def test_unsupported_quantization_is_named(checkpoints, tmp_path):
    quantized, _ = checkpoints["channel"]
    odd = _rewrite(quantized, tmp_path / "odd", rename={}, settings={"quant_method": "awq"})
    with pytest.raises(CheckpointError, match="awq"):
        engine(odd)


def write_modelopt_config(directory: Path, quantization: dict) -> None:
    """ModelOpt's `hf_quant_config.json`, excluding what the test checkpoints leave out."""
    (directory / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt"},
        "quantization": quantization | {
            "exclude_modules": ["lm_head", "*mlp.gate", "model.layers.1.mlp*"]}}))


def _rewrite(source: Path, directory: Path, rename: dict[str, str], settings) -> Path:
    """A copy of `source` with scale suffixes renamed and `quantization_config` replaced
    (None: removed; Ellipsis: kept)."""
    directory.mkdir(parents=True)
    tensors = load_file(source / "model.safetensors")
    renamed = {}
    for name, tensor in tensors.items():
        for old, new in rename.items():
            if name.endswith("." + old):
                name = name[:-len(old)] + new
        renamed[name] = tensor
    save_file(renamed, directory / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    if settings is None:
        config.pop("quantization_config")
    elif settings is not ...:
        config["quantization_config"] = settings
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("scheme", ["tensor", "channel", "nvfp4"])
def test_each_tensor_parallel_rank_loads_its_slice(checkpoints, scheme, monkeypatch):
    """Layer 0's attention over TP = 2, each rank's layers built alone (no other processes):
    every rank loads its slice of the FP8 or packed weights and of their scales (per-part
    scalars, per-channel rows, FP4 blocks) and computes its share of what the dequantized
    projections give."""
    quantized, reference = checkpoints[scheme]
    stored, plain = load_file(quantized / "model.safetensors"), load_file(
        reference / "model.safetensors")
    config = load_quantization_config(quantized, stored)
    prefix = "model.layers.0.self_attn"
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    full = {part: torch.nn.functional.linear(x, plain[f"{prefix}.{part}_proj.weight"])
            for part in "qkv"}
    widths = {"q": 128, "k": 64, "v": 64}  # per rank: 2 of 4 query heads, 1 of 2 kv heads
    attended = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    summed = torch.zeros(3, 256)
    for rank in range(2):
        as_tp_rank(monkeypatch, "muse.layers.linear", 2, rank)
        qkv = QKVParallelLinear(256, 64, 4, 2, quant_config=config, prefix=f"{prefix}.qkv_proj")
        for part in "qkv":
            _load(qkv, stored, f"{prefix}.{part}_proj", part)
        process_weights_after_loading(qkv)
        outputs = qkv(x).split(list(widths.values()), dim=-1)
        for (part, width), output in zip(widths.items(), outputs):
            torch.testing.assert_close(output, full[part][:, rank * width:(rank + 1) * width],
                                       atol=1e-5, rtol=1e-5)
        o_proj = RowParallelLinear(256, 256, reduce_results=False, quant_config=config,
                                   prefix=f"{prefix}.o_proj")
        _load(o_proj, stored, f"{prefix}.o_proj")
        process_weights_after_loading(o_proj)
        summed += o_proj(attended[:, rank * 128:(rank + 1) * 128])
    torch.testing.assert_close(
        summed, torch.nn.functional.linear(attended, plain[f"{prefix}.o_proj.weight"]),
        atol=1e-4, rtol=1e-4)


def test_a_block_split_over_ranks_is_refused(checkpoints, monkeypatch):
    """128 x 128 blocks over TP = 2: a rank's 64 rows of k_proj would cut a block."""
    quantized, _ = checkpoints["block"]
    stored = load_file(quantized / "model.safetensors")
    as_tp_rank(monkeypatch, "muse.layers.linear", 2, 0)
    prefix = "model.layers.0.self_attn"
    qkv = QKVParallelLinear(256, 64, 4, 2, quant_config=load_quantization_config(
        quantized, stored), prefix=f"{prefix}.qkv_proj")
    with pytest.raises(ValueError, match="straddles"):
        _load(qkv, stored, f"{prefix}.k_proj", "k")


def _load(layer, stored: dict, module: str, part=None) -> None:
    """Every checkpoint tensor of `module` into `layer`, through its weight loader."""
    for name, tensor in stored.items():
        if name.startswith(module + "."):
            param = getattr(layer, name[len(module) + 1:])
            if part is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, part)
