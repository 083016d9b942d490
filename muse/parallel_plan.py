"""Weights and KV cache per GPU for a parallel layout, from a config alone (no weights, no torch).

Each figure is what `muse.layers` would create on one rank (the tests build the engine model
in spawned worlds and compare parameter for parameter):

* attention (`QKVParallelLinear`, `RowParallelLinear`): `heads/tp` query heads and
  `kv/tp` K/V heads per rank, or one K/V head replicated on `tp/kv` ranks when tp > kv;
  q/k norms replicated.
* routed experts (`FusedMoE`): every expert with `1/tp` of its intermediate width, or with
  `enable_expert_parallel` whole experts, `num_experts / ep` per rank, where the EP group is a
  pipeline stage's `dp * pcp * tp` ranks; each expert's norm goes with it.
* dense MLPs and shared experts (`MergedColumnParallelLinear` + `RowParallelLinear`): the
  intermediate width split over TP.
* embedding and LM head (`VocabParallelEmbedding`, `ParallelLMHead`): `ceil(vocab/tp)` rows
  rounded up to a multiple of 64 per rank.
* other (replicated): layer norms, the router, the latent pooler and unpooler, the final norm.

Pipeline stage `s` holds layers `[s L/pp, (s+1) L/pp)`; the first stage also holds the
embedding, the last the final norm and the LM head. Data- and prefill-context-parallel ranks
hold the same weights as their TP peers (attention is replicated over them; only EP shares
experts over them). KV: a rank stores its K/V heads for the layers of its stage; a sequence's
tokens are spread over the PCP group, and sliding layers keep at most a window.
"""

from __future__ import annotations

import textwrap
from dataclasses import asdict, dataclass, field

from muse.config import FULL, SLIDING, MuseSparkConfig, TextConfig
from muse.distributed.config import ParallelConfig
from muse.info import DTYPE_BYTES, human_bytes, text_parameters

VOCAB_PADDING = 64  # muse.layers.embedding.DEFAULT_VOCAB_PADDING_SIZE
WEIGHT_KINDS = ("attention", "experts", "dense_mlp", "embedding", "other")
KIND_LABELS = {"attention": "attention", "experts": "routed experts",
               "dense_mlp": "dense MLP / shared experts", "embedding": "embedding / LM head",
               "other": "other (norms, router, pooler)"}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _divisible(value: int, what: str, by: int, by_what: str) -> None:
    if value % by:
        raise ValueError(f"{what} ({value}) must be divisible by {by_what} ({by})")


@dataclass(frozen=True)
class RankShards:
    """What one rank holds of each sharded dimension."""

    num_heads: int
    num_kv_heads: int
    kv_head_replicas: int  # ranks holding each K/V head
    num_experts: int  # routed experts held
    expert_intermediate: int  # of each held expert
    dense_intermediate: int  # of the dense MLP or the shared experts (0: none)
    vocab_rows: int  # embedding and LM head rows, padding included


