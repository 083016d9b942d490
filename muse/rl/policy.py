"""The policy a GRPO run trains: the reference decoder with a PEFT LoRA adapter.

The base weights are frozen and held in the run's dtype (bfloat16 on a GPU); a quantized
checkpoint is trained on its weights dequantized by the engine's own quant methods, the
weights the engine multiplies by. Only the adapter (float32) is trained, and it leaves the
trainer in PEFT's layout: `adapter_config` and `adapter_tensors` are what the engine is
handed in memory every step, `save_adapter` writes the folder `muse serve --lora-modules`
reads.

The routed experts are adapted through PEFT's `target_parameters` (one `ParamWrapper` per
stacked parameter, the layout the engine reads), which apply while the reference MoE calls
its experts module.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from muse.checkpoint import load_config, load_reference_model
from muse.engine.engine import HOST_INIT_MAX_PARAMETERS
from muse.presets import PRESETS, get_preset
from muse.reference.model import MuseForCausalLM, init_weights

EXPERT_PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def require_peft() -> Any:
    try:
        import peft
    except ImportError as error:
        raise ImportError("muse train grpo trains a PEFT LoRA adapter: pip install "
                          "'muse[rl]'") from error
    return peft


# ---- the base model -----------------------------------------------------------------------
def load_base_model(model: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
                    init_std: float | None = None) -> MuseForCausalLM:
    """The frozen base: a preset's seeded random weights (the engine's, for the same seed and
    init_std), a checkpoint, or a quantized checkpoint's weights dequantized."""
    if model in PRESETS:
        config = get_preset(model).text_config
        with torch.device("meta"):
            size = sum(p.numel() for p in MuseForCausalLM(config).parameters())
        if size > HOST_INIT_MAX_PARAMETERS:
            raise ValueError(f"preset {model!r} is too large for host-drawn random weights: "
                             f"write a checkpoint with `muse init` and train on that")
        reference = MuseForCausalLM(config)
        init_weights(reference, seed, config.initializer_range if init_std is None
                     else init_std)
        reference = reference.to(device=device, dtype=dtype)
    elif is_quantized(model):
        reference = dequantized_reference_model(model, dtype, device)
    else:
        reference = load_reference_model(model, dtype=dtype, device=device)
    return reference.requires_grad_(False).eval()


def is_quantized(directory: str | Path) -> bool:
    from muse.checkpoint.reader import CheckpointReader
    from muse.quantization.config import load_quantization_config

    with CheckpointReader(directory) as reader:
        return load_quantization_config(directory, reader.names()) is not None


