"""What a speculative verify step costs next to a plain decode step, and what speedup follows.

Builds the engine on a shape (random weights), puts the largest of --batch-sizes requests of
--context random prompt tokens through the engine's own prefill (`EngineCore.step`), then, for
the first B of those requests at each batch size B, times the model forward (and LM head) of
two kinds of step built from the requests' real block tables:

  decode:  each request feeds its one next token at its next position, logits for every row;
           eagerly and, on CUDA unless --enforce-eager, through the engine's captured decode
           CUDA graphs (`DecodeGraphs`, as plain decoding runs);
  verify:  each request feeds that token and k draft tokens (random ids) at the next 1 + k
           positions, logits for all 1 + k rows; eagerly and, on CUDA unless
           --enforce-eager, through the engine's captured verify graphs (the engine is built
           with n-gram speculation of max(k) tokens, which captures them).

Each figure is `ModelWorker.execute(batch, logits_rows)` alone (host metadata copy, forward,
LM head): the median of --repeats runs after --warmup untimed ones, the device idle before and
after each. Scheduling, sampling and rejection sampling are left out of both.

From them: verify / decode, and the projected speedup of speculation at a mean acceptance
length L (tokens a verify step emits, the bonus token included, 1 <= L <= k + 1):

    speedup(L) = L * T_decode / (T_verify + T_draft),   T_draft = --draft-ms

    python benchmarks/spec_verify_cost.py --out results/spec-verify-cost-muse-spark-15b-a2b.json
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a plain checkout (`python benchmarks/spec_verify_cost.py`): the repository root
# makes `muse` and `benchmarks` importable without installing.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from benchmarks.engines import build_muse, free_memory, random_prompt, synchronize  # noqa: E402
from benchmarks.options import (add_muse_args, add_roofline_args, add_run_args,  # noqa: E402
                                graph_engine_args, parse_list, resolve_device)
from benchmarks.report import environment, error_text, fmt, table, write_json  # noqa: E402
from benchmarks.roofline import (  # noqa: E402
    ROOFLINE_NOTE,
    Machine,
    Roofline,
    attention_flops,
    kv_read_bytes,
    kv_write_bytes,
)
from benchmarks.shapes import describe_muse_side, text_config  # noqa: E402
from muse.engine.args import EngineArgs  # noqa: E402
from muse.info import DTYPE_BYTES  # noqa: E402

METHOD = {
    "setup": "the largest batch's requests (random prompt ids of --context tokens) are "
             "prefilled by the engine's own steps (chunked, prefix caching on but never hit), "
             "greedy, EOS ignored; requests whose prompt finished early decode a few tokens "
             "while the others prefill, so a request's context is --context plus those (the "
             "rows give the range). Each batch size takes the first B of these requests, "
             "whose KV blocks for the next 1 + max(k) positions are allocated before timing",
    "decode_ms": "ModelWorker.execute of a step feeding each request its next token at its "
                 "next position, logits for every row: host metadata to the device, forward, "
                 "LM head; median over repeats after untimed warm-up runs, the device "
                 "synchronized before and after each run (wall time, launches included)",
    "decode_graph_ms": "the same step replayed through the engine's captured decode CUDA "
                       "graphs (DecodeGraphs, as the engine decodes); null where there are "
                       "none (CPU, --enforce-eager)",
    "verify_ms": "the same, for a step feeding each request its next token and k draft "
                 "tokens (random ids) at the next 1 + k positions, logits for all 1 + k rows: "
                 "through the engine's verify CUDA graphs where it has them (the graph of the "
                 "shortest captured query length that holds 1 + k), else eager; "
                 "verify_eager_ms always eager",
    "check": "first_rows_max_abs_diff / first_rows_argmax_agree: each request's first "
             "verify row against the decode step's logits (the same query: token, position "
             "and cached context), so a wrong block table or position shows",
    "excluded": "scheduling, building the host batch, sampling and rejection sampling, and "
                "the drafter (see draft_ms)",
}

SPEEDUP_NOTE = (
    "speedup(L) = L * T_decode / (T_verify + T_draft). A plain decode step emits one token per "
    "request in T_decode; a speculative step drafts k tokens (T_draft = --draft-ms, assumed, "
    "not measured) and verifies them in one target forward (T_verify), emitting L tokens per "
    "request on average: the accepted drafts plus the bonus token, so 1 <= L <= k + 1 (None "
    "outside). L is the mean acceptance length, tokens per target forward, as a speculative "
    "run reports it; it is given (--acceptance-lengths), not measured here. T_decode is the "
    "decode step as plain decoding runs it (CUDA graphs where the engine has them, else "
    "eager); speedup_vs_eager_decode uses the eager decode step instead. break_even_L = "
    "(T_verify + T_draft) / T_decode: the acceptance length below which speculation is "
    "slower. Per-step host work (scheduling, sampling, rejection sampling) is left out of "
    "both, and it favours neither: a speculative engine reads every step back, so it loses "
    "the overlap of host work with the device that plain decoding has.")

VERIFY_ROOFLINE_NOTE = (
    " Verify step: B * (1 + k) tokens in one pass: the weights read once for that many tokens "
    "(so up to min(E, B (1 + k) top_k) routed experts a layer: far more than a decode step "
    "of B tokens reads at small B), each request's KV read once up to its last query, B (1 + "
    "k) tokens' KV written, and logits for every row.")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(parser)
    parser.add_argument("--batch-sizes", default=[1, 2, 4, 8, 16, 32, 64], type=parse_list,
                        help="requests per step, comma separated")
    parser.add_argument("--context", type=int, default=1024,
                        help="tokens already in the KV cache per request (the prompt length)")
    parser.add_argument("--num-draft-tokens", default=[7], type=parse_list,
                        help="k, draft tokens verified per request, comma separated")
    parser.add_argument("--acceptance-lengths", default=[4.0, 5.0, 6.0, 7.0],
                        type=lambda s: parse_list(s, float),
                        help="mean acceptance lengths L (tokens per target forward, bonus "
                             "token included) to project the speedup for")
    parser.add_argument("--draft-ms", type=float, default=0.0,
                        help="drafting time per speculative step, ms (not measured here)")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs before them")
    add_roofline_args(parser)
    add_muse_args(parser)
    args = parser.parse_args(argv)
    if (not args.batch_sizes or min(args.batch_sizes) < 1 or not args.num_draft_tokens
            or min(args.num_draft_tokens) < 1):
        parser.error("need --batch-sizes and --num-draft-tokens of integers >= 1")
    if args.context < 1 or args.repeats < 1 or args.warmup < 0 or args.draft_ms < 0:
        parser.error("need --context >= 1, --repeats >= 1, --warmup >= 0, --draft-ms >= 0")
    if not args.acceptance_lengths or min(args.acceptance_lengths) < 1:
        parser.error("--acceptance-lengths: mean tokens per target forward, each >= 1")
    args.batch_sizes = sorted(set(args.batch_sizes))
    args.num_draft_tokens = sorted(set(args.num_draft_tokens))
    return args


def time_runs(fn: Callable[[], Any], device, warmup: int, repeats: int) -> dict[str, Any]:
    """Median wall time of `fn` in ms, the device idle before and after each run."""
    for _ in range(warmup):
        fn()
    runs = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        runs.append((time.perf_counter() - start) * 1e3)
    return {"ms": statistics.median(runs), "min_ms": min(runs), "runs_ms": runs}


def verify_roofline(roof: Roofline, starts: Sequence[int], k: int) -> tuple[int, int]:
    """(bytes, FLOPs) of one verify step: queries at positions start..start+k of each request,
    logits for every row."""
    text, element = roof.text, roof.dtype_bytes
    tokens = len(starts) * (1 + k)
    nbytes = roof.params.weight_bytes(tokens, element) \
        + sum(kv_read_bytes(text, s + 1 + k, element) for s in starts) \
        + kv_write_bytes(text, tokens, element)
    flops = roof.params.matmul_flops(tokens, tokens) \
        + sum(attention_flops(text, s, s + 1 + k) for s in starts)
    return nbytes, flops


def prefill_requests(llm, count: int, args: argparse.Namespace, rng: np.random.Generator,
                     vocab: int) -> tuple[list, float]:
    """`count` requests of `args.context` random prompt tokens, prefilled through the
    engine's steps; returns them (running, each with its first output token) and the time."""
    from muse import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=engine.max_model_len, ignore_eos=True, temperature=0.0)
    requests = [engine.add_request(f"verify-cost-{i}",
                                   random_prompt(rng, args.context, vocab), params)[0]
                for i in range(count)]
    started = time.perf_counter()
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in requests):
        engine.step()
    synchronize(engine.device)
    seconds = time.perf_counter() - started
    for request in requests:
        if request.is_finished or request.num_pending_tokens:
            raise RuntimeError(f"request {request.request_id} is not ready to decode "
                               f"(finished {request.is_finished}, pending "
                               f"{request.num_pending_tokens})")
    return requests, seconds