def rank_shards(text: TextConfig, parallel: ParallelConfig) -> RankShards:
    """Validate the layout against the model; raise a ValueError naming what does not divide."""
    parallel.validate()
    tp, pp, ep = (parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                  parallel.expert_parallel_size)
    heads, kv = text.num_attention_heads, text.num_key_value_heads
    _divisible(heads, "num_attention_heads", tp, "tensor_parallel_size")
    if tp >= kv:
        _divisible(tp, "with more TP ranks than K/V heads, tensor_parallel_size", kv,
                   "num_key_value_heads")
        kv_local, replicas = 1, tp // kv
    else:
        _divisible(kv, "num_key_value_heads", tp, "tensor_parallel_size")
        kv_local, replicas = kv // tp, 1
    _divisible(text.num_hidden_layers, "num_hidden_layers", pp, "pipeline_parallel_size")
    if parallel.enable_expert_parallel and not text.is_moe:
        raise ValueError("enable_expert_parallel needs a mixture-of-experts model; this one "
                         "is dense (num_experts 0)")
    experts, expert_inter = text.num_experts, text.moe_intermediate_size
    if text.is_moe:
        if parallel.enable_expert_parallel:
            if experts % ep:
                raise ValueError(
                    f"num_experts ({experts}) must be divisible by the expert parallel size "
                    f"({ep} = data {parallel.data_parallel_size} x prefill-context "
                    f"{parallel.prefill_context_parallel_size} x tensor {tp})")
            experts //= ep
        else:
            _divisible(expert_inter, "moe_intermediate_size", tp, "tensor_parallel_size")
            expert_inter //= tp
        dense = text.moe_intermediate_size * text.num_shared_experts
        what = "moe_intermediate_size x num_shared_experts"
    else:
        experts = expert_inter = 0
        dense, what = text.intermediate_size, "intermediate_size"
    if dense:
        _divisible(dense, what, tp, "tensor_parallel_size")
    vocab_rows = _ceil_div(_ceil_div(text.vocab_size, tp), VOCAB_PADDING) * VOCAB_PADDING
    return RankShards(num_heads=heads // tp, num_kv_heads=kv_local, kv_head_replicas=replicas,
                      num_experts=experts, expert_intermediate=expert_inter,
                      dense_intermediate=dense // tp, vocab_rows=vocab_rows)


def layer_elements(text: TextConfig, shards: RankShards) -> dict[str, int]:
    """Parameters of one decoder layer on one rank, by kind."""
    hidden, head_dim = text.hidden_size, text.head_dim
    qkv_rows = (shards.num_heads + 2 * shards.num_kv_heads) * head_dim
    attention = qkv_rows * hidden + shards.num_heads * head_dim * hidden
    attention += qkv_rows if text.attention_bias else 0
    attention += 2 * head_dim if text.qk_norm else 0
    other = 2 * hidden  # input and post-attention norms
    experts = 0
    if text.is_moe:
        width = text.expert_input_size
        experts = shards.num_experts * (3 * width * shards.expert_intermediate
                                        + (width if text.expert_norm else 0))
        other += hidden * text.num_experts
        other += 2 * hidden * text.moe_latent_size if text.moe_latent_size else 0
    return {"attention": attention, "experts": experts,
            "dense_mlp": 3 * hidden * shards.dense_intermediate, "embedding": 0, "other": other}


@dataclass
class StagePlan:
    """One pipeline stage; every GPU of the stage holds the same amounts."""

    stage: int
    first_layer: int
    num_layers: int
    layers_sliding: int
    layers_global: int
    holds_embedding: bool
    holds_lm_head: bool
    weight_elements: dict[str, int]  # per GPU, by kind
    weight_bytes: dict[str, int]
    weight_bytes_total: int
    kv_bytes_per_token: int  # per GPU: its K/V heads over the stage's layers
    kv_bytes_per_sequence: int  # per GPU: its share of one `context`-token sequence
    kv_budget_bytes: int | None = None  # gpu memory x utilisation - weights (< 0: no room)
    kv_tokens: int | None = None  # tokens a replica fits, every layer keeping every token
    kv_sequences: int | None = None  # `context`-token sequences a replica fits


@dataclass
class ParallelPlan:
    tensor_parallel_size: int
    pipeline_parallel_size: int
    data_parallel_size: int
    prefill_context_parallel_size: int
    enable_expert_parallel: bool
    world_size: int
    expert_parallel_size: int
    shards: RankShards
    weight_dtype: str
    kv_dtype: str
    context: int
    stages: list[StagePlan]
    largest_stage: int  # the stage with the most weight bytes per GPU
    weight_bytes_all_gpus: int  # summed over the world, replicas included
    model_weight_bytes: int  # every parameter once
    kv_bytes_per_token_replica: int  # one token's KV summed over the pp x tp GPUs storing it
    model_kv_bytes_per_token: int  # every layer's K/V heads once
    gpu_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def parallel_plan(config: MuseSparkConfig, parallel: ParallelConfig,
                  context: int | None = None, weight_dtype: str | None = None,
                  kv_dtype: str = "bfloat16", gpu_memory_gib: float | None = None,
                  gpu_memory_utilization: float = 0.9) -> ParallelPlan:
    """Per-GPU weights and KV of `config`'s text decoder laid out as `parallel`."""
    text = config.text_config
    weight_dtype = weight_dtype or (config.dtype if config.dtype in DTYPE_BYTES else "bfloat16")
    for name, dtype in (("weight dtype", weight_dtype), ("KV dtype", kv_dtype)):
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"{name} must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
    context = context or text.max_position_embeddings
    if context < 1:
        raise ValueError(f"context must be a positive number of tokens, got {context}")
    if gpu_memory_gib is not None and not gpu_memory_gib > 0:
        raise ValueError(f"gpu memory must be positive, got {gpu_memory_gib} GiB")
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                         f"{gpu_memory_utilization}")
    shards = rank_shards(text, parallel)
    tp, pp, pcp = (parallel.tensor_parallel_size, parallel.pipeline_parallel_size,
                   parallel.prefill_context_parallel_size)
    wbytes, kvbytes = DTYPE_BYTES[weight_dtype], DTYPE_BYTES[kv_dtype]
    per_layer = layer_elements(text, shards)
    kv_per_layer = 2 * shards.num_kv_heads * text.head_dim * kvbytes
    # A sequence's tokens are spread over the PCP group; sliding layers keep one window.
    share_global = _ceil_div(context, pcp)
    share_sliding = _ceil_div(min(context, text.sliding_window or context), pcp)
    memory = int(gpu_memory_gib * 2**30 * gpu_memory_utilization) \
        if gpu_memory_gib is not None else None
    per_stage = text.num_hidden_layers // pp
    stages = []
    for s in range(pp):
        kinds = text.layer_types[s * per_stage:(s + 1) * per_stage]
        first, last = s == 0, s == pp - 1
        elements = {kind: per_layer[kind] * per_stage for kind in WEIGHT_KINDS}
        table = shards.vocab_rows * text.hidden_size
        # A tied LM head shares the embedding's tensor only when one stage holds both.
        head = last and not (first and text.tie_word_embeddings)
        elements["embedding"] = table * (int(first) + int(head))
        elements["other"] += text.hidden_size if last else 0  # the final norm
        weight = {kind: n * wbytes for kind, n in elements.items()}
        total = sum(weight.values())
        kv_token = kv_per_layer * per_stage
        kv_seq = kv_per_layer * (kinds.count(SLIDING) * share_sliding
                                 + kinds.count(FULL) * share_global)
        stage = StagePlan(stage=s, first_layer=s * per_stage, num_layers=per_stage,
                          layers_sliding=kinds.count(SLIDING), layers_global=kinds.count(FULL),
                          holds_embedding=first, holds_lm_head=last, weight_elements=elements,
                          weight_bytes=weight, weight_bytes_total=total,
                          kv_bytes_per_token=kv_token, kv_bytes_per_sequence=kv_seq)
        if memory is not None:
            budget = memory - total
            stage.kv_budget_bytes = budget
            stage.kv_tokens = max(0, budget) // kv_token * pcp
            stage.kv_sequences = max(0, budget) // kv_seq
        stages.append(stage)
    largest = max(stages, key=lambda st: st.weight_bytes_total).stage
    gpus_per_stage = parallel.world_size // pp
    notes = []
    if parallel.enable_expert_parallel and parallel.expert_parallel_size != tp:
        notes.append("muse's FusedMoE runs expert parallelism only with data and "
                     "prefill-context parallel size 1 so far (DP + EP needs the all-to-all "
                     "dispatch)")
    return ParallelPlan(
        tensor_parallel_size=tp, pipeline_parallel_size=pp,
        data_parallel_size=parallel.data_parallel_size, prefill_context_parallel_size=pcp,
        enable_expert_parallel=parallel.enable_expert_parallel,
        world_size=parallel.world_size, expert_parallel_size=parallel.expert_parallel_size,
        shards=shards, weight_dtype=weight_dtype, kv_dtype=kv_dtype, context=context,
        stages=stages, largest_stage=largest,
        weight_bytes_all_gpus=sum(st.weight_bytes_total for st in stages) * gpus_per_stage,
        model_weight_bytes=text_parameters(text).total * wbytes,
        kv_bytes_per_token_replica=sum(st.kv_bytes_per_token for st in stages) * tp,
        model_kv_bytes_per_token=2 * text.num_key_value_heads * text.head_dim * kvbytes
        * text.num_hidden_layers,
        gpu_memory_bytes=int(gpu_memory_gib * 2**30) if gpu_memory_gib is not None else None,
        gpu_memory_utilization=gpu_memory_utilization, notes=notes)


