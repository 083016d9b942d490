"""The model shapes the benchmarks run, and the transformers model that runs each of them.

Both engines run the same shape with random weights. Muse runs a preset; transformers runs the
Qwen3 / Qwen3-MoE model of the same dimensions. For Muse-architecture presets transformers has
no equivalent, so a Qwen3-MoE of the same dims stands in (see `transformers_text_config`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from muse.config import FULL, SLIDING, RopeParameters, TextConfig
from muse.info import kv_bytes_per_token, text_parameters
from muse.presets import get_preset

# The shapes the GPU benchmarks are meant for (any preset is accepted, e.g. muse-spark-tiny on
# the CPU for tests).
SHAPES = ("muse-spark-15b-a2b", "qwen3-30b-a3b-shape", "qwen3-0.6b-shape")

STAND_IN = "transformers stand-in: Qwen3-MoE of the same dims"
STAND_IN_DENSE = "transformers stand-in: Qwen3 of the same dims"


def text_config(shape: str) -> TextConfig:
    return get_preset(shape).text_config


def transformers_text_config(text: TextConfig) -> tuple[TextConfig, list[str]]:
    """The muse config of the transformers model run for `text`, and how it differs from it.

    Qwen3 / Qwen3-MoE are the Muse decoder without its extras. The stand-in keeps hidden size,
    heads, head dim, layers, vocabulary, experts, top-k and expert width, and drops what Qwen3
    lacks: sliding layers (all layers global), the latent projection (experts compute at the
    hidden width), the per-expert norm, shared experts, sigmoid routing and YaRN (plain RoPE at
    the global layers' theta; the rotary kind does not change speed).
    """
    differences = []
    if SLIDING in text.layer_types:
        differences.append(f"all {text.num_hidden_layers} layers global (muse: "
                           f"{text.layer_types.count(SLIDING)} sliding, window "
                           f"{text.sliding_window})")
    if text.is_moe and text.moe_latent_size:
        differences.append(f"no latent projection (experts at width {text.hidden_size}, "
                           f"muse: {text.moe_latent_size})")
    if text.is_moe and text.expert_norm:
        differences.append("no per-expert norm")
    if text.is_moe and text.num_shared_experts:
        differences.append(f"no shared experts (muse: {text.num_shared_experts})")
    if text.is_moe and text.router_scoring != "softmax":
        differences.append("softmax routing")
    if text.attention_bias:
        differences.append("no attention bias")
    if not text.qk_norm:
        differences.append("q/k norm added")
    rope = text.rope_parameters[FULL]
    if any(p.rope_type != "default" for kind, p in text.rope_parameters.items()
           if kind in text.layer_types):
        differences.append(f"plain RoPE, theta {rope.rope_theta:g}")
    stand_in = dataclasses.replace(
        text, layer_types=[FULL] * text.num_hidden_layers, sliding_window=None,
        rope_parameters={FULL: RopeParameters(rope_theta=rope.rope_theta)},
        attention_bias=False, qk_norm=True,
        **({"moe_latent_size": None, "expert_norm": False, "num_shared_experts": 0,
            "router_scoring": "softmax"} if text.is_moe else {}))
    return stand_in, differences


def hf_config(text: TextConfig):
    """A transformers Qwen3MoeConfig / Qwen3Config of the same shape as a Qwen3-like `text`
    (the inverse of muse.checkpoint.hf_configs.qwen3_config)."""
    import transformers

    if SLIDING in text.layer_types or text.attention_bias or not text.qk_norm \
            or (text.is_moe and (text.moe_latent_size or text.expert_norm
                                 or text.num_shared_experts or text.router_scoring != "softmax")):
        raise ValueError("not a Qwen3 shape: map it with transformers_text_config first")
    eos = text.eos_token_ids
    common = dict(
        vocab_size=text.vocab_size, hidden_size=text.hidden_size,
        num_hidden_layers=text.num_hidden_layers,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads, head_dim=text.head_dim,
        max_position_embeddings=text.max_position_embeddings, rms_norm_eps=text.rms_norm_eps,
        rope_parameters={"rope_type": "default",
                         "rope_theta": text.rope_parameters[FULL].rope_theta},
        attention_bias=False, use_sliding_window=False,
        tie_word_embeddings=text.tie_word_embeddings,
        initializer_range=text.initializer_range, bos_token_id=text.bos_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
        pad_token_id=text.pad_token_id)
    if text.is_moe:
        return transformers.Qwen3MoeConfig(
            **common, num_experts=text.num_experts, num_experts_per_tok=text.num_experts_per_tok,
            moe_intermediate_size=text.moe_intermediate_size, norm_topk_prob=text.norm_topk_prob,
            decoder_sparse_step=1, mlp_only_layers=[],
            intermediate_size=text.moe_intermediate_size)
    return transformers.Qwen3Config(**common, intermediate_size=text.intermediate_size,
                                    layer_types=[FULL] * text.num_hidden_layers)


def describe_transformers_side(text: TextConfig) -> dict[str, Any]:
    stand_in, differences = transformers_text_config(text)
    params = text_parameters(stand_in)
    return {
        "architecture": "Qwen3MoeForCausalLM" if text.is_moe else "Qwen3ForCausalLM",
        "stand_in": (STAND_IN if text.is_moe else STAND_IN_DENSE) if differences else None,
        "differences": differences,
        "params_total": params.total, "params_active": params.active,
        "kv_bytes_per_token": sum(kv_bytes_per_token(stand_in).values()),
    }


def describe_muse_side(text: TextConfig) -> dict[str, Any]:
    params = text_parameters(text)
    return {
        "params_total": params.total, "params_active": params.active,
        "layers_sliding": text.layer_types.count(SLIDING),
        "layers_global": text.layer_types.count(FULL),
        "sliding_window": text.sliding_window if SLIDING in text.layer_types else None,
        "kv_bytes_per_token": kv_bytes_per_token(text),
    }


def shape_record(shape: str) -> dict[str, Any]:
    """A record's `shape` entry: the preset's name and both engines' sides of it."""
    text = text_config(shape)
    return {"name": shape, "muse": describe_muse_side(text),
            "transformers": describe_transformers_side(text)}
