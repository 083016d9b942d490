"""The `muse eval` settings and flags, kept free of torch so the CLI starts fast."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

# `unseen_tools`, `user_tools`, `natural_tools`, `sorting` and the media sections run only
# when asked for (`--sections unseen_tools`, `--sections vision,video,audio`): not by default.
# `audio` needs espeak-ng.
SECTIONS = ("arithmetic", "tools", "instructions", "python", "unseen_tools", "user_tools",
            "natural_tools", "sorting", "vision", "video", "audio")
DEFAULT_SECTIONS = ("arithmetic", "tools", "instructions", "python")


@dataclass
class EvalSettings:
    num: int = 200  # problems per category (operation x digits, tool requests, instruction
    # kind, sorted list length, media question kind; unseen-tool cases in all)
    seed: int = 1
    sections: tuple[str, ...] = DEFAULT_SECTIONS
    max_tokens: int = 512  # cap on any reply (each also gets a budget from its right answer)
    max_digits: int = 4
    python_files: int = 40
    python_tokens: int = 512
    unigram_chars: int = 4_000_000
    python_packages: bool = True
    # Offer every function as `"strict": true` (the tool sections): calls are then checked
    # against the offered schemas as they are written, as a client asking for it gets.
    strict_tools: bool = False

    def validate(self) -> None:
        unknown = [s for s in self.sections if s not in SECTIONS]
        if unknown:
            raise ValueError(f"--sections must be among {list(SECTIONS)}, got {unknown}")
        for name in ("num", "max_tokens", "max_digits", "python_files", "python_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `muse eval` flags; the CLI's help formatter adds "(default: VALUE)" where the
    default is a value."""
    defaults = EvalSettings()
    parser.add_argument("--num", type=int, default=defaults.num,
                        help="held-out problems per category")
    parser.add_argument("--json", default=None,
                        help="write the results to this JSON file (default: none)")
    parser.add_argument("--seed", type=int, default=defaults.seed,
                        help="chooses which held-out problems are asked")
    parser.add_argument("--sections", default=",".join(DEFAULT_SECTIONS),
                        help=f"comma-separated, among {', '.join(SECTIONS)}")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens,
                        help="cap on any reply, which also gets a budget from its right answer")
    parser.add_argument("--max-digits", type=int, default=defaults.max_digits,
                        help="arithmetic operands of 1 up to this many digits")
    parser.add_argument("--python-files", type=int, default=defaults.python_files,
                        help="held-out Python files of the next-token loss")
    parser.add_argument("--python-tokens", type=int, default=defaults.python_tokens,
                        help="tokens scored from the start of each Python file")
    parser.add_argument("--unigram-chars", type=int, default=defaults.unigram_chars,
                        help="characters of training source counted for the unigram baseline")
    parser.add_argument("--no-python-packages", dest="python_packages", action="store_false",
                        help="use only the standard library's Python source, not installed "
                             "packages' too (default: off)")
    parser.add_argument("--strict-tools", action="store_true",
                        help='offer every function as `"strict": true` in the tools, '
                             "unseen_tools, user_tools and natural_tools sections: each call "
                             "is checked against the offered names and schemas as it is "
                             "written (default: off, the model alone)")
    parser.add_argument("--lora", default=None, metavar="ADAPTER_DIR",
                        help="score the model with this LoRA adapter (a PEFT folder, e.g. "
                             "`muse train grpo`'s) on every reply (default: none)")
    parser.add_argument("--device", default="auto",
                        help="cpu, cuda, cuda:N, or auto (cuda when available)")
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16"],
                        help="auto: the checkpoint's dtype on a GPU, float32 on a CPU")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="the share of the GPU's memory the engine may take, as in "
                             "`muse serve` (lower it to share the GPU with other runs)")
    # As vLLM's and lm-eval's bars: on a terminal; in a log only when asked for.
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bars of the generation on stderr (default: on when "
                             "stderr is a terminal)")
