"""The command-line options latency.py and throughput.py share: declared, checked, resolved."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.roofline import H200_BF16_MATMUL_FLOPS, H200_MEMORY_BANDWIDTH
from benchmarks.shapes import SHAPES
from muse.presets import PRESETS

ENGINES = ("muse", "transformers")


def parse_list(text: str, kind: Callable[[str], Any] = int) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def parse_range(text: str) -> tuple[int, int]:
    """`N` or `LOW:HIGH` (inclusive)."""
    low, _, high = text.partition(":")
    low_n, high_n = int(low), int(high or low)
    if not 1 <= low_n <= high_n:
        raise argparse.ArgumentTypeError(f"{text!r}: want N or LOW:HIGH with 1 <= LOW <= HIGH")
    return low_n, high_n


def add_common_args(parser: argparse.ArgumentParser) -> None:
    add_run_args(parser)
    parser.add_argument("--engines", default="muse,transformers",
                        type=lambda s: parse_list(s, str))
    parser.add_argument("--merge-from", default=None, metavar="JSON",
                        help="an earlier run's --out: its results for engines not run now are "
                             "kept, and the ratios computed against them")
    add_roofline_args(parser)
    muse_group = add_muse_args(parser)
    add_parallel_args(muse_group)
    muse_group.add_argument("--disable-overlap-schedule", action="store_true",
                            help="read each step back before launching the next")
    muse_group.add_argument("--detokenize", action="store_true",
                            help="keep muse's per-step detokenizer (off: ids in, ids out)")
    hf = parser.add_argument_group("transformers")
    hf.add_argument("--hf-attn-implementation", default=None,
                    help="e.g. sdpa, flash_attention_2 (default: transformers' choice)")
    hf.add_argument("--hf-experts-implementation", default=None,
                    help="e.g. grouped_mm, batched_mm, eager (default: transformers' choice)")


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """What every benchmark of a shape takes: the shape, where, in what dtype, the output."""
    parser.add_argument("--shape", default="muse-spark-15b-a2b", choices=sorted(PRESETS),
                        help=f"a preset; the GPU shapes are {', '.join(SHAPES)}")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16",
                                                                "float32"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="JSON file for the results")


def add_roofline_args(parser: argparse.ArgumentParser) -> None:
    roof = parser.add_argument_group("roofline")
    roof.add_argument("--mem-bandwidth", type=float, default=H200_MEMORY_BANDWIDTH,
                      help="bytes/s (default: measured H200 copy bandwidth)")
    roof.add_argument("--matmul-flops", type=float, default=H200_BF16_MATMUL_FLOPS,
                      help="FLOP/s (default: measured H200 dense bf16 matmul)")


def add_muse_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """muse's engine settings a benchmark passes on; returns the group for more."""
    muse_group = parser.add_argument_group("muse")
    muse_group.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                            help="share of GPU memory muse may fill, weights and KV cache")
    muse_group.add_argument("--max-num-batched-tokens", type=int, default=None,
                            help="tokens per engine step (default: the engine's)")
    muse_group.add_argument("--enforce-eager", action="store_true",
                            help="no CUDA graphs (where the engine has them)")
    muse_group.add_argument("--prefill-graph-max-tokens", type=int, default=None,
                            help="longest one-request prefill step replayed from a CUDA "
                                 "graph (default: the engine's; 0: none)")
    muse_group.add_argument("--piecewise-cuda-graph-max-tokens", type=int, default=None,
                            help="longest other step replayed from piecewise CUDA graphs "
                                 "(default: the engine's)")
    return muse_group


def graph_engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """The CUDA-graph settings of `add_muse_args`, as engine arguments (None: the engine's)."""
    return {"prefill_graph_max_tokens": args.prefill_graph_max_tokens,
            "piecewise_cuda_graph_max_tokens": args.piecewise_cuda_graph_max_tokens}


def add_parallel_args(group: argparse._ActionsContainer) -> None:
    """The engine's parallel layout, with vLLM's flags (default: one GPU)."""
    group.add_argument("--tensor-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-parallel-size", type=int, default=1)
    group.add_argument("--data-parallel-size", type=int, default=1)
    group.add_argument("--enable-expert-parallel", action="store_true")


def parallel_engine_args(args: argparse.Namespace) -> dict[str, Any]:
    return {"tensor_parallel_size": args.tensor_parallel_size,
            "pipeline_parallel_size": args.pipeline_parallel_size,
            "data_parallel_size": args.data_parallel_size,
            "enable_expert_parallel": args.enable_expert_parallel}


def num_gpus(args: argparse.Namespace) -> int:
    """The GPUs the layout takes: the rooflines of its runs are that many GPUs'."""
    return args.tensor_parallel_size * args.pipeline_parallel_size * args.data_parallel_size


def check_common_args(args: argparse.Namespace) -> None:
    unknown = set(args.engines) - set(ENGINES)
    if unknown or not args.engines:
        raise SystemExit(f"--engines: choose among {', '.join(ENGINES)}; got {args.engines}")
    if args.device == "cuda" and args.dtype != "bfloat16":
        print(f"note: --dtype {args.dtype} on the GPU; rooflines use its element size")


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu)")
    return torch.device(name)


def torch_dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16,
            "float32": torch.float32}[name]

