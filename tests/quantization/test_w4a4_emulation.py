"""W4A4 emulation of NVFP4 checkpoints: the activation fake-quantization matches
compressed-tensors' own `fake_quantize` bit for bit; emulating linears and experts equals an
independent computation (compressed-tensors' activations times independently dequantized
weights) and stays a bounded distance from W4A16; the engine argument reaches the layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from muse.layers.fused_moe import FusedMoE
from muse.layers.linear import QKVParallelLinear
from muse.layers.quantization import QuantizationConfig
from muse.quantization.common import QuantOptions, expert_param, quant_options
from muse.quantization.fp4_activations import (fake_quantize_nvfp4, global_divisor,
                                               round_to_e2m1)
from muse.quantization.nvfp4 import Nvfp4Layout, Nvfp4LinearMethod, Nvfp4MoEMethod
from tests.quantization.ct_checkpoints import (_dequantize_nvfp4, tiny_qwen3_moe,
                                               write_quantized_checkpoint)

pytest.importorskip("compressed_tensors")
from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # noqa: E402
from compressed_tensors.quantization.quant_scheme import NVFP4  # noqa: E402
from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp  # noqa: E402

ACTIVATIONS = NVFP4["input_activations"]  # compressed-tensors' W4A4 activation arguments


def ct_fake_quantize(x: torch.Tensor, divisor: float | torch.Tensor) -> torch.Tensor:
    """compressed-tensors' dynamic-local NVFP4 activation QDQ (what `forward_quantize` runs
    for an `input_activations` of the NVFP4 scheme), global scale `divisor`."""
    global_scale = torch.as_tensor(divisor, dtype=torch.float32).reshape(1)
    scale, zero_point = compute_dynamic_scales_and_zp(value=x, args=ACTIVATIONS, module=None,
                                                      global_scale=global_scale)
    return fake_quantize(x, scale, zero_point, ACTIVATIONS, global_scale=global_scale)


def test_e2m1_rounding_is_nearest_ties_to_even():
    values = torch.tensor([0.0, 0.1, 0.25, 0.26, 0.5, 0.74, 0.75, 1.25, 1.3, 1.75, 2.5, 2.6,
                           3.5, 4.9, 5.0, 5.01, 6.0])
    want = torch.tensor([0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 1.0, 1.0, 1.5, 2.0, 2.0, 3.0, 4.0,
                         4.0, 4.0, 6.0, 6.0])
    torch.testing.assert_close(round_to_e2m1(values), want, atol=0, rtol=0)
    torch.testing.assert_close(round_to_e2m1(-values), -want, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("divisor", [448 * 6 / 5.0, 3.7, 25000.0])
def test_fake_quantize_matches_compressed_tensors(dtype, divisor):
    """Rows and blocks of very different magnitudes: zero blocks, blocks whose E4M3 scale
    underflows or saturates (a divisor far from the calibration), exact ties."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 9, 64, generator=generator)
    x = x * 10.0 ** torch.randint(-4, 2, (6, 9, 4, 1), generator=generator).float() \
        .repeat_interleave(16, dim=-1).reshape(6, 9, 4, 16).flatten(-2)
    x[0, 0, :16] = 0
    x[0, 1, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 2)
    x = x.to(dtype)
    got = fake_quantize_nvfp4(x, torch.tensor(divisor))
    want = ct_fake_quantize(x, divisor)
    assert got.dtype == dtype == want.dtype
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert not torch.equal(got, x)


def test_global_divisor_takes_the_largest_multiplier():
    stored = torch.tensor([[336.0, 300.0], [10.0, 20.0]])  # compressed-tensors: divisors
    torch.testing.assert_close(global_divisor(stored, True), torch.tensor([300.0, 10.0]))
    multipliers = 1.0 / stored  # ModelOpt's input_scale
    torch.testing.assert_close(global_divisor(multipliers, False), torch.tensor([300.0, 10.0]))
    # a part or an expert without a usable scale (never reached in calibration) is skipped
    torch.testing.assert_close(global_divisor(torch.tensor([[0.0, 5.0], [0.0, float("inf")],
                                                            [7.0, 9.0]]), True),
                               torch.tensor([5.0, 5.0, 7.0]))
    with pytest.raises(ValueError, match="activation scale"):
        global_divisor(torch.tensor([0.0, float("nan")]), False)


