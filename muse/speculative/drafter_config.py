"""Configuration of the block-diffusion drafter (DFlash backbone, V2 modules, DSpark heads).

A `DrafterConfig` is stored as the `config.json` of a drafter checkpoint folder
(`model_type: "muse_drafter"`, `architectures: ["MuseDrafter"]`), next to `model.safetensors`.
Every field is validated on construction; a bad value raises `ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from muse.config import (FULL, LAYER_TYPES, SLIDING, ConfigError, RopeParameters, TextConfig,
                         read_config_json, rope_parameters_by_kind, write_config_json)

DRAFTER_MODEL_TYPE = "muse_drafter"
DRAFTER_ARCHITECTURE = "MuseDrafter"
METHODS = ("dflash", "dspark")


def _require(condition: bool, field_name: str, allowed: str, value: Any) -> None:
    if not condition:
        raise ConfigError(f"drafter config field `{field_name}` must be {allowed}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: Any, field_name: str) -> None:
    _require(_is_int(value) and value > 0, field_name, "a positive integer", value)


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Target layers whose outputs feed the drafter: `round(1 + i*(N-4)/(K-1))`, i < K.

    The spread skips the first layer (too close to the embeddings) and the last three (too
    specialised to the next token); one feature takes the middle layer N // 2.
    """
    _require(_is_int(num_target_layers) and num_target_layers > 0, "num_target_layers",
             "a positive integer", num_target_layers)
    _require(_is_int(num_features) and num_features > 0, "num_features", "a positive integer",
             num_features)
    if num_features == 1:
        return [num_target_layers // 2]
    # With fewer layers the rounded spread repeats (or leaves) layers.
    _require(num_target_layers >= num_features + 3, "num_target_layers",
             f">= num_features + 3 = {num_features + 3} to spread {num_features} features",
             num_target_layers)
    span = num_target_layers - 4
    return [round(1 + i * span / (num_features - 1)) for i in range(num_features)]


@dataclass
class DrafterConfig:
    """The drafter. The first four fields come from the target and have no sensible default."""

    vocab_size: int
    hidden_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    method: str = "dflash"
    num_hidden_layers: int = 1
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rms_norm_eps: float = 1e-6
    qk_norm: bool = True
    rope_parameters: dict[str, RopeParameters] = field(default_factory=dict)
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    # B: the anchor plus B - 1 mask positions, i.e. B - 1 draft tokens per step.
    block_size: int = 8
    # V2: two-tap dynamic depthwise convolution around every sublayer.
    dynamic_conv: bool = False
    conv_taps: int = 2
    conv_group_size: int = 16
    # V2: pairwise candidate selector over the LM head's top-k.
    candidate_selector: bool = False
    selector_top_k: int = 16
    selector_rank: int = 256
    # DSpark: Markov bias (present when method == "dspark") and confidence head.
    markov_rank: int = 256
    markov_gated: bool = False
    confidence_head: bool = False
    initializer_range: float = 0.02
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.layer_types is None:
            # Draft layers are few and see a short context window of their own: global by default.
            self.layer_types = [FULL] * self.num_hidden_layers
        self.target_layer_ids = list(self.target_layer_ids)
        self.rope_parameters = rope_parameters_by_kind(self.rope_parameters)
        self.validate()

    def validate(self) -> None:
        _require(self.method in METHODS, "method", f"one of {METHODS}", self.method)
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "intermediate_size"):
            _positive_int(getattr(self, name), name)
        _require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                 f"a divisor of num_attention_heads={self.num_attention_heads}",
                 self.num_key_value_heads)
        _require(self.head_dim % 2 == 0, "head_dim", "even (rotary pairs)", self.head_dim)
        _require(self.rms_norm_eps > 0, "rms_norm_eps", "positive", self.rms_norm_eps)
        ids = self.target_layer_ids
        _require(len(ids) > 0 and all(_is_int(i) and i >= 0 for i in ids)
                 and len(set(ids)) == len(ids), "target_layer_ids",
                 "a non-empty list of distinct target layer indices >= 0", ids)
        _require(_is_int(self.mask_token_id) and 0 <= self.mask_token_id < self.vocab_size,
                 "mask_token_id", f"a token id in [0, vocab_size={self.vocab_size})",
                 self.mask_token_id)
        _require(_is_int(self.block_size) and self.block_size >= 2, "block_size",
                 "an integer >= 2 (the anchor and at least one mask)", self.block_size)
        _require(len(self.layer_types) == self.num_hidden_layers, "layer_types",
                 f"a list of {self.num_hidden_layers} entries (num_hidden_layers)",
                 self.layer_types)
        for i, kind in enumerate(self.layer_types):
            _require(kind in LAYER_TYPES, f"layer_types[{i}]", f"one of {LAYER_TYPES}", kind)
        if SLIDING in self.layer_types:
            _positive_int(self.sliding_window, "sliding_window")
        _require(set(self.rope_parameters) <= set(LAYER_TYPES), "rope_parameters",
                 f"a mapping with keys among {LAYER_TYPES}", list(self.rope_parameters))
        for kind, params in self.rope_parameters.items():
            params.validate(f"rope_parameters.{kind}")
        for name in ("qk_norm", "dynamic_conv", "candidate_selector", "markov_gated",
                     "confidence_head"):
            _require(isinstance(getattr(self, name), bool), name, "true or false",
                     getattr(self, name))
        if self.dynamic_conv:
            _positive_int(self.conv_taps, "conv_taps")
            _require(_is_int(self.conv_group_size) and self.conv_group_size > 0
                     and self.hidden_size % self.conv_group_size == 0, "conv_group_size",
                     f"a positive divisor of hidden_size={self.hidden_size}",
                     self.conv_group_size)
        if self.candidate_selector:
            _require(self.method == "dflash", "candidate_selector",
                     "false with method 'dspark' (the Markov bias already orders the block)",
                     self.candidate_selector)
            _require(_is_int(self.selector_top_k) and 1 <= self.selector_top_k
                     <= self.vocab_size, "selector_top_k",
                     f"an integer in [1, vocab_size={self.vocab_size}]", self.selector_top_k)
            _positive_int(self.selector_rank, "selector_rank")
        if self.uses_previous_token:
            _positive_int(self.markov_rank, "markov_rank")
        _require(self.initializer_range > 0, "initializer_range", "positive",
                 self.initializer_range)
        _require(isinstance(getattr(torch, str(self.dtype), None), torch.dtype), "dtype",
                 "a torch dtype name such as 'bfloat16' or 'float32'", self.dtype)

    @property
    def num_draft_tokens(self) -> int:
        return self.block_size - 1

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def markov_bias(self) -> bool:
        return self.method == "dspark"

    @property
    def uses_previous_token(self) -> bool:
        """Whether an embedding of the previous draft token (E1) exists."""
        return self.markov_bias or self.confidence_head

    def layer_window(self, layer_index: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_index] == SLIDING else None

    def check_target(self, target: TextConfig) -> None:
        """Raise `ConfigError` if this drafter cannot serve `target`."""
        _require(self.hidden_size == target.hidden_size, "hidden_size",
                 f"the target's hidden_size={target.hidden_size}", self.hidden_size)
        _require(self.vocab_size == target.vocab_size, "vocab_size",
                 f"the target's vocab_size={target.vocab_size}", self.vocab_size)
        _require(max(self.target_layer_ids) < target.num_hidden_layers, "target_layer_ids",
                 f"indices below the target's num_hidden_layers={target.num_hidden_layers}",
                 self.target_layer_ids)

    @classmethod
    def for_target(cls, target: TextConfig, mask_token_id: int, num_target_features: int = 5,
                   **overrides: Any) -> DrafterConfig:
        """A drafter shaped like `target` (widths, heads, rotary), reading the default layers."""
        values: dict[str, Any] = dict(
            vocab_size=target.vocab_size,
            hidden_size=target.hidden_size,
            target_layer_ids=default_target_layer_ids(target.num_hidden_layers,
                                                      num_target_features),
            mask_token_id=mask_token_id,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            intermediate_size=target.intermediate_size,
            rms_norm_eps=target.rms_norm_eps,
            qk_norm=target.qk_norm,
            rope_parameters=dict(target.rope_parameters),
            initializer_range=target.initializer_range,
        )
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["rope_parameters"] = {k: v.to_dict() for k, v in self.rope_parameters.items()}
        return {"model_type": DRAFTER_MODEL_TYPE, "architectures": [DRAFTER_ARCHITECTURE],
                **data}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DrafterConfig:
        data = dict(data)
        model_type = data.pop("model_type", DRAFTER_MODEL_TYPE)
        _require(model_type == DRAFTER_MODEL_TYPE, "model_type", repr(DRAFTER_MODEL_TYPE),
                 model_type)
        data.pop("architectures", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        _require(not unknown, "config.json", f"made of the fields {sorted(known)}", unknown)
        try:
            return cls(**data)
        except TypeError as error:
            raise ConfigError(f"drafter config.json: {error}") from None

    def save(self, directory: str | Path) -> None:
        write_config_json(directory, self.to_dict())

    @classmethod
    def load(cls, directory: str | Path) -> DrafterConfig:
        return cls.from_dict(read_config_json(directory))
