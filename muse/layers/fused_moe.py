"""The routed experts of a latent MoE layer, sharded over tensor or expert parallelism.

    out[t] = sum_j w[t, j] * norm_e(down_e @ swiglu(gate_up_e @ x[t])),  e = ids[t, j]

Parameters (names and layout of the checkpoint's `mlp.experts.*`, gate rows before up rows):
`gate_up_proj` [E_local, 2 * I_local, L], `down_proj` [E_local, L, I_local] (created by the
quant method) and `norm_weight` [E_local, L] (each expert's RMSNorm, when the model has them).
A checkpoint that interleaves gate and up rows (gpt-oss: row 2i gate i, row 2i + 1 up i) is
read into the same order through parameters tagged `interleaved`.

Two ways to shard, chosen by the parallel config:

* TP (default): every rank holds every expert and 1/tp of each one's intermediate width, so
  each rank's down projection is a partial sum. The expert norm is not linear, so the
  partial (token, expert) outputs are all-reduced over TP *before* the norm, inside
  `fused_experts` (its `reduce_pairs` hook): k times the bytes of reducing the combined
  output, the price of a norm per expert. After it every rank holds the full result.
* EP (`enable_expert_parallel`): rank r of the EP group (dp x tp ranks) holds whole experts
  [r * E/ep, (r + 1) * E/ep), intermediate unsplit. Each rank computes its experts' share of
  every token and the shares are summed over the EP group. The TP ranks of one data-parallel
  rank hold the same tokens; data-parallel ranks hold different ones, so with DP > 1 each
  rank first all-gathers the tokens of every DP rank (padded to the largest count), and the
  shares are summed by an all-reduce over TP, then a reduce-scatter over DP that hands each DP
  rank back its own rows: all-gather + reduce-scatter dispatch (what vLLM calls its naive
  all2all backend), the same bytes as an all-to-all when every rank routes everywhere.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from muse.distributed.parallel_state import (get_dp_group, get_ep_group, get_parallel_config,
                                             get_tp_group)
from muse.kernels.moe import fused_experts_torch
from muse.layers.lazy_slice import LazySlice, copy_into
from muse.layers.quantization import (QUANTIZED_LEAVES, QuantizationConfig, moe_method,
                                      set_weight_attrs)

# Hugging Face Qwen3-MoE stores one matrix per expert projection,
# `...mlp.experts.{e}.{gate,up,down}_proj.weight`; each loads into a fused parameter.
PER_EXPERT_PROJECTIONS: dict[str, tuple[str, str]] = {
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
    "down_proj": ("down_proj", "down"),
}
_PER_EXPERT_NAME = re.compile(r"^(?P<expert>\d+)\.(?P<projection>gate_proj|up_proj|down_proj)"
                              r"\.(?P<leaf>" + "|".join(QUANTIZED_LEAVES) + ")$")
_PROJECTION_SHARDS = {"gate_up": ("gate", "up"), "down": ("down",)}


def per_expert_target(name: str) -> tuple[str, int, str] | None:
    """`{e}.gate_proj.weight` (a name relative to the experts module) -> (parameter name,
    expert_id, shard_id) for `FusedMoE.weight_loader`; None for any other name. A quantized
    checkpoint's scales (`{e}.gate_proj.weight_scale`) load into `gate_up_proj_weight_scale`."""
    match = _PER_EXPERT_NAME.match(name)
    if match is None:
        return None
    param_name, shard_id = PER_EXPERT_PROJECTIONS[match["projection"]]
    if match["leaf"] != "weight":
        param_name = f"{param_name}_{match['leaf']}"
    return param_name, int(match["expert"]), shard_id


