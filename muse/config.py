"""Model configuration: the text decoder plus optional vision and audio encoders.

A `MuseSparkConfig` is read from and written to a Hugging Face style `config.json`
(`model_type: "muse_spark"`). Every field is validated on construction; a bad value raises
`ConfigError` naming the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from muse.json_options import json_object

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)
ROUTER_SCORINGS = ("softmax", "sigmoid")
ROPE_TYPES = ("default", "yarn")
MODEL_TYPE = "muse_spark"


class ConfigError(ValueError):
    """A configuration value a user supplied is not allowed."""


def _require(condition: bool, field_name: str, allowed: str, value: Any) -> None:
    if not condition:
        raise ConfigError(f"config field `{field_name}` must be {allowed}, got {value!r}")


def _positive_int(value: Any, field_name: str) -> None:
    _require(isinstance(value, int) and not isinstance(value, bool) and value > 0,
             field_name, "a positive integer", value)


@dataclass
class RopeParameters:
    """Rotary embedding of one layer kind. `yarn` stretches the context by `factor`."""

    rope_theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0

    def validate(self, prefix: str) -> None:
        _require(self.rope_type in ROPE_TYPES, f"{prefix}.rope_type", f"one of {ROPE_TYPES}",
                 self.rope_type)
        _require(self.rope_theta > 0, f"{prefix}.rope_theta", "positive", self.rope_theta)
        if self.rope_type == "yarn":
            _require(self.factor >= 1.0, f"{prefix}.factor", ">= 1 for yarn", self.factor)
            _positive_int(self.original_max_position_embeddings,
                          f"{prefix}.original_max_position_embeddings")

    def to_dict(self) -> dict[str, Any]:
        if self.rope_type == "default":
            return {"rope_type": "default", "rope_theta": self.rope_theta}
        return dataclasses.asdict(self)


@dataclass
class TextConfig:
    """The decoder. `num_experts == 0` makes every MLP dense (`intermediate_size`)."""

    vocab_size: int = 8192
    hidden_size: int = 64
    num_hidden_layers: int = 4
    layer_types: list[str] | None = None
    sliding_window: int | None = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    attention_bias: bool = False
    qk_norm: bool = True
    rope_parameters: dict[str, RopeParameters] = field(default_factory=dict)
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    intermediate_size: int = 128
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    moe_latent_size: int | None = 32
    expert_norm: bool = True
    router_scoring: str = "softmax"
    norm_topk_prob: bool = True
    num_shared_experts: int = 0
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = 0
    image_token_id: int | None = 13
    video_token_id: int | None = 16
    audio_token_id: int | None = 19

    def __post_init__(self) -> None:
        if self.layer_types is None:
            self.layer_types = default_layer_types(self.num_hidden_layers)
        self.rope_parameters = rope_parameters_by_kind(self.rope_parameters)
        if self.eos_token_id is None:
            self.eos_token_id = [2, 7]
        self.validate()

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            _positive_int(getattr(self, name), name)
        _require(len(self.layer_types) == self.num_hidden_layers, "layer_types",
                 f"a list of {self.num_hidden_layers} entries (num_hidden_layers)",
                 self.layer_types)
        for i, kind in enumerate(self.layer_types):
            _require(kind in LAYER_TYPES, f"layer_types[{i}]", f"one of {LAYER_TYPES}", kind)
        if SLIDING in self.layer_types:
            _positive_int(self.sliding_window, "sliding_window")
        _require(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
                 f"a divisor of num_attention_heads={self.num_attention_heads}",
                 self.num_key_value_heads)
        _require(set(self.rope_parameters) <= set(LAYER_TYPES), "rope_parameters",
                 f"a mapping with keys among {LAYER_TYPES}", list(self.rope_parameters))
        for kind, params in self.rope_parameters.items():
            params.validate(f"rope_parameters.{kind}")
        _require(self.rms_norm_eps > 0, "rms_norm_eps", "positive", self.rms_norm_eps)
        _require(isinstance(self.num_experts, int) and self.num_experts >= 0, "num_experts",
                 "an integer >= 0 (0 = dense MLP)", self.num_experts)
        if self.num_experts == 0:
            _positive_int(self.intermediate_size, "intermediate_size")
        else:
            _require(isinstance(self.num_experts_per_tok, int)
                     and 1 <= self.num_experts_per_tok <= self.num_experts,
                     "num_experts_per_tok", f"an integer in [1, num_experts={self.num_experts}]",
                     self.num_experts_per_tok)
            _positive_int(self.moe_intermediate_size, "moe_intermediate_size")
            if self.moe_latent_size is not None:
                _positive_int(self.moe_latent_size, "moe_latent_size")
            _require(self.router_scoring in ROUTER_SCORINGS, "router_scoring",
                     f"one of {ROUTER_SCORINGS}", self.router_scoring)
            _require(isinstance(self.num_shared_experts, int) and self.num_shared_experts >= 0,
                     "num_shared_experts", "an integer >= 0", self.num_shared_experts)
        for name in ("bos_token_id", "pad_token_id", "image_token_id", "video_token_id",
                     "audio_token_id"):
            value = getattr(self, name)
            _require(value is None or 0 <= value < self.vocab_size, name,
                     f"null or a token id in [0, vocab_size={self.vocab_size})", value)
        for value in self.eos_token_ids:
            _require(0 <= value < self.vocab_size, "eos_token_id",
                     f"token ids in [0, vocab_size={self.vocab_size})", self.eos_token_id)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def expert_input_size(self) -> int:
        """Width the experts compute at: the latent size when there is a pooler."""
        return self.moe_latent_size or self.hidden_size

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [eos] if isinstance(eos, int) else list(eos or [])

    def layer_window(self, layer_index: int) -> int | None:
        """Sliding window of a layer, or None for a global layer."""
        return self.sliding_window if self.layer_types[layer_index] == SLIDING else None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["rope_parameters"] = {k: v.to_dict() for k, v in self.rope_parameters.items()}
        return data


@dataclass
class VisionConfig:
    """NaViT-style vision encoder shared by images and video frames (patches packed)."""

    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    intermediate_size: int = 64
    patch_size: int = 14
    temporal_patch_size: int = 2
    in_channels: int = 3
    spatial_merge_size: int = 2
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.type == "int":
                _positive_int(getattr(self, f.name), f"vision_config.{f.name}")
        _require(self.hidden_size % self.num_attention_heads == 0, "vision_config.hidden_size",
                 "a multiple of vision_config.num_attention_heads", self.hidden_size)


@dataclass
class AudioConfig:
    """Waveform audio encoder: one embedding per `samples_per_token` samples (80 ms at 24 kHz)."""

    sample_rate: int = 24000
    samples_per_token: int = 1920
    # Log-mel front end: STFT frames every `mel_hop_length` samples (10 ms), `mel_n_fft`
    # samples long, `num_mel_bins` mel bands up to `mel_max_hz`; a token's features are its
    # samples_per_token / mel_hop_length frames (8) side by side.
    num_mel_bins: int = 64
    mel_hop_length: int = 240
    mel_n_fft: int = 512
    mel_max_hz: int = 8000
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    intermediate_size: int = 64
    layer_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.type == "int":
                _positive_int(getattr(self, f.name), f"audio_config.{f.name}")
        _require(self.hidden_size % self.num_attention_heads == 0, "audio_config.hidden_size",
                 "a multiple of audio_config.num_attention_heads", self.hidden_size)
        _require(self.samples_per_token % self.mel_hop_length == 0,
                 "audio_config.samples_per_token", "a multiple of audio_config.mel_hop_length",
                 self.samples_per_token)
        _require(self.mel_max_hz <= self.sample_rate // 2, "audio_config.mel_max_hz",
                 "at most half the sample rate", self.mel_max_hz)


@dataclass
class MuseSparkConfig:
    """A whole Muse Spark model: text decoder, and vision / audio encoders when present."""

    text_config: TextConfig = field(default_factory=TextConfig)
    vision_config: VisionConfig | None = None
    audio_config: AudioConfig | None = None
    name: str | None = None
    dtype: str = "bfloat16"

    @property
    def text(self) -> TextConfig:
        return self.text_config

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "model_type": MODEL_TYPE,
            "architectures": ["MuseSparkForConditionalGeneration"],
            "dtype": self.dtype,
            "text_config": self.text_config.to_dict(),
            "vision_config": dataclasses.asdict(self.vision_config) if self.vision_config else None,
            "audio_config": dataclasses.asdict(self.audio_config) if self.audio_config else None,
        }
        if self.name:
            data["name"] = self.name
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MuseSparkConfig:
        data = dict(data)
        model_type = data.pop("model_type", MODEL_TYPE)
        _require(model_type == MODEL_TYPE, "model_type", f"{MODEL_TYPE!r}", model_type)
        data.pop("architectures", None)
        data.pop("transformers_version", None)
        # A quantized checkpoint's settings: read by `muse.quantization.config` from the file.
        data.pop("quantization_config", None)
        text = _build(TextConfig, data.pop("text_config", {}) or {}, "text_config")
        vision = data.pop("vision_config", None)
        audio = data.pop("audio_config", None)
        unknown = set(data) - {"name", "dtype"}
        _require(not unknown, "config.json", "known top-level keys", sorted(unknown))
        return cls(
            text_config=text,
            vision_config=_build(VisionConfig, vision, "vision_config") if vision else None,
            audio_config=_build(AudioConfig, audio, "audio_config") if audio else None,
            name=data.get("name"),
            dtype=data.get("dtype", "bfloat16"),
        )

    def save(self, directory: str | Path) -> None:
        write_config_json(directory, self.to_dict())

    @classmethod
    def load(cls, directory: str | Path) -> MuseSparkConfig:
        return cls.from_dict(read_config_json(directory))


def _build(kind: type, values: dict[str, Any], prefix: str) -> Any:
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(values) - known)
    _require(not unknown, prefix, f"made of the fields {sorted(known)}", unknown)
    try:
        return kind(**values)
    except TypeError as error:
        raise ConfigError(f"config `{prefix}`: {error}") from None


def parse_overrides(value: Any) -> dict[str, Any]:
    """`hf_overrides` as given: a dict, its JSON text, or None (no overrides)."""
    return {} if value is None else json_object(value, "hf_overrides")


def with_overrides(config: MuseSparkConfig, overrides: Any) -> MuseSparkConfig:
    """`config` with vLLM's `hf_overrides` applied: decoder fields (top level, or inside
    `text_config`) replaced, `vision_config` / `audio_config` set to null to leave an encoder
    out. `num_hidden_layers` alone keeps the first layers' kinds."""
    overrides = dict(parse_overrides(overrides))
    if not overrides:
        return config
    text_fields = {f.name for f in dataclasses.fields(TextConfig)}
    nested = overrides.pop("text_config", {})
    if not isinstance(nested, dict):
        raise ValueError(f"`hf_overrides.text_config` must be an object, got {nested!r}")
    encoders = {}
    for name in ("vision_config", "audio_config"):
        if name in overrides:
            if overrides[name] is not None:
                raise ValueError(f"`hf_overrides.{name}` can only be null (no such encoder)")
            encoders[name] = overrides.pop(name)
    text_overrides = {**overrides, **nested}
    unknown = sorted(set(text_overrides) - text_fields)
    if unknown:
        raise ValueError(f"`hf_overrides`: {unknown} are not fields of the model's config "
                         f"(the decoder's: {sorted(text_fields)})")
    text = config.text_config
    layers = text_overrides.get("num_hidden_layers", text.num_hidden_layers)
    if "layer_types" not in text_overrides and layers != text.num_hidden_layers:
        kinds = text.layer_types
        text_overrides["layer_types"] = kinds[:layers] if layers <= len(kinds) \
            else default_layer_types(layers)
    try:
        text = dataclasses.replace(text, **text_overrides)
    except (TypeError, ValueError) as error:
        raise ValueError(f"`hf_overrides`: {error}") from None
    return dataclasses.replace(config, text_config=text, **encoders)


def default_layer_types(num_layers: int, period: int = 4) -> list[str]:
    """The Muse pattern: global where `i % period == period - 1`, and the last layer global."""
    return [FULL if i % period == period - 1 or i == num_layers - 1 else SLIDING
            for i in range(num_layers)]


def write_config_json(directory: str | Path, data: dict) -> None:
    """`directory/config.json`, the folder made if needed."""
    path = Path(directory) / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def read_config_json(directory: str | Path) -> dict:
    """The parsed `directory/config.json`; a `ConfigError` when missing or not JSON."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {directory}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not valid JSON: {error}") from None


def rope_parameters_by_kind(parameters: dict) -> dict[str, RopeParameters]:
    """`RopeParameters` for every attention kind, from instances or their JSON dicts; kinds
    not given get the defaults."""
    result = {kind: params if isinstance(params, RopeParameters) else RopeParameters(**params)
              for kind, params in parameters.items()}
    for kind in LAYER_TYPES:
        result.setdefault(kind, RopeParameters())
    return result