def step_batch(engine, requests: list, num_new: int, rng: np.random.Generator, vocab: int):
    """The host batch of one step: each request's next token, then `num_new - 1` random
    drafts, at its next `num_new` positions, over its real block tables."""
    from muse.engine.metadata import BatchEntry, build_host_batch

    kv = engine.kv_cache
    entries = []
    for request in requests:
        start = request.num_computed_tokens
        tokens = request.token_ids(start, start + 1) + random_prompt(rng, num_new - 1, vocab)
        entries.append(BatchEntry(tokens, start, num_new, kv.block_tables(request)))
    return build_host_batch(list(kv.pools), kv.block_size, kv.sliding_window, entries)


def speedups(lengths: Sequence[float], k: int, decode_ms: float | None, verify_ms: float,
             draft_ms: float) -> dict[str, float | None]:
    if not decode_ms:
        return {}
    return {f"{length:g}": length * decode_ms / (verify_ms + draft_ms)
            if length <= k + 1 else None for length in lengths}


def measure(llm, requests: list, args: argparse.Namespace, device, roof: Roofline,
            rng: np.random.Generator, vocab: int) -> dict[str, Any]:
    """One batch size's row: decode (eager, graphs) and verify at every k."""
    engine, machine = llm.engine, roof.machine
    worker = engine.executor.worker
    graphs, captured = worker.decode_graphs, worker.graphs
    starts = [r.num_computed_tokens for r in requests]
    size = len(requests)
    row: dict[str, Any] = {"batch_size": size, "context_min": min(starts),
                           "context_max": max(starts)}

    decode = step_batch(engine, requests, 1, rng, vocab)
    rows = list(range(decode.num_tokens))

    def eager_runs(batch, rows: list[int]) -> dict[str, Any]:
        worker.graphs = []
        try:
            return time_runs(lambda: worker.execute(batch, rows), device, args.warmup,
                             args.repeats)
        finally:
            worker.graphs = captured

    eager = eager_runs(decode, rows)
    decode_roof = machine.time(*roof.decode_step(starts))
    row["decode"] = {"tokens": decode.num_tokens, "eager_ms": eager["ms"],
                     "eager_min_ms": eager["min_ms"], "eager_runs_ms": eager["runs_ms"],
                     "graph_ms": None, "roofline_ms": decode_roof * 1e3}
    if graphs is not None:
        if not graphs.covers(decode):
            row["decode"]["graph_note"] = "the captured graphs do not cover this step"
        else:
            replays = graphs.replays
            graph = time_runs(lambda: worker.execute(decode, rows), device, args.warmup,
                              args.repeats)
            if graphs.replays != replays + args.warmup + args.repeats:
                raise RuntimeError("the decode step did not replay a captured graph each run")
            row["decode"].update({"graph_ms": graph["ms"], "graph_min_ms": graph["min_ms"],
                                  "graph_runs_ms": graph["runs_ms"]})
    baseline = row["decode"]["graph_ms"] or row["decode"]["eager_ms"]
    row["decode"]["baseline"] = "cuda_graph" if row["decode"]["graph_ms"] else "eager"
    row["decode"]["baseline_ms"] = baseline

    decode_logits = worker.execute(decode, list(range(size))).clone()
    row["verify"] = []
    for k in args.num_draft_tokens:
        verify = step_batch(engine, requests, 1 + k, rng, vocab)
        rows = list(range(verify.num_tokens))
        verify_eager = eager_runs(verify, rows)
        in_graph = any(g.covers(verify) for g in captured if g.query_len > 1)
        timing = time_runs(lambda: worker.execute(verify, rows), device, args.warmup,
                           args.repeats) if in_graph else verify_eager
        # Each request's first verify row is the decode step's query: same token, position
        # and cached context, so the same logits up to kernel rounding.
        first = worker.execute(verify, rows)[::1 + k]
        verify_roof = machine.time(*verify_roofline(roof, starts, k))
        step_ms = timing["ms"] + args.draft_ms
        row["verify"].append({
            "k": k, "tokens": verify.num_tokens, "ms": timing["ms"],
            "min_ms": timing["min_ms"], "runs_ms": timing["runs_ms"], "cuda_graph": in_graph,
            "eager_ms": verify_eager["ms"],
            "ratio_to_decode": timing["ms"] / baseline,
            "ratio_to_eager_decode": timing["ms"] / eager["ms"],
            "roofline_ms": verify_roof * 1e3, "roofline_ratio": verify_roof / decode_roof,
            "first_rows_max_abs_diff": (first - decode_logits).abs().max().item(),
            "first_rows_argmax_agree": (first.argmax(-1) == decode_logits.argmax(-1))
            .float().mean().item(),
            "break_even_L": step_ms / baseline,
            "speedup": speedups(args.acceptance_lengths, k, baseline, timing["ms"],
                                args.draft_ms),
            "speedup_vs_eager_decode": speedups(args.acceptance_lengths, k, eager["ms"],
                                                timing["ms"], args.draft_ms),
            "tok_s_at_L": {f"{length:g}": size * length / step_ms * 1e3
                           for length in args.acceptance_lengths if length <= k + 1},
        })
    row["decode"]["tok_s"] = size / baseline * 1e3
    return row


