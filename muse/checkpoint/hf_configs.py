"""Hugging Face Qwen3 and Qwen3-MoE `config.json` files read as Muse configurations.

Qwen3 is the Muse decoder without the latent-MoE extras: no pooler, no per-expert norm, softmax
routing. Only features the reference decoder reproduces exactly are accepted; anything else
raises `ConfigError`, so a checkpoint never loads into a model that computes something else.
"""

from __future__ import annotations

from typing import Any

from muse.config import (
    FULL,
    LAYER_TYPES,
    SLIDING,
    ConfigError,
    MuseSparkConfig,
    RopeParameters,
    TextConfig,
)

# Values `transformers` assumes when a field is absent from config.json (Qwen3Config defaults).
_QWEN3_HEAD_DIM = 128
_DEFAULT_THETA = 10000.0


def _unsupported(model_type: str, field_name: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{model_type} config.json field `{field_name}` = {value!r} is not "
                       f"supported: {why}")


def _required(data: dict[str, Any], name: str) -> Any:
    if name not in data:
        raise ConfigError(f"{data.get('model_type')} config.json has no `{name}` field")
    return data[name]


def _rope(data: dict[str, Any]) -> RopeParameters:
    """One RopeParameters from `rope_parameters` (v5) or `rope_scaling` + `rope_theta` (v4)."""
    model_type = data["model_type"]
    params = dict(data.get("rope_parameters") or data.get("rope_scaling") or {})
    if set(params) & set(LAYER_TYPES):
        raise _unsupported(model_type, "rope_parameters", params,
                           "Qwen3 uses one rotary embedding for every layer")
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", data.get("rope_theta", _DEFAULT_THETA)))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise _unsupported(model_type, "rope_parameters.partial_rotary_factor",
                           params["partial_rotary_factor"], "Muse rotates the whole head")
    if rope_type == "default":
        return RopeParameters(rope_theta=theta)
    if rope_type != "yarn":
        raise _unsupported(model_type, "rope_parameters.rope_type", rope_type,
                           "allowed values are 'default' and 'yarn'")
    for name in ("attention_factor", "mscale", "mscale_all_dim"):
        if params.get(name) is not None:
            raise _unsupported(model_type, f"rope_parameters.{name}", params[name],
                               "Muse derives the YaRN attention scale from `factor` alone")
    if params.get("truncate", True) is not True:
        raise _unsupported(model_type, "rope_parameters.truncate", params["truncate"],
                           "Muse rounds the YaRN correction range outwards")
    max_positions = int(data.get("max_position_embeddings", 32768))
    original = int(params.get("original_max_position_embeddings") or max_positions)
    return RopeParameters(
        rope_theta=theta,
        rope_type="yarn",
        factor=float(params.get("factor") or max_positions / original),
        original_max_position_embeddings=original,
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
    )


def _layer_types(data: dict[str, Any], window: int | None) -> list[str]:
    layers = int(_required(data, "num_hidden_layers"))
    if window is None:
        # Without `use_sliding_window` transformers gives every layer full attention, whatever
        # `layer_types` says.
        return [FULL] * layers
    if data["model_type"] == "qwen3_moe":
        # Qwen3-MoE has no per-layer kinds: the window applies to every layer.
        return [SLIDING] * layers
    if data.get("layer_types"):
        return list(data["layer_types"])
    first_sliding = int(data.get("max_window_layers", 28))
    return [SLIDING if i >= first_sliding else FULL for i in range(layers)]


def _num_experts(data: dict[str, Any]) -> int:
    if data["model_type"] != "qwen3_moe":
        return 0
    # transformers writes `num_local_experts` (its attribute map); hub files say `num_experts`.
    experts = data.get("num_experts", data.get("num_local_experts"))
    if experts is None:
        raise ConfigError("qwen3_moe config.json has neither `num_experts` nor "
                          "`num_local_experts`")
    return int(experts)


def _moe_fields(data: dict[str, Any], experts: int) -> dict[str, Any]:
    model_type = data["model_type"]
    if data.get("mlp_only_layers"):
        raise _unsupported(model_type, "mlp_only_layers", data["mlp_only_layers"],
                           "Muse gives every layer the same kind of MLP")
    if data.get("decoder_sparse_step", 1) != 1:
        raise _unsupported(model_type, "decoder_sparse_step", data["decoder_sparse_step"],
                           "Muse gives every layer the same kind of MLP (allowed value: 1)")
    return {
        "num_experts": experts,
        "num_experts_per_tok": int(_required(data, "num_experts_per_tok")),
        "moe_intermediate_size": int(_required(data, "moe_intermediate_size")),
        "router_scoring": "softmax",
        "norm_topk_prob": bool(data.get("norm_topk_prob", False)),
        "num_shared_experts": 0,
    }


def qwen3_config(data: dict[str, Any]) -> MuseSparkConfig:
    """A `qwen3` or `qwen3_moe` config.json as a text-only MuseSparkConfig."""
    model_type = data["model_type"]
    if data.get("hidden_act", "silu") != "silu":
        raise _unsupported(model_type, "hidden_act", data["hidden_act"],
                           "Muse MLPs are SwiGLU (allowed value: 'silu')")
    if data.get("attention_bias", False):
        raise _unsupported(model_type, "attention_bias", True,
                           "Qwen3 then also biases o_proj, which Muse's attention does not")
    hidden = int(_required(data, "hidden_size"))
    heads = int(_required(data, "num_attention_heads"))
    default_head_dim = _QWEN3_HEAD_DIM if model_type == "qwen3" else hidden // heads
    window = data.get("sliding_window") if data.get("use_sliding_window", False) else None
    rope = _rope(data)
    eos = data.get("eos_token_id")
    fields: dict[str, Any] = {
        "vocab_size": int(_required(data, "vocab_size")),
        "hidden_size": hidden,
        "num_hidden_layers": int(_required(data, "num_hidden_layers")),
        "layer_types": _layer_types(data, window),
        "sliding_window": window,
        "num_attention_heads": heads,
        "num_key_value_heads": int(data.get("num_key_value_heads") or heads),
        "head_dim": int(data.get("head_dim") or default_head_dim),
        "attention_bias": False,
        "qk_norm": True,
        "rope_parameters": {SLIDING: rope, FULL: rope},
        "max_position_embeddings": int(data.get("max_position_embeddings", 32768)),
        "rms_norm_eps": float(data.get("rms_norm_eps", 1e-6)),
        "num_experts": 0,
        "moe_latent_size": None,
        "expert_norm": False,
        "tie_word_embeddings": bool(data.get("tie_word_embeddings", False)),
        "initializer_range": float(data.get("initializer_range", 0.02)),
        "bos_token_id": data.get("bos_token_id"),
        # An empty list, not None: None would pick up Muse's own default eos ids.
        "eos_token_id": [] if eos is None else eos,
        "pad_token_id": data.get("pad_token_id"),
        "image_token_id": None,
        "video_token_id": None,
        "audio_token_id": None,
    }
    experts = _num_experts(data)
    if experts > 0:
        fields.update(_moe_fields(data, experts))
    else:
        # Dense Qwen3; also a qwen3_moe without experts, which transformers makes dense.
        fields["intermediate_size"] = int(_required(data, "intermediate_size"))
    dtype = data.get("dtype") or data.get("torch_dtype") or "bfloat16"
    return MuseSparkConfig(text_config=TextConfig(**fields), dtype=str(dtype))


HF_CONFIG_READERS = {"qwen3": qwen3_config, "qwen3_moe": qwen3_config}
