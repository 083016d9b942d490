"""FP8 checkpoints written by compressed-tensors itself, from a tiny transformers Qwen3-MoE.

compressed-tensors ships no observers (llm-compressor has them), so the weight scales are
computed here with its own `calculate_qparams` from min-max statistics, as llm-compressor's
MinMax observer does, and static input scales from one calibration forward. transformers 5
keeps Qwen3-MoE experts as 3D parameters, which compressed-tensors does not quantize (it
quantizes `nn.Linear`s), so the experts are first unfused into per-expert linears: the
`mlp.experts.{e}.{gate,up,down}_proj` layout llm-compressor and vLLM use.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.offload import update_offload_parameter  # noqa: E402
from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,  # noqa: E402
                                             QuantizationScheme, QuantizationStatus,
                                             apply_quantization_config)
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

FP8 = dict(num_bits=8, type="float", symmetric=True)
SCHEMES = {
    # per-tensor weights and static per-tensor activations (W8A8, the "FP8" preset)
    "tensor": dict(weights=QuantizationArgs(**FP8, strategy="tensor"),
                   input_activations=QuantizationArgs(**FP8, strategy="tensor", dynamic=False)),
    # per-channel weights, dynamic per-token activations (the "FP8_DYNAMIC" preset)
    "channel": dict(weights=QuantizationArgs(**FP8, strategy="channel"),
                    input_activations=QuantizationArgs(**FP8, strategy="token", dynamic=True)),
    # 128 x 128 blocks (the "FP8_BLOCK" preset's weights), weight-only
    "block": dict(weights=QuantizationArgs(**FP8, strategy="block",
                                           block_structure=[128, 128])),
    # NVFP4 weights, activations unquantized (the "NVFP4A16" preset)
    "nvfp4": dict(weights=QuantizationArgs(num_bits=4, type="float", symmetric=True,
                                           strategy="tensor_group", group_size=16,
                                           scale_dtype=torch.float8_e4m3fn,
                                           zp_dtype=torch.float8_e4m3fn)),
}
# FP4 E2M1 magnitudes by the 3 low bits of a nibble; bit 3 is the sign.
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
# The router, the LM head and every MLP projection of layer 1 stay unquantized.
IGNORE = ["lm_head", r"re:.*mlp\.gate$", r"re:model\.layers\.1\.mlp\..*"]


def tiny_qwen3_moe(seed: int = 0) -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                            moe_intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
                            tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0, 0.05)
    return model


class _Expert(nn.Module):
    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(gate.shape[1], gate.shape[0], bias=False)
        self.up_proj = nn.Linear(up.shape[1], up.shape[0], bias=False)
        self.down_proj = nn.Linear(down.shape[1], down.shape[0], bias=False)
        with torch.no_grad():
            self.gate_proj.weight.copy_(gate)
            self.up_proj.weight.copy_(up)
            self.down_proj.weight.copy_(down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _UnfusedExperts(nn.ModuleList):
    """transformers' fused experts as one module of linears per expert (same forward)."""

    def __init__(self, fused: nn.Module) -> None:
        inter = fused.gate_up_proj.shape[1] // 2
        super().__init__([_Expert(fused.gate_up_proj[e, :inter], fused.gate_up_proj[e, inter:],
                                  fused.down_proj[e])
                          for e in range(fused.gate_up_proj.shape[0])])

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e, expert in enumerate(self):
            token, slot = torch.where(top_k_index == e)
            if token.numel():
                out.index_add_(0, token, expert(hidden[token]) * top_k_weights[token, slot, None])
        return out


def _weight_statistics(weight: torch.Tensor, args: QuantizationArgs
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    if args.strategy == "tensor_group":
        groups = weight.unflatten(-1, (-1, args.group_size))
        return groups.amin(-1), groups.amax(-1)
    if args.strategy == "tensor":
        return weight.amin(), weight.amax()
    if args.strategy == "channel":
        return weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    rows, cols = args.block_structure
    blocks = weight.reshape(weight.shape[0] // rows, rows, weight.shape[1] // cols, cols)
    return blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))


