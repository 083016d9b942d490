"""The block-diffusion drafter in plain PyTorch: DFlash backbone, V2 modules, DSpark heads.

One forward pass proposes a whole block. The block `[anchor, M, ..., M]` (M the mask token)
attends, in every draft layer, to keys/values projected from the target's fused hidden states
of the committed context ("KV injection") and to the whole block (non-causal). The target's
frozen `embed_tokens` and `lm_head` are borrowed, never owned: the state dict holds only the
drafter's own weights.

Two ways to run it:
- `propose`: inference for a batch of requests, each with a `ContextCache` of projected
  context rows that grows by the rows of newly committed tokens; the block's own K/V is never
  cached.
- `forward_batch`: training on a batch of right-padded sequences, all anchors' blocks in one
  pass. Block j of sequence s sees the context rows of s before its anchor and its own rows,
  never another block or sequence: its scores against s's context and against its own B rows
  share one softmax, so the keys of one block row are s's L context rows plus B, not every
  block of the batch. `forward` is the same on one sequence.

Shapes: R requests, A anchors (blocks), B block size, G = B - 1 draft slots, L context rows,
V vocabulary, d hidden size, K target features.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from muse.checkpoint.layout import CheckpointError, format_names
from muse.checkpoint.reader import CheckpointReader
from muse.checkpoint.writer import TensorSpec, dtype_name, write_tensors
from muse.reference.layers import DenseMLP, RMSNorm
from muse.reference.model import init_weights
from muse.rope import apply_rotary, cos_sin, inverse_frequencies
from muse.speculative.drafter_config import DrafterConfig

IGNORE_INDEX = -100
# Callables borrowed from the target: token ids -> embeddings, hidden states -> logits.
Embed = Callable[[torch.Tensor], torch.Tensor]
LMHead = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class ContextCache:
    """One request's context rows in every draft layer: keys normed and rotated, values."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: torch.Tensor

    @property
    def num_rows(self) -> int:
        return self.positions.shape[0]


@dataclass
class DraftProposal:
    tokens: torch.Tensor
    """[R, G] draft token ids."""
    probs: torch.Tensor | None
    """[R, G, V] float32: q, the exact distribution each draft was drawn from (None when
    drafted greedily without it: q is then one-hot)."""
    confidence: torch.Tensor | None = None
    """[R, G] in (0, 1): the predicted chance each draft is accepted given its prefix."""


@dataclass
class DrafterTrainOutput:
    logits: torch.Tensor
    """[A, G, V] float32 draft logits (with the Markov bias of the gold previous token)."""
    labels: torch.Tensor
    """[A, G] gold tokens x_{a+k}; IGNORE_INDEX past the end of the sequence."""
    confidence: torch.Tensor | None = None
    """[A, G] confidence head outputs given the gold previous tokens."""
    selector_scores: torch.Tensor | None = None
    """[A, G, top_k] pair scores of the candidates (gold injected when missing)."""
    selector_labels: torch.Tensor | None = None
    """[A, G] index of the gold token among the candidates; IGNORE_INDEX where no gold."""
    sequence_index: torch.Tensor | None = None
    """[A] the sequence of each block (batched forward); the loss averages each sequence's
    blocks, then weights the sequences by their anchor counts. None: one sequence."""
    num_sequences: int = 1


