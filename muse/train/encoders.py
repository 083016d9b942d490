"""`muse train encoders`: the vision and audio encoders trained alone, on labels the
generated data carries, before the decoder learns to read them.

A fresh encoder trained only through a decoder's next-token loss learns slowly: each
picture gives a few answer tokens of signal, and early on the decoder ignores what the
encoder writes. Here every encoder output token gets a label of its own
(`muse.train.data.encoder_labels`): linear heads on the encoders' outputs, at the decoder's
width, classify what each picture token covers, which way each moving-shape token goes, and
what each clip says. The heads are thrown away; the output folder is a checkpoint of the
whole model (the decoder of `--init-from` unchanged, the trained encoders) for
`muse train pretrain --init-from OUT --speech-pool OUT/speech_pool.npz`, which then trains
them together.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from muse.checkpoint import ASSETS_DIR, save_checkpoint
from muse.multimodal.engine_inputs import has_encoders
from muse.reference.multimodal import MuseSparkForConditionalGeneration
from muse.tokenizer import MuseTokenizer
from muse.train.data.encoder_labels import (DIRECTIONS, IGNORE, MAX_OPERAND, NUM_COLOURS,
                                            NUM_OBJECTS, NUM_SPOKEN_CLASSES, OPERATORS,
                                            EncoderBatches)
from muse.train.data.vision_tasks import BACKGROUND_CLASS
from muse.train.encoder_options import EncoderTrainArgs
from muse.train.pretrain import (build_model, decay_groups, load_initial_weights,
                                 load_or_build_speech_pool, processor_for, resolve_device,
                                 step_loader, training_config)
from muse.train.schedule import learning_rate

logger = logging.getLogger("muse.train")

LOG_FILE = "encoder_log.jsonl"
SUMMARY_FILE = "encoder_summary.json"
SPEECH_POOL_FILE = "speech_pool.npz"
# Seconds kept back from a time budget for saving the checkpoint.
SAVE_RESERVE_S = 15.0


class EncoderHeads(nn.Module):
    """Linear probes on encoder outputs of width `width` (the decoder's hidden size)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.object = nn.Linear(width, NUM_OBJECTS)
        self.colour = nn.Linear(width, NUM_COLOURS)
        self.motion = nn.Linear(width, len(DIRECTIONS))
        self.spoken = nn.Linear(width, NUM_SPOKEN_CLASSES)
        self.first = nn.Linear(width, MAX_OPERAND + 1)
        self.operator = nn.Linear(width, len(OPERATORS))
        self.second = nn.Linear(width, MAX_OPERAND + 1)


@dataclasses.dataclass
class Score:
    """A head's loss (a tensor, for backward) and its accuracy counts."""

    loss: torch.Tensor
    correct: int
    count: int


def _score(logits: torch.Tensor, labels: torch.Tensor, counted: torch.Tensor | None = None
           ) -> Score:
    """Cross-entropy over labelled rows; accuracy over `counted` rows (default: labelled)."""
    loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE)
    counted = labels != IGNORE if counted is None else counted
    correct = (logits.argmax(-1) == labels) & counted
    return Score(loss, int(correct.sum()), int(counted.sum()))


def encoder_scores(model: MuseSparkForConditionalGeneration, heads: EncoderHeads,
                   batch: dict[str, Any], device: torch.device) -> dict[str, Score]:
    """Every head's score on one batch (heads without labels in the batch are left out)."""
    scores: dict[str, Score] = {}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    if batch["vision"]:
        with autocast:
            tokens = torch.cat(model.vision_tower([x.to(device, non_blocking=True)
                                                   for x in batch["vision"]]))
            objects, colours, motion = heads.object(tokens), heads.colour(tokens), \
                heads.motion(tokens)
        labels = batch["object"].to(device)
        # Most tokens are background: its tokens and the objects' weigh the same in the
        # loss, and accuracy counts objects only.
        on_object = labels != BACKGROUND_CLASS
        scores["object"] = _score(objects, labels, on_object)
        scores["object"].loss = sum(F.cross_entropy(objects[part].float(), labels[part])
                                    for part in (on_object, ~on_object) if part.any()) / 2
        scores["colour"] = _score(colours, batch["colour"].to(device))
        motion_labels = batch["motion"].to(device)
        if (motion_labels != IGNORE).any():
            scores["motion"] = _score(motion, motion_labels)
    if batch["audio"]:
        with autocast:
            clips = model.audio_tower([x.to(device, non_blocking=True) for x in batch["audio"]])
            pooled = torch.stack([clip.mean(0) for clip in clips])
            spoken = heads.spoken(pooled)
            operands = [heads.first(pooled), heads.operator(pooled), heads.second(pooled)]
        spoken_labels = batch["spoken"].to(device)
        if (spoken_labels != IGNORE).any():
            scores["spoken"] = _score(spoken, spoken_labels)
        operand_labels = batch["operands"].to(device)
        is_sum = operand_labels[:, 0] != IGNORE
        if is_sum.any():
            parts = [_score(logits, operand_labels[:, i]) for i, logits in enumerate(operands)]
            all_right = torch.stack([logits.argmax(-1) == operand_labels[:, i]
                                     for i, logits in enumerate(operands)]).all(0) & is_sum
            scores["sum"] = Score(sum(part.loss for part in parts), int(all_right.sum()),
                                  int(is_sum.sum()))
    return scores


