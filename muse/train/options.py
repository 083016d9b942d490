"""The `muse train pretrain` options, kept free of torch so the CLI starts fast."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from muse.presets import PRESETS

STATE_FILE = "training_state.pt"


@dataclass
class PretrainArgs:
    out: str
    preset: str = "muse-spark-default"
    # The decoder's sliding-window layers' window; None keeps the preset's.
    sliding_window: int | None = None
    steps: int | None = None  # upper bound; None = as many as the time budget allows
    time_budget_minutes: float | None = None
    # The cosine's length, for a run split over several commands (resumed with --resume):
    # None: --steps, or what the time budget allows at the measured speed.
    schedule_steps: int | None = None
    # None: chosen from the device and its free memory (muse/train/memory.py).
    batch_size: int | None = None  # sequences per optimizer step
    seq_len: int | None = None
    micro_batch_size: int | None = None  # sequences per forward/backward (accumulation)
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    aux_loss_coef: float = 0.01
    # How many times the unseen-tool verdict's tokens (the tool called, or that none fits)
    # count in the loss beside other trained tokens: one token of a long conversation
    # decides it, and with weight 1 it is a few parts in ten thousand of a batch's loss.
    verdict_loss_weight: float = 1.0
    encoder_lr_scale: float = 1.0  # the encoders' learning rate, as a multiple of --lr
    seed: int = 0
    conversation_share: float = 0.7
    # Conversation tasks' weights by name, replacing the defaults of the names given
    # (`muse.train.data.conversations.TASK_NAMES`); None keeps them all.
    task_weights: dict[str, float] | None = None
    python_packages: bool = True  # also installed permissively licensed packages' source
    resume: bool = False
    init_from: str | None = None  # start from this checkpoint's weights (fresh optimizer)
    device: str = "auto"
    num_workers: int | None = None  # None: 0 on CPU, up to 16 on GPU
    log_every: int = 10
    save_every_minutes: float = 2.0
    # Spoken clips for a model with an audio encoder: a saved pool, or this many synthesized.
    speech_pool: str | None = None
    speech_clips: int = 6000
    # torch.compile each decoder layer (the encoders, whose shapes change with every batch's
    # media, stay eager).
    compile: bool = False

    def validate(self) -> None:
        validate_common(self)
        if self.schedule_steps is not None and self.schedule_steps <= 0:
            raise ValueError(f"--schedule-steps must be positive, got {self.schedule_steps}")
        for name in ("batch_size", "seq_len", "micro_batch_size", "log_every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.resume and self.init_from:
            raise ValueError("--resume continues a run; --init-from starts a new one: give one")
        if self.speech_clips < 0:
            raise ValueError(f"--speech-clips must be >= 0, got {self.speech_clips}")
        if self.verdict_loss_weight < 0:
            raise ValueError(f"--verdict-loss-weight must be >= 0, got "
                             f"{self.verdict_loss_weight}")
        if self.encoder_lr_scale <= 0:
            raise ValueError(f"--encoder-lr-scale must be positive, got {self.encoder_lr_scale}")



def parse_task_weights(text: str) -> dict[str, float]:
    """"unseen_tools=0.4,image=0.3" -> {"unseen_tools": 0.4, "image": 0.3}."""
    weights = {}
    for item in text.split(","):
        name, _, value = item.partition("=")
        try:
            weights[name.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected NAME=WEIGHT[,NAME=WEIGHT...], got {text!r}") from None
    return weights


def validate_common(args: Any) -> None:
    """The checks every training command's arguments share: a known preset, a length, and
    an optimizer schedule that makes sense."""
    if args.preset not in PRESETS:
        raise ValueError(f"--preset must be one of {sorted(PRESETS)}, got {args.preset!r}")
    if args.steps is None and args.time_budget_minutes is None:
        raise ValueError("give --steps, --time-budget-minutes, or both")
    for name in ("steps", "time_budget_minutes"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.lr <= 0 or not 0 <= args.min_lr_ratio <= 1 or args.warmup_steps < 0:
        raise ValueError("--lr must be positive, --min-lr-ratio in [0, 1] and "
                         "--warmup-steps >= 0")


def add_length_arguments(parser: argparse.ArgumentParser) -> None:
    """--steps and --time-budget-minutes: how long a training command runs."""
    parser.add_argument("--steps", type=int, default=None,
                        help="stop after this many steps (default: as many as the time budget "
                             "allows)")
    parser.add_argument("--time-budget-minutes", type=float, default=None,
                        help="stop (and save) before this much wall time has passed (default: "
                             "no limit; give this, --steps or both)")


def add_optimizer_arguments(parser: argparse.ArgumentParser, defaults: Any) -> None:
    """The AdamW and learning-rate schedule flags, with `defaults`' values."""
    parser.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate")
    parser.add_argument("--min-lr-ratio", type=float, default=defaults.min_lr_ratio,
                        help="the cosine decays to this fraction of the peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps,
                        help="steps of linear learning-rate warmup")
    parser.add_argument("--weight-decay", type=float, default=defaults.weight_decay,
                        help="AdamW weight decay of matrices (norm gains and biases get none)")
    parser.add_argument("--grad-clip", type=float, default=defaults.grad_clip,
                        help="clip the gradient norm to this")


