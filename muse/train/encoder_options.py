"""The `muse train encoders` options, kept free of torch so the CLI starts fast."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from muse.presets import PRESETS
from muse.train.options import (add_length_arguments, add_machine_arguments,
                                add_optimizer_arguments, add_speech_arguments,
                                validate_common)


@dataclass
class EncoderTrainArgs:
    out: str
    init_from: str | None = None  # the checkpoint whose decoder (and encoders) start the run
    preset: str = "muse-spark-default"
    steps: int | None = None
    time_budget_minutes: float | None = None
    images: int = 64  # per step
    videos: int = 24
    clips: int = 64
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    seed: int = 0
    device: str = "auto"
    num_workers: int | None = None  # None: 0 on CPU, up to 16 on GPU
    log_every: int = 20
    speech_pool: str | None = None
    speech_clips: int = 6000

    def validate(self) -> None:
        validate_common(self)
        if self.log_every < 1:
            raise ValueError(f"--log-every must be at least 1, got {self.log_every}")
        for name in ("images", "videos", "clips", "speech_clips"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got "
                                 f"{getattr(self, name)}")
        if self.images + self.videos + self.clips == 0:
            raise ValueError("--images, --videos and --clips are all 0: nothing to train on")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EncoderTrainArgs(out="")
    parser.add_argument("--out", required=True,
                        help="output folder: a checkpoint (the decoder of --init-from, the "
                             "trained encoders), its speech pool and the training log")
    parser.add_argument("--init-from", default=None,
                        help="start from this checkpoint folder's weights; encoders it lacks "
                             "start fresh (default: seeded random weights)")
    parser.add_argument("--preset", default=defaults.preset, help=f"one of {', '.join(PRESETS)}")
    add_length_arguments(parser)
    parser.add_argument("--images", type=int, default=defaults.images,
                        help="pictures per step")
    parser.add_argument("--videos", type=int, default=defaults.videos, help="clips per step")
    parser.add_argument("--clips", type=int, default=defaults.clips,
                        help="spoken clips per step")
    add_optimizer_arguments(parser, defaults)
    parser.add_argument("--seed", type=int, default=defaults.seed,
                        help="seeds fresh weights, the data stream and a synthesized speech pool")
    add_machine_arguments(parser, defaults)
    parser.add_argument("--log-every", type=int, default=defaults.log_every,
                        help="steps between lines of encoder_log.jsonl")
    add_speech_arguments(parser, defaults)
