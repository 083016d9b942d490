import json

import pytest

from muse.config import FULL, SLIDING, ConfigError, MuseSparkConfig, TextConfig, default_layer_types
from muse.presets import PRESETS, get_preset


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_config_json(tmp_path, name):
    config = get_preset(name)
    config.save(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["model_type"] == "muse_spark"
    assert data["text_config"]["layer_types"] == config.text_config.layer_types
    assert MuseSparkConfig.load(tmp_path) == config


def test_muse_layer_pattern():
    types = default_layer_types(62)
    assert types.count(SLIDING) == 46 and types.count(FULL) == 16
    assert types[3] == FULL and types[2] == SLIDING and types[61] == FULL


@pytest.mark.parametrize("field, value, fragment", [
    ("num_key_value_heads", 3, "divisor of num_attention_heads"),
    ("layer_types", ["sliding_attention"] * 3, "num_hidden_layers"),
    ("layer_types", ["sliding_attention", "full_attention", "chunked", "full_attention"],
     "layer_types[2]"),
    ("sliding_window", 0, "sliding_window"),
    ("num_experts_per_tok", 9, "num_experts_per_tok"),
    ("router_scoring", "relu", "router_scoring"),
    ("hidden_size", -1, "hidden_size"),
    ("eos_token_id", 10**6, "eos_token_id"),
    ("moe_latent_size", 0, "moe_latent_size"),
])
def test_invalid_fields_are_named(field, value, fragment):
    with pytest.raises(ConfigError) as error:
        TextConfig(**{field: value})
    assert fragment in str(error.value)


def test_invalid_rope_and_unknown_keys_are_named():
    with pytest.raises(ConfigError, match="rope_parameters.full_attention.rope_type"):
        TextConfig(rope_parameters={"full_attention": {"rope_type": "linear"}})
    with pytest.raises(ConfigError, match="original_max_position_embeddings"):
        TextConfig(rope_parameters={"full_attention": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ConfigError, match="text_config"):
        MuseSparkConfig.from_dict({"model_type": "muse_spark", "text_config": {"hiden_size": 8}})
    with pytest.raises(ConfigError, match="model_type"):
        MuseSparkConfig.from_dict({"model_type": "llama"})


def test_dense_config_needs_no_expert_fields():
    config = TextConfig(num_experts=0, intermediate_size=96, moe_latent_size=None)
    assert not config.is_moe
