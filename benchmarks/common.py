"""What the offline benchmarks share: model shapes, engine builders, timing, rooflines, output.

Both engines run the same shape with random bf16 weights. Muse runs a preset; transformers runs
the Qwen3 / Qwen3-MoE model of the same dimensions. For Muse-architecture presets transformers
has no equivalent, so a Qwen3-MoE of the same dims stands in (see `transformers_text_config`).

Rooflines are lower bounds on time from two machine figures, memory bandwidth and matmul
throughput: time >= max(bytes moved / bandwidth, FLOPs / matmul rate), taken per forward pass.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from muse.config import FULL, SLIDING, RopeParameters, TextConfig
from muse.info import DTYPE_BYTES, kv_bytes_per_token, text_parameters
from muse.presets import PRESETS, get_preset

REPO_ROOT = Path(__file__).resolve().parent.parent

# Measured on one H200 (SXM, 141 GB HBM3e): sustained device-to-device copy bandwidth and dense
# bf16 matmul throughput. They are what the memory system and the tensor cores deliver in
# practice, so rooflines built on them are reachable; `--mem-bandwidth` / `--matmul-flops`
# override them for other GPUs.
H200_MEMORY_BANDWIDTH = 4.26e12  # bytes/s
H200_BF16_MATMUL_FLOPS = 790e12  # FLOP/s

# The shapes the GPU benchmarks are meant for (any preset is accepted, e.g. muse-spark-tiny on
# the CPU for tests).
SHAPES = ("muse-spark-15b-a2b", "qwen3-30b-a3b-shape", "qwen3-0.6b-shape")
ENGINES = ("muse", "transformers")

# Random prompt ids start here, clear of special and placeholder tokens at the bottom of the
# vocabulary.
FIRST_PROMPT_ID = 256
STAND_IN = "transformers stand-in: Qwen3-MoE of the same dims"
STAND_IN_DENSE = "transformers stand-in: Qwen3 of the same dims"


# ---- shapes ---------------------------------------------------------------------------------
def text_config(shape: str) -> TextConfig:
    return get_preset(shape).text_config


def transformers_text_config(text: TextConfig) -> tuple[TextConfig, list[str]]:
    """The muse config of the transformers model run for `text`, and how it differs from it.

    Qwen3 / Qwen3-MoE are the Muse decoder without its extras. The stand-in keeps hidden size,
    heads, head dim, layers, vocabulary, experts, top-k and expert width, and drops what Qwen3
    lacks: sliding layers (all layers global), the latent projection (experts compute at the
    hidden width), the per-expert norm, shared experts, sigmoid routing and YaRN (plain RoPE at
    the global layers' theta; the rotary kind does not change speed).
    """
    differences = []
    if SLIDING in text.layer_types:
        differences.append(f"all {text.num_hidden_layers} layers global (muse: "
                           f"{text.layer_types.count(SLIDING)} sliding, window "
                           f"{text.sliding_window})")
    if text.is_moe and text.moe_latent_size:
        differences.append(f"no latent projection (experts at width {text.hidden_size}, "
                           f"muse: {text.moe_latent_size})")
    if text.is_moe and text.expert_norm:
        differences.append("no per-expert norm")
    if text.is_moe and text.num_shared_experts:
        differences.append(f"no shared experts (muse: {text.num_shared_experts})")
    if text.is_moe and text.router_scoring != "softmax":
        differences.append("softmax routing")
    if text.attention_bias:
        differences.append("no attention bias")
    if not text.qk_norm:
        differences.append("q/k norm added")
    rope = text.rope_parameters[FULL]
    if any(p.rope_type != "default" for kind, p in text.rope_parameters.items()
           if kind in text.layer_types):
        differences.append(f"plain RoPE, theta {rope.rope_theta:g}")
    stand_in = dataclasses.replace(
        text, layer_types=[FULL] * text.num_hidden_layers, sliding_window=None,
        rope_parameters={FULL: RopeParameters(rope_theta=rope.rope_theta)},
        attention_bias=False, qk_norm=True,
        **({"moe_latent_size": None, "expert_norm": False, "num_shared_experts": 0,
            "router_scoring": "softmax"} if text.is_moe else {}))
    return stand_in, differences


def hf_config(text: TextConfig):
    """A transformers Qwen3MoeConfig / Qwen3Config of the same shape as a Qwen3-like `text`
    (the inverse of muse.checkpoint.hf_configs.qwen3_config)."""
    import transformers

    if SLIDING in text.layer_types or text.attention_bias or not text.qk_norm \
            or (text.is_moe and (text.moe_latent_size or text.expert_norm
                                 or text.num_shared_experts or text.router_scoring != "softmax")):
        raise ValueError("not a Qwen3 shape: map it with transformers_text_config first")
    eos = text.eos_token_ids
    common = dict(
        vocab_size=text.vocab_size, hidden_size=text.hidden_size,
        num_hidden_layers=text.num_hidden_layers,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=text.num_key_value_heads, head_dim=text.head_dim,
        max_position_embeddings=text.max_position_embeddings, rms_norm_eps=text.rms_norm_eps,
        rope_parameters={"rope_type": "default",
                         "rope_theta": text.rope_parameters[FULL].rope_theta},
        attention_bias=False, use_sliding_window=False,
        tie_word_embeddings=text.tie_word_embeddings,
        initializer_range=text.initializer_range, bos_token_id=text.bos_token_id,
        eos_token_id=eos[0] if len(eos) == 1 else (eos or None),
        pad_token_id=text.pad_token_id)
    if text.is_moe:
        return transformers.Qwen3MoeConfig(
            **common, num_experts=text.num_experts, num_experts_per_tok=text.num_experts_per_tok,
            moe_intermediate_size=text.moe_intermediate_size, norm_topk_prob=text.norm_topk_prob,
            decoder_sparse_step=1, mlp_only_layers=[],
            intermediate_size=text.moe_intermediate_size)
    return transformers.Qwen3Config(**common, intermediate_size=text.intermediate_size,
                                    layer_types=[FULL] * text.num_hidden_layers)


def describe_transformers_side(text: TextConfig) -> dict[str, Any]:
    stand_in, differences = transformers_text_config(text)
    params = text_parameters(stand_in)
    return {
        "architecture": "Qwen3MoeForCausalLM" if text.is_moe else "Qwen3ForCausalLM",
        "stand_in": (STAND_IN if text.is_moe else STAND_IN_DENSE) if differences else None,
        "differences": differences,
        "params_total": params.total, "params_active": params.active,
        "kv_bytes_per_token": sum(kv_bytes_per_token(stand_in).values()),
    }


def describe_muse_side(text: TextConfig) -> dict[str, Any]:
    params = text_parameters(text)
    return {
        "params_total": params.total, "params_active": params.active,
        "layers_sliding": text.layer_types.count(SLIDING),
        "layers_global": text.layer_types.count(FULL),
        "sliding_window": text.sliding_window if SLIDING in text.layer_types else None,
        "kv_bytes_per_token": kv_bytes_per_token(text),
    }


# ---- rooflines ------------------------------------------------------------------------------
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


# ---- engines --------------------------------------------------------------------------------
def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu)")
    return torch.device(name)


def torch_dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16,
            "float32": torch.float32}[name]


def _engine_arg_names() -> set[str]:
    from muse.engine.args import EngineArgs

    return {f.name for f in dataclasses.fields(EngineArgs)}


def build_muse(shape: str, device: torch.device, dtype: str, *, enforce_eager: bool = False,
               detokenize: bool = False,
               **engine_args: Any) -> tuple[Any, dict[str, Any]]:
    """A muse LLM on a preset, and a record of how it was configured.

    `engine_args` go to EngineArgs as given; those left None are dropped (engine default).
    """
    from muse import LLM

    names = _engine_arg_names()
    kwargs = {k: v for k, v in engine_args.items() if v is not None}
    info: dict[str, Any] = {"detokenize": detokenize}
    if "enforce_eager" in names:
        kwargs["enforce_eager"] = enforce_eager
        info["enforce_eager"] = enforce_eager
    else:
        info["enforce_eager"] = "not an engine argument in this muse version"
    llm = LLM(shape, dtype=dtype, device=str(device), **kwargs)
    if not detokenize:
        # Token ids in, token ids out, as transformers' generate: no detokenizing per step.
        llm.tokenizer = None
    info["engine_args"] = dataclasses.asdict(llm.engine.args)
    info["max_model_len_resolved"] = llm.engine.max_model_len
    info["parameters"] = sum(p.numel() for p in llm.engine.model.parameters())
    return llm, info


def build_transformers(text: TextConfig, device: torch.device, dtype: torch.dtype, *,
                       attn_implementation: str | None = None,
                       experts_implementation: str | None = None
                       ) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A Qwen3(-MoE) causal LM of `text`'s shape with random weights, built on `device`.

    Constructed inside a `torch.device` context in `dtype`, so every weight is allocated and
    initialized (normal(0, initializer_range), norms at one) on the device, never on the host.
    """
    import transformers

    transformers.logging.set_verbosity_error()
    stand_in, _ = transformers_text_config(text)
    config = hf_config(stand_in)
    cls = transformers.Qwen3MoeForCausalLM if stand_in.is_moe else transformers.Qwen3ForCausalLM
    kwargs: dict[str, Any] = {}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if experts_implementation and stand_in.is_moe:
        kwargs["experts_implementation"] = experts_implementation
    with torch.device(device):
        model = cls._from_config(config, dtype=dtype, **kwargs)
    model.eval().requires_grad_(False)
    info = {"class": cls.__name__,
            "attn_implementation": model.config._attn_implementation,
            "experts_implementation": getattr(model.config, "_experts_implementation", None)
            if stand_in.is_moe else None,
            "parameters": sum(p.numel() for p in model.parameters())}
    return model, info


def left_pad(prompts: Sequence[Sequence[int]], device: torch.device, pad_id: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def hf_generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], new_tokens: int,
                static_cache: bool = False, pad_id: int = 0) -> torch.Tensor:
    """Greedy generation of exactly `new_tokens` tokens for a left-padded batch."""
    ids, mask = left_pad(prompts, model.device, pad_id)
    kwargs: dict[str, Any] = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens,
                              "do_sample": False, "pad_token_id": pad_id}
    if static_cache:
        kwargs["cache_implementation"] = "static"
    out = model.generate(ids, attention_mask=mask, **kwargs)
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, "
                           f"asked for {new_tokens}")
    return out


