"""Parameter counts and KV-cache sizes computed from a configuration (no weights needed)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from muse.config import FULL, SLIDING, AudioConfig, MuseSparkConfig, TextConfig, VisionConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1,
               "float8_e4m3fn": 1}


@dataclass
class ParameterCount:
    total: int
    active: int


def text_parameters(text: TextConfig) -> ParameterCount:
    """Total and per-token active parameters of the decoder, embeddings and LM head included."""
    hidden, head_dim = text.hidden_size, text.head_dim
    q_width = text.num_attention_heads * head_dim
    kv_width = text.num_key_value_heads * head_dim
    attention = hidden * q_width + 2 * hidden * kv_width + q_width * hidden
    if text.attention_bias:
        attention += q_width + 2 * kv_width
    if text.qk_norm:
        attention += 2 * head_dim
    norms = 2 * hidden
    if text.is_moe:
        width = text.expert_input_size
        expert = 3 * width * text.moe_intermediate_size + (width if text.expert_norm else 0)
        router = hidden * text.num_experts
        latent = 2 * hidden * text.moe_latent_size if text.moe_latent_size else 0
        shared = 3 * hidden * text.moe_intermediate_size * text.num_shared_experts
        mlp_total = router + latent + shared + text.num_experts * expert
        mlp_active = router + latent + shared + text.num_experts_per_tok * expert
    else:
        mlp_total = mlp_active = 3 * hidden * text.intermediate_size
    embeddings = text.vocab_size * hidden * (1 if text.tie_word_embeddings else 2) + hidden
    layers = text.num_hidden_layers
    return ParameterCount(
        total=embeddings + layers * (attention + norms + mlp_total),
        active=embeddings + layers * (attention + norms + mlp_active),
    )


def _encoder_layer_parameters(hidden: int, intermediate: int) -> int:
    # LayerNorm (weight + bias) twice, biased qkv / output / MLP projections.
    return 2 * 2 * hidden + (3 * hidden * hidden + 3 * hidden) + (hidden * hidden + hidden) \
        + (hidden * intermediate + intermediate) + (intermediate * hidden + hidden)


def vision_parameters(vision: VisionConfig, text_hidden: int) -> int:
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    merged = vision.hidden_size * vision.spatial_merge_size ** 2
    embed = patch * vision.hidden_size
    layers = vision.num_hidden_layers * _encoder_layer_parameters(vision.hidden_size,
                                                                   vision.intermediate_size)
    # Post-norm, then a two-layer projector over each 2x2 group of merged patches.
    projector = 2 * vision.hidden_size + (merged * merged + merged) + (merged * text_hidden
                                                                        + text_hidden)
    return embed + layers + projector


def audio_parameters(audio: AudioConfig, text_hidden: int) -> int:
    features = audio.samples_per_token // audio.mel_hop_length * audio.num_mel_bins
    frame = features * audio.hidden_size + audio.hidden_size
    layers = audio.num_hidden_layers * _encoder_layer_parameters(audio.hidden_size,
                                                                 audio.intermediate_size)
    projector = 2 * audio.hidden_size + audio.hidden_size * text_hidden + text_hidden
    return frame + layers + projector


def kv_bytes_per_token(text: TextConfig, kv_dtype: str = "bfloat16") -> dict[str, int]:
    """Bytes of K and V one token adds, summed over the layers of each attention kind."""
    per_layer = 2 * text.num_key_value_heads * text.head_dim * DTYPE_BYTES[kv_dtype]
    return {kind: per_layer * text.layer_types.count(kind) for kind in (SLIDING, FULL)}


def kv_cache_bytes(text: TextConfig, context: int, kv_dtype: str = "bfloat16") -> int:
    """KV bytes of one sequence of `context` tokens: sliding layers keep only their window."""
    per_token = kv_bytes_per_token(text, kv_dtype)
    sliding_tokens = min(context, text.sliding_window or context)
    return per_token[SLIDING] * sliding_tokens + per_token[FULL] * context


def all_global_kv_cache_bytes(text: TextConfig, context: int, kv_dtype: str = "bfloat16") -> int:
    return sum(kv_bytes_per_token(text, kv_dtype).values()) * context


@dataclass
class ModelInfo:
    name: str | None
    text_total: int
    text_active: int
    vision: int
    audio: int
    layers_sliding: int
    layers_global: int
    kv_dtype: str
    kv_bytes_per_token: dict[str, int]
    context: int
    kv_cache_bytes: int
    all_global_kv_cache_bytes: int
    kv_ratio: float

    def to_dict(self) -> dict:
        return asdict(self)


def model_info(config: MuseSparkConfig, context: int | None = None,
               kv_dtype: str = "bfloat16") -> ModelInfo:
    text = config.text_config
    context = context or text.max_position_embeddings
    params = text_parameters(text)
    kv = kv_cache_bytes(text, context, kv_dtype)
    all_global = all_global_kv_cache_bytes(text, context, kv_dtype)
    return ModelInfo(
        name=config.name,
        text_total=params.total,
        text_active=params.active,
        vision=vision_parameters(config.vision_config, text.hidden_size)
        if config.vision_config else 0,
        audio=audio_parameters(config.audio_config, text.hidden_size)
        if config.audio_config else 0,
        layers_sliding=text.layer_types.count(SLIDING),
        layers_global=text.layer_types.count(FULL),
        kv_dtype=kv_dtype,
        kv_bytes_per_token=kv_bytes_per_token(text, kv_dtype),
        context=context,
        kv_cache_bytes=kv,
        all_global_kv_cache_bytes=all_global,
        kv_ratio=kv / all_global,
    )


def human_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(int(n))


def human_bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def format_info(info: ModelInfo) -> str:
    lines = [
        f"model: {info.name or '(unnamed)'}",
        f"text parameters: {human_count(info.text_total)} total / "
        f"{human_count(info.text_active)} active per token",
        f"vision encoder parameters: {human_count(info.vision)}",
        f"audio encoder parameters: {human_count(info.audio)}",
        f"layers: {info.layers_sliding} sliding + {info.layers_global} global",
        f"KV bytes per token ({info.kv_dtype}): "
        + ", ".join(f"{kind} {human_bytes(b)}" for kind, b in info.kv_bytes_per_token.items()),
        f"KV cache for one {info.context:,}-token sequence: {human_bytes(info.kv_cache_bytes)} "
        f"vs {human_bytes(info.all_global_kv_cache_bytes)} all-global "
        f"(ratio {info.kv_ratio:.2f})",
    ]
    return "\n".join(lines)