@dataclass
class BlockLayout:
    """The N blocks of a batched training forward over S sequences, and where each sits in
    the padded [S, A] grid the attention runs on (A: the most blocks of one sequence; the
    grid's unused slots hold dummy blocks whose outputs are dropped). All on one device."""

    anchors: torch.Tensor
    """[N] anchor positions, in the caller's order (the order of the outputs)."""
    sequence_index: torch.Tensor
    """[N] the sequence of each anchor."""
    lengths: torch.Tensor
    """[S] sequence lengths."""
    slots: int
    """A, the most blocks of one sequence."""
    grid_index: torch.Tensor
    """[N] the grid row s * A + j of each block."""
    grid_anchors: torch.Tensor
    """[S, A] the anchor of each grid slot (0 where unused)."""

    @property
    def num_sequences(self) -> int:
        return self.lengths.shape[0]

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[0]

    @classmethod
    def build(cls, lengths: Sequence[int] | torch.Tensor, anchors: torch.Tensor,
              sequence_index: torch.Tensor, device: torch.device | str | None = None
              ) -> BlockLayout:
        """From flat anchors [N] and their sequence indices [N] (any order). Worked out where
        `anchors` lives (one sync when that is an accelerator; none from host tensors), then
        moved to `device` without waiting."""
        home = anchors.device
        lengths = torch.as_tensor(lengths, dtype=torch.long, device=home)
        anchors = anchors.to(device=home, dtype=torch.long)
        sequence_index = sequence_index.to(device=home, dtype=torch.long)
        sequences, blocks = lengths.shape[0], anchors.shape[0]
        if blocks == 0 or sequences == 0 or sequence_index.shape != anchors.shape:
            raise ValueError("anchors must be a non-empty set of positions, each with its "
                             "sequence index")
        known = (sequence_index >= 0) & (sequence_index < sequences)
        index = sequence_index.clamp(0, sequences - 1)
        bad = ~known | (anchors < 0) | (anchors >= lengths[index])
        counts = torch.zeros(sequences, dtype=torch.long, device=home).index_add_(
            0, index, torch.ones_like(index))
        slots, invalid = torch.stack([counts.max(), bad.any().long()]).tolist()
        if invalid:
            raise ValueError(f"anchors must be positions in [0, length) of their sequence "
                             f"(lengths {lengths.tolist()}), and sequence indices in "
                             f"[0, {sequences})")
        order = torch.argsort(index, stable=True)
        first = counts.cumsum(0) - counts
        rank = torch.empty_like(index)
        rank[order] = torch.arange(blocks, device=home) - first[index[order]]
        grid_index = index * slots + rank
        grid_anchors = torch.zeros(sequences * slots, dtype=torch.long, device=home)
        grid_anchors[grid_index] = anchors

        def move(tensor: torch.Tensor) -> torch.Tensor:
            return tensor if device is None else tensor.to(device, non_blocking=True)

        return cls(move(anchors), move(index), move(lengths), slots, move(grid_index),
                   move(grid_anchors.view(sequences, slots)))

    @classmethod
    def for_sequences(cls, lengths: Sequence[int], anchors: Sequence[torch.Tensor],
                      device: torch.device | str | None = None) -> BlockLayout:
        """From one anchor tensor per sequence (host tensors: no sync)."""
        counts = torch.tensor([a.numel() for a in anchors], dtype=torch.long)
        flat = torch.cat([a.reshape(-1).to(torch.long) for a in anchors])
        index = torch.repeat_interleave(torch.arange(len(anchors)), counts)
        return cls.build(lengths, flat, index.to(flat.device), device)


