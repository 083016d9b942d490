"""The offline speed benchmarks (benchmarks/) run end to end on the tiny preset on the CPU."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks import (decode_breakdown, gpu_idle, latency, profile_step, quantized_speed,
                        spec_decode, throughput)
from benchmarks.roofline import (
    H200_BF16_MATMUL_FLOPS,
    H200_MEMORY_BANDWIDTH,
    Machine,
    ParameterBreakdown,
    Roofline,
    attention_flops,
    kv_read_bytes,
)
from benchmarks.shapes import STAND_IN, hf_config, transformers_text_config
from muse.checkpoint.hf_configs import qwen3_config
from muse.config import FULL
from muse.info import text_parameters
from muse.presets import PRESETS, SHIPPED_CHECKPOINT, get_preset

TINY = ["--shape", "muse-spark-tiny", "--device", "cpu", "--dtype", "float32"]


def positive(value) -> bool:
    return isinstance(value, (int, float)) and value > 0


def check_environment(record: dict) -> None:
    env = record["environment"]
    for key in ("date", "torch", "transformers", "git_commit"):
        assert key in env
    assert record["machine"]["memory_bandwidth_Bps"] == H200_MEMORY_BANDWIDTH
    assert record["shape"]["transformers"]["stand_in"] == STAND_IN
    assert record["shape"]["transformers"]["differences"]


def test_latency_json(tmp_path):
    out = tmp_path / "latency.json"
    record = latency.main([*TINY, "--lengths", "32", "--decode-tokens", "8", "--repeats", "2",
                           "--prefill-graph-max-tokens", "0", "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "latency"
    assert record["results"]["muse"]["engine"]["engine_args"]["prefill_graph_max_tokens"] == 0
    check_environment(record)
    for engine in ("muse", "transformers"):
        result = record["results"][engine]
        [row] = result["rows"]
        assert "error" not in row, row
        assert row["prompt_tokens"] == 32 and row["decode_tokens"] == 8
        assert positive(row["prefill_tok_s"]) and positive(row["ttft_s"])
        assert positive(row["roofline"]["prefill_tok_s"])
        assert positive(row["roofline"]["decode_tok_s"])
        assert positive(row["prefill_fraction_of_roofline"])
    # Decode from transformers is generate(N) minus time to first token: on a shared CPU the
    # difference may be noise, so only muse's (timed token by token) must be positive here.
    assert positive(record["results"]["muse"]["rows"][0]["decode_tok_s"])
    sides = record["shape"]
    assert record["results"]["muse"]["engine"]["parameters"] == sides["muse"]["params_total"]
    assert record["results"]["transformers"]["engine"]["parameters"] \
        == sides["transformers"]["params_total"]
    [r] = record["ratios"]
    assert r["prompt_tokens"] == 32 and positive(r["prefill"])


def test_throughput_json(tmp_path):
    out = tmp_path / "throughput.json"
    record = throughput.main([*TINY, "--num-requests", "4", "--prompt-lens", "8:24",
                              "--output-lens", "2:6", "--hf-batch-sizes", "2",
                              "--hf-max-requests", "2", "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "throughput"
    check_environment(record)
    work = record["workload"]
    assert work["num_requests"] == 4 and 4 * 2 <= work["output_tokens"] <= 4 * 6
    muse = record["results"]["muse"]
    assert muse["all"]["requests"] == 4 and muse["subset"]["requests"] == 2
    assert muse["all"]["output_tokens"] == work["output_tokens"]
    hf = record["results"]["transformers"]
    assert hf["best_batch_size"] == 2 and "first 2 of the 4" in hf["note"]
    for figures in (muse["all"], muse["subset"], hf["best"]):
        for key in ("wall_s", "output_tok_s", "total_tok_s", "fraction_of_roofline"):
            assert positive(figures[key]), (key, figures)
        assert positive(figures["roofline"]["output_tok_s"])
    assert hf["best"]["generated_tokens"] >= hf["best"]["output_tokens"]
    assert positive(record["ratios"]["muse_all_vs_transformers"])
    assert positive(record["ratios"]["same_requests"])


def test_engines_run_apart_then_merged(tmp_path):
    small = [*TINY, "--num-requests", "3", "--prompt-lens", "8:12", "--output-lens", "2:3",
             "--hf-max-requests", "2", "--hf-batch-sizes", "2"]
    first = tmp_path / "muse.json"
    alone = throughput.main([*small, "--engines", "muse", "--out", str(first)])
    assert set(alone["results"]) == {"muse"} and alone["ratios"] == {}
    assert alone["results"]["muse"]["subset"]["requests"] == 2
    both = throughput.main([*small, "--engines", "transformers", "--merge-from", str(first)])
    assert set(both["results"]) == {"muse", "transformers"}
    assert both["merged_from"]["muse"]["path"] == str(first)
    assert positive(both["ratios"]["same_requests"])
    with pytest.raises(SystemExit):  # another workload is not comparable
        throughput.main([*small, "--seed", "1", "--engines", "transformers",
                         "--merge-from", str(first)])


@pytest.mark.parametrize("shape", sorted(PRESETS))
def test_parameter_breakdown_matches_muse_info(shape):
    text = get_preset(shape).text_config
    counts = text_parameters(text)
    params = ParameterBreakdown.of(text)
    assert (params.total, params.active) == (counts.total, counts.active)
    # At batch 1 a decode step reads exactly the active weights, less the embedding table
    # but for one row.
    table = text.vocab_size * text.hidden_size
    assert params.weight_bytes(1, 2) == 2 * (counts.active - table + text.hidden_size
                                             + (table if text.tie_word_embeddings else 0))


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b-shape", "qwen3-0.6b-shape",
                                   "muse-spark-15b-a2b", "muse-spark-tiny"])
def test_transformers_config_has_the_same_shape(shape):
    text = get_preset(shape).text_config
    stand_in, differences = transformers_text_config(text)
    # The Qwen3 shapes run unchanged; Muse presets lose only what Qwen3 lacks.
    assert bool(differences) == shape.startswith("muse")
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
                 "moe_intermediate_size", "tie_word_embeddings"):
        assert getattr(stand_in, name) == getattr(text, name), name
    assert stand_in.layer_types == [FULL] * text.num_hidden_layers
    # Read back the way muse reads Hugging Face checkpoints: the same model.
    back = qwen3_config(hf_config(stand_in).to_dict()).text_config
    assert text_parameters(back) == text_parameters(stand_in)
    assert back.layer_types == stand_in.layer_types and back.head_dim == text.head_dim
    if not differences:
        assert text_parameters(stand_in) == text_parameters(text)


def test_rooflines_are_consistent():
    text = get_preset("qwen3-30b-a3b-shape").text_config
    roof = Roofline(text, Machine(H200_MEMORY_BANDWIDTH, H200_BF16_MATMUL_FLOPS), 2)
    short, long = roof.single_stream(1024, 128), roof.single_stream(32768, 128)
    # Batch-1 decode is bound by memory and slows as the context (KV read) grows.
    assert short["decode_bound"] == "memory" and long["decode_tok_s"] < short["decode_tok_s"]
    # Long prefill is bound by compute and attention makes it slower per token.
    assert long["prefill_bound"] == "compute" and long["prefill_tok_s"] < short["prefill_tok_s"]
    # 3.0B bf16 weights a token reads (3.3B active less the embedding table) at 4.26 TB/s.
    assert 600 < short["decode_tok_s"] < 710
    # 64 requests at once route to all 128 experts: each step reads every weight (61 GB), so
    # batching gains only the ratio of all to active weights, about 10x, less KV reads.
    batch = roof.batch([(500, 300)] * 64)
    assert 5 * short["decode_tok_s"] < batch["output_tok_s"] < 10 * short["decode_tok_s"]
    # Sliding layers cap their KV reads and attention at the window.
    spark = get_preset("muse-spark-15b-a2b").text_config
    stand_in = transformers_text_config(spark)[0]
    assert kv_read_bytes(spark, 100_000, 2) < kv_read_bytes(stand_in, 100_000, 2)
    assert attention_flops(spark, 0, 10) == attention_flops(stand_in, 0, 10)


@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_profile_step_runs_on_cpu(phase, tmp_path):
    out = tmp_path / "profile.json"
    record = profile_step.main(["--shape", "muse-spark-tiny", "--device", "cpu", "--phase",
                                phase, "--context", "24", "--steps", "2", "--modes", "eager",
                                "--top", "5", "--out", str(out)])
    (run,) = record["runs"]
    assert run["phase"] == phase and run["step_ms"] > 0 and run["kernels"]
    assert json.loads(out.read_text())["runs"][0]["context"] == 24


def test_profile_step_writes_its_trace_on_cpu(tmp_path):
    trace = tmp_path / "MODE.json"
    profile_step.main(["--shape", "muse-spark-tiny", "--device", "cpu", "--phase", "prefill",
                       "--context", "24", "--modes", "eager", "--trace", str(trace)])
    events = gpu_idle.load_events(tmp_path / "eager.json")
    assert any(e.get("cat") == "cpu_op" for e in events)
    with pytest.raises(ValueError, match="no GPU events"):
        gpu_idle.analyse(events)


@pytest.mark.parametrize("shape", ["muse-spark-15b-a2b", "qwen3-30b-a3b-shape",
                                   "qwen3-0.6b-shape"])
def test_decode_breakdown_bytes_add_up_to_the_step_roofline(shape):
    """The parts' bytes and what no part streams (the layer norms, one embedding row) are
    the decode step's roofline bytes: no weight counted twice or left out."""
    text = get_preset(shape).text_config
    roof = Roofline(text, Machine(H200_MEMORY_BANDWIDTH, H200_BF16_MATMUL_FLOPS), 2)
    step_bytes, _ = roof.decode_step([1023])
    parts = decode_breakdown.part_bytes(text, 1024)
    norms = text.num_hidden_layers * (2 * text.hidden_size
                                      + (2 * text.head_dim if text.qk_norm else 0))
    assert sum(parts.values()) + 2 * (norms + 2 * text.hidden_size) == step_bytes


