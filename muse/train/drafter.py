"""`muse train drafter`: train the block-diffusion drafter of a target model.

1. Data (`drafter_data.py`): the target answers training prompts of the default model's
   tasks through the engine; held-out prompts are answered greedily for evaluation.
2. Training: the target is frozen (the reference model, eval mode, no gradients). One target
   forward per batch of sequences gives the outputs of `config.target_layer_ids` at every
   position (the drafter fuses them itself) and the target's logits (for DSpark's L1 and the
   confidence head's BCE). Each sequence gets up to `max_anchors` random anchors among its
   answer tokens; all the batch's blocks go through one batched training forward of the
   drafter, one loss and one backward (a few chunks when the batch is larger than a
   budget; small chunks on a CPU). The loss is `drafter_loss` (slot weights
   exp(-(k-1)/gamma), gamma = B/2), the anchor-weighted mean of the sequences' losses. AdamW
   over the drafter's own weights only: its embedding and LM head are the target's, bound,
   not trained. Linear warm-up over the first 4% of the run, then a cosine; the run's length is
   a step count, a wall-clock budget, or both.
3. Evaluation on the held-out answers: the acceptance length greedy verification would give,
   computed offline. Since the answers are the target's greedy outputs, the target's greedy
   continuation after any prefix of an answer is the rest of that answer; a greedy draft
   from anchor a is accepted up to its first token that differs from it. For every anchor
   with a whole block inside the answer, t = accepted drafts (0..B-1); the summary reports
   the mean acceptance length t + 1 (tokens per target forward) and the chance that draft
   position k is accepted.

The output folder holds the drafter (`config.json`, `model.safetensors` in bf16), the
training log and `drafter_summary.json`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import platform
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from muse.chat_format import PAD_ID
from muse.checkpoint import load_config, load_reference_model
from muse.config import TextConfig
from muse.reference.model import MuseForCausalLM
from muse.speculative.drafter import (
    IGNORE_INDEX,
    BlockLayout,
    DrafterTrainOutput,
    MuseDrafter,
    save_drafter,
)
from muse.speculative.drafter_config import DrafterConfig
from muse.speculative.drafter_loss import block_target_logits, drafter_loss
from muse.tokenizer import MuseTokenizer
from muse.train.drafter_data import DrafterData, DrafterExample, build_data
from muse.train.drafter_options import (
    DEFAULT_TARGET_FEATURES,
    LOG_FILE,
    MASK_TOKEN,
    SUMMARY_FILE,
    DrafterTrainArgs,
)
from muse.train.schedule import learning_rate

logger = logging.getLogger("muse.train")

# The schedule runs on the run's progress in [0, 1] (steps done or budget used), resolved
# into this many virtual steps for `learning_rate`.
SCHEDULE_RESOLUTION = 100_000
# Anchors per `propose` call when evaluating drafters whose drafts need the sequential walk.
PROPOSE_CHUNK = 64
LOSS_TERMS = ("loss", "cross_entropy", "probability_l1", "confidence_bce",
              "selector_cross_entropy")
# Bounds on one batched drafter forward: logit elements (the [blocks, B-1, V] logits and the
# loss's softmaxes scale with them) and cells of the padded attention grid (sequences x most
# blocks of one sequence x B x (context rows + B), per head). A batch over either is split
# into chunks of whole sequences, each with its own forward and backward. On an accelerator
# one large forward is best (a batch of 32 answers of ~70 anchors is one chunk); on a CPU,
# tensors over glibc's 32 MiB mmap ceiling are mapped afresh (page faults) at every
# allocation, so chunks stay under it.
CHUNK_LOGITS = 1 << 28
HOST_CHUNK_LOGITS = 1 << 23
CHUNK_ATTENTION_CELLS = 1 << 26


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast(device: torch.device) -> torch.autocast:
    """bf16 autocast on CUDA; float32 elsewhere."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


# ---- the drafter ----------------------------------------------------------------------------
def default_num_features(num_target_layers: int) -> int:
    """Five target layers, or as many as `default_target_layer_ids` can spread (N - 3)."""
    return max(1, min(DEFAULT_TARGET_FEATURES, num_target_layers - 3))


