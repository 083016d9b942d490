"""Reading a LoRA adapter in the PEFT layout (`adapter_config.json` + `adapter_model.safetensors`).

What PEFT writes, and how each piece maps to the base model's weights:

* a linear module targeted by `target_modules` (`...self_attn.q_proj`): `lora_A.weight` [r, in]
  and `lora_B.weight` [out, r]; the module's weight W [out, in] becomes W + s * B @ A;
* a stacked-experts parameter targeted by `target_parameters` (`...mlp.experts.gate_up_proj`
  [E, out, in], as transformers' Qwen3-MoE and muse store them): one `lora_A.weight`
  [r * E, in] and `lora_B.weight` [out, r * E]; expert e's delta is B_e @ A_e with
  A_e = A.reshape(E, r, in)[e] and B_e = B.reshape(out, r, E)[:, :, e] (PEFT's `ParamWrapper`).
  Several parameters of one module are nested wrappers: the first parameter the module
  registers is the innermost (`experts.base_layer.lora_A`), the last the outermost;
* per-expert linear modules of older checkpoints (`...mlp.experts.3.gate_proj`): plain linear
  LoRA per expert.

The scale s is lora_alpha / r (lora_alpha / sqrt(r) with `use_rslora`), with `rank_pattern` and
`alpha_pattern` matched as PEFT matches them. Adapters whose numerics this engine would not
reproduce (DoRA, LoRA biases, `modules_to_save`, embeddings) are refused with the reason.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# The stacked-experts parameters in the order their module registers them (the nesting order).
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
_PEFT_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+?)(?P<wrappers>(?:\.base_layer)*)\.lora_(?P<factor>[AB])"
                  r"(?:\.[A-Za-z0-9_-]+)?\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be read or does not fit the model; the message says why."""


@dataclass
class LoRAWeights:
    """One adapted weight: delta = scaling * b @ a, per expert when `a` is 3-D.

    a: [r, in] or [E, r, in]; b: [out, r] or [E, out, r] (float32, as read)."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[-2]

    @property
    def delta_shape(self) -> tuple[int, ...]:
        """The adapted weight's shape: [out, in], or [E, out, in]."""
        return (*self.b.shape[:-1], self.a.shape[-1])

    def delta(self) -> torch.Tensor:
        """scaling * B @ A, the change the adapter makes to the weight (float32)."""
        return self.scaling * torch.matmul(self.b, self.a)


@dataclass
class PeftAdapter:
    """An adapter's weights by the base checkpoint's names: a module path
    (`model.layers.0.self_attn.q_proj`) or, for stacked experts, the parameter's path
    (`model.layers.0.mlp.experts.gate_up_proj`)."""

    weights: dict[str, LoRAWeights]
    config: dict[str, Any]
    # A hash of the config and every tensor: the same adapter has the same id in every process
    # and after a restart (prefix-cache keys carry it).
    content_id: str = ""
    source: str = ""
    max_rank: int = field(init=False)

    def __post_init__(self) -> None:
        self.max_rank = max((w.rank for w in self.weights.values()), default=0)


