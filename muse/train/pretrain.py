"""`muse train pretrain`: train a Muse model from scratch on the local data mixture.

The reference model is trained in float32 master weights under bf16 autocast (on CUDA) with
AdamW, linear warmup + cosine decay, gradient clipping and a router load-balancing loss. The
run is bounded by a step count, a wall-clock budget, or both; with a budget the cosine is
stretched over the number of steps the measured warmup speed says will fit. The output
folder is a loadable checkpoint (bf16 weights, tokenizer, chat template, generation config)
plus train_log.jsonl, loss.png, data_manifest.json, train_summary.json and
training_state.pt (fp32 weights + optimizer, for `--resume`; not part of a shipped model).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

import torch
import torch.nn.functional as F

from muse.checkpoint import ASSETS_DIR, load_config, load_weights, save_checkpoint
from muse.config import MuseSparkConfig, with_overrides
from muse.info import text_parameters
from muse.multimodal.engine_inputs import has_encoders
from muse.multimodal.processor import MuseSparkProcessor, preset_processor_config
from muse.presets import get_preset
from muse.reference.layers import Experts
from muse.reference.model import MuseForCausalLM
from muse.reference.multimodal import (ENCODER_PREFIXES, MediaInput,
                                      MuseSparkForConditionalGeneration)
from muse.tokenizer import MuseTokenizer
from muse.train.data.conversations import conversation_tasks
from muse.train.data.mixture import SOURCES, MixtureConfig, TrainingBatches
from muse.train.data.python_source import PythonCorpus
from muse.train.data.split import TRAIN
from muse.train.memory import plan_batch, trains_all_experts_at_once
from muse.train.options import STATE_FILE, PretrainArgs
from muse.train.plot import plot_losses
from muse.train.router_balance import RouterLoadBalance
from muse.train.schedule import learning_rate

logger = logging.getLogger("muse.train")

LOG_FILE = "train_log.jsonl"
PLOT_FILE = "loss.png"
MANIFEST_FILE = "data_manifest.json"
SUMMARY_FILE = "train_summary.json"
# Steps before timing starts (allocator warm-up, first kernels, data workers filling their
# queues) when estimating step time: the early steps run slower, and a schedule fixed from
# them would end the run well before its budget.
TIMING_SKIP_STEPS = 30
# While a budgeted run is in its first half, the schedule is refitted every so many steps to
# the speed of the latest steps when more steps fit than planned (it is never shortened: the
# budget check ends the run in time anyway).
SCHEDULE_REFIT_STEPS = 100
# Arguments that define the model and the data stream: a resumed run must keep them.
RUN_DEFINING = ("preset", "sliding_window", "batch_size", "seq_len", "lr", "min_lr_ratio",
                "warmup_steps", "weight_decay", "grad_clip", "seed", "conversation_share",
                "task_weights", "aux_loss_coef", "python_packages", "encoder_lr_scale",
                "speech_pool", "speech_clips", "schedule_steps", "verdict_loss_weight")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def build_model(config: MuseSparkConfig, seed: int) -> MuseForCausalLM:
    """Seeded initial weights (with the encoders when the config has them); the output
    projections of the residual branches (attention's o_proj, the MoE unpooler, a dense
    MLP's down_proj) are scaled by 1/sqrt(2 * layers) so the residual stream's variance does
    not grow with depth. Few experts run all at once (`trains_all_experts_at_once`)."""
    model = MuseSparkForConditionalGeneration(config) if has_encoders(config) \
        else MuseForCausalLM(config.text_config)
    model.init_weights(seed)
    if trains_all_experts_at_once(config.text_config):
        for module in model.modules():
            if isinstance(module, Experts):
                module.all_experts_at_once = True
    scale = 1.0 / math.sqrt(2 * config.text_config.num_hidden_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.startswith("model.") and name.endswith(
                    ("o_proj.weight", "unpooler.weight", "mlp.down_proj.weight")):
                param.mul_(scale)
    return model


def compile_decoder_layers(model: torch.nn.Module) -> None:
    """torch.compile every decoder layer in place (parameter names unchanged). A layer sees
    the same shapes every step ([rows, seq_len, hidden]), so each compiles once per attention
    kind; the step's many small kernels (norms, rotary, masks, softmax, SwiGLU, the experts'
    sums) become a few fused ones, forward and backward. The router's forward hooks (the
    load-balancing loss) are traced with it."""
    # The routers' load-balancing hooks append to one list, whose length dynamo guards on:
    # each layer compiles its own graph, so the limit must cover the layer count (beyond it,
    # layers would silently run eager).
    layers = len(model.model.layers)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 2 * layers)
    for layer in model.model.layers:
        layer.compile()


def training_config(preset: str, depth_from: str | Path | None) -> MuseSparkConfig:
    """The preset's model, with the decoder's depth (its layer count and kinds) of the
    checkpoint `depth_from` when given: a checkpoint grown by `muse grow` trains as it is,
    and a resumed run keeps the depth it started with."""
    config = get_preset(preset)
    if depth_from is None:
        return config
    text = load_config(depth_from).text_config
    return with_overrides(config, {"num_hidden_layers": text.num_hidden_layers,
                                   "layer_types": list(text.layer_types)})


def load_initial_weights(model: MuseForCausalLM, directory: str) -> None:
    """`--init-from`: every tensor of the checkpoint; a text-only checkpoint may leave the
    encoders at their initial values (a new modality joining a trained decoder)."""
    report = load_weights(model, directory, dtype=torch.float32, strict=False)
    missing = [name for name in report.missing if not name.startswith(ENCODER_PREFIXES)]
    if missing or report.unexpected:
        raise ValueError(f"--init-from {directory} does not fit the model: missing "
                         f"{missing[:5]}, unexpected {report.unexpected[:5]}")
    if report.missing:
        logger.info("encoders not in %s start from their initial weights", directory)


def processor_for(config: MuseSparkConfig, preset: str, tokenizer: MuseTokenizer
                  ) -> MuseSparkProcessor | None:
    """The processor a preset's checkpoints use; None without encoders."""
    if not has_encoders(config):
        return None
    return MuseSparkProcessor(config, preset_processor_config(preset), tokenizer)