def mask_token_id(target: str | Path, given: int | None = None) -> int:
    """`given`, or the id of MASK_TOKEN in the target's tokenizer."""
    if given is not None:
        return given
    token_id = MuseTokenizer.from_pretrained(target).token_to_id(MASK_TOKEN)
    if token_id is None:
        raise ValueError(f"the target's tokenizer has no {MASK_TOKEN}: give --mask-token-id, "
                         f"a token id the target never writes")
    return token_id


def drafter_config(target: TextConfig, args: DrafterTrainArgs, mask_id: int) -> DrafterConfig:
    """The drafter `args` describe, shaped for `target`."""
    features = args.num_target_features or default_num_features(target.num_hidden_layers)
    confidence = args.method == "dspark" if args.confidence_head is None \
        else args.confidence_head
    overrides: dict[str, Any] = dict(
        method=args.method, num_hidden_layers=args.num_layers, block_size=args.block_size,
        intermediate_size=args.intermediate_size or 4 * target.hidden_size,
        markov_rank=args.markov_rank, markov_gated=args.markov_gated,
        confidence_head=confidence, dynamic_conv=args.dynamic_conv,
        candidate_selector=args.candidate_selector, dtype="bfloat16")
    for field, value in (("num_attention_heads", args.num_heads),
                         ("num_key_value_heads", args.num_kv_heads),
                         ("head_dim", args.head_dim)):
        if value is not None:
            overrides[field] = value
    return DrafterConfig.for_target(target, mask_id, features, **overrides)


def needs_target_logits(config: DrafterConfig) -> bool:
    return config.method == "dspark" or config.confidence_head


# ---- target features -------------------------------------------------------------------------
@dataclass
class TargetBatch:
    """The target's view of a batch of sequences (right-padded to the longest)."""

    input_ids: torch.Tensor
    """[n, Lmax] token ids (PAD_ID past each sequence's end)."""
    lengths: list[int]
    hidden: torch.Tensor
    """[n, Lmax, K*d] outputs of the target_layer_ids layers, concatenated."""
    logits: torch.Tensor | None
    """[n, Lmax, V] the target's logits, when the loss needs them."""


