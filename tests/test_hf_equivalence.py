"""The reference model against Hugging Face transformers: Qwen3 and Qwen3-MoE checkpoints as
`save_pretrained` writes them, the latent MoE against a per-token loop, and RoPE frequencies."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding  # noqa: E402

from muse.checkpoint import CheckpointError, load_config, load_reference_model  # noqa: E402
from muse.config import FULL, SLIDING, ConfigError, RopeParameters, TextConfig  # noqa: E402
from muse.presets import PRESETS  # noqa: E402
from muse.reference.layers import LatentMoE  # noqa: E402
from muse.rope import inverse_frequencies  # noqa: E402

VOCAB = 512
LENGTH = 40
WINDOW = 8
LEFT_PADDING = 7
LAYER_TYPES = [FULL, SLIDING, SLIDING, FULL]
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=256)


def randomize(model: torch.nn.Module, std: float = 0.15, seed: int = 0) -> None:
    """Weights large enough that every path moves the logits; norm weights around one."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * std
            param.copy_(1.0 + noise if "norm" in name else noise)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """Batch 2 of random ids, and a mask that left-pads the second row."""
    ids = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[1, :LEFT_PADDING] = 0
    return ids, mask


def hf_logits(model: torch.nn.Module, ids: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
    with torch.no_grad():
        if mask is None:
            return model(input_ids=ids, use_cache=False).logits
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        return model(input_ids=ids, attention_mask=mask, position_ids=positions,
                     use_cache=False).logits


def compare(hf_model: torch.nn.Module, directory: Path) -> dict[str, float]:
    """Relative logit error of the Muse reference loaded from `directory`, with and without a
    left-padded mask (padded positions are not compared)."""
    muse_model = load_reference_model(directory)
    ids, mask = inputs()
    errors = {}
    with torch.no_grad():
        errors["unpadded"] = relative_error(muse_model(ids).logits, hf_logits(hf_model, ids, None))
        real = mask.bool()
        muse_padded = muse_model(ids, attention_mask=mask).logits[real]
        errors["left_padded"] = relative_error(muse_padded, hf_logits(hf_model, ids, mask)[real])
    return errors


def edit_weights(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def dense_model(rope: str, tie: bool, sliding: bool = True) -> torch.nn.Module:
    rope_parameters = {"rope_type": "default", "rope_theta": 10000.0} if rope == "default" \
        else {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
              "original_max_position_embeddings": 16}
    # YaRN stretches 16 original positions to 64, so the 40 tokens compared reach past 16.
    sizes = SMALL if rope == "default" else {**SMALL, "max_position_embeddings": 64}
    config = transformers.Qwen3Config(
        **sizes, use_sliding_window=sliding, sliding_window=WINDOW,
        layer_types=LAYER_TYPES if sliding else [FULL] * len(LAYER_TYPES),
        rope_parameters=rope_parameters, tie_word_embeddings=tie, attn_implementation="eager")
    model = transformers.Qwen3ForCausalLM(config).eval()
    randomize(model)
    return model


def moe_model(norm_topk_prob: bool, sliding: bool) -> torch.nn.Module:
    config = transformers.Qwen3MoeConfig(
        **SMALL, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=norm_topk_prob, use_sliding_window=sliding, sliding_window=WINDOW,
        attn_implementation="eager")
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    randomize(model)
    return model


@pytest.mark.parametrize("rope, tie", [("default", False), ("yarn", True)])
def test_qwen3_with_mixed_sliding_and_full_layers_matches(tmp_path: Path, rope: str,
                                                          tie: bool) -> None:
    hf_model = dense_model(rope, tie)
    hf_model.save_pretrained(tmp_path)
    text = load_config(tmp_path).text_config
    assert text.layer_types == LAYER_TYPES and text.sliding_window == WINDOW
    assert text.tie_word_embeddings == tie and not text.is_moe
    assert text.rope_parameters[SLIDING] == text.rope_parameters[FULL]
    assert text.rope_parameters[FULL].rope_type == rope
    errors = compare(hf_model, tmp_path)
    assert max(errors.values()) < 1e-4, errors

    # The window must matter, or the match above would not prove sliding attention works.
    no_window = dense_model(rope, tie, sliding=False)
    no_window.load_state_dict(hf_model.state_dict())
    ids, mask = inputs()
    assert relative_error(hf_logits(no_window, ids, None), hf_logits(hf_model, ids, None)) > 1e-2


def test_qwen3_comparison_fails_with_swapped_query_rows(tmp_path: Path) -> None:
    hf_model = dense_model("default", tie=False)
    hf_model.save_pretrained(tmp_path)
    name = "model.layers.1.self_attn.q_proj.weight"

    def swap_rows(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][[17, *range(1, 17), 0, *range(18, 64)]].contiguous()

    edit_weights(tmp_path, swap_rows)
    assert min(compare(hf_model, tmp_path).values()) > 1e-2


@pytest.mark.parametrize("norm_topk_prob, sliding", [(True, True), (False, False)])
def test_qwen3_moe_matches(tmp_path: Path, norm_topk_prob: bool, sliding: bool) -> None:
    hf_model = moe_model(norm_topk_prob, sliding)
    hf_model.save_pretrained(tmp_path)
    names = load_file(tmp_path / "model.safetensors").keys()
    # transformers 5.17 fuses experts in memory but writes one matrix per expert.
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in names
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    text = load_config(tmp_path).text_config
    assert text.num_experts == 8 and text.num_experts_per_tok == 2
    assert text.norm_topk_prob == norm_topk_prob and text.moe_latent_size is None
    assert not text.expert_norm and text.router_scoring == "softmax"
    assert text.layer_types == ([SLIDING] * 4 if sliding else [FULL] * 4)
    errors = compare(hf_model, tmp_path)
    assert max(errors.values()) < 1e-4, errors


def test_qwen3_moe_fused_expert_tensors_load_too(tmp_path: Path) -> None:
    hf_model = moe_model(norm_topk_prob=True, sliding=False)
    hf_model.save_pretrained(tmp_path)
    state = {name: tensor.contiguous() for name, tensor in hf_model.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert max(compare(hf_model, tmp_path).values()) < 1e-4


def test_qwen3_moe_comparison_fails_with_swapped_experts(tmp_path: Path) -> None:
    hf_model = moe_model(norm_topk_prob=True, sliding=False)
    hf_model.save_pretrained(tmp_path)

    def swap_experts(tensors: dict[str, torch.Tensor]) -> None:
        for projection in ("gate", "up", "down"):
            first = f"model.layers.0.mlp.experts.0.{projection}_proj.weight"
            second = f"model.layers.0.mlp.experts.1.{projection}_proj.weight"
            tensors[first], tensors[second] = tensors[second], tensors[first]

    edit_weights(tmp_path, swap_experts)
    assert min(compare(hf_model, tmp_path).values()) > 1e-2


def test_incomplete_or_inconsistent_experts_are_named(tmp_path: Path) -> None:
    hf_model = moe_model(norm_topk_prob=True, sliding=False)
    hf_model.save_pretrained(tmp_path)
    gone = "model.layers.2.mlp.experts.5.up_proj.weight"
    edit_weights(tmp_path, lambda tensors: tensors.pop(gone))
    with pytest.raises(CheckpointError, match="missing") as error:
        load_reference_model(tmp_path)
    assert gone in str(error.value)

    odd = "model.layers.1.mlp.experts.3.down_proj.weight"
    edit_weights(tmp_path, lambda tensors: tensors.update(
        {gone: torch.zeros(32, 64), odd: torch.zeros(64, 31)}))
    with pytest.raises(CheckpointError, match="wrong shape") as error:
        load_reference_model(tmp_path)
    message = str(error.value)
    assert odd in message and "(64, 31)" in message and "(64, 32)" in message


def hub_style_config(**changes) -> dict:
    """A config.json shaped like the hub's Qwen3-30B-A3B one (transformers 4 field names)."""
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "attention_bias": False, "bos_token_id": 151643, "decoder_sparse_step": 1,
        "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048,
        "intermediate_size": 6144, "max_position_embeddings": 40960, "max_window_layers": 48,
        "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True,
        "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
        "num_hidden_layers": 48, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_sliding_window": False,
        "vocab_size": 151936,
    }
    config.update(changes)
    return config


def load_config_json(tmp_path: Path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return load_config(tmp_path)


def test_hub_style_qwen3_moe_config(tmp_path: Path) -> None:
    config = load_config_json(tmp_path, hub_style_config(
        rope_scaling={"rope_type": "yarn", "factor": 4.0,
                      "original_max_position_embeddings": 32768}))
    text = config.text_config
    assert config.dtype == "bfloat16"
    assert text.num_experts == 128 and text.head_dim == 128 and text.layer_types == [FULL] * 48
    assert text.eos_token_ids == [151645] and text.bos_token_id == 151643
    rope = text.rope_parameters[FULL]
    assert (rope.rope_type, rope.rope_theta, rope.factor, rope.original_max_position_embeddings) \
        == ("yarn", 1000000.0, 4.0, 32768)


@pytest.mark.parametrize("changes, field", [
    ({"mlp_only_layers": [0, 3]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type"),
])
def test_unsupported_qwen3_moe_features_are_refused(tmp_path: Path, changes: dict,
                                                    field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        load_config_json(tmp_path, hub_style_config(**changes))


def per_token_latent_moe(moe: LatentMoE, x: torch.Tensor) -> torch.Tensor:
    """The latent MoE written out for one token at a time, in float64."""
    config = moe.config
    weight = {name: param.double() for name, param in moe.named_parameters()}
    inter = config.moe_intermediate_size
    outputs = []
    for token in x.reshape(-1, x.shape[-1]).double():
        logits = weight["gate.weight"] @ token
        scores = logits.softmax(-1) if config.router_scoring == "softmax" else logits.sigmoid()
        chosen = sorted(range(config.num_experts), key=lambda e: -scores[e].item())
        chosen = chosen[:config.num_experts_per_tok]
        gates = torch.stack([scores[e] for e in chosen])
        if config.norm_topk_prob:
            gates = gates / gates.sum()
        latent = weight["pooler.weight"] @ token
        combined = torch.zeros_like(latent)
        for expert, gate_weight in zip(chosen, gates):
            gate_up = weight["experts.gate_up_proj"][expert]
            hidden = F.silu(gate_up[:inter] @ latent) * (gate_up[inter:] @ latent)
            out = weight["experts.down_proj"][expert] @ hidden
            out = out / torch.sqrt(out.pow(2).mean() + config.rms_norm_eps)
            combined += gate_weight * out * weight["experts.norm_weight"][expert]
        shared = weight["shared_expert.down_proj.weight"] @ (
            F.silu(weight["shared_expert.gate_proj.weight"] @ token)
            * (weight["shared_expert.up_proj.weight"] @ token))
        outputs.append(weight["unpooler.weight"] @ combined + shared)
    return torch.stack(outputs).reshape(x.shape)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_latent_moe_matches_a_per_token_loop(scoring: str, norm_topk_prob: bool) -> None:
    config = TextConfig(hidden_size=48, num_experts=6, num_experts_per_tok=3,
                        moe_intermediate_size=20, moe_latent_size=24, expert_norm=True,
                        num_shared_experts=2, router_scoring=scoring,
                        norm_topk_prob=norm_topk_prob)
    moe = LatentMoE(config)
    randomize(moe, std=0.3, seed=5)
    x = torch.randn(2, 9, 48, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        actual = moe(x)
    expected = per_token_latent_moe(moe, x)
    assert expected.norm() > 1.0
    assert relative_error(actual.double(), expected) < 1e-5


def hf_rope_config(params: RopeParameters, head_dim: int) -> transformers.Qwen3Config:
    rope = params.to_dict()
    max_positions = 4096
    if params.rope_type == "yarn":
        max_positions = int(params.factor * params.original_max_position_embeddings)
    return transformers.Qwen3Config(hidden_size=head_dim * 4, num_attention_heads=4,
                                    head_dim=head_dim, max_position_embeddings=max_positions,
                                    rope_parameters=rope)


ROPE_CASES = [
    (RopeParameters(rope_theta=10000.0), 16),
    (RopeParameters(rope_theta=1_000_000.0), 128),
    (RopeParameters(rope_theta=10000.0, rope_type="yarn", factor=4.0,
                    original_max_position_embeddings=16), 16),
    (RopeParameters(rope_theta=100_000.0, rope_type="yarn", factor=4.0,
                    original_max_position_embeddings=512, beta_fast=16.0, beta_slow=2.0), 64),
] + [(params, preset().text_config.head_dim) for preset in PRESETS.values()
     for params in preset().text_config.rope_parameters.values()]


@pytest.mark.parametrize("params, head_dim", ROPE_CASES)
def test_rope_frequencies_match_transformers(params: RopeParameters, head_dim: int) -> None:
    config = hf_rope_config(params, head_dim)
    if params.rope_type == "yarn":
        expected, expected_scale = ROPE_INIT_FUNCTIONS["yarn"](config)
    else:
        expected, expected_scale = Qwen3RotaryEmbedding.compute_default_rope_parameters(config)
    actual, scale = inverse_frequencies(params, head_dim)
    torch.testing.assert_close(actual, expected.float(), rtol=1e-6, atol=0)
    assert math.isclose(scale, expected_scale, rel_tol=1e-9)
