"""Rooflines: lower bounds on time from two machine figures, memory bandwidth and matmul
throughput: time >= max(bytes moved / bandwidth, FLOPs / matmul rate), taken per forward pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from muse.config import FULL, SLIDING, TextConfig

# Measured on one H200 (SXM, 141 GB HBM3e): sustained device-to-device copy bandwidth and dense
# bf16 matmul throughput. They are what the memory system and the tensor cores deliver in
# practice, so rooflines built on them are reachable; `--mem-bandwidth` / `--matmul-flops`
# override them for other GPUs.
H200_MEMORY_BANDWIDTH = 4.26e12  # bytes/s
H200_BF16_MATMUL_FLOPS = 790e12  # FLOP/s


@dataclasses.dataclass
class Machine:
    memory_bandwidth: float  # bytes/s
    matmul_flops: float  # FLOP/s

    def time(self, nbytes: float, flops: float) -> float:
        """Lower bound on the time of one pass that moves `nbytes` and computes `flops`."""
        return max(nbytes / self.memory_bandwidth, flops / self.matmul_flops)

    def to_dict(self) -> dict[str, float]:
        return {"memory_bandwidth_Bps": self.memory_bandwidth,
                "matmul_flops": self.matmul_flops}


@dataclasses.dataclass
class ParameterBreakdown:
    """Parameter counts grouped by how often a forward pass reads them.

    `per_layer_dense`: read by every token of every layer (attention with its q/k norms, the
    two layer norms, and the MLP part every token runs: router, latent projections and shared
    experts of an MoE, or the whole dense MLP). `expert`: one routed expert of one layer.
    """

    vocab_hidden: int  # one vocab x hidden matrix: the embedding table, and the LM head's shape
    tied: bool
    hidden: int
    layers: int
    per_layer_dense: int
    expert: int
    num_experts: int
    top_k: int

    @classmethod
    def of(cls, text: TextConfig) -> ParameterBreakdown:
        hidden, head_dim = text.hidden_size, text.head_dim
        q_width = text.num_attention_heads * head_dim
        kv_width = text.num_key_value_heads * head_dim
        attention = 2 * hidden * q_width + 2 * hidden * kv_width
        if text.attention_bias:
            attention += q_width + 2 * kv_width
        if text.qk_norm:
            attention += 2 * head_dim
        if text.is_moe:
            width = text.expert_input_size
            expert = 3 * width * text.moe_intermediate_size + (width if text.expert_norm else 0)
            dense_mlp = hidden * text.num_experts \
                + (2 * hidden * text.moe_latent_size if text.moe_latent_size else 0) \
                + 3 * hidden * text.moe_intermediate_size * text.num_shared_experts
        else:
            expert, dense_mlp = 0, 3 * hidden * text.intermediate_size
        return cls(vocab_hidden=text.vocab_size * hidden, tied=text.tie_word_embeddings,
                   hidden=hidden, layers=text.num_hidden_layers,
                   per_layer_dense=attention + 2 * hidden + dense_mlp, expert=expert,
                   num_experts=text.num_experts, top_k=text.num_experts_per_tok if text.is_moe
                   else 0)

    @property
    def total(self) -> int:
        return self.vocab_hidden * (1 if self.tied else 2) + self.hidden \
            + self.layers * (self.per_layer_dense + self.num_experts * self.expert)

    @property
    def active(self) -> int:
        return self.vocab_hidden * (1 if self.tied else 2) + self.hidden \
            + self.layers * (self.per_layer_dense + self.top_k * self.expert)

    def experts_read(self, tokens: int) -> int:
        """Experts one layer reads for `tokens` tokens: min(E, tokens * k).

        Assumes the tokens' choices land on distinct experts until all E are in use: exact for
        one token, an upper bound otherwise (uniform routing reaches E(1 - (1 - k/E)^tokens)
        distinct experts on average, a few percent fewer at mid-sized batches).
        """
        return min(self.num_experts, tokens * self.top_k)

    def weight_bytes(self, tokens: int, dtype_bytes: int) -> int:
        """Weights one forward pass over `tokens` tokens reads: every layer's dense part and the
        experts its tokens route to, the whole LM head, and one embedding row per token."""
        params = self.layers * (self.per_layer_dense + self.experts_read(tokens) * self.expert) \
            + self.vocab_hidden + min(tokens * self.hidden, self.vocab_hidden) + self.hidden
        return params * dtype_bytes

    def matmul_flops(self, tokens: int, logit_rows: int) -> int:
        """2 x multiply-accumulates of the linear layers: every token through its active
        weights (the embedding lookup is no matmul), the LM head only for `logit_rows` rows."""
        per_token = self.layers * (self.per_layer_dense + self.top_k * self.expert)
        return 2 * tokens * per_token + 2 * logit_rows * self.vocab_hidden


def _keys_seen(n: int, window: int | None) -> int:
    """Sum over query positions 0..n-1 of the keys each attends to: min(p + 1, window)."""
    if window is None or n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def attention_flops(text: TextConfig, start: int, end: int) -> int:
    """Score and value FLOPs of queries at positions [start, end) of one sequence:
    4 * heads * head_dim per (query, key) pair and layer; sliding layers see only the window."""
    per_pair = 4 * text.num_attention_heads * text.head_dim
    total = 0
    for kind in (SLIDING, FULL):
        layers = text.layer_types.count(kind)
        if layers:
            window = text.sliding_window if kind == SLIDING else None
            total += layers * (_keys_seen(end, window) - _keys_seen(start, window))
    return per_pair * total


def kv_read_bytes(text: TextConfig, context: int, dtype_bytes: int) -> int:
    """KV bytes one query reads at a context of `context` tokens, sliding layers capped."""
    per_layer = 2 * text.num_key_value_heads * text.head_dim * dtype_bytes
    sliding = text.layer_types.count(SLIDING)
    window = min(context, text.sliding_window) if sliding else 0
    return per_layer * (sliding * window + (text.num_hidden_layers - sliding) * context)


def kv_write_bytes(text: TextConfig, tokens: int, dtype_bytes: int) -> int:
    return 2 * text.num_key_value_heads * text.head_dim * dtype_bytes * text.num_hidden_layers \
        * tokens


@dataclasses.dataclass
class Roofline:
    text: TextConfig
    machine: Machine
    dtype_bytes: int

    def __post_init__(self) -> None:
        self.params = ParameterBreakdown.of(self.text)

    def prefill(self, prompt_lens: Sequence[int]) -> dict[str, float]:
        """One pass over whole prompts: weights read once, every token computed, the KV
        written; only each prompt's last position goes through the LM head."""
        tokens = sum(prompt_lens)
        nbytes = self.params.weight_bytes(tokens, self.dtype_bytes) \
            + kv_write_bytes(self.text, tokens, self.dtype_bytes)
        flops = self.params.matmul_flops(tokens, len(prompt_lens)) \
            + sum(attention_flops(self.text, 0, n) for n in prompt_lens)
        return {"bytes": nbytes, "flops": flops, "seconds": self.machine.time(nbytes, flops)}

    def decode_step(self, positions: Sequence[int]) -> tuple[int, int]:
        """(bytes, FLOPs) of one decode step whose queries sit at `positions` (one a request):
        the weights for a batch of that size plus every request's KV up to its query."""
        batch = len(positions)
        nbytes = self.params.weight_bytes(batch, self.dtype_bytes) \
            + sum(kv_read_bytes(self.text, p + 1, self.dtype_bytes) for p in positions) \
            + kv_write_bytes(self.text, batch, self.dtype_bytes)
        flops = self.params.matmul_flops(batch, batch) \
            + sum(attention_flops(self.text, p, p + 1) for p in positions)
        return nbytes, flops

    def single_stream(self, prompt_len: int, new_tokens: int) -> dict[str, float]:
        """Batch-1 prefill of `prompt_len` tokens, then `new_tokens - 1` decode steps."""
        prefill = self.prefill([prompt_len])
        decode_s = 0.0
        bound_by_memory = 0
        for step in range(1, new_tokens):
            nbytes, flops = self.decode_step([prompt_len + step - 1])
            decode_s += self.machine.time(nbytes, flops)
            bound_by_memory += nbytes / self.machine.memory_bandwidth \
                >= flops / self.machine.matmul_flops
        steps = max(new_tokens - 1, 0)
        return {
            "prefill_s": prefill["seconds"], "prefill_tok_s": prompt_len / prefill["seconds"],
            "prefill_bound": "memory" if prefill["bytes"] / self.machine.memory_bandwidth
            >= prefill["flops"] / self.machine.matmul_flops else "compute",
            "decode_s": decode_s, "decode_tok_s": steps / decode_s if decode_s else None,
            "decode_bound": None if not steps else
            "memory" if bound_by_memory * 2 >= steps else "compute",
        }

    def batch(self, requests: Sequence[tuple[int, int]]) -> dict[str, float]:
        """All (prompt_len, output_len) requests running at once, ideal continuous batching:
        one prefill pass over every prompt (it gives each request its first token), then decode
        steps over the requests still running, until the longest is done. Phases are summed,
        not overlapped."""
        prefill = self.prefill([p for p, _ in requests])
        decode_s = 0.0
        for step in range(1, max(o for _, o in requests)):
            positions = [p + step - 1 for p, o in requests if o > step]
            decode_s += self.machine.time(*self.decode_step(positions))
        outputs = sum(o for _, o in requests)
        prompts = sum(p for p, _ in requests)
        wall = prefill["seconds"] + decode_s
        return {"wall_s": wall, "prefill_s": prefill["seconds"], "decode_s": decode_s,
                "output_tok_s": outputs / wall, "total_tok_s": (prompts + outputs) / wall}


ROOFLINE_NOTE = (
    "roofline: per forward pass, time >= max(bytes / memory_bandwidth, FLOPs / matmul_flops). "
    "Bytes: weights read (every layer's attention, norms, router / latent / shared or dense MLP; "
    "min(E, tokens*k) routed experts per layer, i.e. distinct experts assumed, exact at batch 1; "
    "the whole LM head; one embedding row per token) + KV read (each request's context times "
    "KV bytes per token, sliding layers capped at the window) + KV written. FLOPs: 2 x active "
    "matmul parameters x tokens (LM head only for rows that need logits) + attention 4 x "
    "heads x head_dim x (query, key) pairs per layer, causal, windowed on sliding layers.")
