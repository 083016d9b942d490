"""The `muse train grpo` options, kept free of torch so the CLI starts fast.

Defaults follow the established GRPO recipes (verl, DAPO, slime): 8 samples per prompt,
clip 0.2 / clip-higher 0.28, token-mean loss, no KL term, truncated importance sampling at 2
against the engine's log-probs; the adapter is Muse Spark's RL recipe (rank 32, alpha 64 on
attention, MLP and expert projections).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from muse.presets import default_model

# Linear modules of the reference decoder a LoRA may adapt, and "experts": the routed
# experts' stacked gate_up_proj / down_proj parameters (PEFT's `target_parameters`).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "pooler", "unpooler", "gate", "experts")
# The router (`gate`) is left out by default: a router update moves tokens between experts,
# a discontinuous change that the engine's and the trainer's routing would have to agree on
# token by token (PEFT's "all-linear" leaves transformers' routers out too).
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj", "pooler", "unpooler", "experts")
METRICS_FILE = "metrics.jsonl"
ADAPTER_DIR = "adapter"
SUMMARY_FILE = "grpo_summary.json"


@dataclass
class GRPOTrainArgs:
    model: str = default_model()
    # What to roll out: a task generator (muse.rl.tasks) or a JSONL file of tasks.
    task: str | None = None  # None: "addition", unless tasks_file is given
    tasks_file: str | None = None
    eval_tasks_file: str | None = None
    reward: str | None = None  # None: each task's own "reward"
    # The batch: prompts per step, G samples per prompt.
    steps: int = 20
    prompts_per_step: int = 8
    group_size: int = 8
    max_tokens: int = 256  # per assistant turn
    max_turns: int = 4  # assistant turns of a tool task
    max_total_tokens: int | None = None  # prompt + response; None: the model's limit
    temperature: float = 1.0
    # The adapter and the optimiser.
    lora_rank: int = 32
    lora_alpha: float = 64.0
    lora_targets: str = ",".join(DEFAULT_LORA_TARGETS)
    lr: float = 1e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    mini_batches: int = 1  # optimizer steps per rollout batch (1: on-policy)
    micro_batch_size: int | None = None  # sequences per forward/backward; None: all at once
    # The loss.
    clip_low: float = 0.2
    clip_high: float = 0.28
    kl_coef: float = 0.0
    scale_by_std: bool = True  # False: Dr.GRPO advantages
    tis_cap: float = 2.0
    dynamic_sampling: bool = False
    max_resample_rounds: int = 3  # extra rollout rounds dynamic sampling may take per step
    # Stop after the step that passes this many minutes (then evaluate and save), so a run on
    # a time-limited machine always ends with its result; None: run every step.
    max_minutes: float | None = None
    # Held-out evaluation (greedy, split="test").
    eval_every: int = 0  # 0: only before the first and after the last step
    eval_tasks: int = 32
    # Before the first and after the last step, also K samples per held-out task at the
    # training temperature: pass@K bounds what sharpening the sampled replies can reach.
    eval_pass_at: int = 0  # 0: off
    # The machine.
    seed: int = 0
    output: str = "grpo-out"
    device: str = "auto"
    dtype: str = "auto"
    init_std: float | None = None  # weight scale of a preset's random weights
    gpu_memory_utilization: float = 0.3  # the engine's share; the trainer uses the rest
    ray: bool = False

    @property
    def targets(self) -> list[str]:
        return [name.strip() for name in self.lora_targets.split(",") if name.strip()]

    def validate(self) -> None:
        if self.task is not None and self.tasks_file is not None:
            raise ValueError("give --task or --tasks-file, not both")
        if self.tasks_file is None and self.task is None:
            self.task = "addition"
        if self.task is not None:
            from muse.rl.tasks import load_tasks

            try:
                load_tasks(self.task, 1)
            except ValueError as error:
                raise ValueError(f"--task: {error}") from None
        for name in ("steps", "prompts_per_step", "group_size", "max_tokens", "max_turns",
                     "lora_rank", "mini_batches", "micro_batch_size", "max_total_tokens",
                     "eval_tasks"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.group_size < 2:
            raise ValueError(f"--group-size must be at least 2 (GRPO compares the samples of a "
                             f"prompt), got {self.group_size}")
        if self.temperature <= 0:
            raise ValueError(f"--temperature must be > 0 (GRPO needs sampled groups), got "
                             f"{self.temperature}")
        if self.lr <= 0 or self.lora_alpha <= 0:
            raise ValueError("--lr and --lora-alpha must be positive")
        if self.weight_decay < 0 or self.grad_clip <= 0:
            raise ValueError("--weight-decay must be >= 0 and --grad-clip positive")
        if not 0 <= self.clip_low < 1 or self.clip_high < 0:
            raise ValueError(f"--clip-low must be in [0, 1) and --clip-high >= 0, got "
                             f"{self.clip_low} and {self.clip_high}")
        if self.kl_coef < 0 or self.tis_cap <= 0:
            raise ValueError("--kl-coef must be >= 0 and --tis-cap positive")
        if self.max_resample_rounds < 0 or self.eval_every < 0 or self.eval_pass_at < 0:
            raise ValueError("--max-resample-rounds, --eval-every and --eval-pass-at must be "
                             ">= 0")
        if self.mini_batches > self.prompts_per_step:
            raise ValueError(f"--mini-batches {self.mini_batches} is more than the "
                             f"{self.prompts_per_step} groups of a step (--prompts-per-step)")
        if not 0 < self.gpu_memory_utilization < 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1), got "
                             f"{self.gpu_memory_utilization}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"--dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        unknown = [name for name in self.targets if name not in LORA_TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"--lora-targets: unknown {unknown or 'empty list'}; choose from "
                             f"{', '.join(LORA_TARGETS)}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `muse train grpo` flags. Flags whose default is a value get "(default: VALUE)"
    from the CLI's help formatter; the others say what happens by default in words."""
    d = GRPOTrainArgs()
    parser.add_argument("--model", default=d.model,
                        help="the base model: a checkpoint folder (quantized ones are trained "
                             "on their weights dequantized) or a preset (seeded random "
                             "weights)")
    data = parser.add_argument_group("tasks")
    data.add_argument("--task", default=None,
                      help="a task generator of muse.rl.tasks: addition, subtraction, "
                           "multiplication (optionally :DIGITS, e.g. multiplication:4), tools, "
                           "unseen_tools, sort (optionally :ITEMS, e.g. sort:6); held-out "
                           "evaluation draws its split=test (default: addition, unless "
                           "--tasks-file)")
    data.add_argument("--tasks-file", default=None,
                      help="a JSONL file of tasks (\"messages\", and what the reward reads: "
                           "\"answer\", \"reward\", ...), cycled in a seeded order; replaces "
                           "--task (default: none)")
    data.add_argument("--eval-tasks-file", default=None,
                      help="held-out tasks for --tasks-file runs (default: none, no "
                           "evaluation)")
    data.add_argument("--reward", default=None,
                      help="the reward of every task: a built-in (arithmetic, tool_call, "
                           "unseen_tool_call) or "
                           "'package.module:function' (default: each task's \"reward\")")
    batch = parser.add_argument_group("rollouts")
    batch.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    batch.add_argument("--max-minutes", type=float, default=None,
                       help="stop after the step that passes this many minutes, then "
                            "evaluate and save the adapter (default: run every step)")
    batch.add_argument("--prompts-per-step", type=int, default=d.prompts_per_step,
                       help="prompts (groups) per step")
    batch.add_argument("--group-size", type=int, default=d.group_size,
                       help="G: samples per prompt")
    batch.add_argument("--max-tokens", type=int, default=d.max_tokens,
                       help="most tokens sampled per assistant turn")
    batch.add_argument("--max-turns", type=int, default=d.max_turns,
                       help="most assistant turns of a tool task")
    batch.add_argument("--max-total-tokens", type=int, default=None,
                       help="most tokens of prompt plus response (default: the model's limit)")
    batch.add_argument("--temperature", type=float, default=d.temperature,
                       help="sampling temperature (the trainer scores tokens at it too)")
    batch.add_argument("--dynamic-sampling", action="store_true",
                       help="drop groups whose rewards are all equal (no signal) and roll out "
                            "more prompts in their place (DAPO) (default: off)")
    batch.add_argument("--max-resample-rounds", type=int, default=d.max_resample_rounds,
                       help="with --dynamic-sampling, extra rollout rounds per step before "
                            "training on the informative groups found")
    adapter = parser.add_argument_group("adapter and optimizer")
    adapter.add_argument("--lora-rank", type=int, default=d.lora_rank, help="LoRA rank r")
    adapter.add_argument("--lora-alpha", type=float, default=d.lora_alpha,
                         help="LoRA alpha (scale alpha / r)")
    adapter.add_argument("--lora-targets", default=d.lora_targets,
                         help=f"comma-separated modules to adapt, of {', '.join(LORA_TARGETS)} "
                              f"(experts: the routed experts' stacked weights; gate: the "
                              f"router)")
    adapter.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate (constant)")
    adapter.add_argument("--weight-decay", type=float, default=d.weight_decay,
                         help="AdamW weight decay of the adapter")
    adapter.add_argument("--grad-clip", type=float, default=d.grad_clip,
                         help="clip the gradient norm to this")
    adapter.add_argument("--mini-batches", type=int, default=d.mini_batches,
                         help="optimizer steps per rollout batch, each on its share of the "
                              "groups (1: one on-policy step)")
    adapter.add_argument("--micro-batch-size", type=int, default=None,
                         help="sequences per forward and backward pass, gradients accumulated "
                              "(default: a process's whole share at once)")
    loss = parser.add_argument_group("loss")
    loss.add_argument("--clip-low", type=float, default=d.clip_low,
                      help="PPO ratio clip below 1")
    loss.add_argument("--clip-high", type=float, default=d.clip_high,
                      help="PPO ratio clip above 1 (DAPO clip-higher)")
    loss.add_argument("--kl-coef", type=float, default=d.kl_coef,
                      help="weight of the low_var_kl term against the frozen base (the "
                           "adapter disabled); 0: no KL term")
    std = loss.add_mutually_exclusive_group()
    std.add_argument("--scale-by-std", dest="scale_by_std",
                     action=argparse.BooleanOptionalAction, default=True,
                     help="divide advantages by their group's std (GRPO) (default: on)")
    std.add_argument("--dr-grpo", dest="scale_by_std", action="store_false",
                     help="advantages are rewards minus the group mean only (Dr.GRPO) "
                          "(default: off)")
    loss.add_argument("--tis-cap", type=float, default=d.tis_cap,
                      help="cap of the truncated importance weight trainer / engine per token")
    evaluation = parser.add_argument_group("held-out evaluation")
    evaluation.add_argument("--eval-every", type=int, default=d.eval_every,
                            help="steps between greedy held-out evaluations (0: before the "
                                 "first and after the last step only)")
    evaluation.add_argument("--eval-tasks", type=int, default=d.eval_tasks,
                            help="held-out tasks (split=test) per evaluation")
    evaluation.add_argument("--eval-pass-at", type=int, default=d.eval_pass_at, metavar="K",
                            help="before the first and after the last step, also sample K "
                                 "replies per held-out task at --temperature and record "
                                 "eval_pass_at_k (the share of tasks with a right reply: the "
                                 "greedy accuracy GRPO's sharpening can reach) and "
                                 "eval_sample_mean (0: off)")
    machine = parser.add_argument_group("machine")
    machine.add_argument("--seed", type=int, default=d.seed,
                         help="seeds the tasks, the adapter's initial weights and sampling "
                              "(CPU runs repeat exactly)")
    machine.add_argument("--output", default=d.output,
                         help="output folder: metrics.jsonl, adapter/ (PEFT layout) and a "
                              "summary")
    machine.add_argument("--device", default=d.device,
                         help="cpu, cuda, cuda:N, or auto (cuda when available; under "
                              "torchrun each process takes cuda:LOCAL_RANK)")
    machine.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16"],
                         help="base weights and activations; auto: bfloat16 on a GPU, float32 "
                              "on a CPU (the adapter is kept in float32)")
    machine.add_argument("--init-std", type=float, default=None,
                         help="weight scale of a preset's random weights (default: the "
                              "preset's initializer_range)")
    machine.add_argument("--gpu-memory-utilization", type=float,
                         default=d.gpu_memory_utilization,
                         help="share of the GPU the rollout engine takes (weights and KV "
                              "cache); the trainer uses the rest")
    machine.add_argument("--ray", action="store_true",
                         help="run the trainer and the rollout engine as Ray actors "
                              "(pip install 'muse[ray]') (default: off, both in this process)")