@torch.no_grad()
def dequantized_reference_model(directory: str | Path, dtype: torch.dtype,
                                device: torch.device) -> MuseForCausalLM:
    """The reference decoder with a quantized checkpoint's weights as the engine runs them:
    the engine's model is loaded (one process), and each quantized layer's `dequantized()`
    weight is split back into the checkpoint's projections; other tensors are copied."""
    from muse.engine.args import EngineArgs
    from muse.engine.engine import load_engine_model
    from muse.layers.fused_moe import FusedMoE
    from muse.layers.linear import LinearBase
    from muse.quantization.config import checkpoint_modules

    dtype_name = str(dtype).removeprefix("torch.")
    _, engine_model, _ = load_engine_model(
        EngineArgs(model=str(directory), device=str(device), dtype=dtype_name), device)
    tensors: dict[str, torch.Tensor] = {}
    covered: list[str] = []

    def keep(name: str, tensor: torch.Tensor) -> None:
        # One layer's float32 weight at a time: the rest is kept in the run's dtype.
        tensors[name] = tensor.detach().to(dtype=dtype)

    for name, layer in engine_model.named_modules():
        method = getattr(layer, "quant_method", None)
        dequantized = getattr(method, "dequantized", None)
        if isinstance(layer, FusedMoE):
            covered.append(name + ".")
            for projection in ("gate_up", "down"):
                keep(f"{name}.{projection}_proj", dequantized(layer, projection)
                     if callable(dequantized) else getattr(layer, f"{projection}_proj"))
            if layer.norm_weight is not None:
                keep(f"{name}.norm_weight", layer.norm_weight)
        elif isinstance(layer, LinearBase):
            covered.append(name + ".")
            weight = dequantized(layer) if callable(dequantized) else layer.weight
            parts = checkpoint_modules(layer, name)
            sizes = list(layer.output_partition_sizes)
            for part, rows in zip(parts, weight.split(sizes, dim=0), strict=True):
                keep(f"{part}.weight", rows)
            if getattr(layer, "bias", None) is not None:
                for part, rows in zip(parts, layer.bias.split(sizes, dim=0), strict=True):
                    keep(f"{part}.bias", rows)
    for name, tensor in engine_model.named_parameters():
        if not any(name.startswith(prefix) for prefix in covered):
            keep(name, tensor)
    del engine_model

    config = load_config(directory).text_config
    with torch.device("meta"):
        reference = MuseForCausalLM(config)
    wanted = reference.state_dict()
    missing = [name for name in wanted if name not in tensors]
    if missing:
        raise ValueError(f"{directory}: cannot dequantize {len(missing)} tensor(s) of the "
                         f"reference decoder, e.g. {missing[:3]}; training on this quantized "
                         f"layout is not supported yet")
    reference.load_state_dict({name: tensors[name].contiguous() for name in wanted},
                              assign=True)
    if config.tie_word_embeddings:
        reference.lm_head.weight = reference.model.embed_tokens.weight
    return reference


# ---- the adapter --------------------------------------------------------------------------
def lora_config(targets: Sequence[str], rank: int, alpha: float, has_experts: bool) -> Any:
    """PEFT's LoraConfig for `targets` (linear module names, and "experts" for the routed
    experts' stacked parameters)."""
    peft = require_peft()
    modules = [name for name in targets if name != "experts"]
    parameters = list(EXPERT_PARAMETERS) if has_experts and "experts" in targets else None
    if not modules and not parameters:
        raise ValueError("--lora-targets adapts nothing this model has (it has no routed "
                         "experts)")
    return peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=modules,
                           target_parameters=parameters, lora_dropout=0.0, bias="none")


def build_policy(base: MuseForCausalLM, config: Any, seed: int,
                 base_model: str | None = None) -> nn.Module:
    """The PEFT model of `base` with a freshly initialised adapter (seeded: lora_A random,
    lora_B zero, so the policy starts as the base), the adapter in float32. `base_model`:
    what adapter_config.json names as the base."""
    peft = require_peft()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = peft.get_peft_model(base, config, autocast_adapter_dtype=True)
    model.peft_config["default"].base_model_name_or_path = base_model
    return model


