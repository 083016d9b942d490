"""Which adapters the engine knows, and which of them sit in the model's slots.

Known adapters (read once, kept in host memory by name) are unlimited; `max_loras` of them are
resident in the model's slots at a time. A request names its adapter with a `LoRARequest`;
the engine makes it resident when it arrives (evicting the least recently used adapter that no
unfinished request uses) and the request keeps its slot until it ends.

Loading a name again (a trainer's new weights: another `lora_int_id`, path or tensors) replaces
the adapter in its slot between two steps and counts a new version. Prefix-cache keys carry the
adapter's content hash, so the old version's cached prefixes are never reused for the new one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from muse.layers.fused_moe import FusedMoE
from muse.layers.linear import LinearBase, MergedColumnParallelLinear
from muse.lora.layers import ExpertsLoRA, LinearLoRA, LoRAContext
from muse.lora.peft_adapter import AdapterError, PeftAdapter, read_adapter
from muse.lora.request import LoRARequest
from muse.model.loader import route

_EXPERT_PARAMETER = re.compile(r"^(?P<module>.+\.experts)\.(?P<parameter>gate_up_proj|down_proj)$")
_PROJECTION_PARTS = {"gate": ("gate_up", 0), "up": ("gate_up", 1), "down": ("down", None)}


@dataclass(frozen=True)
class AdapterUse:
    """What a request records of its adapter when it arrives: the version it runs with (a
    rollout's weight version), its slot, and the id its prefix-cache keys carry."""

    name: str
    version: int
    slot: int
    cache_id: str


@dataclass
class LoadedAdapter:
    name: str
    lora_int_id: int
    path: str
    adapter: PeftAdapter
    version: int = 1
    slot: int | None = None  # in the model's slots, None when not resident
    last_used: int = 0

    def use(self) -> AdapterUse:
        assert self.slot is not None, "only a resident adapter serves requests"
        return AdapterUse(self.name, self.version, self.slot, self.adapter.content_id)


@dataclass
class LoRAManager:
    """The adapters of one engine model; see the module docstring."""

    model: torch.nn.Module
    max_loras: int
    max_lora_rank: int
    dtype: torch.dtype  # the activations' (quantized layers' adapters run in it too)
    device: torch.device
    # The slots unfinished requests hold (never evicted, never unloaded); asked only when
    # an eviction or an unload needs it, not for every request.
    slots_in_use: Callable[[], Collection[int]] = lambda: ()
    context: LoRAContext = field(default_factory=LoRAContext)
    adapters: dict[str, LoadedAdapter] = field(default_factory=dict)
    _clock: int = 0

    def __post_init__(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be positive, got "
                             f"{self.max_loras} and {self.max_lora_rank}")
        self.slots: list[LoadedAdapter | None] = [None] * self.max_loras
        self.modules = dict(self.model.named_modules())
        self.num_experts = 0
        for name, module in self.modules.items():
            if not name.startswith("model.layers."):
                continue  # embeddings and the LM head are not adapted
            if isinstance(module, LinearBase):
                module.lora = LinearLoRA(self.context, self.max_loras, self.max_lora_rank,
                                         module.input_size_per_partition,
                                         _part_rows(module), self.dtype, self.device)
            elif isinstance(module, FusedMoE):
                self.num_experts = module.num_experts
                module.lora = ExpertsLoRA(self.context, self.max_loras, self.max_lora_rank,
                                          module.num_local_experts, module.hidden_size,
                                          module.intermediate_size_per_partition,
                                          self.dtype, self.device)
        self.model.lora_context = self.context

    # ---- known adapters ------------------------------------------------------------------
    def resolve(self, request: LoRARequest) -> LoadedAdapter:
        """The request's adapter, read or replaced when the request says so, and resident."""
        known = self.adapters.get(request.lora_name)
        if not request.has_weights:
            if known is None or known.lora_int_id != request.lora_int_id:
                raise AdapterError(f"no adapter {request.lora_name!r} with lora_int_id "
                                   f"{request.lora_int_id} is loaded (a request without "
                                   f"lora_path or tensors names a loaded one)")
        elif known is None or _is_update(known, request):
            known = self.add(request)
        self.make_resident(known)
        return known

    def add(self, request: LoRARequest) -> LoadedAdapter:
        """Read an adapter (a new name, or new weights for a known one: replaced in place)."""
        if not request.lora_name:
            raise AdapterError("an adapter needs a name")
        if not request.has_weights:
            raise AdapterError(f"adapter {request.lora_name!r}: give lora_path, or config and "
                               f"tensors")
        adapter = read_adapter(request.lora_path or None, config=request.config,
                               tensors=request.tensors, num_experts=self.num_experts or None)
        self._check_targets(adapter, request.lora_name)
        known = self.adapters.get(request.lora_name)
        loaded = LoadedAdapter(request.lora_name, request.lora_int_id,
                               request.lora_path or "", adapter)
        if known is not None:
            loaded.version = known.version + 1
            loaded.slot, known.slot = known.slot, None
        self.adapters[request.lora_name] = loaded
        if loaded.slot is not None:  # new weights in the old version's slot
            self.slots[loaded.slot] = loaded
            self._write(loaded.slot, loaded)
        return loaded

    def remove(self, name: str) -> None:
        """Forget an adapter; refused while unfinished requests use it."""
        known = self.adapters.get(name)
        if known is None:
            raise KeyError(name)
        if known.slot is not None and known.slot in self.slots_in_use():
            raise AdapterError(f"adapter {name!r} serves unfinished requests; unload it when "
                               f"they end")
        del self.adapters[name]
        if known.slot is not None:
            self._clear(known.slot)
            self.slots[known.slot] = None
            self._note_expert_adapters()

    def get(self, name: str) -> LoadedAdapter | None:
        return self.adapters.get(name)

    # ---- slots ---------------------------------------------------------------------------
    def make_resident(self, loaded: LoadedAdapter) -> None:
        self._clock += 1
        loaded.last_used = self._clock
        if loaded.slot is not None:
            return
        free = [slot for slot, held in enumerate(self.slots) if held is None]
        if not free:
            in_use = self.slots_in_use()
            evictable = [held for slot, held in enumerate(self.slots)
                         if held is not None and slot not in in_use]
            if not evictable:
                raise AdapterError(f"all {self.max_loras} adapter slots (--max-loras) serve "
                                   f"unfinished requests; adapter {loaded.name!r} must wait "
                                   f"for one of them to end")
            victim = min(evictable, key=lambda held: held.last_used)
            free = [victim.slot]
            victim.slot = None
        loaded.slot = free[0]
        self.slots[loaded.slot] = loaded
        self._write(loaded.slot, loaded)

    def _clear(self, slot: int) -> None:
        for module in self.modules.values():
            lora = getattr(module, "lora", None)
            if lora is not None:
                lora.clear(slot)

    def _write(self, slot: int, loaded: LoadedAdapter) -> None:
        self._clear(slot)
        for key, weights in loaded.adapter.weights.items():
            self._write_one(slot, key, weights)
        self._note_expert_adapters()

    def _note_expert_adapters(self) -> None:
        """Tell the model whether a resident adapter adapts routed experts (see
        `LoRAContext.experts_adapted`)."""
        self.context.experts_adapted = any(
            held is not None and any(isinstance(self._target(key)[0], FusedMoE)
                                     for key in held.adapter.weights)
            for held in self.slots)

    def _target(self, key: str) -> tuple[Any, dict[str, Any]]:
        """The engine module an adapter key adapts and where in it."""
        stacked = _EXPERT_PARAMETER.match(key)
        if stacked is not None:
            projection = stacked["parameter"].removesuffix("_proj")
            return self.modules.get(stacked["module"]), {"projection": projection,
                                                         "part": None, "expert": None}
        target, arguments = route(f"{key}.weight")
        module = self.modules.get(target.removesuffix(".weight"))
        if "expert_id" in arguments:
            projection, part = _PROJECTION_PARTS[arguments["shard_id"]]
            return module, {"projection": projection, "part": part,
                            "expert": arguments["expert_id"]}
        shard_id = arguments.get("shard_id")
        part = module.shard_ids().index(shard_id) \
            if shard_id is not None and isinstance(module, MergedColumnParallelLinear) else None
        return module, {"part": part}

    def _check_targets(self, adapter: PeftAdapter, name: str) -> None:
        """Every weight has a place here and fits its slot's rank (checked when read, not
        when first made resident)."""
        unknown = []
        for key, weights in adapter.weights.items():
            module, where = self._target(key)
            if getattr(module, "lora", None) is None:
                unknown.append(key)
                continue
            parts = 1
            if where["part"] is None:  # a weight over a fused layer's parts takes their ranks
                parts = ExpertsLoRA.PROJECTIONS[where["projection"]] \
                    if isinstance(module, FusedMoE) else len(module.lora.part_rows)
            if weights.rank > parts * self.max_lora_rank:
                raise AdapterError(f"adapter {name!r}: `{key}` has rank {weights.rank}; this "
                                   f"engine serves ranks up to --max-lora-rank "
                                   f"{self.max_lora_rank}")
        if unknown:
            shown = ", ".join(unknown[:4]) + (" ..." if len(unknown) > 4 else "")
            raise AdapterError(f"adapter {name!r} adapts modules this model does not adapt "
                               f"(attention, MLP and MoE projections can be): {shown}")

    def _write_one(self, slot: int, key: str, weights) -> None:
        module, where = self._target(key)
        try:
            if isinstance(module, FusedMoE):
                module.lora.write(slot, where["projection"], where["part"], where["expert"],
                                  weights, key)
            else:
                module.lora.write(slot, where["part"], weights, key)
        except ValueError as error:
            raise AdapterError(str(error)) from None


def _is_update(known: LoadedAdapter, request: LoRARequest) -> bool:
    """Whether a request for a known name brings other weights than those loaded."""
    return request.tensors is not None or request.lora_int_id != known.lora_int_id \
        or (request.lora_path or "") != known.path


def _part_rows(layer: LinearBase) -> list[tuple[int, int]]:
    """Each checkpoint part's (first output row, rows) in the layer's local output."""
    rows, offset = [], 0
    for size in layer.output_partition_sizes:
        rows.append((offset, size))
        offset += size
    return rows
