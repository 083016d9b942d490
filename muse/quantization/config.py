"""Which quantization a checkpoint uses, and which of its layers it covers.

The layout comes from `config.json`'s `quantization_config` (compressed-tensors, Hugging
Face's `fp8`, gpt-oss's `mxfp4`, ModelOpt's newer exports) or from ModelOpt's
`hf_quant_config.json`. Which layers are quantized comes from the checkpoint itself: a layer
is quantized when its tensors carry the layout's scale. That honours every tool's ignore /
exclude list (`ignore`, `exclude_modules`, `modules_to_not_convert`: those layers are stored
in BF16, without scales) and refuses a fused layer whose parts disagree.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from torch import nn

from muse.checkpoint.layout import CheckpointError
from muse.layers.fused_moe import PER_EXPERT_PROJECTIONS, FusedMoE
from muse.layers.quantization import (FusedMoEMethodBase, LinearMethodBase, QuantizationConfig,
                                      QuantMethod)
from muse.model.loader import FUSED_PARTS
from muse.quantization.fp8 import Fp8LinearMethod, Fp8MoEMethod, Fp8Scheme
from muse.quantization.mxfp4 import Mxfp4LinearMethod, Mxfp4MoEMethod
from muse.quantization.nvfp4 import Nvfp4Layout, Nvfp4LinearMethod, Nvfp4MoEMethod

# Engine layers that fuse several checkpoint projections, and those projections.
FUSED_PROJECTIONS = {fused: [part for part, (owner, _) in FUSED_PARTS.items() if owner == fused]
                     for fused, _ in FUSED_PARTS.values()}


def checkpoint_modules(layer: nn.Module, prefix: str) -> list[str]:
    """The checkpoint modules whose tensors the engine layer named `prefix` loads."""
    if isinstance(layer, FusedMoE):
        return [f"{prefix}.{e}.{projection}" for e in range(layer.num_experts)
                for projection in PER_EXPERT_PROJECTIONS]
    owner, _, name = prefix.rpartition(".")
    parts = FUSED_PROJECTIONS.get(name)
    return [f"{owner}.{part}" for part in parts] if parts else [prefix]


class QuantizedCheckpoint(QuantizationConfig):
    """A checkpoint's quantization: the layers whose checkpoint tensors carry `marker` (a
    tensor only quantized modules have, e.g. `weight_scale`) run with `linear()` or `moe()`;
    the others stay unquantized."""

    def __init__(self, linear: Callable[[], LinearMethodBase],
                 moe: Callable[[], FusedMoEMethodBase], marker: str,
                 quantized_modules: set[str], source: str) -> None:
        self.linear, self.moe = linear, moe
        self.marker = marker
        self.quantized_modules = quantized_modules
        self.source = source  # the layout's name, for messages

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        names = checkpoint_modules(layer, prefix)
        quantized = [name for name in names if name in self.quantized_modules]
        if not quantized:
            return None  # stored unquantized (ignored by the tool that wrote it)
        if len(quantized) != len(names):
            missing = sorted(set(names) - set(quantized))[:3]
            raise CheckpointError(f"`{prefix}` fuses checkpoint modules of which some are "
                                  f"quantized and some not (no {self.marker} for "
                                  f"{', '.join(missing)}); the engine needs them alike")
        return self.moe() if isinstance(layer, FusedMoE) else self.linear()

    def __repr__(self) -> str:
        return f"{self.source} ({len(self.quantized_modules)} modules)"


class GptOssMxfp4Checkpoint(QuantizationConfig):
    """gpt-oss's MXFP4 (`quant_method: "mxfp4"`): stacked experts stored as
    `experts.{gate_up,down}_proj_blocks` and `..._scales`; every other layer (attention, the
    router, the experts named in `modules_to_not_convert`) is stored unquantized."""

    PROJECTIONS = ("gate_up_proj", "down_proj")

    def __init__(self, tensor_names: set[str]) -> None:
        self.tensor_names = tensor_names
        self.quantized = {name.removesuffix(".gate_up_proj_blocks") for name in tensor_names
                          if name.endswith(".gate_up_proj_blocks")}

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        if not isinstance(layer, FusedMoE):
            return None
        wanted = [f"{prefix}.{projection}_{leaf}" for projection in self.PROJECTIONS
                  for leaf in ("blocks", "scales")]
        present = [name for name in wanted if name in self.tensor_names]
        if not present:
            return None  # left unquantized (modules_to_not_convert)
        if len(present) != len(wanted):
            missing = sorted(set(wanted) - set(present))
            raise CheckpointError(f"`{prefix}`: the MXFP4 experts lack {', '.join(missing)}; "
                                  "gpt-oss's layout has blocks and scales for gate_up_proj "
                                  "and down_proj")
        biases = [f"{prefix}.{projection}_bias" in self.tensor_names
                  for projection in self.PROJECTIONS]
        if any(biases) and not all(biases):
            raise CheckpointError(f"`{prefix}` has a bias for one of gate_up_proj and "
                                  "down_proj but not the other")
        return Mxfp4MoEMethod("gpt-oss", expert_bias=all(biases))

    def __repr__(self) -> str:
        return f"gpt-oss MXFP4 experts ({len(self.quantized)} layers)"


def read_quantization_json(directory: Path) -> dict[str, Any] | None:
    """The checkpoint's quantization settings, with `quant_method` set; None if it has none."""
    config_path, modelopt_path = directory / "config.json", directory / "hf_quant_config.json"
    if config_path.is_file():
        found = json.loads(config_path.read_text()).get("quantization_config")
        if found is not None:
            return found
    if modelopt_path.is_file():
        return {"quant_method": "modelopt",
                **json.loads(modelopt_path.read_text()).get("quantization", {})}
    return None