@torch.no_grad()
def target_batch(target: MuseForCausalLM, sequences: Sequence[Sequence[int]],
                 layer_ids: Sequence[int], want_logits: bool, device: torch.device
                 ) -> TargetBatch:
    """One frozen target forward over the sequences."""
    lengths = [len(s) for s in sequences]
    input_ids = torch.full((len(sequences), max(lengths)), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, sequence in enumerate(sequences):
        input_ids[row, :len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        attention_mask[row, :len(sequence)] = 1
    input_ids = input_ids.to(device, non_blocking=True)
    attention_mask = attention_mask.to(device, non_blocking=True)
    with autocast(device):
        out = target(input_ids, attention_mask=attention_mask, hidden_layers=layer_ids)
    hidden = torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1)
    return TargetBatch(input_ids, lengths, hidden, out.logits if want_logits else None)


def sample_anchors(start: int, stop: int, max_anchors: int, generator: torch.Generator
                   ) -> torch.Tensor:
    """Sorted positions in [start, stop): all of them, or `max_anchors` drawn at random."""
    count = stop - start
    if count <= max_anchors:
        return torch.arange(start, max(start, stop))
    picked = torch.randperm(count, generator=generator)[:max_anchors]
    return picked.sort().values + start


def training_anchors(example: DrafterExample, max_anchors: int, generator: torch.Generator
                     ) -> torch.Tensor:
    """Anchors among the answer's tokens whose next token is in the sequence: a is the last
    committed token (the first answer token is the target's own, from the prefill)."""
    return sample_anchors(example.response_start, len(example.input_ids) - 1, max_anchors,
                          generator)


def evaluation_anchors(example: DrafterExample, block_size: int, max_anchors: int,
                       generator: torch.Generator) -> torch.Tensor:
    """Answer positions whose whole block of B - 1 continuations is in the answer."""
    return sample_anchors(example.response_start, len(example.input_ids) - block_size + 1,
                          max_anchors, generator)


def chunk_blocks(config: DrafterConfig, device: torch.device) -> int:
    """The most blocks of one batched forward on `device` (see CHUNK_LOGITS)."""
    budget = CHUNK_LOGITS if device.type != "cpu" else HOST_CHUNK_LOGITS
    return max(1, budget // (config.num_draft_tokens * config.vocab_size))


def chunk_rows(counts: Sequence[int], lengths: Sequence[int], block_size: int,
               max_blocks: int | None = None, max_cells: int | None = None
               ) -> list[list[int]]:
    """The rows with anchors (counts[i] > 0), in chunks of one batched forward each: longest
    first, a chunk grown while its blocks and its padded attention grid stay in budget (a
    row alone always makes a chunk); each chunk's rows in batch order. No block budget by
    default; the cell budget defaults to CHUNK_ATTENTION_CELLS."""
    max_blocks = sum(counts) if max_blocks is None else max_blocks
    max_cells = CHUNK_ATTENTION_CELLS if max_cells is None else max_cells
    order = sorted((i for i, n in enumerate(counts) if n > 0), key=lambda i: -lengths[i])
    chunks: list[list[int]] = []
    blocks = slots = longest = 0
    for row in order:
        grown = (blocks + counts[row], max(slots, counts[row]), max(longest, lengths[row]))
        cells = (len(chunks[-1]) + 1 if chunks else 1) * grown[1] * block_size * \
            (grown[2] + block_size)
        if chunks and (grown[0] > max_blocks or cells > max_cells):
            chunks.append([row])
            blocks, slots, longest = counts[row], counts[row], lengths[row]
        else:
            if not chunks:
                chunks.append([])
            chunks[-1].append(row)
            blocks, slots, longest = grown
    return [sorted(chunk) for chunk in chunks]


@dataclass
class ChunkInputs:
    """One chunk of a target batch, ready for `MuseDrafter.forward_batch`."""

    hidden: torch.Tensor
    """[S, L, K*d] the chunk's target features, right-padded to its longest sequence."""
    input_ids: torch.Tensor
    layout: BlockLayout
    target_logits: torch.Tensor | None
    """[N, B-1, V] the target's logits of every block slot, when the loss needs them."""


def chunk_inputs(batch: TargetBatch, rows: Sequence[int], anchors: Sequence[torch.Tensor],
                 block_size: int, device: torch.device) -> ChunkInputs:
    """The chunk of `rows` of `batch`; anchors: host tensors, one per row of the batch. The
    index tensors are built on the host and copied without waiting for the device."""
    lengths = [batch.lengths[r] for r in rows]
    longest = max(lengths)
    if list(rows) == list(range(batch.input_ids.shape[0])):
        hidden, input_ids = batch.hidden[:, :longest], batch.input_ids[:, :longest]
    else:
        picked = torch.tensor(list(rows)).to(device, non_blocking=True)
        hidden = batch.hidden[picked, :longest]
        input_ids = batch.input_ids[picked, :longest]
    layout = BlockLayout.for_sequences(lengths, [anchors[r] for r in rows], device)
    target_logits = None
    if batch.logits is not None:
        batch_rows = torch.tensor(list(rows)).to(device, non_blocking=True)
        target_logits = block_target_logits(
            batch.logits, layout.anchors, block_size, batch_rows[layout.sequence_index],
            torch.tensor(batch.lengths).to(device, non_blocking=True))
    return ChunkInputs(hidden, input_ids, layout, target_logits)


# ---- acceptance ------------------------------------------------------------------------------
def count_accepted(drafts: torch.Tensor, gold: torch.Tensor) -> torch.Tensor:
    """[A] drafts accepted by greedy verification: the length of the prefix of each row of
    drafts [A, G] that equals the target's greedy continuation gold [A, G]."""
    return (drafts == gold).long().cumprod(dim=-1).sum(dim=-1)


def greedy_drafts(drafter: MuseDrafter, hidden: torch.Tensor, input_ids: torch.Tensor,
                  anchors: torch.Tensor, output: Any = None) -> torch.Tensor:
    """[A, G] greedy drafts from each anchor, with the sequence's committed prefix as context.

    Without a candidate selector, the argmax of the packed forward's logits (given, or
    computed) is exact up to the first draft that differs from the sequence: the Markov
    bias there sees the sequence's previous token, which the walk's draft equals until then,
    and later drafts do not count. A candidate selector ranks candidates by pair scores, so
    its drafts come from the inference walk (`propose`).
    """
    if not drafter.config.candidate_selector:
        if output is None:
            output = drafter(hidden, input_ids, anchors)
        return output.logits.argmax(dim=-1)
    drafts = []
    for chunk in anchors.split(PROPOSE_CHUNK):
        positions = chunk.tolist()
        caches = [drafter.new_cache(hidden.device) for _ in positions]
        context = torch.cat([hidden[:a] for a in positions])
        context_positions = torch.cat([torch.arange(a, device=hidden.device)
                                       for a in positions])
        proposal = drafter.propose(context, context_positions, positions, input_ids[chunk],
                                   chunk.to(hidden.device), caches, temperature=0.0)
        drafts.append(proposal.tokens)
    return torch.cat(drafts)


class AcceptanceCounter:
    """Accepted-draft counts of many blocks, overall and per task."""

    def __init__(self, num_draft_tokens: int) -> None:
        self.slots = num_draft_tokens
        self.counts: dict[str, list[int]] = {}

    def add(self, task: str, accepted: torch.Tensor) -> None:
        histogram = torch.bincount(accepted.cpu(), minlength=self.slots + 1).tolist()
        row = self.counts.setdefault(task, [0] * (self.slots + 1))
        for t, count in enumerate(histogram):
            row[t] += count

    def add_blocks(self, tasks: Sequence[str], counts: Sequence[int],
                   accepted: torch.Tensor) -> None:
        """accepted [sum(counts)]: counts[i] blocks of task tasks[i], in order."""
        accepted = accepted.cpu()
        of_block = torch.repeat_interleave(torch.arange(len(tasks)), torch.tensor(counts))
        for task in sorted(set(tasks)):
            rows = torch.tensor([i for i, t in enumerate(tasks) if t == task])
            self.add(task, accepted[torch.isin(of_block, rows)])

    @staticmethod
    def figures(histogram: Sequence[int]) -> dict[str, Any]:
        blocks = sum(histogram)
        if not blocks:
            return {"blocks": 0}
        # survival[k-1] = P(t >= k): draft k is accepted (all before it were).
        survival = [sum(histogram[k:]) / blocks for k in range(1, len(histogram))]
        previous = [1.0] + survival[:-1]
        return {
            "blocks": blocks,
            "mean_acceptance_length": round(1.0 + sum(survival), 4),
            "mean_accepted_drafts": round(sum(survival), 4),
            "accepted_by_position": [round(s, 4) for s in survival],
            "conditional_acceptance_by_position": [
                round(s / p, 4) if p > 0 else None for s, p in zip(survival, previous)],
            "accepted_histogram": list(histogram),
        }

    def report(self) -> dict[str, Any]:
        total = [sum(row[t] for row in self.counts.values()) for t in range(self.slots + 1)]
        return {**self.figures(total),
                "tasks": {task: self.figures(row) for task, row in sorted(self.counts.items())}}


@torch.no_grad()
def evaluate_acceptance(drafter: MuseDrafter, target: MuseForCausalLM,
                        examples: Sequence[DrafterExample], device: torch.device,
                        max_anchors: int = 512, batch_size: int = 16, seed: int = 0
                        ) -> dict[str, Any]:
    """Offline greedy acceptance of `drafter` on held-out greedy answers of the target.

    Every answer position with a whole block inside the answer is an anchor (at most
    `max_anchors` per answer, drawn with `seed`). Also reports the drafter's held-out loss
    on those blocks. `drafter` may be any module with a `config` and a `forward_batch` that
    maps (target_hidden [S, L, K*d], input_ids [S, L], a `BlockLayout`) to a
    `DrafterTrainOutput`; the blocks of a batch of answers go through it at once."""
    config = drafter.config
    generator = torch.Generator().manual_seed(seed)
    counter = AcceptanceCounter(config.num_draft_tokens)
    loss_sums: dict[str, torch.Tensor] = {}
    weight = 0
    for first in range(0, len(examples), batch_size):
        group = list(examples[first:first + batch_size])
        anchors = [evaluation_anchors(e, config.block_size, max_anchors, generator)
                   for e in group]
        kept = [(e, a) for e, a in zip(group, anchors) if a.numel()]
        if not kept:
            continue
        anchors = [a for _, a in kept]
        batch = target_batch(target, [e.input_ids for e, _ in kept], config.target_layer_ids,
                             needs_target_logits(config), device)
        counts = [a.numel() for a in anchors]
        for rows in chunk_rows(counts, batch.lengths, config.block_size,
                               chunk_blocks(config, device)):
            chunk = chunk_inputs(batch, rows, anchors, config.block_size, device)
            with autocast(device):
                output = drafter.forward_batch(chunk.hidden, chunk.input_ids, chunk.layout)
                loss = drafter_loss(config, output, chunk.target_logits)
                if config.candidate_selector:
                    drafts = torch.cat([greedy_drafts(
                        drafter, chunk.hidden[i, :batch.lengths[r]],
                        chunk.input_ids[i, :batch.lengths[r]], anchors[r].to(device))
                        for i, r in enumerate(rows)])
                else:
                    drafts = output.logits.argmax(dim=-1)
            blocks = chunk.layout.num_blocks
            counter.add_blocks([kept[r][0].task for r in rows], [counts[r] for r in rows],
                               count_accepted(drafts, output.labels))
            for name, value in _loss_terms(loss).items():
                loss_sums[name] = loss_sums.get(name, 0.0) + value.float() * blocks
            weight += blocks
    report = counter.report()
    report["sequences"] = len(examples)
    report["loss"] = {name: round(float(total) / max(weight, 1), 4)
                      for name, total in loss_sums.items()}
    report["definition"] = ("greedy drafts against the target's greedy answers at every anchor "
                            "with a whole block inside the answer; acceptance length = "
                            "accepted drafts + 1 (tokens per target forward)")
    return report


# ---- training --------------------------------------------------------------------------------
def _loss_terms(loss: Any) -> dict[str, torch.Tensor]:
    terms = {"loss": loss.total, "cross_entropy": loss.cross_entropy}
    for name in LOSS_TERMS[2:]:
        value = getattr(loss, name)
        if value is not None:
            terms[name] = value
    return {name: value.detach() for name, value in terms.items()}


def build_optimizer(drafter: MuseDrafter, args: DrafterTrainArgs, device: torch.device
                    ) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains, biases and taps are left alone)."""
    decay, keep = [], []
    for name, param in drafter.named_parameters():
        (keep if "norm" in name or param.ndim < 2 or name.endswith(".base") else decay) \
            .append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": keep, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                             fused=device.type == "cuda")


class Progress:
    """How far the run is, in [0, 1]: steps done of --steps and budget used, the larger."""

    def __init__(self, steps: int | None, budget_minutes: float | None) -> None:
        self.steps = steps
        self.budget = None if budget_minutes is None else budget_minutes * 60.0
        self.started = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def fraction(self, step: int) -> float:
        done = 0.0
        if self.steps is not None:
            done = step / self.steps
        if self.budget is not None:
            done = max(done, self.elapsed() / self.budget)
        return min(done, 1.0)

    def finished(self, step: int, step_seconds: float) -> bool:
        """Whether to stop before step `step` (the next would overrun --steps or the
        budget)."""
        if self.steps is not None and step >= self.steps:
            return True
        return self.budget is not None and self.elapsed() + step_seconds > self.budget


def scheduled_lr(progress: float, args: DrafterTrainArgs) -> float:
    """Linear warm-up over `warmup_fraction` of the run, then a cosine to the floor."""
    return learning_rate(round(progress * SCHEDULE_RESOLUTION), args.lr,
                         round(args.warmup_fraction * SCHEDULE_RESOLUTION),
                         SCHEDULE_RESOLUTION, args.min_lr_ratio)


class IntervalStats:
    """Loss terms and counts summed between log lines (anchor-weighted), on the device."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.anchors = 0
        self.tokens = 0
        self.accepted: torch.Tensor | float = 0.0
        self.full_blocks: torch.Tensor | float = 0.0
        self.steps = 0
        self.started = time.monotonic()

    def add(self, terms: dict[str, torch.Tensor], anchors: int,
            output: DrafterTrainOutput) -> None:
        for name, value in terms.items():
            self.sums[name] = self.sums.get(name, 0.0) + value.float() * anchors
        self.anchors += anchors
        full = (output.labels != IGNORE_INDEX).all(dim=-1)
        accepted = count_accepted(output.logits.detach().argmax(dim=-1), output.labels)
        self.accepted = self.accepted + (accepted * full).sum()
        self.full_blocks = self.full_blocks + full.sum()

    def record(self) -> dict[str, Any]:
        seconds = max(time.monotonic() - self.started, 1e-9)
        record = {name: float(total) / max(self.anchors, 1) for name, total in self.sums.items()}
        full = float(self.full_blocks)
        record["train_acceptance_length"] = 1.0 + float(self.accepted) / full if full else None
        record["blocks_per_s"] = self.anchors / seconds
        record["tokens_per_s"] = self.tokens / seconds
        return record


def train_step(drafter: MuseDrafter, target: MuseForCausalLM, optimizer: torch.optim.Optimizer,
               examples: Sequence[DrafterExample], lr: float, args: DrafterTrainArgs,
               device: torch.device, generator: torch.Generator, stats: IntervalStats
               ) -> torch.Tensor:
    """One optimizer step over a batch of sequences; returns the gradient norm before
    clipping (a device tensor). The batch's blocks go through one batched forward, loss and
    backward (a chunk of sequences each when over the budget, weighted by its share of the
    anchors); nothing here waits for the device."""
    config = drafter.config
    for group in optimizer.param_groups:
        group["lr"] = lr
    anchors = [training_anchors(e, args.max_anchors, generator) for e in examples]
    counts = [a.numel() for a in anchors]
    total_anchors = sum(counts)
    batch = target_batch(target, [e.input_ids for e in examples], config.target_layer_ids,
                         needs_target_logits(config), device)
    for rows in chunk_rows(counts, batch.lengths, config.block_size,
                           chunk_blocks(config, device)):
        chunk = chunk_inputs(batch, rows, anchors, config.block_size, device)
        blocks = chunk.layout.num_blocks
        with autocast(device):
            output = drafter.forward_batch(chunk.hidden, chunk.input_ids, chunk.layout)
            loss = drafter_loss(config, output, chunk.target_logits, args.gamma)
        (loss.total * (blocks / total_anchors)).backward()
        stats.add(_loss_terms(loss), blocks, output)
    stats.tokens += sum(batch.lengths)
    stats.steps += 1
    grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm


def batches(examples: Sequence[DrafterExample], batch_size: int, generator: torch.Generator
            ) -> Iterator[list[DrafterExample]]:
    """Endless batches of `batch_size` (at most len(examples)): each epoch a new shuffle."""
    while True:
        order = torch.randperm(len(examples), generator=generator).tolist()
        for first in range(0, len(order) - batch_size + 1, batch_size):
            yield [examples[i] for i in order[first:first + batch_size]]


def round_to_bf16(module: torch.nn.Module) -> None:
    """Round the weights to the bf16 values the checkpoint stores, so the final evaluation
    measures the saved drafter."""
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(param.to(torch.bfloat16).float())


def train_drafter(args: DrafterTrainArgs, data: DrafterData | None = None) -> Path:
    """The whole run; returns the output folder. `data` skips the generation step."""
    started = time.monotonic()
    args.validate()
    out = Path(args.out) if args.out else Path(args.target) / "drafter"
    args.out = str(out)
    device = resolve_device(args.device)
    target_config = load_config(args.target).text_config
    mask_id = mask_token_id(args.target, args.mask_token_id)
    config = drafter_config(target_config, args, mask_id)
    config.check_target(target_config)
    logger.info("drafter: %s, %d layer(s), block %d, target layers %s, mask token id %d",
                config.method, config.num_hidden_layers, config.block_size,
                config.target_layer_ids, mask_id)

    if data is None:
        data = build_data(args.target, args.num_prompts, args.eval_prompts, args.seed,
                          args.max_tokens, args.temperature, device=str(device),
                          mask_token_id=mask_id)
    data_seconds = time.monotonic() - started
    train_examples = [e for e in data.train if len(e.response_ids) >= 2]
    if not train_examples:
        raise ValueError("no training answer has two tokens or more: nothing to anchor")

    torch.manual_seed(args.seed)
    target = load_reference_model(args.target, dtype=torch.float32, device=device)
    target.requires_grad_(False)
    drafter = MuseDrafter(config)
    drafter.init_weights(args.seed)
    drafter = drafter.to(device).train()
    drafter.bind_target(target.model.embed_tokens, target.lm_head)
    with torch.no_grad():
        # The drafter's last norm feeds the target's LM head: start from the target's gains.
        drafter.norm.weight.copy_(target.model.norm.weight)
    own_parameters = sum(p.numel() for p in drafter.parameters())
    optimizer = build_optimizer(drafter, args, device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    logger.info("drafter: %.2fM parameters of its own, %d training answers, %s",
                own_parameters / 1e6, len(train_examples), device)

    out.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(args.seed)
    stream = batches(train_examples, min(args.batch_size, len(train_examples)), generator)
    progress = Progress(args.steps, args.time_budget_minutes)
    stats = IntervalStats()
    history: list[dict[str, Any]] = []
    step, step_seconds, lr = 0, 0.0, 0.0
    grad_norm = torch.zeros(())
    with (out / LOG_FILE).open("w") as log:
        while not progress.finished(step, step_seconds):
            began = time.monotonic()
            lr = scheduled_lr(progress.fraction(step), args)
            grad_norm = train_step(drafter, target, optimizer, next(stream), lr, args, device,
                                   generator, stats)
            step += 1
            seconds = time.monotonic() - began
            step_seconds = seconds if step == 1 else 0.9 * step_seconds + 0.1 * seconds
            if step % args.log_every == 0:
                history.append(_log(log, step, stats, lr, grad_norm, progress))
        if stats.steps:
            history.append(_log(log, step, stats, lr, grad_norm, progress))
    train_seconds = progress.elapsed()
    logger.info("trained %d steps in %.1f s", step, train_seconds)

    drafter.eval()
    round_to_bf16(drafter)
    save_drafter(drafter, out, dtype=torch.bfloat16)
    eval_started = time.monotonic()
    evaluation = evaluate_acceptance(drafter, target, data.eval, device, args.max_anchors,
                                     seed=args.seed) if data.eval else {}
    eval_seconds = time.monotonic() - eval_started
    if evaluation:
        logger.info("held-out: mean acceptance length %.3f over %d blocks (greedy, B = %d); "
                    "accepted by position %s", evaluation.get("mean_acceptance_length", 0.0),
                    evaluation.get("blocks", 0), config.block_size,
                    evaluation.get("accepted_by_position"))
    summary = {
        "command": sys.argv,
        "args": dataclasses.asdict(args),
        "target": str(args.target),
        "config": config.to_dict(),
        "mask_token": {"id": mask_id, "token": MuseTokenizer.from_pretrained(args.target)
                       .id_to_token(mask_id)},
        "parameters": own_parameters,
        "data": data.stats,
        "steps": step,
        "sequences_seen": step * min(args.batch_size, len(train_examples)),
        "first_log": history[0] if history else None,
        "last_log": history[-1] if history else None,
        "eval": evaluation,
        "seconds": {"data": round(data_seconds, 1), "train": round(train_seconds, 1),
                    "eval": round(eval_seconds, 1),
                    "total": round(time.monotonic() - started, 1)},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "weights_bytes": sum(p.stat().st_size for p in out.glob("*.safetensors")),
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return out


def _log(log: IO[str], step: int, stats: IntervalStats, lr: float, grad_norm: torch.Tensor,
         progress: Progress) -> dict[str, Any]:
    record = {"step": step, **stats.record(), "lr": lr, "grad_norm": float(grad_norm),
              "elapsed_s": round(progress.elapsed(), 2)}
    log.write(json.dumps(record) + "\n")
    log.flush()
    terms = " ".join(f"{name} {record[name]:.4f}" for name in LOSS_TERMS[1:] if name in record)
    accept = record["train_acceptance_length"]
    logger.info("step %d loss %.4f (%s) accept %s lr %.2e grad %.2f %.0f tok/s %.0f blocks/s",
                step, record["loss"], terms, "-" if accept is None else f"{accept:.2f}", lr,
                record["grad_norm"], record["tokens_per_s"], record["blocks_per_s"])
    stats.reset()
    return record


def run_from_args(args: argparse.Namespace) -> None:
    fields = {f.name for f in dataclasses.fields(DrafterTrainArgs)}
    out = train_drafter(DrafterTrainArgs(**{k: v for k, v in vars(args).items()
                                            if k in fields}))
    summary = json.loads((out / SUMMARY_FILE).read_text())
    length = summary["eval"].get("mean_acceptance_length")
    figure = f"; held-out mean acceptance length {length:.3f} (greedy)" if length else ""
    print(f"drafter written to {out}{figure}")