def free_memory(device: torch.device) -> int | None:
    """On CUDA, collect garbage and give cached blocks back; the bytes still allocated."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def random_prompt(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    return rng.integers(FIRST_PROMPT_ID, vocab_size, size=length).tolist()


# ---- timing ---------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """fn's result and its wall time, with the device idle before and after."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


# ---- output ---------------------------------------------------------------------------------
def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment(device: torch.device) -> dict[str, Any]:
    try:
        transformers_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers_version = None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "cpu": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers_version,
        "python": platform.python_version(),
        # MUSE_COMMIT names the commit where the checkout's own history is not at hand (a copy
        # of the working tree on another machine).
        "git_commit": os.environ.get("MUSE_COMMIT") or _git("rev-parse", "--short", "HEAD"),
        "git_dirty": None if status is None else bool(status),
    }


def shape_record(shape: str) -> dict[str, Any]:
    text = text_config(shape)
    return {"name": shape, "muse": describe_muse_side(text),
            "transformers": describe_transformers_side(text)}


def write_json(path: str | os.PathLike | None, data: dict[str, Any]) -> None:
    """Write (atomically) so a run stopped half-way leaves the last complete record."""
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def merge_previous(record: dict[str, Any], path: str | None, engines: Sequence[str],
                   must_match: Sequence[str] = ()) -> None:
    """Take the results of engines not run now from an earlier run's JSON (same benchmark
    and shape), so engines can run in separate commands and still be compared."""
    if not path:
        return
    previous = json.loads(Path(path).read_text())
    for key in ("benchmark",):
        if previous.get(key) != record[key]:
            raise SystemExit(f"--merge-from {path}: a {previous.get(key)} record, not "
                             f"{record[key]}")
    if previous["shape"]["name"] != record["shape"]["name"]:
        raise SystemExit(f"--merge-from {path}: shape {previous['shape']['name']}, not "
                         f"{record['shape']['name']}")
    for key in must_match:
        if previous.get(key) != json.loads(json.dumps(record[key], default=str)):
            raise SystemExit(f"--merge-from {path}: its {key} differs from this run's")
    for engine, result in previous["results"].items():
        if engine not in engines:
            record["results"][engine] = result
            record.setdefault("merged_from", {})[engine] = {
                "path": str(path), "environment": previous.get("environment"),
                "config": previous.get("config")}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(headers, widths))]
    lines += ["  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 500 else text[:500] + "..."


# ---- command line ---------------------------------------------------------------------------
def parse_list(text: str, kind: Callable[[str], Any] = int) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def parse_range(text: str) -> tuple[int, int]:
    """`N` or `LOW:HIGH` (inclusive)."""
    low, _, high = text.partition(":")
    low_n, high_n = int(low), int(high or low)
    if not 1 <= low_n <= high_n:
        raise argparse.ArgumentTypeError(f"{text!r}: want N or LOW:HIGH with 1 <= LOW <= HIGH")
    return low_n, high_n


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="muse-spark-15b-a2b", choices=sorted(PRESETS),
                        help=f"a preset; the GPU shapes are {', '.join(SHAPES)}")
    parser.add_argument("--engines", default="muse,transformers",
                        type=lambda s: parse_list(s, str))
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16",
                                                                "float32"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--merge-from", default=None, metavar="JSON",
                        help="an earlier run's --out: its results for engines not run now are "
                             "kept, and the ratios computed against them")
    roof = parser.add_argument_group("roofline")
    roof.add_argument("--mem-bandwidth", type=float, default=H200_MEMORY_BANDWIDTH,
                      help="bytes/s (default: measured H200 copy bandwidth)")
    roof.add_argument("--matmul-flops", type=float, default=H200_BF16_MATMUL_FLOPS,
                      help="FLOP/s (default: measured H200 dense bf16 matmul)")
    muse_group = parser.add_argument_group("muse")
    muse_group.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                            help="share of GPU memory muse may fill, weights and KV cache")
    muse_group.add_argument("--max-num-batched-tokens", type=int, default=None,
                            help="tokens per engine step (default: the engine's)")
    muse_group.add_argument("--enforce-eager", action="store_true",
                            help="no CUDA graphs (where the engine has them)")
    muse_group.add_argument("--detokenize", action="store_true",
                            help="keep muse's per-step detokenizer (off: ids in, ids out)")
    hf = parser.add_argument_group("transformers")
    hf.add_argument("--hf-attn-implementation", default=None,
                    help="e.g. sdpa, flash_attention_2 (default: transformers' choice)")
    hf.add_argument("--hf-experts-implementation", default=None,
                    help="e.g. grouped_mm, batched_mm, eager (default: transformers' choice)")


def check_common_args(args: argparse.Namespace) -> None:
    unknown = set(args.engines) - set(ENGINES)
    if unknown or not args.engines:
        raise SystemExit(f"--engines: choose among {', '.join(ENGINES)}; got {args.engines}")
    if args.device == "cuda" and args.dtype != "bfloat16":
        print(f"note: --dtype {args.dtype} on the GPU; rooflines use its element size")


def machine(args: argparse.Namespace) -> Machine:
    return Machine(args.mem_bandwidth, args.matmul_flops)


def dtype_bytes(name: str) -> int:
    return DTYPE_BYTES[name]


def header(kind: str, args: argparse.Namespace, env: dict[str, Any]) -> str:
    text = text_config(args.shape)
    side = describe_transformers_side(text)
    where = env["gpu"] or f"CPU ({env['cpu']})"
    lines = [f"{kind}: {args.shape} ({args.dtype}) on {where}, commit {env['git_commit']}"]
    if "transformers" in args.engines and side["stand_in"]:
        lines.append(f"  {side['stand_in']}: " + "; ".join(side["differences"]))
    return "\n".join(lines)
