"""The `muse train drafter` options, kept free of torch so the CLI starts fast.

Defaults are the recipe of the drafter shipped with the default model (hidden size 256, eight
layers): a one-layer DSpark drafter with the target's head shapes, blocks of 8, trained for
a few minutes on one GPU on the target's own answers to 8192 training prompts.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from muse.presets import default_model

METHODS = ("dspark", "dflash")
# The reserved special token the drafter's mask positions carry (see docs/training.md,
# "Drafter"): ids 21..31 are reserved and unused, no training data holds them, so the target
# never writes one; later formats take reserved ids from 21 upward, so the last one is used.
MASK_TOKEN = "<|reserved_31|>"
# The spec's feature count: five target layers, fewer when the target is too shallow.
DEFAULT_TARGET_FEATURES = 5
SUMMARY_FILE = "drafter_summary.json"
LOG_FILE = "train_log.jsonl"


@dataclass
class DrafterTrainArgs:
    target: str = default_model()
    out: str | None = None  # None: TARGET/drafter
    # The drafter.
    method: str = "dspark"
    num_layers: int = 1
    block_size: int = 8
    num_target_features: int | None = None  # None: 5, at most N - 3 (N: target layers)
    num_heads: int | None = None  # None: the target's
    num_kv_heads: int | None = None  # None: the target's
    head_dim: int | None = None  # None: the target's
    intermediate_size: int | None = None  # None: 4 x the target's hidden size
    markov_rank: int = 256
    markov_gated: bool = False
    confidence_head: bool | None = None  # None: on with dspark, off with dflash
    dynamic_conv: bool = False
    candidate_selector: bool = False
    mask_token_id: int | None = None  # None: MASK_TOKEN of the target's tokenizer
    # The data: the target's answers to generated prompts.
    num_prompts: int = 8192
    eval_prompts: int = 256
    max_tokens: int = 512
    temperature: float = 0.0
    # The optimisation.
    max_anchors: int = 512
    batch_size: int = 32  # sequences per optimizer step
    lr: float = 6e-4
    warmup_fraction: float = 0.04
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None  # None: block_size / 2
    steps: int | None = None
    time_budget_minutes: float | None = 4.0
    seed: int = 0
    device: str = "auto"
    log_every: int = 10

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {list(METHODS)}, got {self.method!r}")
        if self.steps is None and self.time_budget_minutes is None:
            raise ValueError("give --steps, --time-budget-minutes, or both")
        for name in ("num_layers", "num_prompts", "eval_prompts", "max_tokens", "max_anchors",
                     "batch_size", "markov_rank", "log_every", "steps", "num_target_features",
                     "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.block_size < 2:
            raise ValueError(f"--block-size must be at least 2, got {self.block_size}")
        if self.time_budget_minutes is not None and self.time_budget_minutes <= 0:
            raise ValueError("--time-budget-minutes must be positive")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1 or \
                not 0 <= self.warmup_fraction < 1:
            raise ValueError("--lr must be positive, --min-lr-ratio in [0, 1] and "
                             "--warmup-fraction in [0, 1)")
        if self.gamma is not None and self.gamma <= 0:
            raise ValueError(f"--gamma must be positive, got {self.gamma}")
        if self.candidate_selector and self.method != "dflash":
            raise ValueError("--candidate-selector needs --method dflash (DSpark's Markov bias "
                             "already orders the block)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `muse train drafter` flags. Flags whose default is a value get "(default: VALUE)"
    from the CLI's help formatter; the others say what happens by default in words."""
    d = DrafterTrainArgs()
    parser.add_argument("--target", default=d.target,
                        help="the target model's checkpoint folder (frozen; it answers the "
                             "training prompts and gives the drafter its features)")
    parser.add_argument("--out", default=None,
                        help="output folder of the drafter (default: TARGET/drafter)")
    model = parser.add_argument_group("drafter")
    model.add_argument("--method", default=d.method, choices=METHODS,
                       help="dspark: Markov bias inside the block, a confidence head, loss "
                            "0.1 CE + 0.9 L1(q - p) + BCE; dflash: the plain block drafter, "
                            "loss CE")
    model.add_argument("--num-layers", type=int, default=d.num_layers, help="draft layers")
    model.add_argument("--block-size", type=int, default=d.block_size,
                       help="B: the anchor plus B - 1 drafted tokens per step")
    model.add_argument("--num-target-features", type=int, default=None,
                       help="K: target layers whose outputs feed the drafter, spread as "
                            "round(1 + i*(N-4)/(K-1)) (default: 5, at most N - 3 for a "
                            "target of N layers)")
    model.add_argument("--num-heads", type=int, default=None,
                       help="query heads of a draft layer (default: the target's)")
    model.add_argument("--num-kv-heads", type=int, default=None,
                       help="key/value heads of a draft layer (default: the target's)")
    model.add_argument("--head-dim", type=int, default=None,
                       help="attention head width (default: the target's)")
    model.add_argument("--intermediate-size", type=int, default=None,
                       help="SwiGLU width of a draft layer (default: 4 x the target's hidden "
                            "size)")
    model.add_argument("--markov-rank", type=int, default=d.markov_rank,
                       help="rank of the DSpark Markov bias and of the previous-token "
                            "embedding")
    model.add_argument("--markov-gated", action="store_true",
                       help="gate the Markov bias with the hidden state (default: off)")
    model.add_argument("--confidence-head", action=argparse.BooleanOptionalAction,
                       default=None,
                       help="train a head predicting each draft's chance of acceptance "
                            "(default: on with dspark, off with dflash)")
    model.add_argument("--dynamic-conv", action="store_true",
                       help="two-tap dynamic convolution around every sublayer (default: off)")
    model.add_argument("--candidate-selector", action="store_true",
                       help="pairwise selector over the LM head's top 16 (dflash only) "
                            "(default: off)")
    model.add_argument("--mask-token-id", type=int, default=None,
                       help=f"token id of the block's mask positions (default: {MASK_TOKEN} "
                            f"of the target's tokenizer, a reserved token it never writes)")
    data = parser.add_argument_group("data")
    data.add_argument("--num-prompts", type=int, default=d.num_prompts,
                      help="training prompts (train split of the default model's tasks), "
                           "answered by the target through the engine")
    data.add_argument("--eval-prompts", type=int, default=d.eval_prompts,
                      help="held-out prompts answered greedily, for the acceptance figures")
    data.add_argument("--max-tokens", type=int, default=d.max_tokens,
                      help="longest answer generated per prompt")
    data.add_argument("--temperature", type=float, default=d.temperature,
                      help="sampling temperature of the training answers (0: greedy)")
    train = parser.add_argument_group("training")
    train.add_argument("--max-anchors", type=int, default=d.max_anchors,
                       help="random anchors (blocks) per sequence, among its answer tokens")
    train.add_argument("--batch-size", type=int, default=d.batch_size,
                       help="sequences per optimizer step (one target forward)")
    train.add_argument("--lr", type=float, default=d.lr, help="peak learning rate")
    train.add_argument("--warmup-fraction", type=float, default=d.warmup_fraction,
                       help="share of the run spent in linear warm-up, before the cosine")
    train.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio,
                       help="the cosine decays to this fraction of the peak learning rate")
    train.add_argument("--weight-decay", type=float, default=d.weight_decay,
                       help="AdamW weight decay of matrices (norm gains and biases get none)")
    train.add_argument("--grad-clip", type=float, default=d.grad_clip,
                       help="clip the gradient norm to this")
    train.add_argument("--gamma", type=float, default=None,
                       help="decay of the per-slot loss weights exp(-(k-1)/gamma) (default: "
                            "block size / 2)")
    train.add_argument("--steps", type=int, default=None,
                       help="stop after this many optimizer steps (default: as many as the "
                            "time budget allows)")
    train.add_argument("--time-budget-minutes", type=float, default=d.time_budget_minutes,
                       help="wall time of the training loop (data generation and the final "
                            "evaluation come on top); with --steps, whichever ends first")
    train.add_argument("--seed", type=int, default=d.seed,
                       help="seeds the prompts, the drafter's initial weights and the anchors")
    train.add_argument("--device", default=d.device,
                       help="cpu, cuda, cuda:N, or auto (cuda when available)")
    train.add_argument("--log-every", type=int, default=d.log_every,
                       help=f"optimizer steps between log lines (and lines of {LOG_FILE})")