class _Config(QuantizationConfig):
    def __init__(self, layout: Nvfp4Layout) -> None:
        self.layout = layout

    def get_quant_method(self, layer, prefix):
        return Nvfp4MoEMethod(self.layout) if isinstance(layer, FusedMoE) \
            else Nvfp4LinearMethod(self.layout)


def _fill_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor,
                generator: torch.Generator) -> None:
    packed.copy_(torch.randint(0, 256, packed.shape, generator=generator, dtype=torch.uint8))
    block_scale.copy_((torch.rand(block_scale.shape, generator=generator) * 4 + 0.5)
                      .to(torch.float8_e4m3fn))


def _qkv(options: QuantOptions, generator: torch.Generator) -> QKVParallelLinear:
    """A W4A4 q/k/v (compressed-tensors names) with per-part global scales."""
    with quant_options(options):
        layer = QKVParallelLinear(64, 32, 2, 1, quant_config=_Config(
            Nvfp4Layout("compressed-tensors", static_input_scale=True)), prefix="qkv")
    _fill_nvfp4(layer.weight_packed.data, layer.weight_scale.data, generator)
    layer.weight_global_scale.data.copy_(torch.tensor([100.0, 200.0, 50.0]))
    layer.input_global_scale.data.copy_(torch.tensor([400.0, 336.0, 500.0]))
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emulated_linear_equals_an_independent_computation(dtype):
    generator = torch.Generator().manual_seed(1)
    emulated = _qkv(QuantOptions(emulate_activations=True), generator)
    assert emulated.quant_method.emulate
    plain = _qkv(QuantOptions(), torch.Generator().manual_seed(1))
    assert not plain.quant_method.emulate
    x = (torch.randn(7, 64, generator=generator) * 2).to(dtype)
    parts = [(slice(0, 64), 100.0), (slice(64, 96), 200.0), (slice(96, 128), 50.0)]
    weight = torch.cat([_dequantize_nvfp4(emulated.weight_packed[rows],
                                          emulated.weight_scale[rows], torch.tensor(divisor))
                        for rows, divisor in parts])
    # Dividing by the global scale here, multiplying by its reciprocal in muse: float32 ulps
    # of the weight (and bfloat16 roundings of those).
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else \
        {"atol": 2e-2, "rtol": 2e-2}
    # one divisor for the fused input: the smallest (the largest multiplier)
    want = F.linear(ct_fake_quantize(x, 336.0), weight.to(dtype))
    got = emulated(x)
    torch.testing.assert_close(got, want, **tolerance)
    w4a16 = plain(x)
    torch.testing.assert_close(w4a16, F.linear(x, weight.to(dtype)), **tolerance)
    # the activation rounding moves the output, by a bounded amount (measured 0.09)
    change = ((got.float() - w4a16.float()).norm() / w4a16.float().norm()).item()
    assert 0.02 < change < 0.2


def _experts(options: QuantOptions, generator: torch.Generator,
             layout: Nvfp4Layout) -> FusedMoE:
    """4 experts, hidden 64, intermediate 32, random NVFP4 weights, per-part global and
    activation scales of different sizes per expert."""
    with quant_options(options):
        layer = FusedMoE(4, 64, 32, expert_norm=True, eps=1e-6, quant_config=_Config(layout),
                         prefix="experts")
    for projection in ("gate_up", "down"):
        _fill_nvfp4(getattr(layer, expert_param(projection, layout.weight)).data,
                    getattr(layer, expert_param(projection, "weight_scale")).data, generator)
        for leaf in (layout.factor, layout.input):
            divisors = torch.rand(getattr(layer, expert_param(projection, leaf)).shape,
                                  generator=generator) * 300 + 50
            getattr(layer, expert_param(projection, leaf)).data.copy_(
                divisors if layout.factor_is_divisor else 1.0 / divisors)
    layer.norm_weight.data.copy_(torch.rand(4, 64, generator=generator) + 0.5)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _divisors(layer: FusedMoE, layout: Nvfp4Layout, projection: str, leaf: str
              ) -> torch.Tensor:
    """[E, parts] divisors from the stored divisors or multipliers."""
    stored = getattr(layer, expert_param(projection, leaf)).data
    return stored if layout.factor_is_divisor else 1.0 / stored