def test_decode_breakdown_of_a_profile(tmp_path):
    kernels = [("_dense_gemv_kernel", 4, 40.0), ("_gemm1_swiglu_kernel", 2, 30.0),
               ("_gemm2_kernel", 2, 20.0), ("nvjet_sm90_tst_512x8", 1, 50.0),
               ("_split_kv_combine_kernel", 2, 4.0), ("_moe_combine_kernel", 2, 5.0),
               ("_rms_norm_kernel", 5, 10.0), ("Memcpy DtoD (Device -> Device)", 1, 1.0)]
    run = {"shape": "muse-spark-tiny", "phase": "decode", "batch": 1, "context": 64,
           "eager": False, "step_ms": 0.2, "kernel_ms": 0.16,
           "kernels": [{"name": n, "calls_per_step": c, "us_per_step": us}
                       for n, c, us in kernels]}
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"runs": [run, {**run, "eager": True}]}))
    out = tmp_path / "breakdown.json"
    decode_breakdown.main([str(profile), "--out", str(out)])
    (result,) = json.loads(out.read_text())["results"]
    rows = {r["part"]: r for r in result["parts"]}
    assert rows["routed experts"]["launches"] == 4 and rows["routed experts"]["us"] == 50.0
    assert rows["LM head (cuBLAS)"]["us"] == 50.0
    assert decode_breakdown.part_of("sm90_xmma_gemm_bf16bf16_bf16f32") == "LM head (cuBLAS)"
    assert decode_breakdown.part_of("void gemv2T_kernel_val<...>") == "other (torch ops, copies)"
    assert decode_breakdown.part_of("ampere_bf16_s16816gemm_bf16_64x64") == "LM head (cuBLAS)"
    assert rows["MoE combine"]["us"] == 5.0 and rows["split-KV combine"]["us"] == 4.0
    assert rows["other (torch ops, copies)"]["launches"] == 1
    assert rows["add + RMSNorm"]["roofline_us"] == 0 and rows["add + RMSNorm"]["lost_us"] == 10
    assert rows["decode attention"]["launches"] == 0 and rows["decode attention"]["bytes"] > 0
    assert result["totals"]["idle_us"] == pytest.approx(40.0)