@torch.no_grad()
def _calibrate_inputs(model: nn.Module, modules: list[nn.Module], ids: torch.Tensor) -> None:
    """Static input scales: amax / 448 of each module's input over one forward."""
    amax: dict[nn.Module, torch.Tensor] = {}

    def record(module: nn.Module, args: tuple) -> None:
        seen = args[0].detach().abs().amax().float()
        amax[module] = torch.maximum(amax.get(module, seen), seen)

    hooks = [module.register_forward_pre_hook(record) for module in modules]
    for module in modules:
        module.quantization_enabled = False
    model(ids)
    for hook in hooks:
        hook.remove()
    for module in modules:
        module.quantization_enabled = True
        args = module.quantization_scheme.input_activations
        top = amax.get(module, torch.tensor(1.0))  # an expert no token reached
        scale, _ = calculate_qparams(-top, top, args)
        update_offload_parameter(module, "input_scale", scale.to(module.input_scale.dtype))


@torch.no_grad()
def write_quantized_checkpoint(source: Qwen3MoeForCausalLM, scheme: str, directory: Path,
                         calibration_ids: torch.Tensor) -> Path:
    """Quantize a copy of `source` with compressed-tensors (`SCHEMES[scheme]`, `IGNORE`) and
    save it to `directory` as compressed-tensors saves it."""
    model = copy.deepcopy(source)
    for layer in model.model.layers:
        layer.mlp.experts = _UnfusedExperts(layer.mlp.experts)
    settings = SCHEMES[scheme]
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], **settings)},
        ignore=IGNORE, quantization_status=QuantizationStatus.INITIALIZED)
    apply_quantization_config(model, config)
    modules = [m for m in model.modules() if getattr(m, "quantization_scheme", None) is not None]
    for module in modules:
        args = module.quantization_scheme.weights
        weight = module.weight.float()
        global_scale = None
        if args.strategy == "tensor_group":
            global_scale = generate_gparam(weight.amin(), weight.amax())
            update_offload_parameter(module, "weight_global_scale", global_scale)
        low, high = _weight_statistics(weight, args)
        scale, _ = calculate_qparams(low, high, args, global_scale=global_scale)
        update_offload_parameter(module, "weight_scale", scale.to(module.weight_scale.dtype))
    inputs = settings.get("input_activations")
    if inputs is not None and not inputs.dynamic:
        _calibrate_inputs(model, modules, calibration_ids)
    for module in modules:
        module.quantization_status = QuantizationStatus.FROZEN
    layout = "nvfp4-pack-quantized" if scheme == "nvfp4" else "float-quantized"
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=layout)
    compressor.compress_model(model)
    model.save_pretrained(directory)
    compressor.update_config(directory)
    return directory


def _dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor,
                      global_scale: torch.Tensor) -> torch.Tensor:
    """fp4 * block_scale / global_scale, from the layout as compressed-tensors documents it."""
    table = torch.tensor(E2M1 + [-v for v in E2M1])
    values = torch.stack([table[(packed & 0xF).long()], table[(packed >> 4).long()]], dim=-1)
    values = values.flatten(-2)
    return values * block_scale.float().repeat_interleave(16, -1) / global_scale.float()


def dequantized_copy(source: Path, directory: Path) -> Path:
    """The checkpoint with every FP8 or NVFP4 weight replaced by its dequantized float32
    values (block scales expanded over their blocks) and no quantization: the reference a
    quantized load must match."""
    tensors = {}
    for file in source.glob("*.safetensors"):
        tensors.update(load_file(file))
    out = {}
    for name, tensor in tensors.items():
        if name.endswith((".weight_scale", ".input_scale", ".weight_global_scale")):
            continue
        if name.endswith(".weight_packed"):
            name = name[:-len("_packed")]
            out[name] = _dequantize_nvfp4(tensor, tensors[name + "_scale"],
                                          tensors[name + "_global_scale"])
            continue
        if tensor.dtype == torch.float8_e4m3fn:
            scale = tensors[name + "_scale"].float()
            if scale.dim() == 2 and tuple(scale.shape) != (tensor.shape[0], 1):  # blocks
                scale = scale.repeat_interleave(128, 0)[:tensor.shape[0]]
                scale = scale.repeat_interleave(128, 1)[:, :tensor.shape[1]]
            tensor = tensor.float() * scale
        out[name] = tensor.contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(out, directory / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config")
    (directory / "config.json").write_text(json.dumps(config))
    return directory
