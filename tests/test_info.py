import json

from muse.cli import main
from muse.info import kv_cache_bytes, model_info, text_parameters
from muse.presets import get_preset
from muse.reference.model import MuseForCausalLM


def test_full_preset_figures(capsys):
    main(["info", "muse-spark-open-816b-a42b"])
    out = capsys.readouterr().out
    assert "815.9B total / 41.9B active" in out
    assert "46 sliding + 16 global" in out
    assert "ratio 0.26)" in out


def test_info_json_is_computed(capsys):
    main(["info", "muse-spark-open-816b-a42b", "--json", "--context", "1048576"])
    data = json.loads(capsys.readouterr().out)
    assert round(data["text_total"] / 1e9, 1) == 815.9
    assert round(data["text_active"] / 1e9, 1) == 41.9
    assert round(data["kv_ratio"], 2) == 0.26
    # Sliding layers hold one window; at a context shorter than the window the ratio is 1.
    short = model_info(get_preset("muse-spark-open-816b-a42b"), context=1024)
    assert short.kv_ratio == 1.0
    assert 1.5e9 < data["vision"] < 2.5e9 and 100e6 < data["audio"] < 140e6


def test_parameter_count_matches_the_model():
    text = get_preset("muse-spark-tiny").text_config
    model = MuseForCausalLM(text)
    assert sum(p.numel() for p in model.parameters()) == text_parameters(text).total


def test_kv_bytes_follow_the_window():
    text = get_preset("muse-spark-tiny").text_config
    per_layer = 2 * text.num_key_value_heads * text.head_dim * 2
    context = 1000
    assert kv_cache_bytes(text, context) == per_layer * (4 * text.sliding_window + 2 * context)
