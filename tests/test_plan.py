"""`muse plan`: its memory arithmetic agrees with `muse info`'s parameter counts, and its
projected speeds behave as the stated model says."""

from __future__ import annotations

import json

import pytest

from muse.distributed.config import ParallelConfig
from muse.info import text_parameters
from muse.plan.gpus import GPUS
from muse.plan.projection import QUANTIZED_KINDS, WEIGHT_FORMATS, project
from muse.presets import get_preset

OPEN = "muse-spark-open-816b-a42b"
TP8_EP = ParallelConfig(tensor_parallel_size=8, enable_expert_parallel=True)


def test_one_gpu_holds_every_parameter_muse_info_counts():
    config = get_preset(OPEN)
    whole = project(config, ParallelConfig(), GPUS["b300"], "bf16")
    assert whole.weight_bytes_per_gpu == 2 * text_parameters(config.text_config).total


def test_eight_gpus_split_what_one_holds_and_replicate_the_rest():
    config = get_preset(OPEN)
    one = project(config, ParallelConfig(), GPUS["b300"], "bf16").weight_bytes_by_kind
    each = project(config, TP8_EP, GPUS["b300"], "bf16").weight_bytes_by_kind
    assert each["experts"] * 8 == one["experts"]  # 32 whole experts each of the 256
    text = config.text_config
    # Each GPU's vocabulary rows are padded to a multiple of 64: 202,048 / 8 -> 25,280.
    rows = -(-text.vocab_size // 8 // 64) * 64
    assert each["embedding"] == one["embedding"] // text.vocab_size * rows
    norms = 2 * text.head_dim * text.num_hidden_layers * 2  # q / k norms, bf16, on every GPU
    assert each["attention"] * 8 == one["attention"] + 7 * norms
    assert each["other"] == one["other"]  # norms, router and pooler on every GPU


@pytest.mark.parametrize("weight_format", sorted(WEIGHT_FORMATS))
def test_a_weight_format_sets_the_bytes_of_the_linear_layers_only(weight_format):
    config = get_preset(OPEN)
    bf16 = project(config, TP8_EP, GPUS["b300"], "bf16").weight_bytes_by_kind
    other = project(config, TP8_EP, GPUS["b300"], weight_format).weight_bytes_by_kind
    for kind, n in bf16.items():
        factor = WEIGHT_FORMATS[weight_format].linear_bytes / 2 if kind in QUANTIZED_KINDS \
            else 1
        assert other[kind] == pytest.approx(n * factor, rel=1e-9), kind
    # NVFP4: 4 bits and an E4M3 scale per 16 weights.
    assert WEIGHT_FORMATS["nvfp4"].linear_bytes == 0.5625


def test_speeds_follow_the_model():
    config = get_preset(OPEN)
    plain = project(config, TP8_EP, GPUS["b300"], "nvfp4", context=16384,
                    concurrency=(1, 8, 128))
    per_user = [s.decode_tokens_per_s_per_user for s in plain.speeds]
    per_gpu = [s.decode_tokens_per_s_per_gpu for s in plain.speeds]
    assert per_user == sorted(per_user, reverse=True) and per_gpu == sorted(per_gpu)
    one = plain.speeds[0]
    assert one.memory_s > one.compute_s  # batch-1 decode reads weights: memory-bound
    # Twice the bandwidth efficiency: a memory-bound step's memory time halves.
    faster = project(config, TP8_EP, GPUS["b300"], "nvfp4", context=16384,
                     memory_efficiency=0.9).speeds[0]
    assert faster.memory_s == pytest.approx(one.memory_s / 2)
    spec = project(config, TP8_EP, GPUS["b300"], "nvfp4", context=16384,
                   num_speculative_tokens=7, acceptance_length=6.0).speeds[0]
    assert 3 * one.decode_tokens_per_s_per_user < spec.decode_tokens_per_s_per_user \
        < 6 * one.decode_tokens_per_s_per_user
    # An H200 has no FP4 tensor cores: FP4 weights compute at its bf16 rate.
    assert GPUS["h200"].matmul_tflops("fp4") == GPUS["h200"].bf16_tflops


def test_a_model_that_does_not_fit_says_so():
    assert not project(get_preset(OPEN), ParallelConfig(), GPUS["h200"], "bf16").fits
    assert project(get_preset(OPEN), TP8_EP, GPUS["b300"], "nvfp4").fits


def test_the_cli_prints_the_announced_layout_and_refuses_a_wrong_gpu_count(capsys):
    from muse.cli import main

    command = ["plan", OPEN, "--gpu", "b300", "--num-gpus", "8", "--tensor-parallel-size", "8",
               "--enable-expert-parallel", "--weight-format", "nvfp4"]
    main(command)
    table = capsys.readouterr().out
    assert "8 x B300" in table and "fits" in table and "decode tok/s/user" in table
    main(command + ["--json"])
    result = json.loads(capsys.readouterr().out)
    assert result["num_gpus"] == 8 and len(result["speeds"]) == 2
    with pytest.raises(SystemExit, match="--num-gpus 4"):
        main(command[:5] + ["4"] + command[6:])


def test_efficiencies_come_from_measured_full_size_layers():
    from pathlib import Path

    from muse.plan.projection import efficiencies_from_layer_timings

    path = Path(__file__).parent.parent / "docs/results/performance/real-size-bf16-9c858ad.json"
    record = json.loads(path.read_text())
    memory, compute = efficiencies_from_layer_timings(record)
    # The batch-1 layer's share of a roofline at the measured 4.26 TB/s, as a share of the
    # datasheet's 4.8; the prefill layer's at 790 TFLOP/s, of 989.
    assert memory == pytest.approx(record["decode_per_layer"]["1"]["roofline_fraction"]
                                   * 4.26 / 4.8)
    assert compute == pytest.approx(record["prefill_per_layer"]["roofline_fraction"]
                                    * 790 / 989)
    config = get_preset(OPEN)
    default = project(config, TP8_EP, GPUS["b300"], "nvfp4").speeds[0]
    measured = project(config, TP8_EP, GPUS["b300"], "nvfp4", memory_efficiency=memory,
                       compute_efficiency=compute).speeds[0]
    assert measured.memory_s == pytest.approx(default.memory_s * 0.45 / memory)


def test_layer_timings_of_a_sharded_layer_give_one_gpu_efficiencies():
    """A record measured over 8 GPUs compares with 8 GPUs' roofline: per GPU it is the same
    efficiency as one GPU's record with the same fractions."""
    from muse.plan.projection import efficiencies_from_layer_timings

    one = {"machine": {"memory_bandwidth_Bps": 4.26e12, "matmul_flops": 790e12},
           "decode_per_layer": {"1": {"roofline_fraction": 0.6}},
           "prefill_per_layer": {"roofline_fraction": 0.5}}
    eight = {**one, "gpus": 8, "machine": {"memory_bandwidth_Bps": 8 * 4.26e12,
                                           "matmul_flops": 8 * 790e12}}
    assert efficiencies_from_layer_timings(eight) == pytest.approx(
        efficiencies_from_layer_timings(one))


def test_fp8_weights_need_two_nodes_of_h100s():
    """816B parameters in FP8 are over 800 GB: more than eight 80 GB H100s hold, within
    sixteen with pipeline stages."""
    config = get_preset(OPEN)
    assert not project(config, TP8_EP, GPUS["h100"], "fp8").fits
    two_nodes = ParallelConfig(tensor_parallel_size=8, pipeline_parallel_size=2,
                               enable_expert_parallel=True)
    assert project(config, two_nodes, GPUS["h100"], "fp8").fits