def run(args: argparse.Namespace, device, record: dict[str, Any]) -> None:
    text = text_config(args.shape)
    rng = np.random.default_rng(args.seed)
    largest, k_max = max(args.batch_sizes), max(args.num_draft_tokens)
    batched = args.max_num_batched_tokens or EngineArgs().max_num_batched_tokens
    # Room for what early requests decode while the others prefill (up to 1 + k_max tokens a
    # step: the engine speculates), and for the drafts.
    margin = (-(-largest * args.context // batched) + 16) * (1 + k_max)
    started = time.perf_counter()
    llm, info = build_muse(
        args.shape, device, args.dtype, enforce_eager=args.enforce_eager, seed=args.seed,
        max_model_len=args.context + margin + k_max + 1, max_num_seqs=largest,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization, overlap_schedule=False,
        **graph_engine_args(args),
        # Speculation makes the engine capture its verify graphs; n-gram needs no drafter.
        speculative_config={"method": "ngram", "num_speculative_tokens": k_max})
    info["build_s"] = time.perf_counter() - started
    info["decode_graphs"] = llm.engine.executor.worker.decode_graphs is not None
    info["verify_graph_query_lens"] = [g.query_len for g in llm.engine.executor.worker.graphs
                                       if g.query_len > 1]
    record["engine"] = info
    requests, info["prefill_s"] = prefill_requests(llm, largest, args, rng, text.vocab_size)
    for request in requests:
        if not llm.engine.kv_cache.allocate(request, 1 + k_max):
            raise RuntimeError("no KV blocks left for the draft positions; lower "
                               "--batch-sizes or --context")
    roof = Roofline(text, Machine(args.mem_bandwidth, args.matmul_flops),
                    DTYPE_BYTES[args.dtype])
    for size in args.batch_sizes:
        try:
            row = measure(llm, requests[:size], args, device, roof, rng, text.vocab_size)
        except Exception as exc:  # noqa: BLE001 - keep the other batch sizes' figures
            row = {"batch_size": size, "error": error_text(exc)}
        record["rows"].append(row)
        write_json(args.out, record)
        print(f"  batch {size}: done", flush=True)
    llm = requests = None  # frees the engine
    info["allocated_after_free"] = free_memory(device)
    info["wall_s"] = time.perf_counter() - started


def report(record: dict[str, Any]) -> str:
    lengths = [f"{x:g}" for x in record["config"]["acceptance_lengths"]]
    headers = ["batch", "context", "decode ms", "graph ms", "k", "verify eager", "verify ms",
               "verify/dec", "roof ratio", "break-even L", *[f"x at L={x}" for x in lengths]]
    rows = []
    for row in record["rows"]:
        if "error" in row:
            rows.append([str(row["batch_size"]), "error: " + row["error"][:60],
                         *[""] * (len(headers) - 2)])
            continue
        decode = row["decode"]
        context = str(row["context_min"]) if row["context_min"] == row["context_max"] \
            else f"{row['context_min']}-{row['context_max']}"
        for verify in row["verify"]:
            rows.append([str(row["batch_size"]), context, fmt(decode["eager_ms"], 2),
                         fmt(decode["graph_ms"], 2), str(verify["k"]),
                         fmt(verify["eager_ms"], 2), fmt(verify["ms"], 2),
                         fmt(verify["ratio_to_decode"], 2), fmt(verify["roofline_ratio"], 2),
                         fmt(verify["break_even_L"], 2),
                         *[fmt(verify["speedup"].get(x), 2) for x in lengths]])
    draft = record["config"]["draft_ms"]
    return "\n".join([
        table(headers, rows),
        "decode ms: eager; graph ms: the engine's decode CUDA graphs; verify ms: its verify "
        "graphs where it has them, else eager. verify/dec, break-even L and speedups against "
        + ("the graph decode step" if record["engine"].get("decode_graphs")
           else "the eager decode step")
        + f"; speedup(L) = L * T_decode / (T_verify + {draft:g} ms drafting); "
        "-: L > k + 1."])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = resolve_device(args.device)
    env = environment(device)
    machine = Machine(args.mem_bandwidth, args.matmul_flops)
    record: dict[str, Any] = {
        "benchmark": "spec_verify_cost", "environment": env, "config": vars(args),
        "shape": {"name": args.shape, "muse": describe_muse_side(text_config(args.shape))},
        "machine": machine.to_dict(), "method": METHOD,
        "notes": {"speedup": SPEEDUP_NOTE,
                  "roofline": ROOFLINE_NOTE + VERIFY_ROOFLINE_NOTE
                  + " roofline_ratio: verify roofline / decode roofline at the same batch."},
        "engine": {}, "rows": []}
    where = env["gpu"] or f"CPU ({env['cpu']})"
    print(f"spec verify cost: {args.shape} ({args.dtype}) on {where}, commit "
          f"{env['git_commit']}; context {args.context}, k {args.num_draft_tokens}, "
          f"batches {args.batch_sizes}", flush=True)
    run(args, device, record)
    write_json(args.out, record)
    print(report(record), flush=True)
    return record


if __name__ == "__main__":
    main()