class DynamicConv(nn.Module):
    """`out[i, c] = sum_t (base[t, c] + delta[i, t, g(c)]) * x[i - t, c]` inside each block.

    Works on [blocks, B, d], so taps never reach into another block or padding. `delta` comes
    from a linear map of x[i], one value per group of channels. Starts as the identity, so
    adding it to a trained backbone changes nothing until it learns.
    """

    def __init__(self, hidden_size: int, taps: int, group_size: int) -> None:
        super().__init__()
        self.taps, self.group_size = taps, group_size
        self.base = nn.Parameter(torch.empty(taps, hidden_size))
        self.delta_proj = nn.Linear(hidden_size, taps * (hidden_size // group_size), bias=False)
        self.reset_to_identity()

    @torch.no_grad()
    def reset_to_identity(self) -> None:
        self.base.zero_()
        self.base[0].fill_(1.0)
        self.delta_proj.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks, length, _ = x.shape
        delta = self.delta_proj(x).view(blocks, length, self.taps, -1)
        weights = self.base + delta.repeat_interleave(self.group_size, dim=-1)
        out = weights[:, :, 0] * x
        for tap in range(1, min(self.taps, length)):
            shifted = F.pad(x[:, :length - tap], (0, 0, tap, 0))
            out = out + weights[:, :, tap] * shifted
        return out


class DraftAttention(nn.Module):
    """GQA whose queries come from the block and whose keys/values come from the same
    projections applied to the context features and to the block."""

    def __init__(self, config: DrafterConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, kv_width = config.hidden_size, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_width, bias=False)
        self.v_proj = nn.Linear(hidden, kv_width, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """k (normed, rotated) and v of shape x.shape[:-1] + (kv_heads, head_dim)."""
        lead = x.shape[:-1]
        k = self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rotary(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                context_k: torch.Tensor, context_v: torch.Tensor, mask: torch.Tensor
                ) -> torch.Tensor:
        """x: [N, B, d]; context_k/v: [S, Lc, kv_heads, head_dim] for S key sets (S = N: one
        per block, S = 1: shared by all blocks packed as one row of N*B queries); mask:
        [S, N*B/S, Lc + N*B/S], True where a query may attend."""
        blocks, length, _ = x.shape
        sets = context_k.shape[0]
        q = self.q_proj(x).view(blocks, length, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rotary(q, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        q = q.reshape(sets, -1, self.num_heads, self.head_dim)
        k = torch.cat([context_k, k.reshape(sets, -1, self.num_kv_heads, self.head_dim)], dim=1)
        v = torch.cat([context_v, v.reshape(sets, -1, self.num_kv_heads, self.head_dim)], dim=1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None],
            enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(blocks, length, -1))

    def forward_training(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         context_k: torch.Tensor, context_v: torch.Tensor,
                         layout: BlockLayout, mask: torch.Tensor) -> torch.Tensor:
        """x: [N, B, d] blocks of `layout`; context_k/v: [S, Lc, kv_heads, head_dim], the
        sequences' context rows; mask: [S, 1, A, B or 1, Lc + B] (see
        `training_attention_mask`). Each block row's scores against its sequence's context
        and against its own block's rows go through one softmax."""
        blocks, length, _ = x.shape
        sequences, slots = layout.num_sequences, layout.slots
        groups = self.num_heads // self.num_kv_heads
        q = self.q_proj(x).view(blocks, length, self.num_heads, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rotary(q, cos, sin)
        k, v = self.keys_values(x, cos, sin)

        def grid(t: torch.Tensor) -> torch.Tensor:
            """[N, B, h, hd] -> [S, h, A, B, hd], unused slots zero."""
            if t.shape[2] != self.num_heads:
                t = t.repeat_interleave(groups, dim=2)
            t = t.new_zeros(sequences * slots, *t.shape[1:]).index_copy(0, layout.grid_index, t)
            return t.view(sequences, slots, *t.shape[1:]).permute(0, 3, 1, 2, 4)

        def heads(t: torch.Tensor) -> torch.Tensor:
            """[S, Lc, kv_heads, hd] -> [S, heads, Lc, hd]."""
            return t.repeat_interleave(groups, dim=2).transpose(1, 2)

        q, k, v = grid(q), grid(k), grid(v)
        context_k, context_v = heads(context_k), heads(context_v)
        rows = context_k.shape[2]
        to_context = (q.flatten(2, 3) @ context_k.transpose(-1, -2)).view(
            sequences, self.num_heads, slots, length, rows)
        to_block = q @ k.transpose(-1, -2)
        scores = torch.cat([to_context, to_block], dim=-1).float() * self.head_dim ** -0.5
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1).to(v.dtype)
        out = (probs[..., :rows].flatten(2, 3) @ context_v).view_as(q) \
            + probs[..., rows:] @ v
        out = out.permute(0, 2, 3, 1, 4).reshape(sequences * slots, length, -1)
        return self.o_proj(out[layout.grid_index])


class DraftLayer(nn.Module):
    """Pre-norm attention + SwiGLU; with V2, a dynamic convolution on each sublayer's input."""

    def __init__(self, config: DrafterConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_index]
        self.sliding_window = config.layer_window(layer_index)
        d = config.hidden_size
        self.input_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.self_attn = DraftAttention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(d, config.rms_norm_eps)
        self.mlp = DenseMLP(d, config.intermediate_size)
        if config.dynamic_conv:
            self.attn_conv = DynamicConv(d, config.conv_taps, config.conv_group_size)
            self.mlp_conv = DynamicConv(d, config.conv_taps, config.conv_group_size)
        else:
            self.attn_conv = self.mlp_conv = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                context_k: torch.Tensor, context_v: torch.Tensor, mask: torch.Tensor
                ) -> torch.Tensor:
        return self._sublayers(x, lambda h: self.self_attn(h, cos, sin, context_k, context_v,
                                                           mask))

    def forward_training(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         context_k: torch.Tensor, context_v: torch.Tensor,
                         layout: BlockLayout, mask: torch.Tensor) -> torch.Tensor:
        return self._sublayers(x, lambda h: self.self_attn.forward_training(
            h, cos, sin, context_k, context_v, layout, mask))

    def _sublayers(self, x: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]
                   ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.attn_conv is not None:
            h = self.attn_conv(h)
        x = x + attend(h)
        h = self.post_attention_layernorm(x)
        if self.mlp_conv is not None:
            h = self.mlp_conv(h)
        return x + self.mlp(h)


class CandidateSelector(nn.Module):
    """Pair scores over the LM head's top-k: `S(a -> b) = U(b) + <A[a] * (P h), B[b]>`."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.top_k = config.selector_top_k
        self.state_proj = nn.Linear(config.hidden_size, config.selector_rank, bias=False)
        self.codebook_a = nn.Embedding(config.vocab_size, config.selector_rank)
        self.codebook_b = nn.Embedding(config.vocab_size, config.selector_rank)

    def pair_scores(self, unary: torch.Tensor, hidden: torch.Tensor, previous: torch.Tensor,
                    candidates: torch.Tensor) -> torch.Tensor:
        """unary [..., V], hidden [..., d], previous [...], candidates [..., k] -> [..., k]."""
        state = self.codebook_a(previous) * self.state_proj(hidden)
        pair = (self.codebook_b(candidates) * state.unsqueeze(-2)).sum(-1)
        return unary.gather(-1, candidates) + pair.float()


class MarkovHead(nn.Module):
    """Low-rank bias from the previous token: `W2 E1[x]`, or `W2 (sigmoid(G h) * E1[x])` gated,
    which lets the hidden state decide how much the previous token matters."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(config.markov_rank, config.vocab_size, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, config.markov_rank, bias=False) \
            if config.markov_gated else None

    def forward(self, previous_embedding: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is not None:
            previous_embedding = previous_embedding * torch.sigmoid(self.gate_proj(hidden))
        return self.up_proj(previous_embedding).float()


def block_attention_mask(query_positions: torch.Tensor, query_blocks: torch.Tensor,
                         block_starts: torch.Tensor, context_positions: torch.Tensor,
                         context_valid: torch.Tensor, window: int | None) -> torch.Tensor:
    """[S, Q, Lc + Q]: context keys before the query's anchor and inside the window, then the
    queries' own rows as keys, visible within the same block (non-causal) and the window.

    query_positions, query_blocks, block_starts: [S, Q]; context_positions, context_valid:
    [S, Lc].
    """
    query = query_positions[:, :, None]
    context = context_positions[:, None, :]
    to_context = context_valid[:, None, :] & (context < block_starts[:, :, None])
    to_block = query_blocks[:, :, None] == query_blocks[:, None, :]
    if window is not None:
        to_context &= context > query - window
        to_block &= query_positions[:, None, :] > query - window
    return torch.cat([to_context, to_block], dim=-1)


def training_attention_mask(grid_anchors: torch.Tensor, context_length: int, block_size: int,
                            window: int | None) -> torch.Tensor:
    """[S, 1, A, B or 1, Lc + B] for the batched training forward: a block row sees its
    sequence's context rows before the block's anchor (never padding: anchors are inside the
    sequence) and inside the window, then its own block's B rows (non-causal) inside the
    window. grid_anchors: [S, A] (see `BlockLayout`); an unused slot sees only its own rows,
    so no row is empty."""
    device = grid_anchors.device
    context = torch.arange(context_length, device=device)
    offsets = torch.arange(block_size, device=device)
    anchors = grid_anchors[:, :, None, None]
    to_context = context < anchors
    if window is None:
        to_block = torch.ones(1, block_size, dtype=torch.bool, device=device)
    else:
        to_context = to_context & (context > anchors + offsets[:, None] - window)
        to_block = offsets[None, :] > offsets[:, None] - window
    to_block = to_block.expand(*to_context.shape[:3], block_size)
    return torch.cat([to_context, to_block], dim=-1)[:, None]


def _draft_distribution(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """[R, n] float32 probabilities: one-hot argmax where temperature <= 0, else softmax(l/T)."""
    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    sampled = (logits.float() / scale[:, None]).softmax(dim=-1)
    one_hot = F.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()
    return torch.where(greedy[:, None], one_hot, sampled)


class MuseDrafter(nn.Module):
    """The drafter's own weights. Bind the target's embedding and LM head before running."""

    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.fc = nn.Linear(config.num_target_features * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(d, config.rms_norm_eps)
        self.candidate_selector = CandidateSelector(config) \
            if config.candidate_selector else None
        self.previous_token_embedding = nn.Embedding(config.vocab_size, config.markov_rank) \
            if config.uses_previous_token else None
        self.markov_head = MarkovHead(config) if config.markov_bias else None
        self.confidence_head = nn.Linear(d + config.markov_rank, 1) \
            if config.confidence_head else None
        # A tuple is not registered by nn.Module: the target's weights stay out of the
        # drafter's parameters, state dict and optimizer.
        self._target: tuple[Embed, LMHead] | None = None
        self._rope: dict[tuple[torch.device, str], tuple[torch.Tensor, float]] = {}

    def bind_target(self, embed_tokens: Embed, lm_head: LMHead) -> MuseDrafter:
        self._target = (embed_tokens, lm_head)
        return self

    @torch.no_grad()
    def init_weights(self, seed: int, std: float | None = None) -> None:
        init_weights(self, seed, self.config.initializer_range if std is None else std)
        for module in self.modules():
            if isinstance(module, DynamicConv):
                module.reset_to_identity()

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Context features `c = RMSNorm(W_fc [h^{id_1}; ...; h^{id_K}])`: [.., K*d] -> [.., d]."""
        expected = self.config.num_target_features * self.config.hidden_size
        if target_hidden.shape[-1] != expected:
            raise ValueError(f"target_hidden must end in K*d = {expected} features (the "
                             f"target_layer_ids outputs concatenated), got "
                             f"{tuple(target_hidden.shape)}")
        return self.hidden_norm(self.fc(target_hidden.to(self.dtype)))

    def new_cache(self, device: torch.device | str | None = None) -> ContextCache:
        device = device if device is not None else self.fc.weight.device
        empty = torch.empty(0, self.config.num_key_value_heads, self.config.head_dim,
                            dtype=self.dtype, device=device)
        return ContextCache(keys=[empty] * len(self.layers), values=[empty] * len(self.layers),
                            positions=torch.empty(0, dtype=torch.long, device=device))

    @torch.no_grad()
    def append_context(self, caches: Sequence[ContextCache], target_hidden: torch.Tensor,
                       positions: torch.Tensor, num_new_rows: Sequence[int]) -> None:
        """Append the rows of newly committed tokens: target_hidden [N, K*d] and positions [N]
        hold request 0's `num_new_rows[0]` rows first, then request 1's, and so on."""
        if len(caches) != len(num_new_rows) or sum(num_new_rows) != positions.shape[0]:
            raise ValueError(f"num_new_rows {list(num_new_rows)} must give one count per cache "
                             f"({len(caches)}) summing to the {positions.shape[0]} new rows")
        features = self.fuse(target_hidden)
        counts = list(num_new_rows)
        for index, layer in enumerate(self.layers):
            cos, sin = self._rotary(positions, layer.layer_type)
            keys, values = layer.self_attn.keys_values(features, cos, sin)
            for cache, k, v in zip(caches, keys.split(counts), values.split(counts)):
                cache.keys[index] = torch.cat([cache.keys[index], k])
                cache.values[index] = torch.cat([cache.values[index], v])
        for cache, rows in zip(caches, positions.split(counts)):
            cache.positions = torch.cat([cache.positions, rows.to(cache.positions.device)])

    @torch.no_grad()
    def propose(self, target_hidden: torch.Tensor, context_positions: torch.Tensor,
                num_new_rows: Sequence[int], anchor_tokens: torch.Tensor,
                anchor_positions: torch.Tensor, caches: Sequence[ContextCache],
                temperature: float | torch.Tensor = 0.0,
                generator: torch.Generator | None = None) -> DraftProposal:
        """Append each request's new context rows, then draft one block per request.

        anchor_tokens, anchor_positions: [R], the last committed token of each request (its
        target hidden state is not known yet). temperature: a float or [R]; <= 0 drafts greedily
        (q one-hot). The caches are changed in place and never hold the block's K/V.
        """
        self.append_context(caches, target_hidden, context_positions, num_new_rows)
        device = anchor_tokens.device
        requests, longest = anchor_tokens.shape[0], max(cache.num_rows for cache in caches)
        context_valid = torch.zeros(requests, longest, dtype=torch.bool, device=device)
        context_pos = torch.zeros(requests, longest, dtype=torch.long, device=device)
        for r, cache in enumerate(caches):
            context_valid[r, :cache.num_rows] = True
            context_pos[r, :cache.num_rows] = cache.positions
        padded = [(_pad_rows([c.keys[i] for c in caches], longest),
                   _pad_rows([c.values[i] for c in caches], longest))
                  for i in range(len(self.layers))]
        return self.draft_blocks(anchor_tokens, anchor_positions, context_pos, context_valid,
                                 lambda index, layer: padded[index], temperature, generator)

    def draft_blocks(self, anchor_tokens: torch.Tensor, anchor_positions: torch.Tensor,
                     context_positions: torch.Tensor, context_valid: torch.Tensor,
                     context_kv: Callable[[int, DraftLayer], tuple[torch.Tensor, torch.Tensor]],
                     temperature: float | torch.Tensor | None = 0.0,
                     generator: torch.Generator | None = None) -> DraftProposal:
        """One block per request over given context rows: context_positions, context_valid
        [R, Lc]; context_kv(i, layer) gives draft layer i's keys and values [R, Lc, ...].
        temperature None: every draft greedy, without q (`probs` None). Only tensor
        operations of fixed shapes, so a CUDA graph can hold it."""
        device = anchor_tokens.device
        requests, length = anchor_tokens.shape[0], self.config.block_size
        block_ids = torch.full((requests, length), self.config.mask_token_id, device=device)
        block_ids[:, 0] = anchor_tokens
        block_positions = anchor_positions[:, None] + torch.arange(length, device=device)
        hidden = self._run_blocks(
            block_ids, block_positions, query_blocks=torch.zeros_like(block_positions),
            context_positions=context_positions, context_valid=context_valid,
            context_kv=context_kv)
        temperatures = None if temperature is None else torch.as_tensor(
            temperature, dtype=torch.float32, device=device).expand(requests)
        return self._walk(hidden[:, 1:], anchor_tokens, temperatures, generator)

    def forward(self, target_hidden: torch.Tensor, input_ids: torch.Tensor,
                anchors: torch.Tensor) -> DrafterTrainOutput:
        """Training on one sequence: target_hidden [L, K*d] (the target_layer_ids outputs of
        every token), input_ids [L], anchors [A] positions in [0, L). Block j is
        `[x_{a_j}, M, ..., M]` at positions a_j.. and predicts x_{a_j+1..a_j+B-1}.
        `forward_batch` with one sequence."""
        layout = BlockLayout.build([input_ids.shape[0]], anchors, torch.zeros_like(anchors),
                                   input_ids.device)
        return self.forward_batch(target_hidden[None], input_ids[None], layout)

    def forward_batch(self, target_hidden: torch.Tensor, input_ids: torch.Tensor,
                      layout: BlockLayout) -> DrafterTrainOutput:
        """Training on S right-padded sequences at once: target_hidden [S, L, K*d],
        input_ids [S, L] (anything past a sequence's length is never seen), the blocks in
        `layout` (on the same device). Outputs have one row per block, in layout order."""
        sequences, padded = input_ids.shape
        if layout.num_sequences != sequences:
            raise ValueError(f"the layout has {layout.num_sequences} sequences, the batch "
                             f"{sequences}")
        device, size = input_ids.device, self.config.block_size
        anchors, index = layout.anchors, layout.sequence_index
        offsets = torch.arange(size, device=device)
        block_ids = torch.full((layout.num_blocks, size), self.config.mask_token_id,
                               device=device)
        block_ids[:, 0] = input_ids[index, anchors]
        block_positions = anchors[:, None] + offsets
        # Zero the padding so that nothing there (even non-finite) reaches the gradients.
        inside = torch.arange(padded, device=device) < layout.lengths[:, None]
        features = self.fuse(torch.where(inside[..., None], target_hidden, 0))
        context_positions = torch.arange(padded, device=device)
        masks: dict[int | None, torch.Tensor] = {}
        x = self._embed(block_ids)
        for layer in self.layers:
            window = layer.sliding_window
            if window not in masks:
                masks[window] = training_attention_mask(layout.grid_anchors, padded, size,
                                                        window)
            keys, values = layer.self_attn.keys_values(
                features, *self._rotary(context_positions, layer.layer_type))
            x = layer.forward_training(x, *self._rotary(block_positions, layer.layer_type),
                                       keys, values, layout, masks[window])
        # Contiguous: the LM head then runs as one matrix product, not one per block.
        hidden = self.norm(x)[:, 1:].contiguous()

        targets = anchors[:, None] + offsets[1:]
        last = (layout.lengths[index] - 1)[:, None]
        rows = index[:, None]
        labels = torch.where(targets <= last, input_ids[rows, torch.minimum(targets, last)],
                             IGNORE_INDEX)
        previous = input_ids[rows, torch.minimum(targets - 1, last)]
        unary = self._lm_head(hidden)
        output = DrafterTrainOutput(logits=unary, labels=labels, sequence_index=index,
                                    num_sequences=sequences)
        if self.markov_head is not None:
            output.logits = unary + self.markov_head(self.previous_token_embedding(previous),
                                                     hidden)
        if self.confidence_head is not None:
            output.confidence = self._confidence(hidden, previous)
        if self.candidate_selector is not None:
            output.selector_scores, output.selector_labels = self._selector_training(
                unary, hidden, previous, labels)
        return output

    def _rotary(self, positions: torch.Tensor, layer_type: str
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # The frequencies move to the device once: a copy from the host cannot sit inside a
        # captured CUDA graph, and the eager warm-up run before a capture fills this cache.
        key = (positions.device, layer_type)
        if key not in self._rope:
            inv_freq, scale = inverse_frequencies(self.config.rope_parameters[layer_type],
                                                  self.config.head_dim)
            self._rope[key] = (inv_freq.to(positions.device), scale)
        return cos_sin(positions, *self._rope[key])

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self._target is None:
            raise RuntimeError("call bind_target(embed_tokens, lm_head) before running the "
                               "drafter")
        return self._target[0](token_ids).to(self.dtype)

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        lm_head = self._target[1]
        weight = getattr(lm_head, "weight", None)
        if isinstance(weight, torch.Tensor):
            hidden = hidden.to(weight.dtype)
        return lm_head(hidden).float()

    def _run_blocks(self, block_ids: torch.Tensor, block_positions: torch.Tensor,
                    query_blocks: torch.Tensor, context_positions: torch.Tensor,
                    context_valid: torch.Tensor,
                    context_kv: Callable[[int, DraftLayer], tuple[torch.Tensor, torch.Tensor]]
                    ) -> torch.Tensor:
        """Final-normed hidden states [N, B, d] of N blocks. query_blocks [S, Q] says which
        block each query row belongs to; context_kv(i, layer) gives layer i's [S, Lc, ...]."""
        sets = context_positions.shape[0]
        query_positions = block_positions.reshape(sets, -1)
        block_starts = block_positions[:, :1].expand_as(block_positions).reshape(sets, -1)
        masks: dict[int | None, torch.Tensor] = {}
        x = self._embed(block_ids)
        for index, layer in enumerate(self.layers):
            window = layer.sliding_window
            if window not in masks:
                masks[window] = block_attention_mask(query_positions, query_blocks, block_starts,
                                                     context_positions, context_valid, window)
            cos, sin = self._rotary(block_positions, layer.layer_type)
            context_k, context_v = context_kv(index, layer)
            x = layer(x, cos, sin, context_k, context_v, masks[window])
        return self.norm(x)

    def _confidence(self, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        features = torch.cat([hidden, self.previous_token_embedding(previous)], dim=-1)
        return torch.sigmoid(self.confidence_head(features).squeeze(-1).float())

    def _selector_training(self, unary: torch.Tensor, hidden: torch.Tensor,
                           previous: torch.Tensor, labels: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pair scores over the top-k, the gold token replacing the last candidate if absent."""
        candidates = unary.detach().topk(self.candidate_selector.top_k, dim=-1).indices
        has_gold = labels != IGNORE_INDEX
        gold = torch.where(has_gold, labels, 0)
        missing = has_gold & ~(candidates == gold[..., None]).any(dim=-1)
        candidates[..., -1] = torch.where(missing, gold, candidates[..., -1])
        gold_index = (candidates == gold[..., None]).int().argmax(dim=-1)
        scores = self.candidate_selector.pair_scores(unary, hidden, previous, candidates)
        return scores, torch.where(has_gold, gold_index, IGNORE_INDEX)

    def _walk(self, hidden: torch.Tensor, anchor_tokens: torch.Tensor,
              temperature: torch.Tensor | None, generator: torch.Generator | None
              ) -> DraftProposal:
        """Draw the G drafts left to right (the Markov bias and the selector look at the
        previous draft; plain DFlash slots are independent but drawn the same way). Without a
        temperature every draft is the argmax and q (one-hot) is not built."""
        unary = self._lm_head(hidden)
        requests, slots, vocab = unary.shape
        tokens = torch.empty(requests, slots, dtype=torch.long, device=unary.device)
        probs = None if temperature is None else torch.zeros(
            requests, slots, vocab, dtype=torch.float32, device=unary.device)
        previous = anchor_tokens
        for slot in range(slots):
            logits, state = unary[:, slot], hidden[:, slot]
            if self.markov_head is not None:
                logits = logits + self.markov_head(self.previous_token_embedding(previous), state)
            if self.candidate_selector is not None:
                candidates = logits.topk(self.candidate_selector.top_k, dim=-1).indices
                scores = self.candidate_selector.pair_scores(logits, state, previous, candidates)
                if probs is None:
                    choice = scores.argmax(dim=-1)
                else:
                    local = _draft_distribution(scores, temperature)
                    choice = _draw(local, generator)
                    probs[:, slot].scatter_(1, candidates, local)
                token = candidates.gather(1, choice[:, None]).squeeze(1)
            elif probs is None:
                token = logits.argmax(dim=-1)
            else:
                probs[:, slot] = _draft_distribution(logits, temperature)
                token = _draw(probs[:, slot], generator)
            tokens[:, slot] = token
            previous = token
        confidence = None
        if self.confidence_head is not None:
            previous_tokens = torch.cat([anchor_tokens[:, None], tokens[:, :-1]], dim=1)
            confidence = self._confidence(hidden, previous_tokens)
        return DraftProposal(tokens=tokens, probs=probs, confidence=confidence)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index per row of `probs` [R, n], drawn from it: the largest p_i / E_i with E_i
    exponential (exact, and unlike `multinomial` free of host syncs, so graphs can hold it).
    A zero-probability entry scores 0 even where E_i is 0."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return torch.where(probs > 0, probs / noise, 0.0).argmax(dim=-1)


def _pad_rows(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    """Stack per-request [n_r, ...] tensors into [R, length, ...] with zero padding."""
    out = rows[0].new_zeros(len(rows), length, *rows[0].shape[1:])
    for index, tensor in enumerate(rows):
        out[index, :tensor.shape[0]] = tensor
    return out


def save_drafter(model: MuseDrafter, directory: str | Path,
                 dtype: torch.dtype | None = None) -> Path:
    """`config.json` + `model.safetensors` (sharded when large); dtype casts float tensors."""
    state = model.state_dict()

    def stored(tensor: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype

    specs = [TensorSpec(name, tuple(t.shape), stored(t)) for name, t in state.items()]
    write_tensors(directory, specs,
                  lambda spec: state[spec.name].detach().to(device="cpu", dtype=spec.dtype))
    config = dataclasses.replace(model.config, dtype=dtype_name(stored(model.fc.weight)))
    config.save(directory)
    return Path(directory)


def load_drafter(directory: str | Path, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None) -> MuseDrafter:
    """A drafter from its folder; dtype None keeps the stored dtype. Bind the target next."""
    config = DrafterConfig.load(directory)
    dtype = dtype if dtype is not None else getattr(torch, config.dtype)
    with torch.device("meta"):
        model = MuseDrafter(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    with CheckpointReader(directory) as reader:
        names = set(reader.names())
        missing, unexpected = sorted(set(expected) - names), sorted(names - set(expected))
        if missing or unexpected:
            raise CheckpointError(f"drafter checkpoint {directory} does not fit its config: "
                                  f"missing {format_names(missing) or 'none'}; unexpected "
                                  f"{format_names(unexpected) or 'none'}")
        state = {}
        for name, shape in expected.items():
            if reader.shape(name) != shape:
                raise CheckpointError(f"drafter tensor `{name}` has shape {reader.shape(name)}"
                                      f" in {directory}, the config needs {shape}")
            tensor = reader.get(name)
            # A copy: the read tensor is backed by the shard's mapping, closed below.
            state[name] = tensor.to(device=device, copy=True,
                                    dtype=dtype if tensor.is_floating_point() else tensor.dtype)
    model.load_state_dict(state, assign=True)
    return model.eval()
