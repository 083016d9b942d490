"""The engine's decoder: its own layers over a flat batch of tokens and a paged KV cache.

Built from `muse.layers`, which own how their parameters are sharded and loaded, with the
kernels of the backends chosen at build time (`muse.kernels.backends`). Parameter names are
the checkpoint's, except where projections are fused (`qkv_proj`, `gate_up_proj`); the loader
(`muse.model.loader`) routes checkpoint tensors to them. The residual stream is carried beside
the layer output, so each norm also does the residual add before it in one kernel. The
reference decoder (`muse.reference`) computes the same function and is the tests' oracle.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from muse.config import LAYER_TYPES, TextConfig
from muse.distributed.parallel_state import get_pcp_group, get_pp_group
from muse.kernels.attention_metadata import BatchMetadata
from muse.kernels.backends import ModelBackends
from muse.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from muse.layers.norm import RMSNorm
from muse.layers.quantization import QuantizationConfig
from muse.model.attention import EngineAttention
from muse.model.moe import EngineMLP, EngineMoE
from muse.rope import cos_sin, inverse_frequencies

Rotary = dict[str, tuple[torch.Tensor, torch.Tensor]]
_LAYER_NAME = re.compile(r"^model\.layers\.(?P<index>\d+)\.")


class LayerHooks(Protocol):
    """Called around each of this rank's layers in an eager forward (position: the layer's
    index among the rank's layers, as its KV caches are ordered)."""

    def before_layer(self, position: int) -> None: ...

    def after_layer(self, position: int, kv_cache: tuple[torch.Tensor, torch.Tensor],
                    meta: BatchMetadata) -> None: ...


class EngineDecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, layer_index: int, backends: ModelBackends,
                 params_dtype: torch.dtype, prefix: str,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.norms = backends.attention
        self.layer_type = config.layer_types[layer_index]
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, params_dtype,
                                       f"{prefix}.input_layernorm")
        self.self_attn = EngineAttention(config, layer_index, backends.attention, params_dtype,
                                         f"{prefix}.self_attn", quant_config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, params_dtype,
                                                f"{prefix}.post_attention_layernorm")
        self.is_moe = config.is_moe
        self.mlp = EngineMoE(config, backends.moe, params_dtype, f"{prefix}.mlp", quant_config) \
            if config.is_moe else EngineMLP(config.hidden_size, config.intermediate_size,
                                            params_dtype, f"{prefix}.mlp", quant_config)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rotary: Rotary,
                meta: BatchMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual): their sum is the reference layer's output.

        `residual` is None for the first layer, whose input is the whole residual stream."""
        q, k, v, residual = self.before_attention(x, residual, rotary)
        attended = self.self_attn.attend(q, k, v, meta, kv_cache)
        return self.after_attention(attended, residual, meta.dp_num_tokens)

    def before_attention(self, x: torch.Tensor, residual: torch.Tensor | None, rotary: Rotary
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v, residual): the norm and the attention's projections, which read no
        metadata (a piece of a piecewise graph)."""
        h, residual = self._norm(x, residual, self.input_layernorm)
        cos, sin = rotary[self.layer_type]
        q, k, v = self.self_attn.project(h, cos, sin)
        return q, k, v, residual

    def after_attention(self, attended: torch.Tensor, residual: torch.Tensor,
                        dp_num_tokens: list[int] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual) from the attention's output before `o_proj`."""
        h = self.self_attn.o_proj(attended)
        h, residual = self._norm(h, residual, self.post_attention_layernorm)
        if self.is_moe:
            return self.mlp(h, dp_num_tokens), residual
        return self.mlp(h), residual

    def _norm(self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed, residual): the residual added first, except in the first layer, whose input
        is the whole residual stream."""
        if residual is None:
            return self.norms.rms_norm(x, norm.weight, norm.eps), x
        return self.norms.add_rms_norm(x, residual, norm.weight, norm.eps)


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    """The contiguous layers of one pipeline stage (stages hold equal numbers)."""
    if num_layers % num_stages:
        raise ValueError(f"num_hidden_layers ({num_layers}) must be divisible by "
                         f"pipeline_parallel_size ({num_stages})")
    per_stage = num_layers // num_stages
    return range(stage * per_stage, (stage + 1) * per_stage)


class EngineModel(nn.Module):
    """The decoder, or this rank's pipeline stage of it: its contiguous layers, the first
    stage also the embedding, the last the final norm and the LM head. Layers keep their
    global index in parameter names (`model.layers.{i}`), so checkpoints load unchanged."""

    def __init__(self, config: TextConfig, backends: ModelBackends,
                 params_dtype: torch.dtype | None = None,
                 quant_config: QuantizationConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.norms = backends.attention
        dtype = params_dtype or torch.get_default_dtype()
        stages = get_pp_group()
        self.is_first_stage, self.is_last_stage = stages.is_first_rank, stages.is_last_rank
        self.layer_indices = stage_layers(config.num_hidden_layers, stages.world_size,
                                          stages.rank_in_group)
        self.model = nn.Module()
        if self.is_first_stage:
            self.model.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, params_dtype=dtype,
                prefix="model.embed_tokens")
        self.model.layers = nn.ModuleDict({
            str(i): EngineDecoderLayer(config, i, backends, dtype, f"model.layers.{i}",
                                       quant_config)
            for i in self.layer_indices})
        if self.is_last_stage:
            self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype,
                                      "model.norm")
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                          params_dtype=dtype, prefix="lm_head")
            if config.tie_word_embeddings and self.is_first_stage:
                self.lm_head.tie_weights(self.model.embed_tokens)
        self._rope = {kind: inverse_frequencies(config.rope_parameters[kind], config.head_dim)
                      for kind in LAYER_TYPES}
        self._rope_on_device: dict[torch.device, dict[str, tuple[torch.Tensor, float]]] = {}
        # Speculative decoding with a drafter: the outputs of these layers (global indices),
        # concatenated per token, go to `context_writer` at the end of each forward (the
        # drafter's context rows; inside the CUDA graphs too).
        self.capture_layers: tuple[int, ...] = ()
        self.context_writer: Callable[[torch.Tensor, BatchMetadata], None] | None = None
        # `--calculate-kv-scales`: the next forward sets every layer's FP8 KV scales.
        self.kv_scales_pending = False
        # Set by `muse.lora.manager.LoRAManager`: each forward tells the adapted layers which
        # adapter slot each token uses.
        self.lora_context = None
        # Called around each of this rank's layers (eager forwards only): the host KV tier
        # lands its loads before a layer, a KV connector may load and save layer by layer.
        self.layer_hooks: list[LayerHooks] = []

    def calculate_kv_scales_on_next_step(self) -> None:
        """The next forward's K/V set the FP8 KV scales of every layer, which stay fixed
        after it. Call it once the dummy runs (memory profile, graph capture) are done; that
        forward must run eagerly, as a captured graph would not compute them."""
        self._set_kv_scale_calculation(True)

    def _set_kv_scale_calculation(self, on: bool) -> None:
        self.kv_scales_pending = on
        for layer in self.model.layers.values():
            layer.self_attn.calculate_kv_scales = on

    @property
    def num_kv_heads(self) -> int:
        """K/V heads each layer keeps on this rank (the KV cache's width)."""
        return next(iter(self.model.layers.values())).self_attn.num_kv_heads

    @property
    def layer_types(self) -> list[str]:
        """The attention kind of each layer this rank holds, in order."""
        return [self.config.layer_types[i] for i in self.layer_indices]

    def checkpoint_target(self, name: str) -> str | None:
        """The name a checkpoint tensor loads into on this rank, None when another pipeline
        stage holds it. A tied LM head on a last stage that lacks the embedding loads the
        embedding's table."""
        match = _LAYER_NAME.match(name)
        if match is not None:
            return name if int(match["index"]) in self.layer_indices else None
        if name.startswith("model.embed_tokens."):
            if self.is_first_stage:
                return name
            tied = self.config.tie_word_embeddings and self.is_last_stage
            return "lm_head.weight" if tied else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if self.is_last_stage else None
        return name

    def rotary(self, positions: torch.Tensor) -> Rotary:
        # The frequencies move to the device once: a copy from the host cannot sit inside a
        # captured CUDA graph, and the first (eager) step on a device fills this cache.
        rope = self._rope_on_device.get(positions.device)
        if rope is None:
            rope = {kind: (inv_freq.to(positions.device), scale)
                    for kind, (inv_freq, scale) in self._rope.items()}
            self._rope_on_device[positions.device] = rope
        return {kind: cos_sin(positions, inv_freq, scale)
                for kind, (inv_freq, scale) in rope.items()}

    def forward(self, input_ids: torch.Tensor, meta: BatchMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                inputs_embeds: torch.Tensor | None = None,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states (before the last norm) of the step's tokens, [tokens, hidden].

        A pipeline stage after the first starts from the previous stage's `intermediate`
        (layer output, residual); a stage before the last returns its own pair instead."""
        if intermediate is not None:
            x, residual = intermediate
        else:
            x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        rotary = self.rotary(meta.positions)
        if self.lora_context is not None:
            self.lora_context.indices = None if meta.lora_slots is None \
                else meta.lora_slots[meta.token_request]
        captured = []
        hooks = self.layer_hooks
        for position, ((index, layer), kv_cache) in enumerate(zip(self.model.layers.items(),
                                                                  kv_caches)):
            for hook in hooks:
                hook.before_layer(position)
            x, residual = layer(x, residual, rotary, meta=meta, kv_cache=kv_cache)
            for hook in hooks:
                hook.after_layer(position, kv_cache, meta)
            if int(index) in self.capture_layers:
                captured.append(x + residual)  # the layer's output, as the reference's
        if self.kv_scales_pending:
            self._set_kv_scale_calculation(False)
        if self.context_writer is not None:
            self.context_writer(torch.cat(captured, dim=-1), meta)
        if not self.is_last_stage:
            return x, residual
        if meta.context_parallel is not None:
            # Every rank gets the whole step's hidden states (the logits rows are anywhere).
            return get_pcp_group().all_gather_rows(x + residual, meta.context_parallel.num_tokens)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        norm = self.model.norm
        return self.lm_head(self.norms.rms_norm(hidden, norm.weight, norm.eps)).float()
