"""The quant-method interface fits quantized layouts: a toy W4A16 method shaped like NVFP4
(two 4-bit codes per byte along the input, one scale per 16 inputs, one global scale per fused
part) is created, sharded and loaded by the same layers and loaders as the unquantized one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from muse.layers.fused_moe import FusedMoE
from muse.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from muse.layers.quantization import (
    FusedMoEMethodBase,
    LinearMethodBase,
    QuantizationConfig,
    UnquantizedFusedMoEMethod,
    UnquantizedLinearMethod,
    new_parameter,
    process_weights_after_loading,
)
from tests.layers.common import SHARDED_TOLERANCE, as_tp_rank, randn

EXACT = {"rtol": 0.0, "atol": 0.0}
BLOCK = 16


class PackedInt4Method(LinearMethodBase):
    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, weight_loader) -> None:
        rows = sum(output_partition_sizes)
        new_parameter(layer, "weight_packed", (rows, input_size_per_partition // 2),
                      torch.uint8, weight_loader, output_dim=0, input_dim=1)
        new_parameter(layer, "weight_scale", (rows, input_size_per_partition // BLOCK),
                      torch.float32, weight_loader, output_dim=0, input_dim=1)
        new_parameter(layer, "weight_global_scale", (len(output_partition_sizes),),
                      torch.float32, weight_loader, per_shard=True)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        global_scale = layer.weight_global_scale.repeat_interleave(
            torch.tensor(layer.output_partition_sizes))
        layer.dequantized = dequantize(layer.weight_packed, layer.weight_scale,
                                       global_scale[:, None])

    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.dequantized, bias)


class ToyConfig(QuantizationConfig):
    """Quantizes every linear layer but those named in `excluded`."""

    def __init__(self, excluded: tuple[str, ...] = (), method=None) -> None:
        self.excluded = excluded
        self.method = method or PackedInt4Method()

    def get_quant_method(self, layer: nn.Module, prefix: str):
        return None if prefix in self.excluded else self.method


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] codes in 0..15 -> [out, in/2] bytes, the even (first) code in the low nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def dequantize(packed: torch.Tensor, scale: torch.Tensor,
               global_scale: torch.Tensor) -> torch.Tensor:
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).float()
    return (codes - 8) * scale.repeat_interleave(BLOCK, dim=-1) * global_scale


def quantized_part(rows: int, columns: int, seed: int) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors for one projection, as a quantization tool would write them."""
    gen = torch.Generator().manual_seed(seed)
    return {"weight_packed": pack(torch.randint(0, 16, (rows, columns), generator=gen)),
            "weight_scale": torch.rand(rows, columns // BLOCK, generator=gen) + 0.5,
            "weight_global_scale": torch.rand((), generator=gen) + 0.5}


def dense(part: dict[str, torch.Tensor]) -> torch.Tensor:
    return dequantize(part["weight_packed"], part["weight_scale"], part["weight_global_scale"])


def load_part(layer: nn.Module, part: dict[str, torch.Tensor], shard_id=None) -> None:
    for name, tensor in part.items():
        param = getattr(layer, name)
        param.weight_loader(param, tensor, shard_id)


def test_merged_parts_with_their_own_global_scales() -> None:
    parts = [quantized_part(16, 64, seed=1), quantized_part(32, 64, seed=2)]
    layer = MergedColumnParallelLinear(64, [16, 32], quant_config=ToyConfig())
    assert layer.weight_packed.shape == (48, 32) and layer.weight_packed.dtype == torch.uint8
    assert layer.weight_scale.shape == (48, 4) and layer.weight_global_scale.shape == (2,)
    for shard_id, part in enumerate(parts):
        load_part(layer, part, shard_id)
    process_weights_after_loading(layer)
    x = randn(5, 64, seed=3)
    expected = F.linear(x, torch.cat([dense(part) for part in parts]))
    torch.testing.assert_close(layer(x), expected, **EXACT)


def test_row_parallel_slices_packed_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """The input dimension is stored 2 codes per byte and 16 per scale: each rank's slice of
    both is found from the parameter's stored width."""
    part = quantized_part(24, 128, seed=4)
    x = randn(5, 128, seed=5)
    total = torch.zeros(5, 24)
    tp = 2
    for rank in range(tp):
        as_tp_rank(monkeypatch, "muse.layers.linear", tp, rank)
        layer = RowParallelLinear(128, 24, reduce_results=False, quant_config=ToyConfig())
        load_part(layer, part)
        torch.testing.assert_close(layer.weight_packed,
                                   part["weight_packed"][:, rank * 32:(rank + 1) * 32], **EXACT)
        torch.testing.assert_close(layer.weight_scale,
                                   part["weight_scale"][:, rank * 4:(rank + 1) * 4], **EXACT)
        process_weights_after_loading(layer)
        total += layer(x[:, rank * 64:(rank + 1) * 64])
    torch.testing.assert_close(total, F.linear(x, dense(part)), **SHARDED_TOLERANCE)


def test_qkv_per_shard_global_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    parts = {"q": quantized_part(32, 32, seed=6), "k": quantized_part(16, 32, seed=7),
             "v": quantized_part(16, 32, seed=8)}
    x = randn(5, 32, seed=9)
    full = {name: F.linear(x, dense(part)) for name, part in parts.items()}
    tp = 2
    for rank in range(tp):
        as_tp_rank(monkeypatch, "muse.layers.linear", tp, rank)
        layer = QKVParallelLinear(32, 8, 4, 2, quant_config=ToyConfig())
        for name, part in parts.items():
            load_part(layer, part, name)
        expected_scales = torch.stack([parts[n]["weight_global_scale"] for n in "qkv"])
        torch.testing.assert_close(layer.weight_global_scale, expected_scales, **EXACT)
        process_weights_after_loading(layer)
        q, k, v = layer(x).split([16, 8, 8], dim=-1)
        torch.testing.assert_close(q, full["q"][:, rank * 16:(rank + 1) * 16],
                                   **SHARDED_TOLERANCE)
        torch.testing.assert_close(k, full["k"][:, rank * 8:(rank + 1) * 8], **SHARDED_TOLERANCE)
        torch.testing.assert_close(v, full["v"][:, rank * 8:(rank + 1) * 8], **SHARDED_TOLERANCE)


def test_config_picks_methods_by_prefix() -> None:
    config = ToyConfig(excluded=("lm_head",))
    assert isinstance(RowParallelLinear(32, 8, quant_config=config, prefix="o_proj").quant_method,
                      PackedInt4Method)
    kept = RowParallelLinear(32, 8, quant_config=config, prefix="lm_head")
    assert isinstance(kept.quant_method, UnquantizedLinearMethod)
    assert kept.weight.shape == (8, 32)
    moe = FusedMoE(4, 16, 8, quant_config=ToyConfig(excluded=("experts",)), prefix="experts")
    assert isinstance(moe.quant_method, UnquantizedFusedMoEMethod)


def test_config_giving_the_wrong_kind_of_method() -> None:
    class MoEOnly(FusedMoEMethodBase):
        def create_weights(self, *args, **kwargs) -> None: ...

        def apply(self, *args, **kwargs) -> torch.Tensor: ...

    with pytest.raises(TypeError, match="`o_proj`; it must be a LinearMethodBase"):
        RowParallelLinear(32, 8, quant_config=ToyConfig(method=MoEOnly()), prefix="o_proj")
    with pytest.raises(TypeError, match="`experts`; it must be a FusedMoEMethodBase"):
        FusedMoE(4, 16, 8, quant_config=ToyConfig(), prefix="experts")