# A layout: (linear method factory, MoE method factory, the marker tensor, its name).
Layout = tuple[Callable[[], LinearMethodBase], Callable[[], FusedMoEMethodBase], str, str]


def _fp8(scheme: Fp8Scheme, source: str) -> Layout:
    return (lambda: Fp8LinearMethod(scheme), lambda: Fp8MoEMethod(scheme), scheme.scale_name,
            f"{source} FP8 {scheme}")


def _nvfp4(layout: Nvfp4Layout, source: str) -> Layout:
    return (lambda: Nvfp4LinearMethod(layout), lambda: Nvfp4MoEMethod(layout), layout.factor,
            f"{source} NVFP4" + (" (W4A4 scales kept)" if layout.static_input_scale else ""))


def _mxfp4(source: str) -> Layout:
    return (Mxfp4LinearMethod, lambda: Mxfp4MoEMethod("compressed-tensors"), "weight_packed",
            f"{source} MXFP4")


def _static_activations(activations: dict[str, Any]) -> bool:
    """Whether a config group stores activation scales: `dynamic: false`, or NVFP4's
    `dynamic: "local"` (per-block scales computed at run time from a stored global scale)."""
    return bool(activations) and activations.get("dynamic", True) in (False, "local")


def _compressed_tensors_layout(settings: dict[str, Any]) -> Layout:
    layout = settings.get("format")
    schemes = set()
    for name, group in settings.get("config_groups", {}).items():
        weights = group.get("weights") or {}
        activations = group.get("input_activations") or {}
        static = _static_activations(activations)
        kind = (weights.get("type"), weights.get("num_bits"))
        group_size, strategy = weights.get("group_size"), weights.get("strategy")
        if kind == ("float", 8):
            block = weights.get("block_structure")
            schemes.add(("fp8", strategy, tuple(block) if block else None, static))
        elif kind == ("float", 4) and group_size == 16 and strategy == "tensor_group":
            schemes.add(("nvfp4", None, None, static))
        elif kind == ("float", 4) and group_size == 32 and strategy == "group" \
                and weights.get("scale_dtype") in (None, "torch.uint8", "uint8"):
            if static:
                raise CheckpointError(f"compressed-tensors group `{name}`: MXFP4 weights with "
                                      "static activation scales are not read; muse reads "
                                      "MXFP4 weight-only (MXFP4A16) or with dynamic "
                                      "activations")
            schemes.add(("mxfp4", None, None, False))
        else:
            raise CheckpointError(f"compressed-tensors group `{name}` ({layout}) has "
                                  f"{weights.get('num_bits')}-bit {weights.get('type')} "
                                  f"weights ({strategy}, groups of {group_size}); muse reads "
                                  "FP8, NVFP4 (4-bit float, groups of 16) and MXFP4 (4-bit "
                                  "float, groups of 32, E8M0 scales) weights")
    if len(schemes) != 1:
        raise CheckpointError(f"compressed-tensors config with {len(schemes)} different weight "
                              "schemes; muse reads one per checkpoint")
    kind, strategy, block, static = schemes.pop()
    if kind == "nvfp4":
        return _nvfp4(Nvfp4Layout("compressed-tensors", static), "compressed-tensors")
    if kind == "mxfp4":
        return _mxfp4("compressed-tensors")
    return _fp8(Fp8Scheme(strategy, block, "weight_scale", static), "compressed-tensors")


def layout_of(settings: dict[str, Any]) -> Layout:
    """The quantized layout a checkpoint's quantization settings describe."""
    method = settings.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_layout(settings)
    if method == "fp8":  # Hugging Face's fine-grained FP8 (DeepSeek's block layout)
        block = settings.get("weight_block_size")
        static = settings.get("activation_scheme") == "static"
        if block is None:
            return _fp8(Fp8Scheme("tensor", None, "weight_scale", static), "fp8")
        return _fp8(Fp8Scheme("block", tuple(block), "weight_scale_inv", static), "fp8")
    if method == "modelopt":
        algorithm = settings.get("quant_algo")
        if algorithm == "FP8":
            return _fp8(Fp8Scheme("tensor", None, "weight_scale", True), "modelopt")
        if algorithm == "NVFP4":
            if settings.get("group_size", 16) != 16:
                raise CheckpointError(f"ModelOpt NVFP4 with group_size "
                                      f"{settings['group_size']}: NVFP4 blocks are 16 wide")
            return _nvfp4(Nvfp4Layout("modelopt", True), "modelopt")
        raise CheckpointError(f"ModelOpt quant_algo {algorithm!r}: muse reads FP8 and NVFP4 "
                              "so far")
    raise CheckpointError(f"quantization method {method!r} is not supported; muse reads "
                          "compressed-tensors (FP8, NVFP4, MXFP4), Hugging Face fp8, gpt-oss "
                          "mxfp4 and ModelOpt (FP8, NVFP4)")


def load_quantization_config(directory: str | Path, tensor_names: Iterable[str]
                             ) -> QuantizationConfig | None:
    """The quantization of the checkpoint in `directory` (None: unquantized), given the names
    of its tensors."""
    settings = read_quantization_json(Path(directory))
    return None if settings is None else quantization_of(settings, tensor_names)


def quantization_of(settings: dict[str, Any], tensor_names: Iterable[str]) -> QuantizationConfig:
    """The quantization that `settings` (a `quantization_config`) describes, over tensors of
    these names."""
    if settings.get("quant_method") == "mxfp4":
        return GptOssMxfp4Checkpoint(set(tensor_names))
    linear, moe, marker, source = layout_of(settings)
    suffix = "." + marker
    quantized = {name[:-len(suffix)] for name in tensor_names if name.endswith(suffix)}
    return QuantizedCheckpoint(linear, moe, marker, quantized, source)
