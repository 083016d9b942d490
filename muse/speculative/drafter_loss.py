"""Training loss of the block-diffusion drafter.

Every term is a per-slot value averaged with the decay weights `w_k = exp(-(k-1)/gamma)` over
the slots that have a gold token, normalised by the sum of those weights: early slots matter
most, since a draft is only useful up to its first rejection. gamma defaults to B / 2 (4 for
B = 8, the published setting), so the decay keeps its shape when the block size changes.

- cross entropy against the gold tokens (weight 1, or 0.1 for DSpark);
- DSpark: `0.9 * L1(q - p)`, q the drafter's distribution (with the Markov bias of the gold
  previous token) and p the target's;
- confidence head: `1.0 * BCE(c, 1 - TV(q, p))`, the expected acceptance as a soft label;
- candidate selector: `1.0 * ` the K-way cross entropy of the pair scores (gold injected).

A batched forward (several sequences) averages each sequence's slots as above, then weights
the sequences by their share of the blocks: the loss of the batch is the anchor-weighted mean
of the per-sequence losses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from muse.speculative.drafter import IGNORE_INDEX, DrafterTrainOutput
from muse.speculative.drafter_config import DrafterConfig

DSPARK_CE_WEIGHT = 0.1
DSPARK_L1_WEIGHT = 0.9
CONFIDENCE_WEIGHT = 1.0
SELECTOR_WEIGHT = 1.0


@dataclass
class DrafterLoss:
    total: torch.Tensor
    cross_entropy: torch.Tensor
    probability_l1: torch.Tensor | None = None
    confidence_bce: torch.Tensor | None = None
    selector_cross_entropy: torch.Tensor | None = None


def decay_weights(block_size: int, gamma: float | None = None,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """[B - 1] weights `exp(-(k-1)/gamma)` of slots k = 1..B-1; gamma None means B / 2."""
    gamma = block_size / 2 if gamma is None else gamma
    if not gamma > 0:
        raise ValueError(f"gamma must be positive, got {gamma!r}")
    slots = torch.arange(block_size - 1, dtype=torch.float32, device=device)
    return torch.exp(-slots / gamma)


def block_target_logits(sequence_logits: torch.Tensor, anchors: torch.Tensor,
                        block_size: int, sequence_index: torch.Tensor | None = None,
                        lengths: torch.Tensor | None = None) -> torch.Tensor:
    """[A, B-1, V] target logits per block slot, from the target's [L, V] logits of the
    sequence: slot k's distribution p_k is predicted at position a + k - 1. Slots past the
    end repeat the last row; their labels are ignored.

    Batched: sequence_logits [S, L, V] of right-padded sequences, sequence_index [A] the
    sequence of each anchor and lengths [S] the sequences' lengths."""
    positions = anchors[:, None] + torch.arange(block_size - 1, device=anchors.device)
    if sequence_index is None:
        return sequence_logits[positions.clamp(max=sequence_logits.shape[0] - 1)]
    if lengths is None:
        raise ValueError("batched target logits need the sequences' lengths")
    last = (lengths[sequence_index] - 1)[:, None]
    return sequence_logits[sequence_index[:, None], torch.minimum(positions, last)]


def drafter_loss(config: DrafterConfig, output: DrafterTrainOutput,
                 target_logits: torch.Tensor | None = None,
                 gamma: float | None = None) -> DrafterLoss:
    """The loss of one packed (or batched) forward. target_logits [A, B-1, V] (see
    `block_target_logits`) is needed by DSpark and by the confidence head."""
    labels = output.labels
    has_gold = labels != IGNORE_INDEX
    weights = decay_weights(config.block_size, gamma, labels.device)[None] * has_gold
    tiny = torch.finfo(torch.float32).tiny
    if output.sequence_index is None:
        weights = weights / weights.sum().clamp(min=tiny)
    else:
        # Block of sequence s: its weights / W_s (W_s: the weight of s's slots), times
        # n_s / A, n_s the blocks of s: the anchor-weighted mean of per-sequence means.
        index, blocks = output.sequence_index, labels.shape[0]
        zeros = weights.new_zeros(output.num_sequences)
        total = zeros.index_add(0, index, weights.sum(dim=-1))
        count = zeros.index_add(0, index, torch.ones_like(weights[:, 0]))
        weights = weights * (count / (blocks * total.clamp(min=tiny)))[index][:, None]

    def weighted_mean(per_slot: torch.Tensor) -> torch.Tensor:
        # where(), not a product, so values at ignored slots (even inf) cannot leak in.
        return torch.where(has_gold, per_slot * weights, 0.0).sum()

    logits = output.logits.float()
    cross_entropy = weighted_mean(F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
        reduction="none").view_as(labels))
    loss = DrafterLoss(total=cross_entropy, cross_entropy=cross_entropy)
    needs_target = config.method == "dspark" or output.confidence is not None
    if needs_target:
        if target_logits is None:
            raise ValueError("target_logits are needed for the DSpark and confidence terms")
        q = logits.softmax(dim=-1)
        p = target_logits.float().softmax(dim=-1)
        l1 = (q - p).abs().sum(dim=-1)
        if config.method == "dspark":
            loss.probability_l1 = weighted_mean(l1)
            loss.total = DSPARK_CE_WEIGHT * cross_entropy + DSPARK_L1_WEIGHT * loss.probability_l1
        if output.confidence is not None:
            # 1 - TV(q, p) = sum_v min(q, p): the chance a draft from q survives verification.
            accept = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)
            # Outside autocast: binary cross-entropy of probabilities needs float32.
            with torch.autocast(output.confidence.device.type, enabled=False):
                bce = F.binary_cross_entropy(output.confidence.float(), accept,
                                             reduction="none")
            loss.confidence_bce = weighted_mean(bce)
            loss.total = loss.total + CONFIDENCE_WEIGHT * loss.confidence_bce
    if output.selector_scores is not None:
        scores, selector_labels = output.selector_scores.float(), output.selector_labels
        selector_ce = F.cross_entropy(scores.flatten(0, 1), selector_labels.flatten(),
                                      ignore_index=IGNORE_INDEX, reduction="none")
        loss.selector_cross_entropy = weighted_mean(selector_ce.view_as(selector_labels))
        loss.total = loss.total + SELECTOR_WEIGHT * loss.selector_cross_entropy
    return loss