def _event(cat, name, ts, dur, tid=1, correlation=None):
    args = {} if correlation is None else {"correlation": correlation}
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_gpu_idle_charges_each_gap_to_the_launch_that_ends_it(tmp_path):
    events = [
        # Host: an operator launches kernel a early; a later one launches b after a ended
        # (host-late: 30 us idle); c was launched early but starts 10 us after b (device).
        _event("cpu_op", "aten::mm", 0, 10), _event("cuda_runtime", "cudaLaunchKernel", 2, 3,
                                                     correlation=1),
        _event("cpu_op", "triton_slow_op", 40, 100), _event("cpu_op", "inner", 50, 15),
        _event("cuda_runtime", "cuLaunchKernelEx", 60, 5, correlation=2),
        _event("cuda_runtime", "cuLaunchKernelEx", 70, 2, correlation=3),
        _event("kernel", "a", 10, 25, tid=7, correlation=1),  # busy 10-35
        _event("kernel", "b", 65, 20, tid=7, correlation=2),  # idle 35-65 (host late)
        _event("kernel", "c", 95, 5, tid=7, correlation=3),   # idle 85-95 (device)
        _event("gpu_memset", "Memset (Device)", 97, 1, tid=7),  # inside c: no gap
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = tmp_path / "idle.json"
    result = gpu_idle.main([str(path), "--min-gap-us", "5", "--out", str(out)])
    assert result["span_us"] == 90 and result["busy_us"] == 50 and result["idle_us"] == 40
    assert result["gaps"] == 2 and result["host_late_us"] == 30
    assert result["lead_in_us"] == 10
    first, second = result["largest"]
    assert (first["idle_us"], first["next"], first["host_late"], first["launched_by"]) == \
        (30, "b", True, "inner")
    assert (second["idle_us"], second["host_late"]) == (10, False)
    assert result["by_launching_op"] == {"inner": 30, "triton_slow_op": 10}
    assert json.loads(out.read_text())["idle_us"] == 40


def test_profile_step_quantizes_the_weights(tmp_path):
    record = profile_step.main(["--shape", "muse-spark-tiny", "--device", "cpu", "--context",
                                "24", "--steps", "2", "--modes", "eager", "--top", "50",
                                "--quantization", "nvfp4-w4a16"])
    (run,) = record["runs"]
    assert run["quantization"] == "nvfp4-w4a16"
    # The packed FP4 weights are unpacked in the step (on the CPU: the torch twin's ops).
    assert any("bitwise" in k["name"] or "__rshift__" in k["name"] or "__and__" in k["name"]
               for k in run["kernels"]), [k["name"] for k in run["kernels"]]


def test_spec_decode_json(tmp_path):
    """The shipped model with n-gram drafts (no drafter needed): acceptance per family and the
    three speed modes; greedy speculation gives the plain engine's tokens."""
    out = tmp_path / "spec.json"
    k = 3
    record = spec_decode.main([
        "--device", "cpu", "--num-prompts", "1", "--max-tokens", "6", "--concurrency", "1,2",
        "--repeats", "1", "--speed-requests", "2", "--speculative-config",
        json.dumps({"method": "ngram", "num_speculative_tokens": k}), "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "spec_decode"
    assert "date" in record["environment"] and "git_commit" in record["environment"]
    assert {"mean_acceptance_length", "per_position", "per_request_tok_s"} <= set(record["notes"])
    assert record["engine_configs"]["adaptive"]["enable_adaptive_verification"]
    assert record["engine_configs"]["sampled_block"]["rejection_sample_method"] == "block"
    assert set(record["acceptance"]) == {"greedy", "sampled_token", "sampled_block"}
    for setting, families in record["acceptance"].items():
        assert set(families) == {"arithmetic", "tools", "instructions", "all"}
        for family, row in families.items():
            assert row["requests"] == (3 if family == "all" else 1)
            assert len(row["per_position"]) == len(row["accepted_per_position"]) == k
            if row["num_drafts"]:
                assert 1 <= row["mean_acceptance_length"] <= 1 + k
                assert row["mean_acceptance_length"] == pytest.approx(
                    1 + row["num_accepted_tokens"] / row["num_drafts"])
                assert row["per_position"][0] == pytest.approx(
                    row["accepted_per_position"][0] / row["num_drafts"])
                # Accepting position j needs every position before it.
                assert row["per_position"] == sorted(row["per_position"], reverse=True)
            if setting == "greedy":
                assert row["equal_to_plain"] == row["requests"], row
        total = families["all"]
        assert total["num_drafts"] == sum(families[f]["num_drafts"]
                                          for f in ("arithmetic", "tools", "instructions"))
    assert [row["concurrency"] for row in record["speed"]] == [1, 2]
    for row in record["speed"]:
        c = row["concurrency"]
        assert row["plain"]["speedup"] == pytest.approx(1.0)
        for mode in ("plain", "speculative", "adaptive"):
            figures = row[mode]
            assert figures["requests"] == 2  # two waves of one, one wave of two
            assert figures["output_tokens"] == 6 * 2  # EOS ignored
            assert positive(figures["output_tok_s"])
            assert figures["per_request_tok_s"] == pytest.approx(figures["output_tok_s"] / c)
            if mode != "plain":
                assert positive(figures["speedup"]) and figures["equal_to_plain"] == 2


def test_speed_mixes_keep_to_the_families_the_shipped_model_knows(monkeypatch):
    """The held-out stream follows the data generators' mix, which also has tasks the shipped
    model was never taught (unseen tools): the speed mix skips them, in stream order."""
    from muse.train.drafter_data import DrafterPrompt

    tasks = ["unseen_tools", "arithmetic", "unseen_tools", "tools", "instructions",
             "unseen_tools", "arithmetic", "tools", "instructions"] * 4

    def stream(num, seed, split):
        return [DrafterPrompt(task, [{"role": "user", "content": str(i)}], None)
                for i, task in enumerate(tasks[:num])]

    class Tokenizer:
        def apply_chat_template(self, messages, **kwargs):
            return [int(messages[0]["content"])]

    monkeypatch.setattr(spec_decode, "sample_prompts", stream)
    prompts = spec_decode.held_out_prompts(Tokenizer(), 2, 5, seed=0)
    assert prompts.mix == [[1], [3], [4], [6], [7]]
    assert all(tasks[ids[0]] in spec_decode.FAMILIES for group in prompts.families.values()
               for ids in group)


def test_spec_decode_needs_a_drafter_for_drafter_methods(tmp_path):
    spec = spec_decode.SpeculativeConfig.parse({"method": "dspark"})
    with pytest.raises(SystemExit, match="needs a drafter checkpoint"):
        spec_decode.check_drafter(str(tmp_path), spec)
    spec_decode.check_drafter(str(tmp_path), spec_decode.SpeculativeConfig.parse(
        {"method": "ngram"}))
    with pytest.raises(SystemExit):
        spec_decode.parse_args(["--sections", "latency"])
    with pytest.raises(SystemExit):
        spec_decode.parse_args(["--speculative-config", '{"method": "ngram", "k": 3}'])


def test_quantized_speed_json(tmp_path):
    """Each format's weights as stored (FP4 far below bf16), its rates and KV capacities."""
    out = tmp_path / "quantized.json"
    record = quantized_speed.main([
        "--shape", "muse-spark-tiny", "--device", "cpu", "--dtype", "float32",
        "--formats", "bf16,nvfp4-w4a16", "--context", "16", "--decode-tokens", "3",
        "--requests", "2", "--prompt-tokens", "8", "--output-tokens", "2", "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "quantized_speed"
    bf16, fp4 = record["rows"]
    assert fp4["weight_bytes"] < bf16["weight_bytes"]
    for row in (bf16, fp4):
        assert positive(row["decode_tok_s"]) and positive(row["throughput_tok_s"])
        assert row["kv_tokens_fp8"] >= row["kv_tokens"] > 0


def test_real_size_json(tmp_path):
    from benchmarks import real_size

    out = tmp_path / "real-size.json"
    record = real_size.main(["--preset", "muse-spark-tiny", "--device", "cpu", "--dtype",
                             "float32", "--batches", "1,4", "--context", "48", "--prefill",
                             "48", "--decode-steps", "2", "--kv-cache-memory-bytes",
                             str(32 * 2**20), "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "real_size"
    assert {"date", "torch", "git_commit"} <= set(record["environment"])
    assert set(record["decode_per_layer"]) == {"1", "4"}
    for runs in record["runs"].values():  # each model's own step times
        assert all(positive(s) for s in runs["decode_step_s"].values())
        assert positive(runs["prefill_s"])
    assert all(positive(cell["roofline_s"]) for cell in record["decode_per_layer"].values())
    # The cut models: the preset's layer shapes, sliding and global in turn.
    cut = real_size.cut_config("muse-spark-open-816b-a42b", 4).text_config
    assert cut.hidden_size == 8192 and cut.num_experts == 256
    assert cut.layer_types == ["sliding_attention", "full_attention"] * 2


def test_real_size_over_two_ranks():
    """Every rank cuts the preset itself (`hf_overrides`), so a sharded layout runs too."""
    from benchmarks import real_size

    record = real_size.main(["--preset", "muse-spark-tiny", "--device", "cpu", "--dtype",
                             "float32", "--batches", "1", "--context", "16", "--prefill", "16",
                             "--decode-steps", "2", "--kv-cache-memory-bytes", str(32 * 2**20),
                             "--tensor-parallel-size", "2"])
    assert record["gpus"] == 2 and record["parallel"]["tensor_parallel_size"] == 2
    assert all(positive(s) for run in record["runs"].values()
               for s in run["decode_step_s"].values())


def test_kv_offload_copies_json(tmp_path):
    from benchmarks import kv_offload_copies

    out = tmp_path / "kv-copies.json"
    record = kv_offload_copies.main(["--preset", "muse-spark-tiny", "--device", "cpu",
                                     "--blocks", "2,8", "--gpu-blocks", "32",
                                     "--host-blocks", "16", "--repeats", "2", "--out", str(out)])
    assert json.loads(out.read_text())["benchmark"] == "kv_offload_copies"
    assert [row["blocks_per_kind"] for row in record["rows"]] == [2, 8]
    for row in record["rows"]:
        assert positive(row["bytes"])
        for phase in ("save", "load"):
            assert positive(row[phase]["host_ms"]) and row[phase]["compute_ms"] is None


@pytest.mark.skipif(not (SHIPPED_CHECKPOINT / "config.json").is_file(),
                    reason="no shipped checkpoint in this tree")
def test_batch1_steps_splits_prefill_from_decode(tmp_path):
    from benchmarks import batch1_steps
    out = tmp_path / "steps.json"
    profile = tmp_path / "profile.txt"
    record = batch1_steps.main(["--device", "cpu", "--prompts", "2", "--max-tokens", "6",
                                "--out", str(out), "--profile", str(profile),
                                "--eager-verification", "--prefill-read-back"])
    assert json.loads(out.read_text())["results"].keys() == record["results"].keys()
    sections = [line for line in profile.read_text().splitlines() if line.startswith("== ")]
    modes = ("plain", "speculative", "speculative_eager_verification")
    assert sections == [f"== {mode}: {what}" for mode in modes for what in
                        ("Python functions by cumulative time", "operators by self host time")]
    for mode in modes:
        result = record["results"][mode]
        assert result["prefill"]["steps"] == 2  # one prompt at a time, each one step
        assert result["decode"]["steps"] >= 1 and result["output_tokens"] > 0
    assert record["results"]["speedup"] > 0
    speculative = record["results"]["speculative"]
    assert speculative["prefill_read_back"]["output_tokens"] == speculative["output_tokens"]
    assert "prefill_read_back" not in record["results"]["plain"]


def test_host_step_times_decode_steps_without_the_model(tmp_path):
    from benchmarks import host_step
    from muse.engine.worker import ModelWorker
    execute = ModelWorker.execute
    record = host_step.main(["--requests", "8", "--steps", "4", "--out",
                             str(tmp_path / "host.json")])
    assert ModelWorker.execute is execute  # the real forward is back
    assert record["requests"] == 8 and record["host_ms_median"] > 0
    assert json.loads((tmp_path / "host.json").read_text())["steps"] == 4


def test_kv_fp8_agreement_counts_parted_replies_as_misses():
    from benchmarks.kv_fp8_agreement import agreement
    got = agreement([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4, 7], [5, 6]])
    assert (got["same_tokens"], got["tokens"], got["identical_replies"]) == (5, 7, 1)


@pytest.mark.skipif(not (SHIPPED_CHECKPOINT / "config.json").is_file(),
                    reason="no shipped checkpoint in this tree")
def test_kv_fp8_agreement_json(tmp_path):
    from benchmarks import kv_fp8_agreement
    out = tmp_path / "agreement.json"
    record = kv_fp8_agreement.main(["--sets", "fp8-test", "--max-tokens", "4", "--device",
                                    "cpu", "--out", str(out)])
    assert json.loads(out.read_text())["results"] == record["results"]
    rows = record["results"]["fp8-test"]
    assert set(rows) == {"fp8", "fp8-calculated", "float32"}
    # The arithmetic questions' first tokens are confident: every variant keeps some.
    assert all(0 < row["same_tokens"] <= row["tokens"] for row in rows.values())


def test_recording_llm_keeps_every_eval_reply(tmp_path):
    from benchmarks.kv_fp8_agreement import eval_replies
    from muse import LLM
    from muse.init_checkpoint import init_random_checkpoint
    from muse.presets import get_preset
    checkpoint = init_random_checkpoint(get_preset("muse-spark-tiny"), tmp_path / "tiny", seed=0)
    llm = LLM(str(checkpoint), device="cpu")
    try:
        replies, scores = eval_replies(llm, num=1)
    finally:
        llm.shutdown()
    # One problem per category: 3 operations x 4 digit counts, the tool requests, 5 kinds.
    assert len(replies) >= 12 + 5 and all(replies)
    assert set(scores) == {"arithmetic.overall.exact", "tools.valid", "tools.correct",
                           "instructions"}
    assert all(0.0 <= value <= 1.0 for value in scores.values())


def test_parallel_check_compares_up_to_the_first_near_tie():
    from benchmarks.parallel_check import compare
    gaps = [[1.0, 1.0, 1e-4, 1.0], [1.0, 1.0]]
    # A difference at or after a near tie is allowed; the tokens before it are compared.
    result = compare([[1, 2, 3, 4], [5, 6]], gaps, [[1, 2, 9, 9], [5, 6]], min_gap=1e-3)
    assert result["equal"] and result["compared_tokens"] == 4 and result["cut_by_near_ties"] == 1
    # One before it fails the layout, and says where.
    result = compare([[1, 2, 3, 4], [5, 6]], gaps, [[1, 2, 3, 4], [5, 7]], min_gap=1e-3)
    assert not result["equal"]
    assert result["first_difference"] == {"prompt": 1, "position": 1, "want": 6, "got": 7,
                                          "gap": 1.0}
    assert not compare([[1, 2]], [[1.0, 1.0]], [[1]], min_gap=1e-3)["equal"]


def test_parallel_check_runs_two_ranks_on_the_cpu(tmp_path):
    from benchmarks import parallel_check
    out = tmp_path / "parallel.json"
    record = parallel_check.main([
        "--shape", "muse-spark-tiny", "--device", "cpu", "--layouts", "tp2",
        "--num-prompts", "3", "--prompt-tokens", "8:40", "--max-tokens", "6",
        "--init-std", "0.1", "--out", str(out)])
    result = record["results"]["tp2"]
    assert result["equal"] and result["world_size"] == 2 and result["compared_tokens"] > 0
    assert json.loads(out.read_text())["results"]["tp2"]["equal"]


def test_latency_over_two_ranks_takes_two_gpus_rooflines(tmp_path):
    args = [*TINY, "--engines", "muse", "--lengths", "16", "--decode-tokens", "4",
            "--repeats", "1"]
    one = latency.main(args)
    two = latency.main([*args, "--tensor-parallel-size", "2"])
    assert (one["gpus"], two["gpus"]) == (1, 2)
    [row_one], [row_two] = (r["results"]["muse"]["rows"] for r in (one, two))
    assert "error" not in row_two, row_two
    assert two["results"]["muse"]["engine"]["engine_args"]["tensor_parallel_size"] == 2
    assert row_two["roofline"]["decode_tok_s"] == pytest.approx(
        2 * row_one["roofline"]["decode_tok_s"])


def test_collectives_json(tmp_path):
    from benchmarks import collectives
    out = tmp_path / "collectives.json"
    record = collectives.main(["--device", "cpu", "--shape", "muse-spark-tiny", "--world-sizes",
                               "2", "--tokens", "1,4", "--repeats", "2", "--out", str(out)])
    by_count = json.loads(out.read_text())["results"]["2"]
    assert set(by_count) == {"1", "4"}
    for ops in by_count.values():
        assert set(ops) == set(collectives.OPS)
        assert all(figures["us"] > 0 and figures["step_ms"] > 0 for figures in ops.values())
    layers = record["layers"]
    us = by_count["1"]["all_reduce"]["us"]
    assert by_count["1"]["all_reduce"]["step_ms"] == pytest.approx(2 * layers * us / 1e3)


def test_decode_ab_script_interleaves_its_settings(tmp_path):
    """scripts/decode_ab_h200.sh: every shape runs every setting once a round, settings in
    turn, each with its own environment and JSON (dry run: the commands it would run); without
    settings, the defaults against MUSE_PDL=0."""
    import subprocess

    script = Path(__file__).resolve().parent.parent / "scripts" / "decode_ab_h200.sh"
    env = dict(os.environ, DRY_RUN="1", ROUNDS="2", SHAPES="muse-spark-tiny qwen3-0.6b-shape")
    lines = subprocess.run(["bash", str(script), str(tmp_path), "base",
                            "MUSE_PDL=0,MUSE_ONE_ROW_GEMV=0"], env=env, capture_output=True,
                           text=True, check=True).stdout.splitlines()
    assert len(lines) == 2 * 2 * 2
    assert lines[0].startswith("env python3 benchmarks/latency.py --shape muse-spark-tiny")
    assert lines[1].startswith("env MUSE_PDL=0 MUSE_ONE_ROW_GEMV=0 python3 benchmarks/latency.py")
    assert lines[1].endswith("latency-muse-spark-tiny-MUSE_PDL-0+MUSE_ONE_ROW_GEMV-0-r1.json")
    assert "--shape qwen3-0.6b-shape" in lines[2] and lines[-1].endswith("-r2.json")
    defaults = subprocess.run(["bash", str(script), str(tmp_path)], env=dict(env, ROUNDS="1"),
                              capture_output=True, text=True, check=True).stdout.splitlines()
    assert [line.split(" python3 ")[0] for line in defaults] == ["env", "env MUSE_PDL=0"] * 2


def test_mixed_steps_json(tmp_path):
    from benchmarks import mixed_steps

    out = tmp_path / "mixed.json"
    record = mixed_steps.main(["--shape", "muse-spark-tiny", "--device", "cpu", "--requests",
                               "6", "--prompt-len", "20", "--output-len", "4",
                               "--max-num-batched-tokens", "32", "--repeats", "1",
                               "--out", str(out)])
    assert record["same_tokens"] and set(record["modes"]) == {"graphs", "piecewise"}
    # Every prompt token is computed in each run (no prefix-cache hits across runs).
    assert all(mode["steps"] >= 6 * 20 // 32 for mode in record["modes"].values())
    assert json.loads(out.read_text())["settings"]["requests"] == 6
