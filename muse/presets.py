"""Named configurations of the Muse Spark family, from the full model down to a CPU test size."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from muse.config import (
    AudioConfig,
    ConfigError,
    FULL,
    SLIDING,
    MuseSparkConfig,
    RopeParameters,
    TextConfig,
    VisionConfig,
)

# Sliding layers see at most a window, so they keep plain RoPE; global layers stretch theirs
# with YaRN up to the full context.
def _rope(global_theta: float, factor: float, original: int) -> dict[str, RopeParameters]:
    return {
        SLIDING: RopeParameters(rope_theta=10000.0),
        FULL: RopeParameters(rope_theta=global_theta, rope_type="yarn", factor=factor,
                             original_max_position_embeddings=original),
    }


def full_816b() -> MuseSparkConfig:
    """The open-weight model: 62 layers of 256 latent experts, 1M context."""
    text = TextConfig(
        vocab_size=202048,
        hidden_size=8192,
        num_hidden_layers=62,
        sliding_window=2048,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        rope_parameters=_rope(1_000_000.0, 8.0, 131072),
        max_position_embeddings=1_048_576,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=4096,
        moe_latent_size=4096,
        expert_norm=True,
        num_shared_experts=0,
        tie_word_embeddings=False,
    )
    vision = VisionConfig(hidden_size=1536, num_hidden_layers=50, num_attention_heads=16,
                          intermediate_size=8960)
    audio = AudioConfig(hidden_size=768, num_hidden_layers=15, num_attention_heads=12,
                        intermediate_size=3200)
    return MuseSparkConfig(text, vision, audio, name="muse-spark-open-816b-a42b")


def spark_15b() -> MuseSparkConfig:
    """Same structure at a size that fits one 141 GB GPU in bf16 with room for KV cache."""
    text = TextConfig(
        vocab_size=202048,
        hidden_size=2048,
        num_hidden_layers=28,
        sliding_window=2048,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        rope_parameters=_rope(1_000_000.0, 4.0, 65536),
        max_position_embeddings=262_144,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=640,
        moe_latent_size=1024,
        expert_norm=True,
        tie_word_embeddings=False,
    )
    return MuseSparkConfig(text, name="muse-spark-15b-a2b")


def tiny() -> MuseSparkConfig:
    """Every feature on, small enough for the whole test suite on two CPU cores."""
    text = TextConfig(
        vocab_size=8192,
        hidden_size=64,
        num_hidden_layers=6,
        sliding_window=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters=_rope(100_000.0, 4.0, 512),
        max_position_embeddings=2048,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_latent_size=32,
        expert_norm=True,
        num_shared_experts=1,
        tie_word_embeddings=False,
    )
    vision = VisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          intermediate_size=64)
    audio = AudioConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64)
    return MuseSparkConfig(text, vision, audio, name="muse-spark-tiny", dtype="float32")


def spark_default() -> MuseSparkConfig:
    """The model shipped in checkpoints/: every Muse feature (sliding + global attention, GQA,
    q/k norm, latent MoE with per-expert norm; vision and audio encoders) with an 18.9M
    decoder, small enough to train in minutes on one GPU and to answer on a CPU."""
    text = TextConfig(
        vocab_size=8192,
        hidden_size=256,
        num_hidden_layers=8,
        sliding_window=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rope_parameters=_rope(100_000.0, 4.0, 1024),
        max_position_embeddings=4096,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=512,
        moe_latent_size=128,
        expert_norm=True,
        num_shared_experts=0,
        tie_word_embeddings=False,
    )
    # The encoders (version 2), at width 192: vision 4 layers (2.8M parameters), audio 3
    # (1.5M). The repository carries the checkpoint and its drafter and stays under 64 MiB
    # in all, which leaves the encoders about 4M parameters beside the 18.9M decoder.
    vision = VisionConfig(hidden_size=192, num_hidden_layers=4, num_attention_heads=4,
                          intermediate_size=768)
    audio = AudioConfig(hidden_size=192, num_hidden_layers=3, num_attention_heads=4,
                        intermediate_size=768)
    return MuseSparkConfig(text, vision, audio, name="muse-spark-default")


# `processor_config.json` fields a preset's checkpoints get (`muse.multimodal.processor.
# ProcessorConfig`); the processor's defaults elsewhere. The default model sees every image
# at about 224 x 224 (16 to 64 tokens) and every video frame at about 112 x 112 (16 tokens a
# frame group), as it was trained: a model this small does not carry over to other scales.
PROCESSOR_SETTINGS: dict[str, dict] = {
    "muse-spark-default": {"min_pixels": 112 * 112, "max_pixels": 224 * 224,
                           "video_max_pixels": 112 * 112, "max_video_frames": 8,
                           "video_fps": 2.0, "trim_audio_silence": True},
}


# Shapes of two public models, for speed comparisons (random weights; the engine reads them as
# Muse configs: every layer global, no latent projection, no expert norm).
def qwen3_30b_a3b_shape() -> MuseSparkConfig:
    """Qwen3-30B-A3B: 48 layers, hidden 2048, 128 experts top-8 of width 768, 32/4 heads."""
    text = TextConfig(
        vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
        layer_types=[FULL] * 48, sliding_window=None,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        rope_parameters={FULL: RopeParameters(rope_theta=1_000_000.0)},
        max_position_embeddings=40960,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        moe_latent_size=None, expert_norm=False, num_shared_experts=0,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=[151645], pad_token_id=None,
    )
    return MuseSparkConfig(text, name="qwen3-30b-a3b-shape")


def qwen3_06b_shape() -> MuseSparkConfig:
    """Qwen3-0.6B: 28 dense layers, hidden 1024, 16/8 heads of dim 128, tied embeddings."""
    text = TextConfig(
        vocab_size=151936, hidden_size=1024, num_hidden_layers=28,
        layer_types=[FULL] * 28, sliding_window=None,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        rope_parameters={FULL: RopeParameters(rope_theta=1_000_000.0)},
        max_position_embeddings=40960, intermediate_size=3072, num_experts=0,
        moe_latent_size=None, expert_norm=False,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=[151645], pad_token_id=None,
    )
    return MuseSparkConfig(text, name="qwen3-0.6b-shape")


PRESETS: dict[str, Callable[[], MuseSparkConfig]] = {
    "muse-spark-open-816b-a42b": full_816b,
    "muse-spark-15b-a2b": spark_15b,
    "muse-spark-tiny": tiny,
    "muse-spark-default": spark_default,
    "qwen3-30b-a3b-shape": qwen3_30b_a3b_shape,
    "qwen3-0.6b-shape": qwen3_06b_shape,
}


def get_preset(name: str) -> MuseSparkConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[name]()


# The trained model shipped in the repository; presets stand in where it is absent.
SHIPPED_CHECKPOINT = Path(__file__).resolve().parent.parent / "checkpoints" / "muse-spark-default"


def default_model() -> str:
    """What `muse serve`, `muse chat` and `LLM()` use when no model is named."""
    return str(SHIPPED_CHECKPOINT) if (SHIPPED_CHECKPOINT / "config.json").is_file() \
        else "muse-spark-tiny"