def add_machine_arguments(parser: argparse.ArgumentParser, defaults: Any) -> None:
    """--device and --num-workers."""
    parser.add_argument("--device", default=defaults.device,
                        help="cpu, cuda, cuda:N, or auto (cuda when available)")
    parser.add_argument("--num-workers", type=int, default=None,
                        help="data loader processes (default: 0 on CPU, up to 16 on GPU)")


def add_speech_arguments(parser: argparse.ArgumentParser, defaults: Any) -> None:
    """Where the spoken clips of a model with an audio encoder come from."""
    parser.add_argument("--speech-pool", default=None,
                        help="a saved pool of spoken clips (muse.train.data.speech) for the "
                             "audio task (default: synthesize --speech-clips with espeak-ng)")
    parser.add_argument("--speech-clips", type=int, default=defaults.speech_clips,
                        help="clips to synthesize for the audio task when no --speech-pool is "
                             "given; 0: no audio task (espeak-ng is then not needed)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `muse train pretrain` flags (defaults: the shipped model's recipe). Flags whose
    default is a value get "(default: VALUE)" from the CLI's help formatter; the others say
    what happens by default in words."""
    defaults = PretrainArgs(out="")
    parser.add_argument("--out", required=True, help="output folder (a checkpoint + logs)")
    parser.add_argument("--preset", default=defaults.preset, help=f"one of {', '.join(PRESETS)}")
    parser.add_argument("--sliding-window", type=int, default=None,
                        help="the window of the decoder's sliding-window layers, in tokens "
                             "(default: the preset's)")
    add_length_arguments(parser)
    parser.add_argument("--schedule-steps", type=int, default=None,
                        help="length of the learning-rate schedule in steps, for a run split "
                             "over several commands: each stops at its time budget and the "
                             "next continues with --resume (default: --steps, or as many as "
                             "the time budget allows)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="sequences per optimizer step (default: 32 on a GPU; on a CPU up "
                             "to 4, as many as fit in half its free memory)")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="sequences per forward and backward pass; gradients of a step's "
                             "micro-batches are accumulated (default: as many as fit in the "
                             "device's free memory)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence (default: 1024, halved until one sequence "
                             "fits in the device's free memory)")
    add_optimizer_arguments(parser, defaults)
    parser.add_argument("--encoder-lr-scale", type=float, default=defaults.encoder_lr_scale,
                        help="the vision and audio encoders' learning rate as a multiple of "
                             "the schedule's")
    parser.add_argument("--aux-loss-coef", type=float, default=defaults.aux_loss_coef,
                        help="weight of the router load-balancing loss")
    parser.add_argument("--verdict-loss-weight", type=float,
                        default=defaults.verdict_loss_weight,
                        help="how many times the tokens of the unseen-tool reasoning's "
                             "verdict (the tool it calls, or that none of the offered fits) "
                             "count in the loss beside other trained tokens")
    parser.add_argument("--seed", type=int, default=defaults.seed,
                        help="seeds the initial weights and the data stream")
    parser.add_argument("--conversation-share", type=float, default=defaults.conversation_share,
                        help="share of each row's tokens given to conversations")
    parser.add_argument("--task-weights", type=parse_task_weights, default=None,
                        help="conversation tasks' weights, e.g. unseen_tools=0.4,image=0.3, "
                             "replacing those of the tasks named: arithmetic, tools, "
                             "instructions, unseen_tools, image, video, audio (default: the "
                             "weights in muse/train/data/conversations.py)")
    parser.add_argument("--no-python-packages", dest="python_packages", action="store_false",
                        help="use only the standard library's Python source, not installed "
                             "permissively licensed packages' too (default: off)")
    parser.add_argument("--resume", action="store_true",
                        help=f"continue from {STATE_FILE} in --out instead of starting a new "
                             f"run (default: off)")
    parser.add_argument("--init-from", default=None,
                        help="start from this checkpoint folder's weights with a new optimizer "
                             "and schedule: a further stage of training, e.g. on a fresh "
                             "machine without the optimizer state (default: seeded random "
                             "weights)")
    add_machine_arguments(parser, defaults)
    parser.add_argument("--log-every", type=int, default=defaults.log_every,
                        help="steps between lines of train_log.jsonl")
    add_speech_arguments(parser, defaults)
    parser.add_argument("--save-every-minutes", type=float, default=defaults.save_every_minutes,
                        help="minutes between saves of the checkpoint and training state")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each decoder layer: its norms, rotary, attention "
                             "masks and experts' elementwise work fused into few kernels (a "
                             "minute or two of compiling first; the encoders stay eager) "
                             "(default: off)")