def _budget(n: int) -> str:
    return human_bytes(n) if n >= 0 else f"weights over by {human_bytes(-n)}"


def describe_layout(plan: ParallelPlan) -> str:
    layout = (f"TP {plan.tensor_parallel_size} x PP {plan.pipeline_parallel_size} x "
              f"DP {plan.data_parallel_size} x PCP {plan.prefill_context_parallel_size} = "
              f"{plan.world_size} GPU{'s' if plan.world_size > 1 else ''}")
    if plan.enable_expert_parallel:
        layout += f", experts over EP {plan.expert_parallel_size}"
    return layout


def format_plan(plan: ParallelPlan) -> str:
    """The per-GPU table: one column per pipeline stage."""
    sh = plan.shards
    held = [f"{sh.num_heads} query + {sh.num_kv_heads} K/V heads"
            + (f" (each K/V head on {sh.kv_head_replicas} GPUs)" if sh.kv_head_replicas > 1
               else "")]
    if sh.num_experts:
        held.append(f"{sh.num_experts} experts of intermediate {sh.expert_intermediate}")
    held.append(f"{sh.vocab_rows:,} vocabulary rows")
    lines = [f"parallel layout: {describe_layout(plan)}",
             f"per GPU: {', '.join(held)}"]

    def stage_name(st: StagePlan) -> str:
        name = f"stage {st.stage}" if plan.pipeline_parallel_size > 1 else "each GPU"
        return name + (" *" if plan.pipeline_parallel_size > 1
                       and st.stage == plan.largest_stage else "")

    def holds(st: StagePlan) -> str:
        parts = [p for p, on in (("embedding", st.holds_embedding),
                                 ("LM head", st.holds_lm_head)) if on]
        return " + ".join(parts) or "-"

    rows: list[tuple[str, list[str]]] = [
        ("text decoder, per GPU", [stage_name(st) for st in plan.stages]),
        ("layers", [f"{st.first_layer}-{st.first_layer + st.num_layers - 1}"
                    for st in plan.stages]),
        ("sliding + global", [f"{st.layers_sliding} + {st.layers_global}"
                              for st in plan.stages]),
        ("holds", [holds(st) for st in plan.stages]),
        (f"weights ({plan.weight_dtype})", [human_bytes(st.weight_bytes_total)
                                            for st in plan.stages]),
    ]
    rows += [(f"  {KIND_LABELS[kind]}", [human_bytes(st.weight_bytes[kind])
                                         for st in plan.stages])
             for kind in WEIGHT_KINDS if any(st.weight_bytes[kind] for st in plan.stages)]
    rows += [
        (f"KV per token ({plan.kv_dtype})", [human_bytes(st.kv_bytes_per_token)
                                            for st in plan.stages]),
        (f"KV of one {plan.context:,}-token sequence",
         [human_bytes(st.kv_bytes_per_sequence) for st in plan.stages]),
    ]
    if plan.gpu_memory_bytes is not None:
        gib = plan.gpu_memory_bytes / 2**30
        rows += [
            (f"KV budget ({gib:g} GiB x {plan.gpu_memory_utilization:g} - weights)",
             [_budget(st.kv_budget_bytes or 0) for st in plan.stages]),
            ("tokens that fit, as all-global", [f"{st.kv_tokens:,}" for st in plan.stages]),
            (f"{plan.context:,}-token sequences that fit",
             [f"{st.kv_sequences:,}" for st in plan.stages]),
        ]
    label_width = max(len(label) for label, _ in rows)
    widths = [max(len(values[i]) for _, values in rows) for i in range(len(plan.stages))]
    for label, values in rows:
        cells = "  ".join(value.rjust(width) for value, width in zip(values, widths))
        lines.append(f"  {label.ljust(label_width)}  {cells}")
    if plan.pipeline_parallel_size > 1:
        largest = plan.stages[plan.largest_stage].weight_bytes_total
        lines.append(f"  * the largest stage: {human_bytes(largest)} of weights per GPU")
    holders = plan.pipeline_parallel_size * plan.tensor_parallel_size
    lines.append(f"all {plan.world_size} GPUs: weights {human_bytes(plan.weight_bytes_all_gpus)} "
                 f"(the model once: {human_bytes(plan.model_weight_bytes)})")
    lines.append(f"a token's KV over the {holders} GPUs holding it: "
                 f"{human_bytes(plan.kv_bytes_per_token_replica)} (the model once: "
                 f"{human_bytes(plan.model_kv_bytes_per_token)})")
    if plan.gpu_memory_bytes is not None:
        tokens = min(st.kv_tokens or 0 for st in plan.stages)
        sequences = min(st.kv_sequences or 0 for st in plan.stages)
        replicas = (f" (each of {plan.data_parallel_size} data-parallel replicas)"
                    if plan.data_parallel_size > 1 else "")
        lines.append(f"KV capacity{replicas}: {tokens:,} tokens as all-global, or {sequences:,} "
                     f"sequences of {plan.context:,} tokens")
        lines.append("  (activations, CUDA graphs and the vision and audio encoders not counted)")
    lines += [textwrap.fill(f"note: {note}", 100, subsequent_indent="  ")
              for note in plan.notes]
    return "\n".join(lines)
