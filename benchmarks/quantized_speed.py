"""Speed and memory of quantized weights and of the FP8 KV cache, one format after another.

For each --formats entry the shape's random weights are quantized as they load (the engine's
`quantization`: exactly the tensors `muse quantize --format` writes; `bf16` keeps them as they
are) and measured:

  weight_bytes        every parameter of the engine model as stored (packed values and scales);
  decode_tok_s        batch 1: (N - 1) / (last token time - first token time) for N tokens
                      after a --context-token random prompt, EOS ignored (stream timestamps);
  decode_roofline     the bytes of one batch-1 decode step read at --mem-bandwidth: the weights
                      as stored (every non-expert parameter, the embedding's one row, top_k of
                      the E experts of each layer) plus the KV of the context;
  throughput_tok_s    --requests random prompts of --prompt-tokens, --output-tokens each (EOS
                      ignored), all submitted at once: output tokens / wall time;
  kv_tokens           the KV cache's capacity in tokens (global-attention pool; the engines
                      take a --max-model-len long enough that memory, not the sequences,
                      bounds it), with the model's dtype and with --kv-cache-dtype fp8 (the
                      second engine is only built, not timed, unless --time-fp8-kv).

    python benchmarks/quantized_speed.py --shape muse-spark-15b-a2b --out quantized.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import time
from typing import Any

import numpy as np

from benchmarks.engines import build_muse, free_memory, random_prompt, synchronize, timed
from benchmarks.options import (add_muse_args, add_roofline_args, add_run_args,
                                graph_engine_args, parse_list, resolve_device)
from benchmarks.report import environment, fmt, table, write_json
from benchmarks.roofline import kv_read_bytes
from benchmarks.shapes import shape_record, text_config
from muse.config import FULL
from muse.quantization import ONLINE_FORMATS

FORMATS = ("bf16",) + ONLINE_FORMATS


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(parser)
    add_roofline_args(parser)
    muse_group = add_muse_args(parser)
    muse_group.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--formats", default=list(FORMATS), type=lambda s: parse_list(s, str),
                        help=f"comma separated, of {', '.join(FORMATS)}")
    parser.add_argument("--context", type=int, default=1024, help="batch-1 prompt tokens")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--requests", type=int, default=256, help="throughput requests")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=65536,
                        help="long enough that --max-num-seqs sequences of it outgrow the KV "
                             "cache: the pools then hold what memory allows (the capacity)")
    parser.add_argument("--no-fp8-kv", action="store_true",
                        help="skip the second engine (the FP8 KV cache's capacity)")
    parser.add_argument("--time-fp8-kv", action="store_true",
                        help="also time decoding with the FP8 KV cache")
    args = parser.parse_args(argv)
    unknown = set(args.formats) - set(FORMATS)
    if unknown or not args.formats:
        parser.error(f"--formats: choose among {', '.join(FORMATS)}; got {args.formats}")
    return args


def weight_bytes(model: Any) -> tuple[int, int]:
    """(every parameter's bytes as stored, the bytes a batch-1 decode step reads of them:
    the embedding's one row, top_k of each layer's E experts, everything else)."""
    config = model.config
    total = read = 0
    for name, param in model.named_parameters():
        nbytes = param.numel() * param.element_size()
        total += nbytes
        if "embed_tokens" in name:
            read += nbytes // config.vocab_size
        elif ".experts." in name:
            read += nbytes * config.num_experts_per_tok // config.num_experts
        else:
            read += nbytes
    return total, read


def build(args: argparse.Namespace, device, form: str, kv_cache_dtype: str) -> Any:
    llm, _ = build_muse(
        args.shape, device, args.dtype, enforce_eager=args.enforce_eager, seed=args.seed,
        quantization=None if form == "bf16" else form, kv_cache_dtype=kv_cache_dtype,
        max_model_len=max(min(args.max_model_len,
                              text_config(args.shape).max_position_embeddings),
                          args.context + args.decode_tokens,
                          args.prompt_tokens + args.output_tokens),
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, **graph_engine_args(args))
    return llm


def kv_tokens(llm: Any) -> int:
    return (llm.engine.num_blocks[FULL] - 1) * llm.engine.args.block_size


def decode_rate(llm: Any, args: argparse.Namespace, device, rng) -> float:
    from muse import SamplingParams

    params = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True, temperature=0.0)
    vocab = llm.engine.config.vocab_size
    llm.generate([random_prompt(rng, args.context, vocab)], params)  # compiles at this size
    synchronize(device)
    marks = [(time.perf_counter(), len(out.outputs[0].token_ids))
             for out in llm.stream(random_prompt(rng, args.context, vocab), params)
             if out.outputs[0].token_ids]
    (t_first, n_first), (t_last, n_last) = marks[0], marks[-1]
    return (n_last - n_first) / (t_last - t_first)


def throughput(llm: Any, args: argparse.Namespace, device, rng) -> float:
    from muse import SamplingParams

    params = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True, temperature=0.0)
    vocab = llm.engine.config.vocab_size
    prompts = [random_prompt(rng, args.prompt_tokens, vocab) for _ in range(args.requests)]
    # Untimed first: the same prompts' prefill and a few steps at every batch size compile
    # the kernels' shapes (the first engine of a process would pay for it otherwise).
    llm.generate(prompts, SamplingParams(max_tokens=min(8, args.output_tokens),
                                         ignore_eos=True, temperature=0.0), use_tqdm=False)
    prompts = [random_prompt(rng, args.prompt_tokens, vocab) for _ in range(args.requests)]
    outputs, seconds = timed(lambda: llm.generate(prompts, params, use_tqdm=False), device)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds


def measure(args: argparse.Namespace, device, form: str) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    llm = build(args, device, form, "auto")
    total, read = weight_bytes(llm.engine.model)
    text = llm.engine.config
    kv_dtype_bytes = llm.engine.kv_cache_dtype.itemsize
    step_bytes = read + kv_read_bytes(text, args.context + args.decode_tokens // 2,
                                      kv_dtype_bytes)
    row: dict[str, Any] = {
        "format": form, "build_s": time.perf_counter() - started, "weight_bytes": total,
        "decode_step_bytes": step_bytes,
        "decode_roofline_tok_s": args.mem_bandwidth / step_bytes,
        "kv_tokens": kv_tokens(llm)}
    row["decode_tok_s"] = decode_rate(llm, args, device, rng)
    row["decode_fraction_of_roofline"] = row["decode_tok_s"] / row["decode_roofline_tok_s"]
    row["throughput_tok_s"] = throughput(llm, args, device, rng)
    llm = None
    free_memory(device)
    if args.no_fp8_kv:
        return row
    llm = build(args, device, form, "fp8")
    row["kv_tokens_fp8"] = kv_tokens(llm)
    if args.time_fp8_kv:
        row["decode_tok_s_fp8_kv"] = decode_rate(llm, args, device, rng)
    llm = None
    free_memory(device)
    return row


def report(record: dict[str, Any]) -> str:
    rows = record["rows"]
    base = next((r for r in rows if r["format"] == "bf16" and "error" not in r), None)
    cells = []
    for r in rows:
        if "error" in r:
            cells.append([r["format"], r["error"]] + [""] * 7)
            continue
        speedup = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}x" if base else "-"
        cells.append([r["format"], f"{r['weight_bytes'] / 2**30:.2f}", fmt(r["decode_tok_s"]),
                      speedup, f"{100 * r['decode_fraction_of_roofline']:.0f}%",
                      fmt(r["throughput_tok_s"]), f"{r['kv_tokens']:,}",
                      f"{r['kv_tokens_fp8']:,}" if "kv_tokens_fp8" in r else "-"])
    requests = record["config"]["requests"]
    return table(["format", "weights GiB", "decode tok/s", "vs bf16", "of roofline",
                  f"{requests}-req tok/s", "KV tokens", "KV tokens fp8"], cells)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = resolve_device(args.device)
    record: dict[str, Any] = {"benchmark": "quantized_speed", "environment": environment(device),
                              "config": vars(args), "shape": shape_record(args.shape),
                              "method": __doc__.split("\n\n")[1], "rows": []}
    text_config(args.shape)  # an unknown shape fails here, before any engine
    for form in args.formats:
        try:
            record["rows"].append(measure(args, device, form))
        except Exception as exc:  # noqa: BLE001 - keep the other formats' figures
            record["rows"].append({"format": form, "error": f"{type(exc).__name__}: {exc}"})
            free_memory(device)
        write_json(args.out, record)
        print(f"  {form}: done", flush=True)
    print(report(record), flush=True)
    return record


if __name__ == "__main__":
    main()
