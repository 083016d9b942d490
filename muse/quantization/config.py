"""Which quantization a checkpoint uses, and which of its layers it covers.

The layout comes from `config.json`'s `quantization_config` (compressed-tensors, Hugging
Face's `fp8`, ModelOpt's newer exports) or from ModelOpt's `hf_quant_config.json`. Which
layers are quantized comes from the checkpoint itself: a layer is quantized when its tensors
carry a weight scale. That honours every tool's ignore / exclude list (those layers are
stored in BF16, without scales) and refuses a fused layer whose parts disagree.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from torch import nn

from muse.checkpoint.layout import CheckpointError
from muse.layers.fused_moe import PER_EXPERT_PROJECTIONS, FusedMoE
from muse.layers.quantization import QuantizationConfig, QuantMethod
from muse.quantization.fp8 import Fp8LinearMethod, Fp8MoEMethod, Fp8Scheme

# Engine layers that fuse several checkpoint projections, and those projections.
FUSED_PROJECTIONS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                     "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_modules(layer: nn.Module, prefix: str) -> list[str]:
    """The checkpoint modules whose tensors the engine layer named `prefix` loads."""
    if isinstance(layer, FusedMoE):
        return [f"{prefix}.{e}.{projection}" for e in range(layer.num_experts)
                for projection in PER_EXPERT_PROJECTIONS]
    owner, _, name = prefix.rpartition(".")
    parts = FUSED_PROJECTIONS.get(name)
    return [f"{owner}.{part}" for part in parts] if parts else [prefix]


class Fp8Config(QuantizationConfig):
    def __init__(self, scheme: Fp8Scheme, scaled_modules: set[str], source: str) -> None:
        self.scheme = scheme
        self.scaled_modules = scaled_modules  # modules whose checkpoint tensors have a scale
        self.source = source  # the layout's name, for messages

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantMethod | None:
        names = checkpoint_modules(layer, prefix)
        scaled = [name for name in names if name in self.scaled_modules]
        if not scaled:
            return None  # stored unquantized (ignored by the tool that wrote it)
        if len(scaled) != len(names):
            missing = sorted(set(names) - set(scaled))[:3]
            raise CheckpointError(f"`{prefix}` fuses checkpoint modules of which some are FP8 "
                                  f"and some not (no {self.scheme.scale_name} for "
                                  f"{', '.join(missing)}); the engine needs them alike")
        return Fp8MoEMethod(self.scheme) if isinstance(layer, FusedMoE) \
            else Fp8LinearMethod(self.scheme)

    def __repr__(self) -> str:
        return f"Fp8Config({self.source}, {self.scheme}, {len(self.scaled_modules)} modules)"


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


def _compressed_tensors_scheme(settings: dict[str, Any]) -> tuple[Fp8Scheme, str]:
    layout = settings.get("format")
    schemes = set()
    for name, group in settings.get("config_groups", {}).items():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise CheckpointError(f"compressed-tensors group `{name}` ({layout}) has "
                                  f"{weights.get('num_bits')}-bit {weights.get('type')} weights;"
                                  " muse reads FP8 (8-bit float) weights so far")
        block = weights.get("block_structure")
        activations = group.get("input_activations") or {}
        schemes.add((weights.get("strategy"), tuple(block) if block else None,
                     bool(activations) and not activations.get("dynamic", True)))
    if len(schemes) != 1:
        raise CheckpointError(f"compressed-tensors config with {len(schemes)} different FP8 "
                              "weight schemes; muse reads one per checkpoint")
    strategy, block, static = schemes.pop()
    return Fp8Scheme(strategy, block, "weight_scale", static), f"compressed-tensors {layout}"


def scheme_of(settings: dict[str, Any]) -> tuple[Fp8Scheme, str]:
    """The FP8 scheme a checkpoint's quantization settings describe, and the layout's name."""
    method = settings.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(settings)
    if method == "fp8":  # Hugging Face's fine-grained FP8 (DeepSeek's block layout)
        block = settings.get("weight_block_size")
        static = settings.get("activation_scheme") == "static"
        if block is None:
            return Fp8Scheme("tensor", None, "weight_scale", static), "fp8"
        return Fp8Scheme("block", tuple(block), "weight_scale_inv", static), "fp8 (block)"
    if method == "modelopt":
        algorithm = settings.get("quant_algo")
        if algorithm != "FP8":
            raise CheckpointError(f"ModelOpt quant_algo {algorithm!r}: muse reads FP8 so far")
        return Fp8Scheme("tensor", None, "weight_scale", True), "modelopt FP8"
    raise CheckpointError(f"quantization method {method!r} is not supported; muse reads "
                          "compressed-tensors FP8, Hugging Face fp8 and ModelOpt FP8")


def load_quantization_config(directory: str | Path, tensor_names: Iterable[str]
                             ) -> QuantizationConfig | None:
    """The quantization of the checkpoint in `directory` (None: unquantized), given the names
    of its tensors."""
    settings = read_quantization_json(Path(directory))
    if settings is None:
        return None
    scheme, source = scheme_of(settings)
    suffix = "." + scheme.scale_name
    scaled = {name[:-len(suffix)] for name in tensor_names if name.endswith(suffix)}
    return Fp8Config(scheme, scaled, source)
