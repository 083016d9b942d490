"""MXFP4 checkpoints: compressed-tensors' `mxfp4-pack-quantized` (written by compressed-tensors
itself, and by `muse quantize`, byte for byte the same) and gpt-oss's stacked expert naming
(written here by hand, gate and up rows interleaved) load into the engine and run as their
dequantized weights; tensor and expert parallel ranks load their slice of the packed values
and scales.

Bounds: greedy tokens equal the dequantized reference's exactly and logprobs within the
engine's batching tolerance (1e-4, `assert_same_outputs`): the engine multiplies by exactly the
dequantized weights. Reading gpt-oss's gate/up rows as gate half then up half instead moves
the prompt logprobs of the same model by far more (checked: over 0.5; 2.5 measured).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from muse import LLM, SamplingParams
from muse.checkpoint.layout import CheckpointError
from muse.distributed.config import ParallelConfig
from muse.init_checkpoint import init_random_checkpoint
from muse.layers.fused_moe import FusedMoE, per_expert_target
from muse.layers.linear import QKVParallelLinear, RowParallelLinear
from muse.layers.quantization import (UnquantizedFusedMoEMethod, UnquantizedLinearMethod,
                                      process_weights_after_loading)
from muse.presets import tiny
from muse.quantization.config import (GptOssMxfp4Checkpoint, QuantizedCheckpoint, layout_of,
                                      load_quantization_config)
from muse.quantization.mxfp4 import Mxfp4LinearMethod, Mxfp4MoEMethod
from muse.quantization.quantize import (compressed_tensors_config, quantize_checkpoint,
                                        quantize_mxfp4)
from tests.engine.helpers import assert_same_outputs
from tests.layers.common import FakeGroup, as_tp_rank
from tests.quantization.ct_checkpoints import IGNORE, _UnfusedExperts, tiny_qwen3_moe
from tests.quantization.dequantize import deinterleave, dequantized_copy, mx_dequantize

pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.offload import update_offload_parameter  # noqa: E402
from compressed_tensors.quantization import (QuantizationConfig,  # noqa: E402
                                             QuantizationStatus, apply_quantization_config,
                                             preset_name_to_scheme)
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

PROMPTS = [[5, 17, 99, 230, 41, 7, 300], [12, 12, 480, 3, 77], list(range(40, 70))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3,
                        prompt_logprobs=2)
LAYER_1_MLP = r"re:model\.layers\.1\.mlp\..*"


def engine(path: Path) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", kv_cache_memory_bytes=16 * 2**20)


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in folder.glob("*.safetensors"):
        out.update(load_file(file))
    return out


# ---- compressed-tensors' MXFP4 ----------------------------------------------------------------

@torch.no_grad()
def write_ct_mxfp4(source: torch.nn.Module, directory: Path) -> Path:
    """compressed-tensors' own MXFP4A16 checkpoint of `source` (experts unfused into
    per-expert linears, `IGNORE` left out), scales from its `calculate_qparams` over each
    group's min and max, as llm-compressor's MinMax observer gives them."""
    model = copy.deepcopy(source)
    for layer in model.model.layers:
        layer.mlp.experts = _UnfusedExperts(layer.mlp.experts)
    config = QuantizationConfig(
        config_groups={"group_0": preset_name_to_scheme("MXFP4A16", ["Linear"])},
        ignore=IGNORE, quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        groups = module.weight.float().unflatten(-1, (-1, 32))
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1),
                                     module.quantization_scheme.weights)
        update_offload_parameter(module, "weight_scale", scale.to(module.weight_scale.dtype))
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(
        model, quantization_format="mxfp4-pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)
    return directory


@pytest.fixture(scope="module")
def ct_mxfp4(tmp_path_factory):
    """(the source model, its folder, compressed-tensors' MXFP4 checkpoint of it)."""
    model = tiny_qwen3_moe()
    root = tmp_path_factory.mktemp("ct-mxfp4")
    model.save_pretrained(root / "source")
    return model, root / "source", write_ct_mxfp4(model, root / "theirs")


def test_muse_quantize_mxfp4_is_what_compressed_tensors_writes(ct_mxfp4, tmp_path):
    _, source, theirs = ct_mxfp4
    ours = tmp_path / "ours"
    settings = quantize_checkpoint(source, ours, "mxfp4", ignore=[LAYER_1_MLP], progress=False)
    mine, reference = tensors(ours), tensors(theirs)
    assert set(mine) == set(reference)
    for name, tensor in reference.items():
        assert mine[name].dtype == tensor.dtype and torch.equal(mine[name], tensor), name
    written = json.loads((theirs / "config.json").read_text())["quantization_config"]
    assert settings["format"] == written["format"] == "mxfp4-pack-quantized"
    assert settings["config_groups"]["group_0"]["weights"] == \
        written["config_groups"]["group_0"]["weights"]
    assert set(settings["ignore"]) == set(written["ignore"])


def test_compressed_tensors_mxfp4_runs_as_its_dequantized_weights(ct_mxfp4, tmp_path):
    _, _, theirs = ct_mxfp4
    llm = engine(theirs)
    layers = llm.engine.model.model.layers
    assert type(layers["0"].self_attn.qkv_proj.quant_method) is Mxfp4LinearMethod
    assert type(layers["0"].mlp.experts.quant_method) is Mxfp4MoEMethod
    assert type(layers["1"].mlp.experts.quant_method) is UnquantizedFusedMoEMethod
    assert type(layers["0"].mlp.gate.quant_method) is UnquantizedLinearMethod
    assert layers["0"].mlp.experts.gate_up_proj_weight_scale.dtype == torch.uint8
    reference = dequantized_copy(theirs, tmp_path / "dequantized")
    assert_same_outputs(llm.generate(PROMPTS, PARAMS, use_tqdm=False),
                        engine(reference).generate(PROMPTS, PARAMS, use_tqdm=False))


def test_mxfp4_rounding_stays_close_to_the_original_model(ct_mxfp4):
    """MXFP4 rounding (power-of-two scales, groups of 32) of the random test model moves
    the top-20 next-token logprobs by at most 1.0 (0.52 measured)."""
    model, _, theirs = ct_mxfp4
    with torch.no_grad():
        want = model(torch.tensor([PROMPTS[2]])).logits[0, -1].log_softmax(-1)
    got = engine(theirs).generate([PROMPTS[2]], SamplingParams(
        max_tokens=1, logprobs=20, temperature=0.0), use_tqdm=False)[0].outputs[0].logprobs[0]
    assert max(abs(logprob - want[token].item()) for token, logprob in got.top) < 1.0


@pytest.mark.parametrize("rank", [0, 1])
def test_each_tensor_parallel_rank_loads_its_slice_of_a_linear(ct_mxfp4, monkeypatch, rank):
    """Layer 0's q/k/v and o_proj over TP = 2: each rank's packed values and E8M0 scales
    give its rows (q/k/v) or columns (o_proj, 128 of 256 inputs) of the dequantized weight."""
    _, _, theirs = ct_mxfp4
    stored = tensors(theirs)
    config = load_quantization_config(theirs, stored)
    prefix = "model.layers.0.self_attn"
    as_tp_rank(monkeypatch, "muse.layers.linear", 2, rank)
    qkv = QKVParallelLinear(256, 64, 4, 2, quant_config=config, prefix=f"{prefix}.qkv_proj")
    o_proj = RowParallelLinear(256, 256, reduce_results=False, quant_config=config,
                               prefix=f"{prefix}.o_proj")
    for layer, parts in ((qkv, "qkv"), (o_proj, None)):
        for part in parts or [None]:
            module = f"{prefix}.{part}_proj" if part else f"{prefix}.o_proj"
            for leaf in ("weight_packed", "weight_scale"):
                param = getattr(layer, leaf)
                args = (part,) if part else ()
                param.weight_loader(param, stored[f"{module}.{leaf}"], *args)
        process_weights_after_loading(layer)

    def full(module: str) -> torch.Tensor:
        return mx_dequantize(stored[f"{module}.weight_packed"],
                                stored[f"{module}.weight_scale"])

    widths = {"q": 128, "k": 64, "v": 64}
    want = torch.cat([full(f"{prefix}.{part}_proj")[rank * width:(rank + 1) * width]
                      for part, width in widths.items()])
    assert torch.equal(qkv.quant_method.dequantized(qkv), want)
    assert torch.equal(o_proj.quant_method.dequantized(o_proj),
                       full(f"{prefix}.o_proj")[:, rank * 128:(rank + 1) * 128])


# ---- gpt-oss's naming -------------------------------------------------------------------------

def interleave(rows: torch.Tensor) -> torch.Tensor:
    """Gate rows then up rows [E, 2I, ...] -> gpt-oss's order (gate 0, up 0, gate 1, ...)."""
    gate, up = rows.chunk(2, dim=1)
    return torch.stack([gate, up], dim=2).flatten(1, 2)


def gpt_oss_experts(gate_up: torch.Tensor, down: torch.Tensor, bias: bool = True
                    ) -> dict[str, torch.Tensor]:
    """gpt-oss's MXFP4 tensors of stacked experts gate_up [E, 2I, L] (gate rows first) and
    down [E, L, I]: blocks [E, rows, in / 32, 16], scales [E, rows, in / 32], zero biases."""
    out = {}
    for name, weight in (("gate_up_proj", gate_up), ("down_proj", down)):
        quantized = quantize_mxfp4(weight)
        packed, scales = quantized["weight_packed"], quantized["weight_scale"]
        if name == "gate_up_proj":
            packed, scales = interleave(packed), interleave(scales)
        out[f"{name}_blocks"] = packed.unflatten(-1, (-1, 16)).contiguous()
        out[f"{name}_scales"] = scales.contiguous()
        if bias:
            out[f"{name}_bias"] = torch.zeros(weight.shape[:2], dtype=torch.bfloat16)
    return out


def write_gpt_oss_mxfp4(source: Path, directory: Path, keep: tuple[int, ...] = (1,),
                        bias: bool = True) -> Path:
    """`source` (a muse checkpoint) with the experts of every layer but `keep` in gpt-oss's
    MXFP4 naming; the kept layers' experts and everything else stay as they are, listed in
    `modules_to_not_convert`."""
    directory.mkdir(parents=True)
    stored = tensors(source)
    out = {}
    layers = sorted({int(name.split(".")[2]) for name in stored
                     if name.endswith("mlp.experts.gate_up_proj")})
    for name, tensor in stored.items():
        if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")) \
                or int(name.split(".")[2]) in keep:
            out[name] = tensor
    for layer in layers:
        if layer in keep:
            continue
        prefix = f"model.layers.{layer}.mlp.experts"
        for name, tensor in gpt_oss_experts(stored[f"{prefix}.gate_up_proj"],
                                            stored[f"{prefix}.down_proj"], bias).items():
            out[f"{prefix}.{name}"] = tensor
    save_file(out, directory / "model.safetensors")
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            (directory / path.name).write_bytes(path.read_bytes())
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.gate",
                                   "model.layers.*.mlp.pooler", "model.layers.*.mlp.unpooler",
                                   "model.layers.*.mlp.shared_expert", "lm_head",
                                   *[f"model.layers.{layer}.mlp.experts" for layer in keep]]}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(muse's tiny preset with weights large enough that the experts matter, its gpt-oss
    MXFP4 copy with layer 1's experts left in BF16)."""
    root = tmp_path_factory.mktemp("gpt-oss")
    source = init_random_checkpoint(tiny(), root / "source", seed=3, dtype="float32",
                                    std=0.15)
    return source, write_gpt_oss_mxfp4(source, root / "mxfp4")


def test_gpt_oss_mxfp4_runs_as_its_dequantized_weights(gpt_oss, tmp_path):
    _, quantized = gpt_oss
    llm = engine(quantized)
    layers = llm.engine.model.model.layers
    experts = layers["0"].mlp.experts
    assert type(experts.quant_method) is Mxfp4MoEMethod
    assert experts.gate_up_proj_blocks.shape == (8, 64, 1, 16)  # E, 2I, L / 32, 16
    assert experts.down_proj_scales.shape == (8, 32, 1)
    # modules_to_not_convert: layer 1's experts, attention, router, shared expert stay BF16.
    assert type(layers["1"].mlp.experts.quant_method) is UnquantizedFusedMoEMethod
    for linear in (layers["0"].self_attn.qkv_proj, layers["0"].mlp.gate,
                   layers["0"].mlp.shared_expert.gate_up_proj):
        assert type(linear.quant_method) is UnquantizedLinearMethod
    got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    right = engine(dequantized_copy(quantized, tmp_path / "right"))
    assert_same_outputs(got, right.generate(PROMPTS, PARAMS, use_tqdm=False))
    # The same tensors with gate/up read as halves: a different model, far outside the bound.
    wrong = engine(dequantized_copy(quantized, tmp_path / "wrong", gpt_oss_interleaved=False))
    assert largest_logprob_gap(got, wrong.generate(PROMPTS, PARAMS, use_tqdm=False)) > 0.5


def largest_logprob_gap(got, want) -> float:
    """The largest difference of a prompt token's logprob between two runs."""
    gap = 0.0
    for mine, theirs in zip(got, want):
        for a, b in zip(mine.prompt_logprobs[1:], theirs.prompt_logprobs[1:]):
            gap = max(gap, abs(a.logprob - b.logprob))
    return gap


def test_a_non_zero_expert_bias_is_refused_by_name(gpt_oss, tmp_path):
    _, quantized = gpt_oss
    broken = tmp_path / "biased"
    broken.mkdir()
    stored = tensors(quantized)
    stored["model.layers.2.mlp.experts.down_proj_bias"][3, 5] = 0.25
    save_file(stored, broken / "model.safetensors")
    for path in quantized.iterdir():
        if path.suffix != ".safetensors":
            (broken / path.name).write_bytes(path.read_bytes())
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.experts\.down_proj_bias"):
        engine(broken)


def use_parallel(monkeypatch, config: ParallelConfig, rank: int) -> None:
    module = "muse.layers.fused_moe"
    monkeypatch.setattr(f"{module}.get_parallel_config", lambda: config)
    monkeypatch.setattr(f"{module}.get_tp_group",
                        lambda: FakeGroup(config.tensor_parallel_size, rank))
    monkeypatch.setattr(f"{module}.get_ep_group",
                        lambda: FakeGroup(config.expert_parallel_size, rank))


def per_expert_mxfp4(gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' per-expert MXFP4 tensors, named relative to the experts module."""
    inter = gate_up.shape[1] // 2
    out = {}
    for expert in range(gate_up.shape[0]):
        for part, weight in (("gate_proj", gate_up[expert, :inter]),
                             ("up_proj", gate_up[expert, inter:]), ("down_proj", down[expert])):
            for leaf, tensor in quantize_mxfp4(weight).items():
                out[f"{expert}.{part}.{leaf}"] = tensor
    return out


@pytest.mark.parametrize("layout", ["gpt-oss", "compressed-tensors"])
@pytest.mark.parametrize("ep", [False, True], ids=["tp2", "ep2"])
@pytest.mark.parametrize("rank", [0, 1])
def test_each_rank_loads_its_slice_of_mxfp4_experts(monkeypatch, layout, ep, rank):
    """Experts of width 64 and intermediate 128 over TP = 2 (each rank 64 intermediate
    features: its gate rows and up rows, out of gpt-oss's interleaved tensor or the
    per-expert parts, and its 2 of 4 groups of down's inputs) or EP = 2 (whole experts): the
    dequantized weights are the rank's slice of the whole."""
    experts, hidden, inter = 4, 64, 128
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=generator)
    down = torch.randn(experts, hidden, inter, generator=generator)
    stored = gpt_oss_experts(gate_up, down)
    full = {"gate_up": deinterleave(mx_dequantize(stored["gate_up_proj_blocks"].flatten(-2),
                                                     stored["gate_up_proj_scales"])),
            "down": mx_dequantize(stored["down_proj_blocks"].flatten(-2),
                                     stored["down_proj_scales"])}
    use_parallel(monkeypatch, ParallelConfig(tensor_parallel_size=2,
                                             enable_expert_parallel=ep), rank)
    prefix = "model.layers.0.mlp.experts"
    if layout == "gpt-oss":
        config = GptOssMxfp4Checkpoint({f"{prefix}.{name}" for name in stored})
        layer = FusedMoE(experts, hidden, inter, quant_config=config, prefix=prefix)
        for name, tensor in stored.items():
            param = getattr(layer, name)
            param.weight_loader(param, tensor)
    else:
        per_expert = per_expert_mxfp4(gate_up, down)
        config = ct_mxfp4_config({f"{prefix}.{name}" for name in per_expert})
        layer = FusedMoE(experts, hidden, inter, quant_config=config, prefix=prefix)
        for name, tensor in per_expert.items():
            param_name, expert_id, shard_id = per_expert_target(name)
            param = getattr(layer, param_name)
            param.weight_loader(param, tensor, shard_id=shard_id, expert_id=expert_id)
    process_weights_after_loading(layer)
    method = layer.quant_method
    if ep:
        mine = slice(rank * experts // 2, (rank + 1) * experts // 2)
        want = {"gate_up": full["gate_up"][mine], "down": full["down"][mine]}
    else:
        half = inter // 2
        rows = slice(rank * half, (rank + 1) * half)
        gate, up = full["gate_up"].chunk(2, dim=1)
        want = {"gate_up": torch.cat([gate[:, rows], up[:, rows]], dim=1),
                "down": full["down"][:, :, rows]}
    for projection in ("gate_up", "down"):
        assert torch.equal(method.dequantized(layer, projection), want[projection]), projection


def ct_mxfp4_config(tensor_names: set[str]) -> QuantizedCheckpoint:
    """The config muse reads from compressed-tensors' MXFP4 checkpoint with these tensors."""
    linear, moe, marker, source = layout_of(compressed_tensors_config("mxfp4", []))
    suffix = "." + marker
    return QuantizedCheckpoint(linear, moe, marker, {name.removesuffix(suffix) for name in
                                                     tensor_names if name.endswith(suffix)},
                               source)


def test_gpt_oss_experts_missing_scales_are_named(gpt_oss, tmp_path):
    _, quantized = gpt_oss
    names = set(tensors(quantized)) - {"model.layers.0.mlp.experts.down_proj_scales"}
    config = GptOssMxfp4Checkpoint(names)
    with pytest.raises(CheckpointError, match="down_proj_scales"):
        config.get_quant_method(FusedMoE(8, 32, 32), "model.layers.0.mlp.experts")