def _expert_weight(layer: FusedMoE, layout: Nvfp4Layout, projection: str, expert: int
                   ) -> torch.Tensor:
    divisor = _divisors(layer, layout, projection, layout.factor)[expert]
    packed = getattr(layer, expert_param(projection, layout.weight))[expert]
    block_scale = getattr(layer, expert_param(projection, "weight_scale"))[expert]
    rows = packed.shape[0] // divisor.numel()
    return torch.cat([_dequantize_nvfp4(packed[p * rows:(p + 1) * rows],
                                        block_scale[p * rows:(p + 1) * rows], divisor[p])
                      for p in range(divisor.numel())])


@pytest.mark.parametrize("layout", ["compressed-tensors", "modelopt"])
def test_emulated_experts_equal_an_independent_computation(layout):
    """Token by token: each expert's input and intermediate fake-quantized by
    compressed-tensors with that expert's own divisor (gate/up: the smaller of the two)."""
    layout = Nvfp4Layout(layout, static_input_scale=True)
    layer = _experts(QuantOptions(emulate_activations=True), torch.Generator().manual_seed(2),
                     layout)
    plain = _experts(QuantOptions(), torch.Generator().manual_seed(2), layout)
    assert layer.quant_method.emulate and not plain.quant_method.emulate
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(9, 64, generator=generator)
    ids = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=generator)
    gate_up_divisor = _divisors(layer, layout, "gate_up", layout.input).amin(-1)
    down_divisor = _divisors(layer, layout, "down", layout.input).amin(-1)
    want = torch.zeros(9, 64)
    for t in range(9):
        for j in range(2):
            e = int(ids[t, j])
            gate_up = ct_fake_quantize(x[t:t + 1], gate_up_divisor[e]) \
                @ _expert_weight(layer, layout, "gate_up", e).t()
            h = F.silu(gate_up[:, :32]) * gate_up[:, 32:]
            y = ct_fake_quantize(h, down_divisor[e]) @ _expert_weight(layer, layout, "down",
                                                                      e).t()
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * layer.norm_weight[e]
            want[t] += weights[t, j] * y[0]
    got = layer.quant_method.apply(layer, x, weights, ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    w4a16 = plain.quant_method.apply(plain, x, weights, ids)
    change = ((got - w4a16).norm() / w4a16.norm()).item()
    assert 0.02 < change < 0.3  # measured 0.16


def test_emulation_needs_activation_scales():
    """A W4A16 checkpoint (no activation scales) runs W4A16 even when emulation is asked."""
    with quant_options(QuantOptions(emulate_activations=True)):
        method = Nvfp4LinearMethod(Nvfp4Layout("compressed-tensors", static_input_scale=False))
    assert not method.emulate


def _w4a4_checkpoint(root: Path) -> Path:
    """compressed-tensors' NVFP4 (W4A16) checkpoint of the tiny Qwen3-MoE, made W4A4: every
    quantized module gets an `input_global_scale` (448 * 6 / 8, activations up to about 8)
    and the config NVFP4's dynamic-local input activations."""
    path = write_quantized_checkpoint(tiny_qwen3_moe(), "nvfp4", root / "w4a4",
                                      torch.tensor([list(range(40, 70))]))
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith(".weight_global_scale")]:
        tensors[name.replace(".weight_global_scale", ".input_global_scale")] = \
            torch.tensor([448 * 6 / 8.0])
    save_file(tensors, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        group["input_activations"] = {"num_bits": 4, "type": "float", "symmetric": True,
                                      "strategy": "tensor_group", "group_size": 16,
                                      "dynamic": "local"}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_engine_argument_emulates_a_w4a4_checkpoint(tmp_path):
    from muse import LLM, SamplingParams

    path = _w4a4_checkpoint(tmp_path)
    params = SamplingParams(max_tokens=1, logprobs=20, temperature=0.0)
    runs = {}
    for emulate in (False, True):
        llm = LLM(str(path), device="cpu", dtype="float32", kv_cache_memory_bytes=16 * 2**20,
                  quantization_emulate_activations=emulate)
        layer = llm.engine.model.model.layers["0"]
        assert layer.self_attn.qkv_proj.quant_method.emulate == emulate
        assert layer.mlp.experts.quant_method.emulate == emulate
        runs[emulate] = dict(llm.generate([list(range(40, 70))], params)[0]
                             .outputs[0].logprobs[0].top)
        llm.shutdown()
    shared = set(runs[False]) & set(runs[True])
    moved = max(abs(runs[True][token] - runs[False][token]) for token in shared)
    assert 0 < moved < 1.0  # measured 0.21
