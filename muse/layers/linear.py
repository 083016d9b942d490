"""Linear layers that own their tensor-parallel sharding (Megatron's column / row split).

Each layer computes the logical shape of this rank's shard, lets its quant method create the
parameters at that shape, and gives every parameter its `weight_loader`, which narrows a full
checkpoint tensor (or a lazily read safetensors slice) to this rank's part:

| layer | shard of the weight [out, in] | forward |
|---|---|---|
| `ReplicatedLinear` | all of it | x W^T |
| `ColumnParallelLinear` | rows (output features) | local outputs; `gather_output` gathers them |
| `MergedColumnParallelLinear` | rows of each fused part (gate, up) | local parts, concatenated |
| `QKVParallelLinear` | this rank's q heads and the kv heads they use | local q, k, v |
| `RowParallelLinear` | columns (input features) | partial sums, all-reduced over TP |

A column layer followed by a row layer (q/k/v then o, gate/up then down) needs one all-reduce
and no gather in between. Parameters are frozen (`requires_grad=False`): these layers serve
inference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from muse.distributed.parallel_state import get_tp_group
from muse.layers.lazy_slice import LazySlice, copy_into
from muse.layers.quantization import (QuantizationConfig, UnquantizedLinearMethod, linear_method,
                                     set_weight_attrs)

ShardId = int | str


def divide(numerator: int, denominator: int, what: str,
           by: str = "the tensor parallel size") -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) must be divisible by {by} ({denominator})")
    return numerator // denominator


def scale_offset(features: int, stored: int, logical: int, what: str) -> int:
    """The stored length of `features` logical features along a dimension that holds `stored`
    entries for `logical` features (packed FP4: stored = logical / 2; block scales: / 16)."""
    if (features * stored) % logical:
        raise ValueError(f"{what}: {features} of {logical} features do not fill whole entries "
                         f"of a dimension stored as {stored} (a block or pack straddles shards)")
    return features * stored // logical


class LinearBase(nn.Module):
    """What every linear layer shares: the quant method, the TP group, the optional bias."""

    def __init__(self, input_size: int, output_size: int, input_size_per_partition: int,
                 output_partition_sizes: list[int], bias: bool, bias_sharded: bool,
                 params_dtype: torch.dtype | None, quant_config: QuantizationConfig | None,
                 prefix: str) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = output_partition_sizes
        self.output_size_per_partition = sum(output_partition_sizes)
        self.prefix = prefix
        self.tp_group = get_tp_group()
        self.tp_rank = self.tp_group.rank_in_group
        self.tp_size = self.tp_group.world_size
        params_dtype = params_dtype or torch.get_default_dtype()
        self.quant_method = linear_method(quant_config, self, prefix)
        self.quant_method.create_weights(self, input_size_per_partition, output_partition_sizes,
                                         input_size, output_size, params_dtype,
                                         weight_loader=self.weight_loader)
        # LoRA adapters' slots (`muse.lora.layers.LinearLoRA`), attached when serving them.
        self.lora = None
        if bias:
            width = self.output_size_per_partition if bias_sharded else output_size
            self.bias = nn.Parameter(torch.empty(width, dtype=params_dtype), requires_grad=False)
            attrs: dict[str, Any] = {"output_dim": 0} if bias_sharded else {}
            set_weight_attrs(self.bias, weight_loader=self.weight_loader, **attrs)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: Any,
                      shard_id: ShardId | None = None) -> None:
        raise NotImplementedError

    def _load_split(self, param: nn.Parameter, loaded: Any, shard_id: ShardId | None,
                    dim_attribute: str) -> None:
        """This rank's equal part along the dimension the parameter tags with
        `dim_attribute` ("output_dim" or "input_dim"); untagged parameters load whole."""
        if shard_id is not None:
            raise ValueError(f"{self._name(param)} is not fused: shard_id must be None, "
                             f"got {shard_id!r}")
        source = LazySlice.of(loaded)
        dim = getattr(param, dim_attribute, None)
        if dim is not None:
            size = param.shape[dim]
            source = source.narrow(dim, self.tp_rank * size, size)
        copy_into(param.data, source, self._name(param))

    def _adapted(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The output plus the adapters' deltas of this step's tokens (a row-parallel layer's
        partial sums get their partial deltas, reduced with them)."""
        return self.lora.add(out, x) if self.lora is not None else out

    def plain_weight(self) -> torch.Tensor | None:
        """This rank's weight when the layer's output is x @ W^T and nothing else: unquantized,
        no bias, no adapters, no gather or reduce after it. A caller that merges products (the
        MoE's stacked input product) may then compute it itself; None otherwise."""
        plain = (isinstance(self.quant_method, UnquantizedLinearMethod) and self.bias is None
                 and self.lora is None and not isinstance(self, RowParallelLinear)
                 and not (getattr(self, "gather_output", False) and self.tp_size > 1))
        return self.weight if plain else None

    def _name(self, param: nn.Parameter) -> str:
        """The parameter's name for error messages (loaders get the object, not the name)."""
        name = next((key for key, value in self._parameters.items() if value is param), "?")
        return f"{self.prefix}.{name}" if self.prefix else f"{type(self).__name__}.{name}"

    def extra_repr(self) -> str:
        return (f"in={self.input_size_per_partition}/{self.input_size}, "
                f"out={self.output_size_per_partition}/{self.output_size}, tp={self.tp_size}, "
                f"bias={self.bias is not None}")


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank (routers, small projections)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        super().__init__(input_size, output_size, input_size, [output_size], bias, True,
                         params_dtype, quant_config, prefix)

    def weight_loader(self, param: nn.Parameter, loaded: Any,
                      shard_id: ShardId | None = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{self._name(param)} is not fused: shard_id must be None, "
                             f"got {shard_id!r}")
        copy_into(param.data, loaded, self._name(param))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._adapted(self.quant_method.apply(self, x, self.bias), x)