class FusedMoE(nn.Module):
    """forward(x [T, L], topk_weights [T, k] float32, topk_ids [T, k] global expert ids)
    -> [T, L], the same full result on every rank.

    hidden_size: the experts' input and output width (the latent width of a latent MoE).
    expert_norm: give each expert its own RMSNorm (weight `norm_weight`, epsilon `eps`).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 expert_norm: bool = True, eps: float = 1e-6,
                 params_dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "",
                 experts_kernel: Callable = fused_experts_torch) -> None:
        super().__init__()
        config = get_parallel_config()
        self.prefix = prefix
        # The MoE backend's experts function (muse.kernels.backends), fixed at build time.
        self.backend_experts_kernel = experts_kernel
        # LoRA adapters' slots (`muse.lora.layers.ExpertsLoRA`), attached when serving them.
        self.lora = None
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.eps = eps
        self.dp_group = None
        if config.enable_expert_parallel:
            if config.prefill_context_parallel_size > 1:
                raise ValueError("expert parallelism with prefill context parallelism is not "
                                 "supported: use one of enable_expert_parallel and "
                                 "prefill_context_parallel_size > 1")
            self.ep_group = get_ep_group()
            if config.data_parallel_size > 1:
                self.dp_group = get_dp_group()
            self.tp_group = None
            self.tp_size, self.tp_rank = 1, 0
        else:
            self.ep_group = None
            self.tp_group = get_tp_group()
            self.tp_size, self.tp_rank = self.tp_group.world_size, self.tp_group.rank_in_group
        self.ep_size = self.ep_group.world_size if self.ep_group is not None else 1
        self.ep_rank = self.ep_group.rank_in_group if self.ep_group is not None else 0
        if num_experts % self.ep_size:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the expert "
                             f"parallel size ({self.ep_size})")
        if intermediate_size % self.tp_size:
            raise ValueError(f"moe_intermediate_size ({intermediate_size}) must be divisible "
                             f"by the tensor parallel size ({self.tp_size})")
        self.num_local_experts = num_experts // self.ep_size
        self.expert_start = self.ep_rank * self.num_local_experts
        self.intermediate_size_per_partition = intermediate_size // self.tp_size
        dtype = params_dtype or torch.get_default_dtype()

        self.quant_method = moe_method(quant_config, self, prefix)
        self.quant_method.create_weights(self, self.num_local_experts, hidden_size,
                                         self.intermediate_size_per_partition, dtype,
                                         weight_loader=self.weight_loader)
        if expert_norm:
            # The norm scales whole latent rows: never quantized, never split but by expert.
            self.norm_weight = nn.Parameter(torch.empty(self.num_local_experts, hidden_size,
                                                        dtype=dtype), requires_grad=False)
            set_weight_attrs(self.norm_weight, weight_loader=self.weight_loader)
        else:
            self.register_parameter("norm_weight", None)

    @property
    def experts_kernel(self) -> Callable:
        """What the quant methods call: the backend's kernel, or, in a step where tokens use
        LoRA adapters, the plain experts path with the adapters' deltas inside it (they act
        before the SwiGLU and the expert norm, where no fused kernel has a hook yet)."""
        if self.lora is not None and self.lora.active():
            return functools.partial(fused_experts_torch, lora=self.lora.hook)
        return self.backend_experts_kernel

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: str | None = None,
                      expert_id: int | None = None) -> None:
        """Load this rank's part of a checkpoint tensor into `param`.

        expert_id None: `loaded` is the stacked tensor of all experts ([E, 2I, L] for
        `gate_up_proj`, gate rows first, or alternating gate and up rows for a parameter
        tagged `interleaved`; [E, L, I] for `down_proj`; [E, L] for `norm_weight`), shard_id
        None. expert_id e: one expert's tensor, with shard_id "gate" or "up" ([I, L]) or
        "down" ([L, I]); experts another EP rank holds are skipped.
        """
        name = self._name(param)
        source = LazySlice.of(loaded)
        target = param.data
        if expert_id is None:
            if source.shape[0] != self.num_experts:
                raise ValueError(f"{name}: the stacked checkpoint tensor of shape "
                                 f"{source.shape} must have {self.num_experts} experts first")
            source = source.narrow(0, self.expert_start, self.num_local_experts)
            expert_dims = 1
        else:
            if not 0 <= expert_id < self.num_experts:
                raise ValueError(f"{name}: expert_id must be in [0, {self.num_experts}), got "
                                 f"{expert_id}")
            local = expert_id - self.expert_start
            if not 0 <= local < self.num_local_experts:
                return
            target = target[local]
            expert_dims = 0

        projection = getattr(param, "moe_projection", None)
        if projection is None:
            if shard_id is not None:
                raise ValueError(f"{name} is not split into parts: shard_id must be None, got "
                                 f"{shard_id!r}")
            copy_into(target, source, name)
            return
        shards = _PROJECTION_SHARDS[projection]
        if shard_id is None and len(shards) == 1:
            shard_id = shards[0]
        if shard_id is not None and shard_id not in shards:
            raise ValueError(f"shard_id for {name} must be one of {shards}, got {shard_id!r}")
        if getattr(param, "per_shard", False):
            if shard_id is None:
                raise ValueError(f"{name} holds one value per part: load each part's value "
                                 f"with its shard_id")
            copy_into(target.select(expert_dims, shards.index(shard_id)), source, name)
            return
        # The intermediate features: the output rows of gate/up, the input columns of down.
        dim = getattr(param, "output_dim" if projection == "gate_up" else "input_dim", None)
        if dim is None:
            # Nothing along the intermediate features (down's per-channel scales run along
            # the hidden width): the whole tensor, per expert.
            copy_into(target, source, name)
            return
        dim += expert_dims - 1
        if shard_id is None and getattr(param, "interleaved", False):
            self._load_interleaved(target, source, dim, name)
            return
        if shard_id is None:
            # A stacked gate_up: gate half then up half along the intermediate dimension.
            half = source.shape[dim] // 2
            for index, part in enumerate(shards):
                self._load_part(target, source.narrow(dim, index * half, half), dim, index,
                                len(shards), name)
            return
        self._load_part(target, source, dim, shards.index(shard_id), len(shards), name)

    def _load_part(self, target: torch.Tensor, source: LazySlice, dim: int, index: int,
                   num_parts: int, name: str) -> None:
        """Part `index` of `num_parts` along `dim` of target <- this rank's TP slice of the
        part's full checkpoint tensor (stored widths, so packed formats need nothing more)."""
        width = target.shape[dim] // num_parts
        copy_into(target.narrow(dim, index * width, width),
                  source.narrow(dim, self.tp_rank * width, width), name)

    def _load_interleaved(self, target: torch.Tensor, source: LazySlice, dim: int,
                          name: str) -> None:
        """A stacked gate_up whose rows alternate along `dim` (row 2i gate feature i, row
        2i + 1 up feature i, as gpt-oss stores them) into gate rows then up rows. This rank's
        features [r * w, (r + 1) * w) are the contiguous source rows [2 r w, 2 (r + 1) w)."""
        width = target.shape[dim] // 2
        if source.shape[dim] != 2 * width * self.tp_size:
            raise ValueError(f"{name}: the checkpoint's interleaved gate/up has "
                             f"{source.shape[dim]} rows along dimension {dim}; this layer "
                             f"needs {2 * width * self.tp_size}")
        rows = source.narrow(dim, 2 * self.tp_rank * width, 2 * width).read()
        pairs = rows.unflatten(dim, (width, 2))
        for index in range(2):
            copy_into(target.narrow(dim, index * width, width), pairs.select(dim + 1, index),
                      name)

    def _name(self, param: nn.Parameter) -> str:
        name = next((key for key, value in self._parameters.items() if value is param), "?")
        return f"{self.prefix}.{name}" if self.prefix else f"FusedMoE.{name}"

    def _all_reduce_pairs(self, y: torch.Tensor) -> torch.Tensor:
        assert self.tp_group is not None
        return self.tp_group.all_reduce(y)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                dp_num_tokens: list[int] | None = None) -> torch.Tensor:
        """`dp_num_tokens`: the token count of every data-parallel rank this step (needed, and
        only used, when experts are spread over data-parallel ranks)."""
        if self.dp_group is not None:
            return self._forward_data_parallel(x, topk_weights, topk_ids, dp_num_tokens)
        if self.ep_size > 1:
            topk_weights, topk_ids = self._local_pairs(topk_weights, topk_ids)
        reduce_pairs = self._all_reduce_pairs if self.tp_size > 1 else None
        out = self.quant_method.apply(self, x, topk_weights, topk_ids, reduce_pairs=reduce_pairs)
        if self.ep_size > 1:
            assert self.ep_group is not None
            out = self.ep_group.all_reduce(out)
        return out

    def _local_pairs(self, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Experts are contiguous per rank, so a global id modulo the local count is its local
        id here. Pairs of other ranks' experts run on a local expert with weight 0 (static
        shapes, no host sync; their compute is wasted until the kernels learn to skip
        non-local pairs)."""
        is_local = topk_ids // self.num_local_experts == self.ep_rank
        return torch.where(is_local, topk_weights, 0.0), topk_ids % self.num_local_experts

    def _forward_data_parallel(self, x: torch.Tensor, topk_weights: torch.Tensor,
                               topk_ids: torch.Tensor, dp_num_tokens: list[int] | None
                               ) -> torch.Tensor:
        assert self.dp_group is not None
        dp = self.dp_group
        if dp_num_tokens is None or len(dp_num_tokens) != dp.world_size \
                or dp_num_tokens[dp.rank_in_group] != x.shape[0]:
            raise ValueError(f"{self.prefix}: experts spread over {dp.world_size} data-parallel "
                             "ranks need every rank's token count this step (dp_num_tokens), "
                             f"got {dp_num_tokens} for {x.shape[0]} local tokens")
        rows = max(dp_num_tokens)
        pad = rows - x.shape[0]
        # Padding rows route to expert 0 with weight 0: they add nothing anywhere.
        gathered = [dp.all_gather(F.pad(t, (0, 0, 0, pad)), dim=0)
                    for t in (x, topk_weights, topk_ids)]
        weights, ids = self._local_pairs(gathered[1], gathered[2])
        out = self.quant_method.apply(self, gathered[0], weights, ids, reduce_pairs=None)
        tp = get_tp_group()
        out = dp.reduce_scatter(tp.all_reduce(out), dim=0)
        return out[:x.shape[0]]

    def extra_repr(self) -> str:
        return (f"experts={self.num_local_experts}/{self.num_experts} (from "
                f"{self.expert_start}), hidden={self.hidden_size}, intermediate="
                f"{self.intermediate_size_per_partition}/{self.intermediate_size}, "
                f"tp={self.tp_size}, ep={self.ep_size}, norm={self.norm_weight is not None}")