def decay_groups(named: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float,
                 **options: Any) -> list[dict[str, Any]]:
    """Optimizer parameter groups: matrices with `weight_decay`, norm gains and biases with
    none (empty groups left out); `options` go in both."""
    decay, keep = [], []
    for name, param in named:
        (keep if "norm" in name or param.ndim < 2 else decay).append(param)
    return [{"params": params, "weight_decay": rate, **options}
            for params, rate in ((decay, weight_decay), (keep, 0.0)) if params]


def build_optimizer(model: torch.nn.Module, args: PretrainArgs, device: torch.device
                    ) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains and biases are left alone); the
    encoders' parameters learn at `encoder_lr_scale` times the schedule's rate (`lr_scale`
    of their groups), so fresh encoders can move faster than a trained decoder."""
    groups = []
    for encoder in (False, True):
        named = [(name, param) for name, param in model.named_parameters()
                 if name.startswith(ENCODER_PREFIXES) == encoder]
        groups += decay_groups(named, args.weight_decay,
                               lr_scale=args.encoder_lr_scale if encoder else 1.0)
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                             fused=device.type == "cuda")


def load_or_build_speech_pool(config: MuseSparkConfig, path: str | None, clips: int,
                              seed: int) -> Any:
    """Spoken clips for the audio task: loaded from `path`, or `clips` synthesized with
    espeak-ng (before any data worker forks). None, and no audio task, without an audio
    encoder or with no clips asked for (`--speech-clips 0`, e.g. where espeak-ng is not
    installed)."""
    if config.audio_config is None or (not path and clips == 0):
        return None
    from muse.train.data.speech import SpeechPool

    if path:
        return SpeechPool.load(path)
    began = time.monotonic()
    pool = SpeechPool.build(seed=seed, size=clips, workers=os.cpu_count() or 1)
    logger.info("speech pool: %d clips in %.1f s", clips, time.monotonic() - began)
    return pool


def step_loader(batches: torch.utils.data.Dataset, steps: range, device: torch.device,
                workers: int | None) -> torch.utils.data.DataLoader:
    """Batches of a dataset whose item `step` is a whole batch, made ahead by `workers`
    forked processes (default: none on a CPU, up to 16 beside a GPU)."""
    if workers is None:
        workers = 0 if device.type == "cpu" else min(16, max(1, (os.cpu_count() or 2) - 2))
    # Workers are forked processes; tokenizers' own thread pool must not be copied into
    # them mid-use.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return torch.utils.data.DataLoader(
        batches, batch_size=None, sampler=steps, num_workers=workers,
        pin_memory=device.type == "cuda", prefetch_factor=4 if workers else None)


class Run:
    """One training process: the model, optimizer, data and bookkeeping of a run."""

    def __init__(self, args: PretrainArgs) -> None:
        self.started = time.monotonic()
        self.out = Path(args.out)
        self.state = self._load_state(args) if args.resume else None
        if self.state is not None:
            saved = self.state["args"]
            for name in RUN_DEFINING:
                # A state saved before an argument existed ran with its default.
                setattr(args, name, saved.get(name, getattr(args, name)))
        args.validate()
        self.out.mkdir(parents=True, exist_ok=True)
        self.args = args
        self.device = resolve_device(args.device)
        self.config = training_config(
            args.preset, self.out if self.state is not None else args.init_from)
        if args.sliding_window is not None:
            self.config = with_overrides(self.config, {"sliding_window": args.sliding_window})
        self._choose_batch()
        self.tokenizer = MuseTokenizer.base()
        self.processor = processor_for(self.config, args.preset, self.tokenizer)
        self.step = self.state["step"] if self.state else 0
        # A step-bounded run knows its length (`--steps` counts from step 0, so resuming
        # with a larger value extends the run); a budgeted one fixes it once it has measured
        # its speed, and keeps that length when resumed; `--schedule-steps` fixes it outright
        # (a run split over several budgeted commands).
        self.total_steps = args.schedule_steps or args.steps
        if args.time_budget_minutes is not None and args.schedule_steps is None:
            saved = self.state["total_steps"] if self.state else None
            self.total_steps = min(saved, args.steps or saved) if saved else None
        self.tokens_seen = self.state["tokens_seen"] if self.state else 0
        self.elapsed_before = self.state["elapsed_s"] if self.state else 0.0
        self.save_seconds = 0.0
        self.skipped_steps = 0  # updates skipped for a non-finite gradient norm
        self.refit_schedule = False  # the schedule came from this process's speed estimate

    def _choose_batch(self) -> None:
        """Fill in what was not given of the batch (a resumed run keeps its batch and
        sequence length, but splits them for the memory of the machine it runs on)."""
        args = self.args
        plan = plan_batch(self.config.text_config, self.device, args.batch_size, args.seq_len,
                          args.micro_batch_size)
        args.batch_size, args.seq_len = plan.batch_size, plan.seq_len
        args.micro_batch_size = plan.micro_batch_size
        logger.info("batch: %s", plan.describe())

    @staticmethod
    def _load_state(args: PretrainArgs) -> dict[str, Any]:
        path = Path(args.out) / STATE_FILE
        if not path.is_file():
            raise FileNotFoundError(f"--resume: no {STATE_FILE} in {args.out}")
        return torch.load(path, map_location="cpu", weights_only=False)

    # ---- budget --------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def budget_seconds(self) -> float | None:
        minutes = self.args.time_budget_minutes
        return None if minutes is None else minutes * 60.0

    def reserve_seconds(self) -> float:
        """Time kept back at the end for the final save: twice the last save's, and never
        less than 2% of the budget (before the first save there is nothing measured)."""
        return max(2.0 * self.save_seconds, 0.02 * (self.budget_seconds() or 0.0))

    def estimate_total_steps(self, step_seconds: float) -> int:
        """The step count the remaining budget allows at the measured speed."""
        limit = self.args.steps or sys.maxsize
        budget = self.budget_seconds()
        if budget is None:
            return limit
        remaining = budget - self.elapsed() - self.reserve_seconds()
        return min(limit, self.step + max(1, int(remaining / step_seconds)))

    # ---- data ----------------------------------------------------------------------------
    def data(self) -> tuple[TrainingBatches, dict[str, Any]]:
        corpus, manifest = PythonCorpus.discover(TRAIN, include_packages=self.args.python_packages)
        mixture = MixtureConfig(seq_len=self.args.seq_len, batch_size=self.args.batch_size,
                                conversation_share=self.args.conversation_share,
                                seed=self.args.seed)
        pool = load_or_build_speech_pool(self.config, self.args.speech_pool,
                                         self.args.speech_clips, self.args.seed)
        tasks = conversation_tasks(vision=self.config.vision_config is not None,
                                   speech_pool=pool, weights=self.args.task_weights)
        batches = TrainingBatches(mixture, self.tokenizer, corpus, tasks, self.processor)
        sources = batches[0]["sources"].reshape(-1)
        counts = torch.bincount(sources.long(), minlength=len(SOURCES)).tolist()
        manifest = {"python_source": manifest, "mixture": dataclasses.asdict(mixture),
                    "task_weights": {task.name: task.weight for task in tasks},
                    "token_share_of_batch_0": {name: count / sources.numel()
                                               for name, count in zip(SOURCES, counts)}}
        (self.out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
        return batches, manifest

    def loader(self, batches: TrainingBatches, last_step: int) -> torch.utils.data.DataLoader:
        return step_loader(batches, range(self.step, last_step), self.device,
                           self.args.num_workers)

    # ---- saving --------------------------------------------------------------------------
    def save(self, model: MuseForCausalLM, optimizer: torch.optim.Optimizer) -> None:
        began = time.monotonic()
        save_checkpoint(model.state_dict(), self.config, self.out, dtype=torch.bfloat16,
                        tokenizer_from=ASSETS_DIR)
        if self.processor is not None:
            self.processor.save_pretrained(self.out)
        state = {"step": self.step, "total_steps": self.total_steps,
                 "tokens_seen": self.tokens_seen,
                 "elapsed_s": self.elapsed_before + self.elapsed(),
                 "args": dataclasses.asdict(self.args), "model": model.state_dict(),
                 "optimizer": optimizer.state_dict()}
        partial = self.out / (STATE_FILE + ".partial")
        torch.save(state, partial)
        os.replace(partial, self.out / STATE_FILE)
        plot_losses(self.out / LOG_FILE, self.out / PLOT_FILE,
                    title=f"{self.config.name}: {self.args.batch_size}x{self.args.seq_len} "
                          f"tokens/step, seed {self.args.seed}")
        self.save_seconds = time.monotonic() - began
        logger.info("step %d: saved %s (%.1f s)", self.step, self.out, self.save_seconds)

    def trim_log(self) -> None:
        """Drop log lines past the resumed step (written after the last save of a crash)."""
        path = self.out / LOG_FILE
        if not path.is_file():
            return
        kept = [line for line in path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= self.step]
        path.write_text("".join(line + "\n" for line in kept))


class IntervalStats:
    """Losses summed on the device between log lines, so logging syncs only once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros(len(SOURCES), device=self.device, dtype=torch.float64)
        self.count = torch.zeros(len(SOURCES), device=self.device, dtype=torch.float64)
        self.aux_sum = torch.zeros((), device=self.device)
        self.steps = 0
        self.started = time.monotonic()

    def add(self, per_token: torch.Tensor, sources: torch.Tensor,
            aux: torch.Tensor | None) -> None:
        index = sources.reshape(-1).long()
        self.loss_sum.index_add_(0, index, per_token.detach().reshape(-1).double())
        self.count.index_add_(0, index, torch.ones_like(index, dtype=torch.float64))
        if aux is not None:
            self.aux_sum += aux.detach()
        self.steps += 1

    def record(self) -> dict[str, Any]:
        sums, counts = self.loss_sum.tolist(), self.count.tolist()
        trained = sum(counts[1:])
        record: dict[str, Any] = {"loss": sum(sums[1:]) / max(trained, 1.0)}
        for name, total, count in zip(SOURCES[1:], sums[1:], counts[1:]):
            record[f"loss_{name}"] = total / count if count else None
        record["aux_loss"] = float(self.aux_sum) / max(self.steps, 1)
        return record

    def seconds(self) -> float:
        return time.monotonic() - self.started


