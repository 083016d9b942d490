import json
import re

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


def test_hf_overrides_replace_decoder_fields_and_drop_encoders():
    from muse.config import with_overrides

    config = get_preset("muse-spark-default")
    assert config.vision_config is not None and config.audio_config is not None
    kinds = config.text_config.layer_types
    cut = with_overrides(config, '{"num_hidden_layers": 2, "vision_config": null}')
    assert cut.text_config.num_hidden_layers == 2
    assert cut.text_config.layer_types == kinds[:2]  # the first layers' kinds kept
    assert cut.vision_config is None and cut.audio_config == config.audio_config
    nested = with_overrides(config, {"text_config": {"sliding_window": 8}, "audio_config": None})
    assert nested.text_config.sliding_window == 8 and nested.audio_config is None
    grown = with_overrides(config, {"num_hidden_layers": len(kinds) + 4})
    assert grown.text_config.layer_types == default_layer_types(len(kinds) + 4)
    assert with_overrides(config, None) is config
    assert config.text_config.num_hidden_layers == len(kinds)  # the original is untouched


@pytest.mark.parametrize(("overrides", "fragment"), [
    ({"num_hidden_layer": 2}, "['num_hidden_layer'] are not fields"),
    ('{"num_hidden_layers": ', "not valid JSON"),
    ([1, 2], "must be a JSON object"),
    ({"vision_config": {"hidden_size": 8}}, "can only be null"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"layer_types": ["sliding_attention"]}, "layer_types"),
])
def test_bad_hf_overrides_are_named(overrides, fragment):
    from muse.config import with_overrides

    with pytest.raises(ValueError, match=re.escape(fragment)):
        with_overrides(get_preset("muse-spark-tiny"), overrides)