class ColumnParallelLinear(LinearBase):
    """Output features split over TP: rank r holds rows [r * out/tp, (r + 1) * out/tp).

    gather_output: all-gather the local outputs so every rank returns all `output_size`
    features; otherwise each rank returns its own (the input a row-parallel layer wants).
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 gather_output: bool = False, params_dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        tp_size = get_tp_group().world_size
        self.gather_output = gather_output
        super().__init__(input_size, output_size, input_size,
                         [divide(output_size, tp_size, "output size")], bias, True,
                         params_dtype, quant_config, prefix)

    def weight_loader(self, param: nn.Parameter, loaded: Any,
                      shard_id: ShardId | None = None) -> None:
        self._load_split(param, loaded, shard_id, "output_dim")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._adapted(self.quant_method.apply(self, x, self.bias), x)
        if self.gather_output and self.tp_size > 1:
            out = self.tp_group.all_gather(out, dim=-1)
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel layers of one input fused into one parameter (gate and up).

    output_sizes: each part's full width; rank r holds the r-th 1/tp of every part, stored
    part after part, so the local output is [part 0 | part 1 | ...] of this rank. The
    checkpoint's parts load with shard_id 0, 1, ...; a checkpoint that already stores the
    fused tensor loads with shard_id None.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 params_dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        tp_size = get_tp_group().world_size
        self.output_sizes = list(output_sizes)
        # Gathering would interleave the ranks' parts; fused outputs stay local.
        self.gather_output = False
        LinearBase.__init__(self, input_size, sum(output_sizes), input_size,
                            [divide(size, tp_size, "each output size")
                             for size in output_sizes],
                            bias, True, params_dtype, quant_config, prefix)

    def shard_ids(self) -> list[ShardId]:
        return list(range(len(self.output_sizes)))

    def _shard_layout(self, shard_id: ShardId) -> tuple[int, int, int]:
        """(offset and width of the part in this rank's parameter, in logical features; which
        of the checkpoint part's equal slices this rank holds)."""
        index = self._shard_index(shard_id)
        partitions = self.output_partition_sizes
        return sum(partitions[:index]), partitions[index], self.tp_rank

    def _shard_index(self, shard_id: ShardId) -> int:
        ids = self.shard_ids()
        if shard_id not in ids:
            raise ValueError(f"shard_id of {type(self).__name__} `{self.prefix}` must be one "
                             f"of {ids}, got {shard_id!r}")
        return ids.index(shard_id)

    def weight_loader(self, param: nn.Parameter, loaded: Any,
                      shard_id: ShardId | None = None) -> None:
        name = self._name(param)
        source = LazySlice.of(loaded)
        output_dim = getattr(param, "output_dim", None)
        if getattr(param, "per_shard", False):
            if shard_id is None:
                raise ValueError(f"{name} holds one value per part: load each part's value "
                                 f"with its shard_id")
            copy_into(param.data[self._shard_index(shard_id)], source, name)
            return
        if output_dim is None:
            copy_into(param.data, source, name)  # replicated (scalar input scales)
            return
        if shard_id is None:
            # The checkpoint stores the parts fused, at full width: split it into parts.
            full = self.output_sizes
            offset = 0
            for part, width in zip(self.shard_ids(), full):
                stored = scale_offset(width, source.shape[output_dim], sum(full), name)
                self.weight_loader(param, source.narrow(output_dim, offset, stored), part)
                offset += stored
            return
        offset, width, slice_index = self._shard_layout(shard_id)
        stored_total, logical_total = param.shape[output_dim], self.output_size_per_partition
        offset = scale_offset(offset, stored_total, logical_total, name)
        width = scale_offset(width, stored_total, logical_total, name)
        target = param.data.narrow(output_dim, offset, width)
        copy_into(target, source.narrow(output_dim, slice_index * width, width), name)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections fused; heads split over TP (shard ids "q", "k", "v").

    Rank r holds query heads [r * H/tp, (r + 1) * H/tp). With tp <= num_kv_heads it holds
    kv heads [r * KV/tp, ...) likewise. With tp > num_kv_heads (tp a multiple of it) each kv
    head is replicated on tp / num_kv_heads consecutive ranks: rank r holds kv head
    r // (tp / KV), the one its query heads attend with (GQA groups are consecutive heads).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, params_dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        tp_size = get_tp_group().world_size
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        self.head_dim = head_dim
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = divide(num_heads, tp_size, "num_heads")
        if tp_size >= num_kv_heads:
            # Replicas of a kv head must serve whole ranks' query heads.
            self.num_kv_head_replicas = divide(
                tp_size, num_kv_heads, "with more ranks than kv heads, the tensor parallel "
                "size", by="num_kv_heads")
            self.num_kv_heads = 1
        else:
            self.num_kv_head_replicas = 1
            self.num_kv_heads = divide(num_kv_heads, tp_size, "num_kv_heads")
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        self.output_sizes = [num_heads * head_dim, num_kv_heads * head_dim,
                             num_kv_heads * head_dim]
        self.gather_output = False
        LinearBase.__init__(self, hidden_size, sum(self.output_sizes), hidden_size,
                            [self.q_size, self.kv_size, self.kv_size], bias, True,
                            params_dtype, quant_config, prefix)

    def shard_ids(self) -> list[ShardId]:
        return ["q", "k", "v"]

    def _shard_layout(self, shard_id: ShardId) -> tuple[int, int, int]:
        index = self._shard_index(shard_id)
        if index == 0:
            return 0, self.q_size, self.tp_rank
        offset = self.q_size + (index - 1) * self.kv_size
        return offset, self.kv_size, self.tp_rank // self.num_kv_head_replicas

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's fused output -> q, k, v of shape [..., heads, head_dim]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        lead = qkv.shape[:-1]
        return (q.view(*lead, self.num_heads, self.head_dim),
                k.view(*lead, self.num_kv_heads, self.head_dim),
                v.view(*lead, self.num_kv_heads, self.head_dim))


class RowParallelLinear(LinearBase):
    """Input features split over TP: rank r holds columns [r * in/tp, (r + 1) * in/tp) and
    takes the matching slice of the input (what a column-parallel layer hands over).

    reduce_results: all-reduce the partial products so every rank returns the full output;
    without it each rank returns its partial sum for the caller to reduce (e.g. fused with
    the next norm). The bias is added by rank 0 only, before the reduction, so it counts once
    either way.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 reduce_results: bool = True, params_dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None, prefix: str = "") -> None:
        tp_size = get_tp_group().world_size
        self.reduce_results = reduce_results
        super().__init__(input_size, output_size, divide(input_size, tp_size, "input size"),
                         [output_size], bias, False, params_dtype, quant_config, prefix)

    def weight_loader(self, param: nn.Parameter, loaded: Any,
                      shard_id: ShardId | None = None) -> None:
        self._load_split(param, loaded, shard_id, "input_dim")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.tp_rank == 0 else None
        out = self._adapted(self.quant_method.apply(self, x, bias), x)
        if self.reduce_results and self.tp_size > 1:
            out = self.tp_group.all_reduce(out)
        return out