def read_adapter(path: str | Path | None = None, *, config: dict[str, Any] | None = None,
                 tensors: dict[str, torch.Tensor] | None = None,
                 num_experts: int | None = None) -> PeftAdapter:
    """An adapter from a PEFT folder, or from its config and state dict in memory (an
    in-process hand-over from a trainer). `num_experts`: the base model's routed experts,
    needed to split stacked-experts factors."""
    source = str(path) if path is not None else "the in-memory adapter"
    if path is not None:
        folder = Path(path)
        config_file, weights_file = folder / ADAPTER_CONFIG, folder / ADAPTER_WEIGHTS
        if not config_file.is_file():
            raise AdapterError(f"{source}: no {ADAPTER_CONFIG} (a PEFT adapter folder has "
                               f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
        if not weights_file.is_file():
            raise AdapterError(f"{source}: no {ADAPTER_WEIGHTS}")
        from safetensors.torch import load_file

        config = json.loads(config_file.read_text())
        tensors = load_file(str(weights_file))
    if config is None or tensors is None:
        raise AdapterError("an adapter needs a path, or both its config and its tensors")
    _check_supported(config, source)
    weights = _parse(config, tensors, num_experts, source)
    if not weights:
        raise AdapterError(f"{source}: no LoRA weights found (expected keys ending in "
                           f"lora_A.weight / lora_B.weight)")
    return PeftAdapter(weights, config, _content_id(config, tensors), source)


def config_max_rank(path: str | Path) -> int:
    """The largest rank an adapter folder's config declares (`r` and `rank_pattern`): what
    `--max-lora-rank` must allow to serve it."""
    config_file = Path(path) / ADAPTER_CONFIG
    if not config_file.is_file():
        raise AdapterError(f"{path}: no {ADAPTER_CONFIG}")
    config = json.loads(config_file.read_text())
    return max([int(config.get("r", 8)), *map(int, (config.get("rank_pattern") or {}).values())])


def _check_supported(config: dict[str, Any], source: str) -> None:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{source}: peft_type {peft_type!r} is not a LoRA adapter")
    refused = {"use_dora": "DoRA", "modules_to_save": "modules_to_save (full copies of modules)",
               "trainable_token_indices": "trainable token indices"}
    for key, what in refused.items():
        if config.get(key):
            raise AdapterError(f"{source}: {what} is not supported")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise AdapterError(f"{source}: LoRA biases are not supported (bias must be 'none')")
    if config.get("fan_in_fan_out"):
        raise AdapterError(f"{source}: fan_in_fan_out (Conv1D layers) is not supported")


def _pattern_value(patterns: dict[str, Any], key: str, default: Any) -> Any:
    """PEFT's rule: a pattern applies when the key ends with it after a dot (or is it)."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _parse(config: dict[str, Any], tensors: dict[str, torch.Tensor],
           num_experts: int | None, source: str) -> dict[str, LoRAWeights]:
    factors: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _KEY.match(name.removeprefix(_PEFT_PREFIX))
        if match is None:
            raise AdapterError(f"{source}: unexpected tensor `{name}` (only lora_A / lora_B "
                               f"weights are supported)")
        depth = match["wrappers"].count(".base_layer")
        factors.setdefault((match["module"], depth), {})[match["factor"]] = tensor
    alpha = config.get("lora_alpha", 8)
    rank_patterns, alpha_patterns = config.get("rank_pattern") or {}, \
        config.get("alpha_pattern") or {}
    weights: dict[str, LoRAWeights] = {}
    for (module, depth), pair in sorted(factors.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"{source}: `{module}` has lora_{next(iter(pair))} without "
                               f"its other factor")
        a, b = pair["A"].float(), pair["B"].float()
        parameter = _expert_parameter(config, module, depth, source)
        key = f"{module}.{parameter}" if parameter else module
        if parameter:
            if not num_experts:
                raise AdapterError(f"{source}: `{key}` adapts stacked experts, but the model "
                                   f"has none")
            if a.shape[0] % num_experts:
                raise AdapterError(f"{source}: `{key}` lora_A has {a.shape[0]} rows, not a "
                                   f"multiple of the model's {num_experts} experts")
            rank = a.shape[0] // num_experts
            a = a.reshape(num_experts, rank, a.shape[1])
            b = b.reshape(b.shape[0], rank, num_experts).permute(2, 0, 1).contiguous()
        else:
            rank = a.shape[0]
            if b.shape[1] != rank:
                raise AdapterError(f"{source}: `{module}` lora_B {tuple(b.shape)} does not "
                                   f"match lora_A {tuple(a.shape)}")
        expected = _pattern_value(rank_patterns, key, config.get("r", rank))
        if int(expected) != rank:
            raise AdapterError(f"{source}: `{key}` has rank {rank}; the config says {expected}")
        module_alpha = _pattern_value(alpha_patterns, key, alpha)
        scaling = module_alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        weights[key] = LoRAWeights(a, b, float(scaling))
    return weights


def _expert_parameter(config: dict[str, Any], module: str, depth: int,
                      source: str) -> str | None:
    """The stacked-experts parameter a `target_parameters` wrapper adapts, None for a module.

    Parameters are targeted on stacked-experts modules (`....experts`; other modules are
    linear layers, whatever the patterns say). With targeted parameters such a module is a nest
    of wrappers: the deepest adapts the first parameter the module registers."""
    targets = config.get("target_parameters") or []
    if not targets or not module.endswith(".experts"):
        if depth:
            raise AdapterError(f"{source}: `{module}` is nested in base_layer without "
                               f"target_parameters in the config")
        return None
    targeted = [p for p in EXPERT_PARAMETERS
                if any(f"{module}.{p}" == t or f"{module}.{p}".endswith(f".{t}")
                       for t in targets)]
    if not targeted:
        if depth:
            raise AdapterError(f"{source}: `{module}` is nested in base_layer, but no "
                               f"target_parameters name one of its parameters")
        return None
    index = len(targeted) - 1 - depth
    if index < 0:
        raise AdapterError(f"{source}: `{module}` nests {depth + 1} wrappers for "
                           f"{len(targeted)} targeted parameters {targeted}")
    return targeted[index]


def _content_id(config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name in sorted(tensors):
        tensor = tensors[name].detach().contiguous().cpu()
        digest.update(name.encode())
        digest.update(str(tuple(tensor.shape)).encode() + str(tensor.dtype).encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()[:32]