def _json_value(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if hasattr(value, "value"):  # enums (PeftType, TaskType)
        return value.value
    return str(value)


def adapter_config(model: nn.Module) -> dict[str, Any]:
    """The adapter's adapter_config.json contents (what `save_pretrained` writes)."""
    config = model.peft_config["default"].to_dict()
    return json.loads(json.dumps(config, default=_json_value))


def full_adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's parameters under the PEFT model's own state-dict names, whole tensors
    detached from training. Under FSDP every rank must call it: sharded parameters are
    gathered."""
    from torch.distributed.tensor import DTensor

    return {name: (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor)
            .detach().clone()
            for name, tensor in model.state_dict().items() if "lora_" in name}


def adapter_tensors(model: nn.Module, state: dict[str, torch.Tensor] | None = None
                    ) -> dict[str, torch.Tensor]:
    """The adapter's PEFT state dict, keys as `save_pretrained` writes them (the layout
    the engine reads); `state`: `full_adapter_state(model)` when already gathered."""
    peft = require_peft()
    # Embeddings are never adapted; "auto" would read the base's config to find out.
    return peft.get_peft_model_state_dict(
        model, state_dict=full_adapter_state(model) if state is None else state,
        save_embedding_layers=False)


def save_adapter(model: nn.Module, directory: str | Path,
                 state: dict[str, torch.Tensor]) -> None:
    """Write the adapter with PEFT's `save_pretrained` (adapter_config.json and
    adapter_model.safetensors); `state`: `full_adapter_state(model)`."""
    model.save_pretrained(str(directory), save_embedding_layers=False,
                          state_dict={name: tensor.cpu() for name, tensor in state.items()})


# ---- FSDP2 --------------------------------------------------------------------------------
def shard_policy(model: nn.Module) -> None:
    """FSDP2 (`fully_shard`): each decoder layer, then the root. Gradients are summed over
    ranks, not averaged: the loss is already divided by the global token count."""
    from torch.distributed.fsdp import fully_shard

    for layer in _decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    model.set_gradient_divide_factor(1.0)


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    return model.get_base_model().model.layers


# ---- log-probs of trajectories --------------------------------------------------------------
@dataclass
class SequenceBatch:
    """Right-padded sequences, aligned on the predicted token: position t of `input_ids`
    predicts `targets[:, t]`. `loss_mask` is 1 on response tokens the engine sampled;
    `rollout_logprobs` holds the engine's log-probs there (0 elsewhere)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    targets: torch.Tensor
    loss_mask: torch.Tensor
    rollout_logprobs: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum().item())


def sequence_batch(sequences: Sequence[Any], device: torch.device) -> SequenceBatch:
    """The batch of trajectories (`prompt_ids`, `response_ids`, `loss_mask`,
    `rollout_logprobs`, as muse.rl.rollout makes them)."""
    width = max(len(s.prompt_ids) + len(s.response_ids) for s in sequences) - 1
    shape = (len(sequences), max(width, 1))
    input_ids = torch.zeros(shape, dtype=torch.long)
    attention_mask = torch.zeros(shape, dtype=torch.long)
    targets = torch.zeros(shape, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.float32)
    rollout = torch.zeros(shape, dtype=torch.float32)
    for row, sequence in enumerate(sequences):
        ids = list(sequence.prompt_ids) + list(sequence.response_ids)
        length = len(ids) - 1
        start = len(sequence.prompt_ids) - 1  # the position predicting the first response token
        input_ids[row, :length] = torch.tensor(ids[:-1])
        attention_mask[row, :length] = 1
        targets[row, :length] = torch.tensor(ids[1:])
        loss_mask[row, start:length] = torch.tensor(sequence.loss_mask, dtype=torch.float32)
        rollout[row, start:length] = torch.tensor(sequence.rollout_logprobs,
                                                  dtype=torch.float32)
    return SequenceBatch(input_ids.to(device), attention_mask.to(device), targets.to(device),
                         loss_mask.to(device), rollout.to(device))


def empty_batch(device: torch.device) -> SequenceBatch:
    """One masked-out token: a rank without sequences still runs the forward and backward
    its FSDP peers wait for."""
    zeros = torch.zeros((1, 1), dtype=torch.long, device=device)
    return SequenceBatch(zeros, torch.ones_like(zeros), zeros, zeros.float(), zeros.float())


def batch_logits(model: nn.Module, batch: SequenceBatch) -> torch.Tensor:
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits


@torch.no_grad()
def greedy_tokens(model: nn.Module, prompt_ids: Sequence[int], max_tokens: int,
                  stop_ids: Sequence[int] = ()) -> list[int]:
    """The trainer's greedy continuation (no cache: each step reruns the whole prefix)."""
    device = next(model.parameters()).device
    ids = list(prompt_ids)
    for _ in range(max_tokens):
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, -1]
        token = int(logits.argmax())
        ids.append(token)
        if token in stop_ids:
            break
    return ids[len(prompt_ids):]

