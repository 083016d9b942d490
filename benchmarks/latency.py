"""Batch-1 latency: how fast one request is prefilled and decoded, muse vs transformers.

For each prompt length, one request alone on the GPU:
  prefill tokens/s = prompt tokens / time to first token (generation of max 1 token; the median
                     over --repeats fresh random prompts);
  decode tokens/s  = (N - 1) / (time of the last token - time of the first token), N =
                     --decode-tokens generated with EOS ignored. muse: token times from its
                     stream API; transformers: generate(N) wall time minus the median time to
                     first token at that length.
Each figure sits next to its roofline (see benchmarks/roofline.py) and muse / transformers
ratios.

    python benchmarks/latency.py --shape qwen3-30b-a3b-shape --out latency.json
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a plain checkout (`python benchmarks/latency.py`): the repository root makes
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
    median,
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

METHOD = {
    "prefill_tok_s": "prompt tokens / time to first token (max_tokens=1), median over repeats; "
                     "a fresh random prompt each time, so no prefix cache hits",
    "decode_tok_s": "(N - 1) / (last token time - first token time) for N tokens with EOS "
                    "ignored, greedy; muse from per-token stream times, transformers as "
                    "generate(N) wall time minus the median time to first token",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    parser.add_argument("--lengths", default=[1024, 8192, 32768], type=parse_list,
                        help="prompt lengths, comma separated")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3,
                        help="time-to-first-token runs per length (median reported)")
    parser.add_argument("--max-num-seqs", type=int, default=1,
                        help="muse's sequence limit (one request runs at a time here)")
    parser.add_argument("--hf-static-cache", action="store_true",
                        help='transformers with cache_implementation="static"')
    args = parser.parse_args(argv)
    check_common_args(args)
    if args.decode_tokens < 2 or args.repeats < 1 or not args.lengths:
        parser.error("need --decode-tokens >= 2, --repeats >= 1 and some --lengths")
    return args


def _row(length: int, args: argparse.Namespace, roofline: dict[str, Any]) -> dict[str, Any]:
    return {"prompt_tokens": length, "decode_tokens": args.decode_tokens, "roofline": roofline}


def _finish_row(row: dict[str, Any], ttfts: list[float]) -> None:
    row["ttft_s_runs"] = ttfts
    row["ttft_s"] = median(ttfts)
    row["prefill_tok_s"] = row["prompt_tokens"] / row["ttft_s"]
    roof = row["roofline"]
    row["prefill_fraction_of_roofline"] = ratio(row["prefill_tok_s"], roof["prefill_tok_s"])
    row["decode_fraction_of_roofline"] = ratio(row.get("decode_tok_s"), roof["decode_tok_s"])


def run_muse(args: argparse.Namespace, device, text, roofline: Roofline) -> dict[str, Any]:
    from muse import SamplingParams

    rng = np.random.default_rng(args.seed)
    n = args.decode_tokens
    max_len = max(args.lengths) + n + 16
    llm, info = build_muse(
        args.shape, device, args.dtype, enforce_eager=args.enforce_eager,
        detokenize=args.detokenize, seed=args.seed, max_model_len=max_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        **graph_engine_args(args),
        overlap_schedule=not args.disable_overlap_schedule, **parallel_engine_args(args))
    first = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    full = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)

    def stream(ids: list[int]) -> tuple[float, float, int]:
        """(time to first token, time from first to last token, tokens after the first)."""
        synchronize(device)
        start = time.perf_counter()
        marks = []
        for out in llm.stream(ids, full):
            count = len(out.outputs[0].token_ids)
            if count:
                marks.append((time.perf_counter(), count))
        (t_first, n_first), (t_last, n_last) = marks[0], marks[-1]
        if n_last != n:
            raise RuntimeError(f"muse generated {n_last} tokens, asked for {n}")
        return t_first - start, t_last - t_first, n_last - n_first

    warm = random_prompt(rng, min(256, min(args.lengths)), text.vocab_size)
    llm.generate([warm], first)
    stream(warm)
    rows = []
    for length in args.lengths:
        row = _row(length, args, roofline.single_stream(length, n))
        try:
            # One untimed prefill at this length first: kernels specialise on sizes, and their
            # first launch at a new size compiles.
            llm.generate([random_prompt(rng, length, text.vocab_size)], first)
            ttfts = []
            for _ in range(args.repeats):
                ids = random_prompt(rng, length, text.vocab_size)
                _, seconds = timed(lambda ids=ids: llm.generate([ids], first), device)
                ttfts.append(seconds)
            ttft, decode_s, decoded = stream(random_prompt(rng, length, text.vocab_size))
            row.update({"decode_run_ttft_s": ttft, "decode_s": decode_s,
                        "decode_tok_s": decoded / decode_s})
            _finish_row(row, ttfts)
        except Exception as exc:  # noqa: BLE001 - keep the other lengths' figures
            row["error"] = error_text(exc)
        rows.append(row)
        free_memory(device)
    llm.shutdown()  # ends its worker processes and leaves their world
    llm = None  # frees the engine before the next one loads
    info["allocated_after_free"] = free_memory(device)
    return {"engine": info, "rows": rows}


def run_transformers(args: argparse.Namespace, device, text, roofline: Roofline
                     ) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed + 1)
    n = args.decode_tokens
    model, info = build_transformers(
        text, device, torch_dtype(args.dtype),
        attn_implementation=args.hf_attn_implementation,
        experts_implementation=args.hf_experts_implementation)
    info["cache"] = "static" if args.hf_static_cache else "dynamic"

    def generate(ids: list[int], tokens: int) -> float:
        return timed(lambda: hf_generate(model, [ids], tokens, args.hf_static_cache),
                     device)[1]

    warm = random_prompt(rng, min(256, min(args.lengths)), text.vocab_size)
    generate(warm, 1)
    generate(warm, min(n, 16))
    rows = []
    for length in args.lengths:
        row = _row(length, args, roofline.single_stream(length, n))
        try:
            generate(random_prompt(rng, length, text.vocab_size), 1)  # as for muse
            ttfts = [generate(random_prompt(rng, length, text.vocab_size), 1)
                     for _ in range(args.repeats)]
            total = generate(random_prompt(rng, length, text.vocab_size), n)
            decode_s = total - median(ttfts)
            row.update({"generate_s": total, "decode_s": decode_s,
                        "decode_tok_s": (n - 1) / decode_s if decode_s > 0 else None})
            _finish_row(row, ttfts)
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory at the longest prompt
            row["error"] = error_text(exc)
        rows.append(row)
        free_memory(device)
    model = None  # frees the model before the next one loads
    info["allocated_after_free"] = free_memory(device)
    return {"engine": info, "rows": rows}


def ratios(results: dict[str, Any]) -> list[dict[str, Any]]:
    if not {"muse", "transformers"} <= set(results):
        return []
    out = []
    theirs_by_length = {row["prompt_tokens"]: row for row in results["transformers"]["rows"]}
    for mine in results["muse"]["rows"]:
        theirs = theirs_by_length.get(mine["prompt_tokens"])
        if theirs is None:
            continue
        out.append({"prompt_tokens": mine["prompt_tokens"],
                    "prefill": ratio(mine.get("prefill_tok_s"), theirs.get("prefill_tok_s")),
                    "decode": ratio(mine.get("decode_tok_s"), theirs.get("decode_tok_s"))})
    return out


def report(record: dict[str, Any]) -> str:
    rows = []
    for engine, result in record["results"].items():
        for row in result["rows"]:
            if "error" in row:
                rows.append([engine, str(row["prompt_tokens"]), "error: " + row["error"][:60],
                             "", "", ""])
                continue
            rows.append([engine, str(row["prompt_tokens"]), fmt(row["prefill_tok_s"]),
                         pct(row["prefill_fraction_of_roofline"]),
                         fmt(row.get("decode_tok_s"), 1),
                         pct(row["decode_fraction_of_roofline"])])
    lines = [table(["engine", "prompt", "prefill tok/s", "of roof", "decode tok/s", "of roof"],
                   rows)]
    if record["ratios"]:
        lines.append("muse / transformers: " + "; ".join(
            f"{r['prompt_tokens']}: prefill {fmt(r['prefill'], 2)}x, "
            f"decode {fmt(r['decode'], 2)}x" for r in record["ratios"]))
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
    rooflines = {"muse": Roofline(text, muse_machine, element),
                 "transformers": Roofline(stand_in, machine, element)}
    texts = {"muse": text, "transformers": text}
    runners = {"muse": run_muse, "transformers": run_transformers}
    record: dict[str, Any] = {
        "benchmark": "latency", "environment": env, "config": vars(args),
        "shape": shape_record(args.shape), "machine": machine.to_dict(), "gpus": gpus,
        "method": METHOD, "roofline_note": ROOFLINE_NOTE, "results": {}, "ratios": []}
    merge_previous(record, args.merge_from, args.engines)
    print(header("latency (batch 1)", args, env), flush=True)
    for engine in args.engines:
        started = time.perf_counter()
        record["results"][engine] = runners[engine](args, device, texts[engine],
                                                    rooflines[engine])
        record["results"][engine]["engine"]["wall_s"] = time.perf_counter() - started
        record["ratios"] = ratios(record["results"])
        write_json(args.out, record)
    record["ratios"] = ratios(record["results"])
    write_json(args.out, record)
    print(report(record), flush=True)
    return record


if __name__ == "__main__":
    main()