def _media_of_rows(media: list[MediaInput], rows: slice, device: torch.device
                   ) -> list[MediaInput]:
    """The batch's media items in `rows`, renumbered from the slice's start, on `device`."""
    return [MediaInput(item.kind, item.data.to(device, non_blocking=True), item.spans,
                       item.row - rows.start)
            for item in media if rows.start <= item.row < rows.stop]


def accumulate_gradients(model: MuseForCausalLM, balance: RouterLoadBalance,
                         batch: dict[str, Any], micro_batch_size: int,
                         aux_loss_coef: float, device: torch.device,
                         verdict_loss_weight: float = 1.0
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Forward and backward over `batch` in micro-batches of `micro_batch_size` rows.

    Each micro-batch's loss is divided by the whole batch's count of trained tokens, so the
    gradients add up to those of the batch's masked mean loss however it is split (the
    balance loss, being per micro-batch, is weighted by its share of rows). Emphasized tokens
    (the batch's `emphasis` mask) count `verdict_loss_weight` times in the sum, the divisor
    unchanged, so every other token's gradient is what it was. Returns the per-token losses,
    their sources and the balance loss, still on the device."""
    input_ids = batch["input_ids"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    sources = batch["sources"].to(device, non_blocking=True)
    weights = (sources > 0).float()
    trained_tokens = weights.sum().clamp(min=1.0)
    if verdict_loss_weight != 1.0 and "emphasis" in batch:
        emphasis = batch["emphasis"].to(device, non_blocking=True)
        weights = weights + (verdict_loss_weight - 1.0) * (weights * emphasis.float())
    rows = input_ids.shape[0]
    losses, balance_losses = [], []
    for start in range(0, rows, micro_batch_size):
        part = slice(start, start + micro_batch_size)
        media = _media_of_rows(batch.get("media", []), part, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = (model(input_ids[part], media=media) if media
                      else model(input_ids[part])).logits
        per_token = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                    labels[part].reshape(-1), reduction="none")
        loss = (per_token * weights[part].reshape(-1)).sum() / trained_tokens
        aux = balance.loss()
        if aux is not None:
            aux = aux * (input_ids[part].shape[0] / rows)
            loss = loss + aux_loss_coef * aux
            balance_losses.append(aux.detach())
        loss.backward()
        losses.append(per_token.detach())
    aux_total = torch.stack(balance_losses).sum() if balance_losses else None
    return torch.cat(losses), sources, aux_total


def train_step(model: MuseForCausalLM, optimizer: torch.optim.Optimizer,
               balance: RouterLoadBalance, batch: dict[str, torch.Tensor], lr: float,
               args: PretrainArgs, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, bool]:
    """One optimizer step; returns per-token losses, their sources, the balance loss and the
    gradient norm before clipping (still on the device), and whether the step was taken: a
    non-finite gradient norm skips the update, since one NaN would spread to every weight
    (reading the norm costs one sync a step, small beside a step's work)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    per_token, sources, aux = accumulate_gradients(
        model, balance, batch, args.micro_batch_size or args.batch_size, args.aux_loss_coef,
        device, args.verdict_loss_weight)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    taken = bool(torch.isfinite(grad_norm))
    if taken:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return per_token, sources, aux, grad_norm, taken


def train(args: PretrainArgs) -> Path:
    """Run (or resume) pretraining; returns the output folder."""
    run = Run(args)
    args = run.args
    batches, manifest = run.data()
    last_step = args.steps or sys.maxsize
    # Worker processes are forked before the model is built; they make CPU batches only and
    # never touch CUDA, which a forked process cannot use.
    data = iter(run.loader(batches, last_step))

    torch.manual_seed(args.seed)
    model = build_model(run.config, args.seed)
    if run.state is not None:
        model.load_state_dict(run.state["model"])
    elif args.init_from:
        load_initial_weights(model, args.init_from)
        logger.info("initial weights from %s", args.init_from)
    model = model.to(run.device).train()
    if args.compile:
        compile_decoder_layers(model)
    optimizer = build_optimizer(model, args, run.device)
    if run.state is not None:
        optimizer.load_state_dict(run.state["optimizer"])
        run.trim_log()
    elif (run.out / LOG_FILE).exists():
        (run.out / LOG_FILE).unlink()
    balance = RouterLoadBalance(model, run.config.text_config.num_experts_per_tok)
    if run.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    tokens_per_step = args.batch_size * args.seq_len
    parameters = text_parameters(run.config.text_config)
    logger.info("%s: %.1fM parameters (%.1fM active), %s, %d tokens/step, from step %d",
                run.config.name, parameters.total / 1e6, parameters.active / 1e6, run.device,
                tokens_per_step, run.step)

    stats = IntervalStats(run.device)
    timer = StepTimer(run.device)
    last_save = time.monotonic()
    budget = run.budget_seconds()
    step_seconds = None
    with (run.out / LOG_FILE).open("a") as log:
        while run.step < min(last_step, run.total_steps or last_step):
            if budget is not None and \
                    run.elapsed() + (step_seconds or 0.0) + run.reserve_seconds() > budget:
                logger.info("time budget reached at step %d", run.step)
                break
            lr = learning_rate(run.step, args.lr, args.warmup_steps,
                               run.total_steps or last_step, args.min_lr_ratio)
            per_token, sources, aux, grad_norm, taken = train_step(
                model, optimizer, balance, next(data), lr, args, run.device)
            if taken:
                stats.add(per_token, sources, aux)
            else:
                _report_skipped(run, per_token, sources)
            run.step += 1
            run.tokens_seen += tokens_per_step

            step_seconds = timer.tick(run.step)
            # With a time budget the cosine is fixed once, when warmup ends, from the speed
            # measured so far; before that only the (linear) warmup part is in use.
            if run.total_steps is None and step_seconds is not None and \
                    run.step >= args.warmup_steps:
                run.total_steps = run.estimate_total_steps(step_seconds)
                run.refit_schedule = True
                logger.info("step %d: %.3f s/step, schedule set to %d steps", run.step,
                            step_seconds, run.total_steps)
            elif run.refit_schedule and run.step % SCHEDULE_REFIT_STEPS == 0 and \
                    run.step < run.total_steps // 2 and timer.recent_seconds is not None:
                refitted = run.estimate_total_steps(timer.recent_seconds)
                if refitted > run.total_steps:
                    logger.info("step %d: %.3f s/step lately, schedule extended to %d steps",
                                run.step, timer.recent_seconds, refitted)
                    run.total_steps = refitted
            if run.step % args.log_every == 0:
                _log(log, run, stats, lr, grad_norm, tokens_per_step)
            if time.monotonic() - last_save > args.save_every_minutes * 60:
                run.save(model, optimizer)
                last_save = time.monotonic()
        if stats.steps:
            _log(log, run, stats, lr, grad_norm, tokens_per_step)
    balance.remove()
    run.save(model, optimizer)
    _write_summary(run, manifest, parameters)
    return run.out


def _report_skipped(run: Run, per_token: torch.Tensor, sources: torch.Tensor) -> None:
    run.skipped_steps += 1
    bad = sorted({SOURCES[int(s)] for s in sources.reshape(-1)[~per_token.isfinite()].tolist()})
    logger.warning("step %d: non-finite gradient norm, update skipped (%d so far); "
                   "non-finite losses in: %s", run.step + 1, run.skipped_steps,
                   ", ".join(bad) or "none (the backward pass)")


def _log(log: IO[str], run: Run, stats: IntervalStats, lr: float, grad_norm: torch.Tensor,
         tokens_per_step: int) -> None:
    """Append one train_log.jsonl record covering the steps since the last one."""
    record = {"step": run.step, **stats.record(), "lr": lr, "grad_norm": float(grad_norm),
              "tokens_per_s": tokens_per_step * stats.steps / stats.seconds(),
              "tokens_seen": run.tokens_seen, "skipped_steps": run.skipped_steps,
              "elapsed_s": round(run.elapsed_before + run.elapsed(), 2)}
    log.write(json.dumps(record) + "\n")
    log.flush()
    losses = " ".join(f"{key[5:]} {value:.3f}" for key, value in record.items()
                      if key.startswith("loss_") and value is not None)
    logger.info("step %d loss %.4f (%s) lr %.2e %.0f tok/s", run.step, record["loss"], losses,
                lr, record["tokens_per_s"])
    stats.reset()


class StepTimer:
    """Mean seconds per step since warm-up, measured every `every` steps (with a device
    sync, since CUDA work is asynchronous)."""

    def __init__(self, device: torch.device, every: int = 10) -> None:
        self.device = device
        self.every = every
        self.start: tuple[int, float] | None = None
        self.seconds: float | None = None
        # The mean over the last `every` steps, and where that window began.
        self.recent_seconds: float | None = None
        self.last: tuple[int, float] | None = None

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.monotonic()

    def tick(self, step: int) -> float | None:
        """Call after each step; returns the latest estimate (None until there is one)."""
        if self.start is None:
            if step >= TIMING_SKIP_STEPS:
                self.start = (step, self._now())
        elif (step - self.start[0]) % self.every == 0:
            now = self._now()
            self.seconds = (now - self.start[1]) / (step - self.start[0])
            if self.last is not None:
                self.recent_seconds = (now - self.last[1]) / (step - self.last[0])
            self.last = (step, now)
        return self.seconds


def _write_summary(run: Run, manifest: dict[str, Any], parameters: Any) -> None:
    summary = {
        "command": sys.argv,
        "args": dataclasses.asdict(run.args),
        "data_seed": run.args.seed,
        "steps": run.step,
        "scheduled_steps": run.total_steps,
        "tokens_seen": run.tokens_seen,
        "skipped_steps": run.skipped_steps,
        "elapsed_s": round(run.elapsed_before + run.elapsed(), 1),
        "parameters": {"total": parameters.total, "active": parameters.active},
        "device": torch.cuda.get_device_name(run.device) if run.device.type == "cuda"
        else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "python_source_files": manifest["python_source"]["files"],
        "weights_bytes": sum(p.stat().st_size for p in run.out.glob("*.safetensors")),
    }
    (run.out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")


def run_from_args(args: argparse.Namespace) -> None:
    fields = {f.name for f in dataclasses.fields(PretrainArgs)}
    out = train(PretrainArgs(**{k: v for k, v in vars(args).items() if k in fields}))
    print(f"trained model written to {out}")
