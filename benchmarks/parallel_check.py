"""Do parallel layouts give the one-GPU engine's greedy output? Token for token, over NCCL on
GPUs (gloo on the CPU), for each layout of `--layouts` that fits in `--num-gpus`.

The one-GPU engine runs first with top-2 logprobs: at each generated token the gap between
its first and second choice. Ranks sum partial products in another order than one GPU does,
so a choice whose gap is below `--min-gap` (a near tie) may flip legitimately; each reply is
compared up to its first near tie (the near tie itself included when it agrees), and any
difference before that fails the layout. Float32 (the default) leaves few near ties; bf16
needs the guard (the engine tests' own gap, 2e-3, suits float32; bf16 wants ~0.1).

    python benchmarks/parallel_check.py --num-gpus 8 --out parallel-check.json
    python benchmarks/parallel_check.py --shape muse-spark-tiny --device cpu --layouts tp2,pp2

On the CPU the ranks are processes on gloo: a dry run of the GPU command.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.engines import free_memory, random_prompt  # noqa: E402
from benchmarks.options import parse_list, resolve_device  # noqa: E402
from benchmarks.report import environment, table, write_json  # noqa: E402
from muse import LLM, SamplingParams  # noqa: E402
from muse.presets import PRESETS, get_preset  # noqa: E402

# vLLM's flags as EngineArgs fields; the announced deployments are tp8xep and tp4xep.
LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": {"tensor_parallel_size": 2},
    "tp4": {"tensor_parallel_size": 4},
    "tp8": {"tensor_parallel_size": 8},
    "tp2xep": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
    "tp4xep": {"tensor_parallel_size": 4, "enable_expert_parallel": True},
    "tp8xep": {"tensor_parallel_size": 8, "enable_expert_parallel": True},
    "pp2": {"pipeline_parallel_size": 2},
    "tp2xpp2": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
    "dp2xep": {"data_parallel_size": 2, "enable_expert_parallel": True},
    "dp4xep": {"data_parallel_size": 4, "enable_expert_parallel": True},
    "dp8xep": {"data_parallel_size": 8, "enable_expert_parallel": True},
    "pcp2": {"prefill_context_parallel_size": 2},
    "tp2xpcp2": {"tensor_parallel_size": 2, "prefill_context_parallel_size": 2},
}


def world_size(layout: dict[str, Any]) -> int:
    size = 1
    for field in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                  "prefill_context_parallel_size"):
        size *= layout.get(field, 1)
    return size


def compare(reference: list[list[int]], gaps: list[list[float]], got: list[list[int]],
            min_gap: float) -> dict[str, Any]:
    """Each reply against the reference's up to the reference's first near tie (a gap below
    min_gap; compared too, but a difference there is not a failure): how many tokens were
    compared, how many replies were cut by a near tie, and the first real difference."""
    compared = cut = 0
    first_difference = None
    for index, (want, want_gaps, have) in enumerate(zip(reference, gaps, got, strict=True)):
        for position, (a, b, gap) in enumerate(zip(want, have, want_gaps)):
            if gap < min_gap:
                cut += 1
                break
            compared += 1
            if a != b and first_difference is None:
                first_difference = {"prompt": index, "position": position, "want": a, "got": b,
                                    "gap": gap}
                break
        else:
            if len(have) != len(want) and first_difference is None:
                first_difference = {"prompt": index, "position": min(len(want), len(have)),
                                    "want_length": len(want), "got_length": len(have)}
    return {"equal": first_difference is None, "compared_tokens": compared,
            "cut_by_near_ties": cut, "first_difference": first_difference}


def generate(engine_args: dict[str, Any], prompts: list[list[int]], max_tokens: int,
             logprobs: int | None) -> tuple[list, float]:
    llm = LLM(**engine_args)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                                logprobs=logprobs)
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        return [o.outputs[0] for o in outputs], time.perf_counter() - start
    finally:
        llm.shutdown()
        del llm
        free_memory(torch.device(engine_args["device"]))


def top2_gap(entry) -> float:
    top = sorted((value for _, value in entry.top), reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="muse-spark-15b-a2b", choices=sorted(PRESETS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--num-gpus", type=int, default=torch.cuda.device_count() or 8,
                        help="layouts of more ranks are skipped (default: the GPUs here)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        type=lambda text: parse_list(text, str),
                        help=f"comma separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", default="16:512",
                        help="MIN:MAX random prompt lengths")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--min-gap", type=float, default=2e-3,
                        help="top-1/top-2 logit gap below which a choice is a near tie")
    parser.add_argument("--max-model-len", type=int, default=4096,
                        help="capped by the shape's own limit")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init-std", type=float, default=None,
                        help="scale of the random weights (default: the preset's)")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    if unknown := set(args.layouts) - set(LAYOUTS):
        parser.error(f"--layouts: unknown {sorted(unknown)}; choose among {', '.join(LAYOUTS)}")
    device = resolve_device(args.device)
    low, high = (int(v) for v in args.prompt_tokens.split(":"))
    vocab = get_preset(args.shape).text_config.vocab_size
    rng = np.random.default_rng(args.seed)
    prompts = [random_prompt(rng, int(length), vocab)
               for length in rng.integers(low, high + 1, size=args.num_prompts)]
    base = {"model": args.shape, "device": str(device), "dtype": args.dtype, "seed": args.seed,
            "max_model_len": min(args.max_model_len,
                                 get_preset(args.shape).text_config.max_position_embeddings),
            "max_num_seqs": args.num_prompts,
            "enforce_eager": device.type != "cuda", "init_std": args.init_std}
    if device.type == "cuda":
        base["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        base["kv_cache_memory_bytes"] = 64 * 2**20

    outputs, seconds = generate(base, prompts, args.max_tokens, logprobs=2)
    reference = [list(o.token_ids) for o in outputs]
    gaps = [[top2_gap(entry) for entry in o.logprobs] for o in outputs]
    results: dict[str, Any] = {"one-gpu": {"seconds": seconds}}
    for name in args.layouts:
        layout = LAYOUTS[name]
        if device.type == "cuda" and world_size(layout) > args.num_gpus:
            results[name] = {"skipped": f"needs {world_size(layout)} GPUs"}
            continue
        try:
            got, seconds = generate({**base, **layout}, prompts, args.max_tokens, logprobs=None)
        except Exception as error:  # a layout that fails is a result, not the end of the run
            results[name] = {"error": f"{type(error).__name__}: {error}"[:2000]}
            continue
        results[name] = {**compare(reference, gaps, [list(o.token_ids) for o in got],
                                   args.min_gap), "seconds": seconds,
                         "world_size": world_size(layout)}
    record = {"benchmark": "parallel_check", "environment": environment(device),
              "args": vars(args), "results": results}
    write_json(args.out, record)
    rows = [[name, str(r.get("world_size", 1)),
             "skipped" if "skipped" in r else "error" if "error" in r else
             ("equal" if r.get("equal", True) else "DIFFERENT"),
             str(r.get("compared_tokens", "")), str(r.get("cut_by_near_ties", "")),
             f"{r['seconds']:.1f}" if "seconds" in r else ""]
            for name, r in results.items()]
    print(table(["layout", "ranks", "greedy output", "tokens compared", "cut by near ties",
                 "seconds"], rows))
    return record


if __name__ == "__main__":
    main()
