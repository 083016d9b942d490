"""The reference a quantized load must match: a copy of a quantized checkpoint with every
quantized weight replaced by its dequantized float32 values and no quantization config.

Written from the layouts as their tools document them (docs/formats.md), independently of
muse's quant methods: compressed-tensors FP8, NVFP4 (`weight_global_scale` a divisor) and
MXFP4 (`weight_scale` uint8 E8M0 exponents); ModelOpt FP8 and NVFP4 (`weight_scale_2` a
multiplier); gpt-oss's stacked MXFP4 experts (`*_blocks`, `*_scales`, gate and up rows
interleaved), written back in muse's stacked layout (gate rows, then up rows).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
SCALE_LEAVES = (".weight_scale", ".weight_scale_2", ".weight_global_scale", ".input_scale",
                ".input_global_scale", "_scales", "_bias")


def fp4_values(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n / 2] -> float32 [..., n]: low nibble first, bit 3 the sign."""
    table = torch.tensor(E2M1 + [-v for v in E2M1])
    return torch.stack([table[(packed & 0xF).long()], table[(packed >> 4).long()]],
                       dim=-1).flatten(-2)


def nv_dequantize(packed: torch.Tensor, block_scale: torch.Tensor,
                  row_factor: torch.Tensor) -> torch.Tensor:
    """NVFP4: fp4 * the block's E4M3 scale * each row's per-tensor factor [..., out, 1]."""
    return fp4_values(packed) * block_scale.float().repeat_interleave(16, -1) * row_factor


def mx_dequantize(packed: torch.Tensor, exponents: torch.Tensor) -> torch.Tensor:
    scales = torch.pow(2.0, exponents.to(torch.float32) - 127)
    return fp4_values(packed) * scales.repeat_interleave(32, -1)


def deinterleave(rows: torch.Tensor) -> torch.Tensor:
    """[..., 2I, ...] with rows gate 0, up 0, gate 1, ... -> gate rows then up rows."""
    return torch.cat([rows[:, 0::2], rows[:, 1::2]], dim=1)


def dequantize_tensors(tensors: dict[str, torch.Tensor], gpt_oss_interleaved: bool = True
                       ) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(SCALE_LEAVES):
            continue
        if name.endswith("_blocks"):  # gpt-oss stacked experts [E, rows, groups, 16]
            base = name.removesuffix("_blocks")
            weight = mx_dequantize(tensor.flatten(-2), tensors[base + "_scales"])
            if base.endswith("gate_up_proj") and gpt_oss_interleaved:
                weight = deinterleave(weight)
            out[base] = weight
            continue
        if name.endswith(".weight_packed"):  # compressed-tensors FP4
            module = name.removesuffix(".weight_packed")
            scale = tensors[module + ".weight_scale"]
            if scale.dtype == torch.uint8:
                out[module + ".weight"] = mx_dequantize(tensor, scale)
            else:
                out[module + ".weight"] = (fp4_values(tensor)
                                           * scale.float().repeat_interleave(16, -1)
                                           / tensors[module + ".weight_global_scale"].float())
            continue
        if name.endswith(".weight") and name + "_scale_2" in tensors:  # ModelOpt NVFP4
            scale = tensors[name + "_scale"].float().repeat_interleave(16, -1)
            out[name] = fp4_values(tensor) * scale * tensors[name + "_scale_2"].float()
            continue
        if tensor.dtype == torch.float8_e4m3fn:  # per tensor or per channel
            out[name] = tensor.float() * tensors[name + "_scale"].float()
            continue
        out[name] = tensor.float() if tensor.is_floating_point() else tensor
    return {name: tensor.contiguous() for name, tensor in out.items()}


def dequantized_copy(source: Path, directory: Path, gpt_oss_interleaved: bool = True) -> Path:
    """`source` dequantized into `directory` (with its other files: tokenizer, ...).
    `gpt_oss_interleaved=False` reads gpt-oss's gate_up rows as gate half then up half: the
    wrong reading, for tests that must tell the two apart."""
    tensors = {}
    for file in source.glob("*.safetensors"):
        tensors.update(load_file(file))
    directory.mkdir(parents=True, exist_ok=True)
    save_file(dequantize_tensors(tensors, gpt_oss_interleaved), directory / "model.safetensors")
    for path in source.iterdir():
        if path.is_file() and not path.name.endswith(".safetensors") and path.name not in (
                "config.json", "hf_quant_config.json", "model.safetensors.index.json"):
            shutil.copy2(path, directory / path.name)
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    (directory / "config.json").write_text(json.dumps(config))
    return directory