def _optimizer(modules: list[nn.Module], args: EncoderTrainArgs, device: torch.device
               ) -> torch.optim.AdamW:
    named = [item for module in modules for item in module.named_parameters()]
    return torch.optim.AdamW(decay_groups(named, args.weight_decay), lr=args.lr,
                             betas=(0.9, 0.98), fused=device.type == "cuda")


def train(args: EncoderTrainArgs) -> Path:
    """Train the encoders of `args.preset`; returns the output folder."""
    args.validate()
    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(args.device)
    config = training_config(args.preset, args.init_from)
    if not has_encoders(config):
        raise ValueError(f"preset {args.preset} has no vision or audio encoder to train")
    processor = processor_for(config, args.preset, MuseTokenizer.base())
    pool = load_or_build_speech_pool(config, args.speech_pool, args.speech_clips, args.seed) \
        if args.clips else None
    if pool is not None:
        pool.save(out / SPEECH_POOL_FILE)
    batches = EncoderBatches(processor, args.seed, args.images, args.videos, args.clips, pool)
    data = iter(step_loader(batches, range(args.steps or sys.maxsize), device,
                            args.num_workers))

    torch.manual_seed(args.seed)
    model = build_model(config, args.seed)
    if args.init_from:
        load_initial_weights(model, args.init_from)
    towers = [tower for tower in (model.vision_tower, model.audio_tower) if tower is not None]
    heads = EncoderHeads(config.text_config.hidden_size)
    for module in (*towers, heads):
        module.to(device).train()
    optimizer = _optimizer([*towers, heads], args, device)
    parameters = [param for group in optimizer.param_groups for param in group["params"]]
    budget = None if args.time_budget_minutes is None \
        else args.time_budget_minutes * 60.0 - SAVE_RESERVE_S

    step, train_began = 0, time.monotonic()
    totals: dict[str, list[float]] = {}
    history: list[dict[str, Any]] = []
    with (out / LOG_FILE).open("w") as log:
        while step < (args.steps or sys.maxsize):
            elapsed = time.monotonic() - started
            if budget is not None and step and elapsed + elapsed / step > budget:
                break
            total_steps = args.steps or sys.maxsize
            if budget is not None and step >= args.warmup_steps:
                # Spread the cosine over the steps the budget allows at the speed so far.
                spent = time.monotonic() - train_began
                by_time = round(step * (budget - (train_began - started)) / max(spent, 1e-6))
                total_steps = min(total_steps, max(step + 1, by_time))
            lr = learning_rate(step, args.lr, args.warmup_steps, total_steps, args.min_lr_ratio)
            for group in optimizer.param_groups:
                group["lr"] = lr
            scores = encoder_scores(model, heads, next(data), device)
            loss = sum(score.loss for score in scores.values())
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(parameters, args.grad_clip)
            if torch.isfinite(grad_norm):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            for name, score in scores.items():
                entry = totals.setdefault(name, [0.0, 0, 0, 0])
                entry[0] += float(score.loss.detach())
                entry[1] += 1
                entry[2] += score.correct
                entry[3] += score.count
            if step % args.log_every == 0:
                record = {"step": step, "lr": lr, "grad_norm": float(grad_norm),
                          "elapsed_s": round(time.monotonic() - started, 1)}
                for name, (loss_sum, steps, correct, count) in totals.items():
                    record[f"loss_{name}"] = round(loss_sum / steps, 4)
                    record[f"accuracy_{name}"] = round(correct / max(count, 1), 4)
                log.write(json.dumps(record) + "\n")
                log.flush()
                history.append(record)
                logger.info("step %d %s", step, {k: v for k, v in record.items()
                                                 if k.startswith("accuracy")})
                totals.clear()

    save_checkpoint(model.state_dict(), config, out, dtype=torch.bfloat16,
                    tokenizer_from=ASSETS_DIR)
    processor.save_pretrained(out)
    summary = {"command": sys.argv, "args": dataclasses.asdict(args), "steps": step,
               "elapsed_s": round(time.monotonic() - started, 1),
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "final": history[-1] if history else None}
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return out


def run_from_args(args: argparse.Namespace) -> None:
    fields = {f.name for f in dataclasses.fields(EncoderTrainArgs)}
    out = train(EncoderTrainArgs(**{k: v for k, v in vars(args).items() if k in fields}))
    print(f"model with trained encoders written to {out}")
