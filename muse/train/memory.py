"""Choosing the batch of `muse train pretrain` from the device and the memory it has free.

The reference model materialises every layer's [heads, T, T] attention scores and the
[T, vocab] logits, so activations, not weights, fill memory: the shipped recipe's 32 x 1024
tokens need about 20 GB on top of the weights. When the batch is not given it is chosen
here: the recipe's 32 sequences per step on a GPU (split into micro-batches with gradient
accumulation when they do not fit at once), a few sequences on a CPU, and a shorter sequence
only when not even one of the default length fits.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from muse.config import TextConfig
from muse.info import text_parameters

logger = logging.getLogger("muse.train")

FLOAT32_BYTES = 4
DEFAULT_SEQ_LEN = 1024
MIN_SEQ_LEN = 128
# The shipped model's recipe: sequences per optimizer step on a GPU.
GPU_BATCH_SIZE = 32
# A CPU's tokens/s hardly grows with the batch (about 400 tokens/s on one core for 1 to 4
# sequences of 1024), so a larger batch would only mean fewer, longer steps in a time budget.
CPU_BATCH_SIZE = 4
# Share of the free memory training may plan to use. A CPU machine is shared with the OS,
# the page cache and other processes; a GPU's free memory is the process's own.
USABLE_SHARE = {"cpu": 0.5, "cuda": 0.85}
# Memory taken whatever the batch: the torch runtime, the tokenizer and the Python corpus
# the data mixture reads (at most 128 MB of source).
RUNTIME_BYTES = {"cpu": 1_500_000_000, "cuda": 1_000_000_000}
# Float32 weights, their gradients and AdamW's two moments; bf16 copies under autocast.
STATE_BYTES_PER_PARAMETER = 18


# Models of at most this many experts train with every expert on every token
# (`Experts.all_experts_forward`): the default model's 8 experts cost 4x the products of its
# top-2, and save the per-expert loop's ~600 small ops a layer, which bound its training step.
ALL_EXPERTS_AT_ONCE_MAX_EXPERTS = 16


def trains_all_experts_at_once(text: TextConfig) -> bool:
    return text.is_moe and text.num_experts <= ALL_EXPERTS_AT_ONCE_MAX_EXPERTS


def activation_bytes_per_sequence(text: TextConfig, seq_len: int) -> int:
    """Peak activation memory of one training sequence in the reference model (float32).

    An upper estimate: every intermediate of a layer is counted as kept for the backward
    pass (measured on a CPU, the default preset at 1024 tokens takes about two thirds of it).
    """
    q_width = text.num_attention_heads * text.head_dim
    kv_width = text.num_key_value_heads * text.head_dim
    per_token = (
        10 * text.hidden_size  # two RMSNorms with their float32 copies, the residual sums
        # q, k, v normed and rotated, k and v repeated to every query head, the output
        + 6 * q_width + 6 * kv_width
        # the scores and the probabilities kept for backward: the reference computes every
        # [T, T] pair even in sliding layers, then masks it
        + 2 * text.num_attention_heads * seq_len)
    if text.is_moe:
        chosen = text.num_experts if trains_all_experts_at_once(text) \
            else text.num_experts_per_tok
        latent = text.expert_input_size
        per_token += (3 * text.num_experts  # router logits and probabilities
                      # each expert run's input, gate and up, product, output and norm
                      + chosen * (3 * text.moe_intermediate_size + 4 * latent)
                      + 3 * latent  # pooled, combined (float32) and cast back
                      + 3 * text.moe_intermediate_size * text.num_shared_experts)
    else:
        per_token += 3 * text.intermediate_size
    layers = text.num_hidden_layers * seq_len * per_token
    # The logits, the log-probabilities the loss keeps, and their gradient.
    head = 3 * seq_len * text.vocab_size
    # The backward pass of one layer's attention holds the gradients of its scores.
    backward = 3 * text.num_attention_heads * seq_len * seq_len
    return FLOAT32_BYTES * (layers + head + backward)


def training_state_bytes(text: TextConfig) -> int:
    return STATE_BYTES_PER_PARAMETER * text_parameters(text).total


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_available() -> int | None:
    """What a container's memory limit leaves (cgroup v2), or None without a limit."""
    folder = Path("/sys/fs/cgroup")
    try:
        limit = (folder / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((folder / "memory.current").read_text())
    except (OSError, ValueError):
        return None


def available_memory_bytes(device: torch.device) -> int | None:
    """Memory free for this process on `device`, or None where it cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    if device.type == "cpu":
        found = [v for v in (_meminfo_available(), _cgroup_available()) if v is not None]
        return min(found) if found else None
    return None


@dataclass
class BatchPlan:
    batch_size: int  # sequences per optimizer step
    micro_batch_size: int  # sequences per forward and backward pass
    seq_len: int
    bytes_per_sequence: int
    available_bytes: int | None

    @property
    def accumulation_steps(self) -> int:
        return math.ceil(self.batch_size / self.micro_batch_size)

    def describe(self) -> str:
        memory = "free memory unknown" if self.available_bytes is None else \
            f"{self.available_bytes / 1e9:.1f} GB free"
        return (f"{self.batch_size} x {self.seq_len} tokens per step in "
                f"{self.accumulation_steps} micro-batch(es) of {self.micro_batch_size} "
                f"(about {self.bytes_per_sequence / 1e9:.2f} GB of activations per sequence, "
                f"{memory})")


def plan_batch(text: TextConfig, device: torch.device, batch_size: int | None = None,
               seq_len: int | None = None, micro_batch_size: int | None = None,
               available_bytes: int | None = None) -> BatchPlan:
    """The batch, micro-batch and sequence length: given values are kept, the others are
    the largest that fit the usable share of `available_bytes` (read from the device when
    None)."""
    if available_bytes is None:
        available_bytes = available_memory_bytes(device)
    kind = "cuda" if device.type == "cuda" else "cpu"
    default_batch = GPU_BATCH_SIZE if kind == "cuda" else CPU_BATCH_SIZE
    length = seq_len or DEFAULT_SEQ_LEN
    if available_bytes is None:
        return BatchPlan(batch_size or default_batch, micro_batch_size or batch_size
                         or default_batch, length, activation_bytes_per_sequence(text, length),
                         None)
    budget = (USABLE_SHARE[kind] * available_bytes - RUNTIME_BYTES[kind]
              - training_state_bytes(text))
    if seq_len is None:
        while length > MIN_SEQ_LEN and activation_bytes_per_sequence(text, length) > budget:
            length //= 2
    per_sequence = activation_bytes_per_sequence(text, length)
    fits = int(budget // per_sequence)
    if fits < 1:
        logger.warning("one sequence of %d tokens needs about %.2f GB of activations; with "
                       "%.1f GB free that is more than training plans to use, so it may run "
                       "out of memory", length, per_sequence / 1e9, available_bytes / 1e9)
        fits = 1
    if batch_size is None:
        batch_size = default_batch if kind == "cuda" else min(default_batch, fits)
    if micro_batch_size is None:
        # As few micro-batches as fit, of equal size, rather than full ones and a remainder.
        micro_batch_size = math.ceil(batch_size / math.ceil(batch_size / fits))
    return BatchPlan(batch_size, min(micro_batch_size, batch_size), length, per_sequence,
                     available_bytes)
