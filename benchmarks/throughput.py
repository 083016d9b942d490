"""Offline throughput: how many tokens/s each engine gets through a batch of requests.

Workload: --num-requests requests (256) of random token ids, prompt and output lengths drawn
uniformly from --prompt-lens and --output-lens (100:1024 each), seeded; every request generates
exactly its output length (EOS ignored, greedy).

muse: every request submitted at once to `LLM.generate`, which batches them continuously.
transformers: its best practical offline mode, static batches through `generate` with left
padding, requests sorted by output then prompt length so a batch's lengths are close; each
batch runs to its longest output, and only the tokens requests asked for are counted. As that
is slow, it runs the first --hf-max-requests requests (64), at each of --hf-batch-sizes; muse
also runs that same subset, so the two compare on equal work as well.

Figures: output tokens/s and (prompt + output) tokens/s over the wall time of the whole
run, next to the roofline of the same requests (see Roofline.batch in benchmarks/roofline.py).

    python benchmarks/throughput.py --shape qwen3-30b-a3b-shape --out throughput.json
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a plain checkout (`python benchmarks/throughput.py`): the repository root makes
# `muse` and `benchmarks` importable without installing.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import time
from typing import Any

import numpy as np

from benchmarks.engines import (
    build_muse,
    build_transformers,
    free_memory,
    hf_generate,
    random_prompt,
    synchronize,
    timed,
)
from benchmarks.options import (
    add_common_args,
    check_common_args,
    graph_engine_args,
    num_gpus,
    parallel_engine_args,
    parse_list,
    parse_range,
    resolve_device,
    torch_dtype,
)
from benchmarks.report import (
    environment,
    error_text,
    fmt,
    header,
    merge_previous,
    pct,
    ratio,
    table,
    write_json,
)
from benchmarks.roofline import ROOFLINE_NOTE, Machine, Roofline
from benchmarks.shapes import shape_record, text_config, transformers_text_config
from muse.info import DTYPE_BYTES

Request = tuple[list[int], int]  # prompt token ids, output length


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-lens", type=parse_range, default=(100, 1024),
                        help="LOW:HIGH, uniform")
    parser.add_argument("--output-lens", type=parse_range, default=(100, 1024),
                        help="LOW:HIGH, uniform")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="muse's concurrent sequence limit (default: the engine's)")
    parser.add_argument("--hf-batch-sizes", default=[16, 64], type=parse_list)
    parser.add_argument("--hf-max-requests", type=int, default=64,
                        help="transformers runs only the first this many requests")
    parser.add_argument("--no-muse-subset", action="store_true",
                        help="skip muse's extra run on transformers' subset of requests")
    args = parser.parse_args(argv)
    check_common_args(args)
    if args.num_requests < 1 or args.hf_max_requests < 1 or not args.hf_batch_sizes:
        parser.error("need --num-requests >= 1, --hf-max-requests >= 1, some --hf-batch-sizes")
    return args


def workload(args: argparse.Namespace, vocab_size: int) -> list[Request]:
    rng = np.random.default_rng(args.seed)
    prompt_lens = rng.integers(args.prompt_lens[0], args.prompt_lens[1] + 1, args.num_requests)
    output_lens = rng.integers(args.output_lens[0], args.output_lens[1] + 1, args.num_requests)
    return [(random_prompt(rng, int(p), vocab_size), int(o))
            for p, o in zip(prompt_lens, output_lens)]


def lengths(requests: list[Request]) -> list[tuple[int, int]]:
    return [(len(p), o) for p, o in requests]


def figures(requests: list[Request], wall: float, roofline: dict[str, float],
            output_tokens: int | None = None) -> dict[str, Any]:
    prompt_tokens = sum(len(p) for p, _ in requests)
    outputs = sum(o for _, o in requests) if output_tokens is None else output_tokens
    result = {"requests": len(requests), "prompt_tokens": prompt_tokens,
              "output_tokens": outputs, "wall_s": wall, "output_tok_s": outputs / wall,
              "total_tok_s": (prompt_tokens + outputs) / wall, "roofline": roofline}
    result["fraction_of_roofline"] = result["output_tok_s"] / roofline["output_tok_s"]
    return result


def run_muse(args: argparse.Namespace, device, requests: list[Request], subset: int | None,
             roofline: Roofline) -> dict[str, Any]:
    from muse import SamplingParams

    max_len = args.prompt_lens[1] + args.output_lens[1] + 16
    llm, info = build_muse(
        args.shape, device, args.dtype, enforce_eager=args.enforce_eager,
        detokenize=args.detokenize, seed=args.seed, max_model_len=max_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        **graph_engine_args(args),
        overlap_schedule=not args.disable_overlap_schedule, **parallel_engine_args(args))

    def generate(batch: list[Request]) -> tuple[float, int]:
        prompts = [{"prompt_token_ids": p} for p, _ in batch]
        params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0)
                  for _, o in batch]
        outputs, seconds = timed(lambda: llm.generate(prompts, params), device)
        produced = sum(len(out.outputs[0].token_ids) for out in outputs)
        if produced != sum(o for _, o in batch):
            raise RuntimeError(f"muse generated {produced} tokens, asked for "
                               f"{sum(o for _, o in batch)}")
        return seconds, produced

    warm = [(p[:64], 16) for p, _ in requests[:4]]
    generate(warm)
    result: dict[str, Any] = {"engine": info}
    seconds, produced = generate(requests)
    result["all"] = figures(requests, seconds, roofline.batch(lengths(requests)), produced)
    if subset:
        part = requests[:subset]
        seconds, produced = generate(part)
        result["subset"] = figures(part, seconds, roofline.batch(lengths(part)), produced)
    llm.shutdown()  # ends its worker processes and leaves their world
    llm = None  # frees the engine before the next one loads
    info["allocated_after_free"] = free_memory(device)
    return result


def run_transformers(args: argparse.Namespace, device, text, requests: list[Request],
                     roofline: Roofline) -> dict[str, Any]:
    model, info = build_transformers(
        text, device, torch_dtype(args.dtype),
        attn_implementation=args.hf_attn_implementation,
        experts_implementation=args.hf_experts_implementation)
    info["cache"] = "dynamic"
    info["order"] = "sorted by (output length, prompt length), left padding"
    part = requests[:args.hf_max_requests]
    ordered = sorted(part, key=lambda r: (r[1], len(r[0])))
    roof = roofline.batch(lengths(part))
    hf_generate(model, [p[:64] for p, _ in part[:2]], 16)  # warm up
    runs = []
    for batch_size in args.hf_batch_sizes:
        run: dict[str, Any] = {"batch_size": batch_size}
        try:
            generated = 0
            synchronize(device)
            start = time.perf_counter()
            for i in range(0, len(ordered), batch_size):
                batch = ordered[i:i + batch_size]
                longest = max(o for _, o in batch)
                hf_generate(model, [p for p, _ in batch], longest)
                generated += longest * len(batch)
            synchronize(device)
            run.update(figures(part, time.perf_counter() - start, roof))
            run["generated_tokens"] = generated  # padding rows' and overrun tokens included
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory at the larger batch
            run["error"] = error_text(exc)
        runs.append(run)
        free_memory(device)
    model = None  # frees the model before the next one loads
    info["allocated_after_free"] = free_memory(device)
    done = [r for r in runs if "error" not in r]
    best = max(done, key=lambda r: r["output_tok_s"]) if done else None
    return {"engine": info, "runs": runs, "best_batch_size": best and best["batch_size"],
            "best": best,
            "note": f"tokens/s over the first {len(part)} of the {len(requests)} requests "
                    "(the ones transformers ran), counting only the output tokens they asked "
                    "for"}


def compare(results: dict[str, Any]) -> dict[str, Any]:
    best = results.get("transformers", {}).get("best")
    muse = results.get("muse")
    if not best or not muse:
        return {}
    out = {"muse_all_vs_transformers": ratio(muse["all"]["output_tok_s"],
                                             best["output_tok_s"])}
    same = muse.get("subset") or (muse["all"] if muse["all"]["requests"] == best["requests"]
                                  else None)
    if same:
        out["same_requests"] = ratio(same["output_tok_s"], best["output_tok_s"])
    out["note"] = ("output tokens/s ratios against transformers at its best batch size; "
                   "muse_all_vs_transformers: muse on all requests vs transformers on its "
                   "subset; same_requests: both on the subset")
    return out


def report(record: dict[str, Any]) -> str:
    rows = []
    muse = record["results"].get("muse")
    if muse:
        for key in ("all", "subset"):
            if key in muse:
                r = muse[key]
                rows.append(["muse", "all at once" if key == "all" else "subset at once",
                             str(r["requests"]), f"{r['wall_s']:.1f}",
                             fmt(r["output_tok_s"]), fmt(r["total_tok_s"]),
                             pct(r["fraction_of_roofline"])])
    hf = record["results"].get("transformers")
    if hf:
        for r in hf["runs"]:
            if "error" in r:
                rows.append(["transformers", f"batch {r['batch_size']}", "",
                             "error: " + r["error"][:60], "", "", ""])
            else:
                rows.append(["transformers", f"batch {r['batch_size']}", str(r["requests"]),
                             f"{r['wall_s']:.1f}", fmt(r["output_tok_s"]),
                             fmt(r["total_tok_s"]), pct(r["fraction_of_roofline"])])
    lines = [table(["engine", "mode", "requests", "wall s", "output tok/s", "total tok/s",
                    "of roof"], rows)]
    ratios = record["ratios"]
    if ratios:
        lines.append("muse / transformers (output tok/s): "
                     f"all vs its subset {fmt(ratios['muse_all_vs_transformers'], 2)}x"
                     + (f", same requests {fmt(ratios['same_requests'], 2)}x"
                        if ratios.get("same_requests") else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = resolve_device(args.device)
    env = environment(device)
    text = text_config(args.shape)
    stand_in, _ = transformers_text_config(text)
    machine = Machine(args.mem_bandwidth, args.matmul_flops)
    # A layout over several GPUs reads and multiplies on all of them at once.
    gpus = num_gpus(args)
    muse_machine = Machine(args.mem_bandwidth * gpus, args.matmul_flops * gpus)
    element = DTYPE_BYTES[args.dtype]
    requests = workload(args, text.vocab_size)
    # muse also runs the requests transformers runs (cheap), for a ratio on equal work.
    subset = args.hf_max_requests if not args.no_muse_subset \
        and args.hf_max_requests < len(requests) else None
    record: dict[str, Any] = {
        "benchmark": "throughput", "environment": env, "config": vars(args),
        "shape": shape_record(args.shape), "machine": machine.to_dict(), "gpus": gpus,
        "workload": {"num_requests": len(requests), "prompt_lens": args.prompt_lens,
                     "output_lens": args.output_lens, "seed": args.seed,
                     "prompt_tokens": sum(len(p) for p, _ in requests),
                     "output_tokens": sum(o for _, o in requests),
                     "ignore_eos": True, "sampling": "greedy"},
        "roofline_note": ROOFLINE_NOTE + " Throughput: every request running at once, "
        "one prefill pass over all prompts then one decode step per output position, the "
        "phases summed (an engine that overlaps them could beat this).",
        "results": {}, "ratios": {}}
    merge_previous(record, args.merge_from, args.engines, must_match=("workload",))
    print(header("throughput", args, env), flush=True)
    for engine in args.engines:
        started = time.perf_counter()
        if engine == "muse":
            result = run_muse(args, device, requests, subset,
                              Roofline(text, muse_machine, element))
        else:
            result = run_transformers(args, device, text, requests,
                                      Roofline(stand_in, machine, element))
        result["engine"]["wall_s"] = time.perf_counter() - started
        record["results"][engine] = result
        record["ratios"] = compare(record["results"])
        write_json(args.out, record)
    record["ratios"] = compare(record["results"])
    write_json(args.out, record)
    print(report(record), flush=True)
    return record


if __name__ == "__main__":
    main()
