"""The `muse train pretrain` options, kept free of torch so the CLI starts fast."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from muse.presets import PRESETS

STATE_FILE = "training_state.pt"


@dataclass
class PretrainArgs:
    out: str
    preset: str = "muse-spark-default"
    steps: int | None = None  # upper bound; None = as many as the time budget allows
    time_budget_minutes: float | None = None
    batch_size: int = 32
    seq_len: int = 1024
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    aux_loss_coef: float = 0.01
    seed: int = 0
    conversation_share: float = 0.7
    python_packages: bool = True  # also installed permissively licensed packages' source
    resume: bool = False
    init_from: str | None = None  # start from this checkpoint's weights (fresh optimizer)
    device: str = "auto"
    num_workers: int | None = None  # None: 0 on CPU, up to 8 on GPU
    log_every: int = 10
    save_every_minutes: float = 2.0

    def validate(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"--preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        if self.steps is None and self.time_budget_minutes is None:
            raise ValueError("give --steps, --time-budget-minutes, or both")
        for name in ("steps", "time_budget_minutes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
        for name in ("batch_size", "seq_len", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.resume and self.init_from:
            raise ValueError("--resume continues a run; --init-from starts a new one: give one")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or self.warmup_steps < 0:
            raise ValueError("--lr must be positive, --min-lr-ratio in [0, 1] and "
                             "--warmup-steps >= 0")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `muse train pretrain` flags (defaults: the shipped model's recipe)."""
    defaults = PretrainArgs(out="")
    parser.add_argument("--out", required=True, help="output folder (a checkpoint + logs)")
    parser.add_argument("--preset", default=defaults.preset, help=f"one of {', '.join(PRESETS)}")
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    parser.add_argument("--time-budget-minutes", type=float, default=None,
                        help="stop (and save) before this much wall time has passed")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate")
    parser.add_argument("--min-lr-ratio", type=float, default=defaults.min_lr_ratio)
    parser.add_argument("--warmup-steps", type=int, default=defaults.warmup_steps)
    parser.add_argument("--weight-decay", type=float, default=defaults.weight_decay)
    parser.add_argument("--grad-clip", type=float, default=defaults.grad_clip)
    parser.add_argument("--aux-loss-coef", type=float, default=defaults.aux_loss_coef,
                        help="weight of the router load-balancing loss")
    parser.add_argument("--seed", type=int, default=defaults.seed,
                        help="seeds the initial weights and the data stream")
    parser.add_argument("--conversation-share", type=float, default=defaults.conversation_share,
                        help="share of each row's tokens given to conversations")
    parser.add_argument("--no-python-packages", dest="python_packages", action="store_false",
                        help="use only the standard library's Python source")
    parser.add_argument("--resume", action="store_true",
                        help=f"continue from {STATE_FILE} in --out")
    parser.add_argument("--init-from", default=None,
                        help="start from this checkpoint folder's weights with a new optimizer "
                             "and schedule (a further stage of training, e.g. on a fresh "
                             "machine without the optimizer state)")
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--num-workers", type=int, default=None,
                        help="data loader processes (default: 0 on CPU, up to 8 on GPU)")
    parser.add_argument("--log-every", type=int, default=defaults.log_every)
    parser.add_argument("--save-every-minutes", type=float, default=defaults.save_every_minutes)
