"""Per-GPU weights and KV cache of a parallel layout (`muse/parallel_plan.py`, `muse info`).

The plan is arithmetic on the config; these tests hold it to the parameters the engine model
(`muse.model.decoder.EngineModel`, built from `muse.layers`) really creates on each rank:
small presets in spawned gloo worlds (three spawns: TP=2, TP=4, TP=2 + EP), and the 816B
preset on the meta device with its rank's groups.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from muse.cli import main
from muse.config import MuseSparkConfig, TextConfig
from muse.distributed import parallel_state
from muse.distributed.config import ParallelConfig
from muse.distributed.group import GroupCoordinator
from muse.distributed.launch import spawn_workers
from muse.distributed.layout import GROUP_KINDS, group_of
from muse.info import kv_cache_bytes, text_parameters
from muse.parallel_plan import WEIGHT_KINDS, parallel_plan
from muse.presets import get_preset

FULL_816B = "muse-spark-open-816b-a42b"
# A dense model with tied embeddings, q/k/v biases and a vocabulary that needs padding.
DENSE_TIED = MuseSparkConfig(TextConfig(
    vocab_size=1000, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, num_experts=0, intermediate_size=48,
    attention_bias=True, tie_word_embeddings=True), name="dense-tied", dtype="float32")


def small_configs() -> dict[str, MuseSparkConfig]:
    return {"muse-spark-tiny": get_preset("muse-spark-tiny"),
            "muse-spark-default": get_preset("muse-spark-default"),
            "dense-tied": DENSE_TIED}


def build_model(text: TextConfig, dtype: torch.dtype = torch.float32):
    from muse.kernels.backends import select_backends
    from muse.model.decoder import EngineModel

    return EngineModel(text, select_backends(torch.device("cpu")), dtype)


def model_tensors(model) -> dict:
    """Each parameter tensor once: (every name it has, bytes), and the K/V heads per layer."""
    names: dict[int, list[str]] = {}
    sizes: dict[int, int] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        sizes[id(param)] = param.numel() * param.element_size()
    return {"tensors": [(names[key], sizes[key]) for key in names],
            "kv_heads": model.num_kv_heads}


def build_worker(rank: int) -> dict[str, dict]:
    torch.set_num_threads(1)
    return {key: model_tensors(build_model(config.text_config))
            for key, config in small_configs().items()}


def kind_of(name: str) -> str:
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return "embedding"
    if ".self_attn." in name:
        return "attention"
    if ".mlp.experts." in name:
        return "experts"
    if ".mlp.shared_expert." in name or re.search(r"\.mlp\.(gate_up|down)_proj\.", name):
        return "dense_mlp"
    return "other"  # layer norms, router, pooler, unpooler, final norm


def stage_of(name: str, text: TextConfig, pp: int) -> int:
    match = re.match(r"model\.layers\.(\d+)\.", name)
    if match:
        return int(match[1]) // (text.num_hidden_layers // pp)
    return 0 if name == "model.embed_tokens.weight" else pp - 1


def stage_bytes(built: dict, text: TextConfig, pp: int, stage: int) -> dict[str, int]:
    """Bytes by kind that the GPUs of `stage` hold: each tensor once per stage holding one of
    its names (a tied embedding and LM head are one tensor unless they are on two stages)."""
    sums = dict.fromkeys(WEIGHT_KINDS, 0)
    for names, size in built["tensors"]:
        mine = [name for name in names if stage_of(name, text, pp) == stage]
        if mine:
            sums[kind_of(mine[0])] += size
    return sums


def check_rank(built: dict, config: MuseSparkConfig, parallel: ParallelConfig,
               rank: int) -> None:
    plan = parallel_plan(config, parallel, weight_dtype="float32")
    stage = plan.stages[parallel.coordinates(rank).pp]
    text = config.text_config
    assert stage.weight_bytes == stage_bytes(built, text, parallel.pipeline_parallel_size,
                                             stage.stage), (config.name, parallel, rank)
    assert plan.shards.num_kv_heads == built["kv_heads"]
    assert stage.kv_bytes_per_token == (2 * built["kv_heads"] * text.head_dim * 2
                                        * stage.num_layers)


@pytest.fixture(scope="module")
def tp2_models() -> list[dict]:
    return spawn_workers(build_worker, ParallelConfig(tensor_parallel_size=2), backend="gloo")


def test_tensor_parallel_2_and_with_pipeline_parallel_2(tp2_models) -> None:
    for key, config in small_configs().items():
        tp2 = ParallelConfig(tensor_parallel_size=2)
        for rank in range(2):
            check_rank(tp2_models[rank][key], config, tp2, rank)
        # A TP2 x PP2 rank holds the TP2 model's parameters of its stage (the same TP group
        # of 2 creates them), so one world of 2 checks both layouts.
        tp2_pp2 = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
        for rank in range(tp2_pp2.world_size):
            tp_rank = tp2_pp2.coordinates(rank).tp
            check_rank(tp2_models[tp_rank][key], config, tp2_pp2, rank)


def test_tensor_parallel_4_replicates_kv_heads() -> None:
    parallel = ParallelConfig(tensor_parallel_size=4)
    built = spawn_workers(build_worker, parallel, backend="gloo")
    for key, config in small_configs().items():
        assert config.text_config.num_key_value_heads == 2
        plan = parallel_plan(config, parallel)
        assert (plan.shards.num_kv_heads, plan.shards.kv_head_replicas) == (1, 2)
        for rank in range(4):
            check_rank(built[rank][key], config, parallel, rank)
        # Each K/V head is on two GPUs: a token's KV over the layout is twice the model's.
        assert plan.kv_bytes_per_token_replica == 2 * plan.model_kv_bytes_per_token


def test_expert_parallel_and_data_parallel_with_expert_parallel() -> None:
    ep2 = ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True)
    configs = {key: config for key, config in small_configs().items()
               if config.text_config.is_moe}
    built = spawn_workers(build_worker, ep2, backend="gloo")
    single = {key: model_tensors(build_model(config.text_config))
              for key, config in configs.items()}
    dp2_ep = ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)
    for key, config in configs.items():
        for rank in range(2):
            check_rank(built[rank][key], config, ep2, rank)
        # FusedMoE refuses DP + EP until the all-to-all dispatch exists, so a DP2 + EP rank is
        # put together: its attention, embedding and other weights are the whole single-GPU
        # model's (data parallel replicates them); its experts those of the EP2 rank it matches.
        for rank in range(2):
            composite = [(names, size) for names, size in single[key]["tensors"]
                         if kind_of(names[0]) != "experts"]
            composite += [(names, size) for names, size in built[rank][key]["tensors"]
                          if kind_of(names[0]) == "experts"]
            check_rank({"tensors": composite, "kv_heads": single[key]["kv_heads"]}, config,
                       dp2_ep, rank)
        plan = parallel_plan(config, dp2_ep)
        assert plan.expert_parallel_size == 2 and plan.notes  # muse cannot run it yet


def stand_in_groups(parallel: ParallelConfig, rank: int) -> parallel_state._State:
    """The groups `rank` would have, without a process group: enough to build the layers,
    which read only each group's size and this rank's place in it."""
    groups = {}
    for kind in GROUP_KINDS:
        ranks = group_of(parallel, kind, rank)
        groups[kind] = GroupCoordinator(ranks, rank, device_group="unused",
                                        cpu_group="unused", name=kind)
    return parallel_state._State(config=parallel, groups=groups)


@pytest.mark.parametrize("layout", [
    dict(tensor_parallel_size=8, enable_expert_parallel=True),
    dict(tensor_parallel_size=8),
    dict(tensor_parallel_size=4, pipeline_parallel_size=2, enable_expert_parallel=True),
])
def test_816b_rank_on_the_meta_device(monkeypatch, layout) -> None:
    config = get_preset(FULL_816B)
    parallel = ParallelConfig(**layout)
    for rank in (0, parallel.world_size - 1):
        monkeypatch.setattr(parallel_state, "_state", stand_in_groups(parallel, rank))
        with torch.device("meta"):
            model = build_model(config.text_config, torch.bfloat16)
        monkeypatch.setattr(parallel_state, "_state", None)
        plan = parallel_plan(config, parallel)
        stage = plan.stages[parallel.coordinates(rank).pp]
        built = model_tensors(model)
        assert stage.weight_bytes == stage_bytes(built, config.text_config,
                                                 parallel.pipeline_parallel_size, stage.stage)
        assert plan.shards.num_kv_heads == built["kv_heads"]


def test_816b_tp8_ep_figures_add_up() -> None:
    config = get_preset(FULL_816B)
    text = config.text_config
    plan = parallel_plan(config, ParallelConfig(tensor_parallel_size=8,
                                                enable_expert_parallel=True))
    assert (plan.world_size, plan.expert_parallel_size, len(plan.stages)) == (8, 8, 1)
    gpu = plan.stages[0].weight_elements
    h, d, layers = text.hidden_size, text.head_dim, text.num_hidden_layers
    heads, kv, experts = (text.num_attention_heads, text.num_key_value_heads,
                          text.num_experts)
    latent, inter = text.moe_latent_size, text.moe_intermediate_size
    # Over the 8 GPUs: each split parameter once, each replicated one 8 times.
    qk_norms = 2 * d
    attention = (heads + 2 * kv) * d * h + heads * d * h  # q, k, v, o: split (8 K/V heads)
    assert 8 * gpu["attention"] == layers * (attention + 8 * qk_norms)
    assert 8 * gpu["experts"] == layers * experts * (3 * latent * inter + latent)  # EP: once
    assert gpu["dense_mlp"] == 0
    replicated = layers * (2 * h + h * experts + 2 * h * latent) + h  # norms, router, pooler
    assert gpu["other"] == replicated
    rows = 25_280  # ceil(202048 / 8) = 25256, rounded up to a multiple of 64
    assert gpu["embedding"] == 2 * rows * h
    padding = 2 * (8 * rows - text.vocab_size) * h
    total = text_parameters(text).total
    assert 8 * sum(gpu.values()) == total + 7 * (replicated + layers * qk_norms) + padding
    assert plan.weight_bytes_all_gpus == 8 * sum(gpu.values()) * 2
    assert plan.model_weight_bytes == total * 2
    # Plausible: bf16 weights are a bit over an eighth of the model (the replicated router,
    # pooler and unpooler), routed experts dominate, one K/V head per GPU.
    per_gpu = plan.stages[0].weight_bytes_total
    assert plan.weight_dtype == "bfloat16"
    assert 1.0 < per_gpu / (total * 2 / 8) < 1.05
    assert plan.stages[0].weight_bytes["experts"] > 0.9 * per_gpu
    assert plan.stages[0].kv_bytes_per_token * 8 == plan.model_kv_bytes_per_token
    assert plan.stages[0].kv_bytes_per_sequence * 8 == kv_cache_bytes(text, 1_048_576)


def test_pipeline_and_context_parallel_kv() -> None:
    config = get_preset(FULL_816B)
    text = config.text_config
    plan = parallel_plan(config, ParallelConfig(tensor_parallel_size=8, pipeline_parallel_size=2,
                                                prefill_context_parallel_size=2),
                         context=100_000, gpu_memory_gib=141)
    first, last = plan.stages
    assert (first.first_layer, first.num_layers, last.first_layer) == (0, 31, 31)
    assert (first.layers_global, last.layers_global) == (7, 9)
    assert first.holds_embedding and not first.holds_lm_head and last.holds_lm_head
    assert plan.largest_stage == 1  # the final norm
    per_layer = 2 * 1 * text.head_dim * 2
    # Each PCP rank stores half of the sequence: 50,000 tokens, 1,024 of a sliding window.
    assert last.kv_bytes_per_sequence == per_layer * (22 * 1024 + 9 * 50_000)
    budget = int(141 * 2**30 * 0.9) - last.weight_bytes_total
    assert last.kv_budget_bytes == budget
    assert last.kv_tokens == budget // last.kv_bytes_per_token * 2
    assert last.kv_sequences == budget // last.kv_bytes_per_sequence


def test_cli_prints_the_per_gpu_table(capsys) -> None:
    main(["info", FULL_816B, "--tensor-parallel-size", "8", "--enable-expert-parallel",
          "--gpu-memory-gib", "139.8"])
    out = capsys.readouterr().out
    assert "815.9B total / 41.9B active" in out and "ratio 0.26)" in out  # as before
    assert "parallel layout: TP 8 x PP 1 x DP 1 x PCP 1 = 8 GPUs, experts over EP 8" in out
    assert "8 query + 1 K/V heads, 32 experts of intermediate 4096" in out
    rows = dict(re.findall(r"^ +(\S.*?) {2,}(\S.*)$", out, re.MULTILINE))
    assert rows["weights (bfloat16)"] == "196.96 GiB"
    assert rows["routed experts"] == "186.02 GiB"
    assert rows["attention"] == "2.18 GiB"
    assert rows["embedding / LM head"] == "790.00 MiB"
    assert rows["KV per token (bfloat16)"] == "31.00 KiB"
    assert rows["KV of one 1,048,576-token sequence"] == "8.04 GiB"
    assert "weights over by" in out  # bf16 weights alone exceed 0.9 of an H200
    assert "all 8 GPUs: weights 1.54 TiB (the model once: 1.48 TiB)" in out

    main(["info", FULL_816B, "-tp", "8", "-ep", "--dtype", "float32", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert data["text_total"] == text_parameters(get_preset(FULL_816B).text_config).total
    parallel = data["parallel"]
    assert parallel["world_size"] == 8 and parallel["weight_dtype"] == "float32"
    stage = parallel["stages"][0]
    assert stage["weight_bytes_total"] == 4 * sum(stage["weight_elements"].values())


def test_cli_default_layout_is_one_gpu(capsys) -> None:
    main(["info", "muse-spark-tiny", "--json"])
    data = json.loads(capsys.readouterr().out)
    stage = data["parallel"]["stages"][0]
    assert data["parallel"]["world_size"] == 1
    assert stage["weight_bytes_total"] == data["text_total"] * 4  # the config's float32


@pytest.mark.parametrize("flags, message", [
    (["-tp", "3"], "num_attention_heads (64) must be divisible by tensor_parallel_size (3)"),
    (["-pp", "4"], "num_hidden_layers (62) must be divisible by pipeline_parallel_size (4)"),
    (["-tp", "8", "-dp", "3", "-ep"], "num_experts (256) must be divisible by the expert "
     "parallel size (24 = data 3 x prefill-context 1 x tensor 8)"),
    (["-tp", "0"], "`tensor_parallel_size` must be a positive integer, got 0"),
    (["--gpu-memory-gib", "80", "--gpu-memory-utilization", "1.5"],
     "gpu_memory_utilization must be in (0, 1], got 1.5"),
])
def test_bad_layouts_give_one_line_errors(capsys, flags, message) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["info", FULL_816B, *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == f"muse info: error: {message}\n"


def test_layout_validation_in_the_library() -> None:
    # More TP ranks than K/V heads: each rank's query heads must map to one K/V head.
    text = TextConfig(num_attention_heads=12, num_key_value_heads=4)
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(6\) must be divisible by "
                                         r"num_key_value_heads \(4\)"):
        parallel_plan(MuseSparkConfig(text), ParallelConfig(tensor_parallel_size=6))
    with pytest.raises(ValueError, match="moe_intermediate_size .* tensor_parallel_size"):
        parallel_plan(MuseSparkConfig(TextConfig(num_attention_heads=4, num_key_value_heads=4,
                                                 moe_intermediate_size=30)),
                      ParallelConfig(tensor_parallel_size=4))
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        parallel_plan(DENSE_TIED, ParallelConfig(enable_expert_parallel=True))
