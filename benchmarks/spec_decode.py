"""What speculative decoding gives on the shipped model: acceptance per task and end-to-end speed.

Offline, through `muse.LLM` on one device, on held-out chat prompts of the default model's
task families (arithmetic, tool calls, instructions; never trained on), rendered with the
chat template as `LLM.chat` renders them.

1. Acceptance. For each family, --num-prompts prompts of up to --max-tokens output tokens:
     greedy:        temperature 0, the speculative config as given (its drafts);
     sampled_token: temperature --temperature, probabilistic drafts, token-wise verification;
     sampled_block: temperature --temperature, probabilistic drafts, block verification.
   From the engine's counters (`llm.engine.spec_stats`), as deltas around each family's run:
     mean acceptance length L = 1 + accepted / drafts (tokens per target forward of a request,
     the one extra token included), and the per-position rates accepted_per_position[j] /
     drafts. Greedy outputs with speculation are compared with greedy outputs without, token
     for token (speculation is lossless: they should all be equal).

2. Speed. At each --concurrency C, waves of C prompts of the held-out mix are started
   together, one wave after the other until --speed-requests requests ran (at least one
   wave; greedy, up to --max-tokens output tokens each, each ending at its end-of-turn token
   unless --ignore-eos), and the waves are timed wall clock together (median of --repeats
   after one untimed warm-up), for three modes:
   plain, speculative, and speculative with adaptive verification. Reported: output tokens/s,
   the speedup over plain, and output tokens/s per request (at C = 1: one user's rate).

Each setting runs on its own engine, built in turn and freed before the next. Prefix caching is
off unless --enable-prefix-caching: with it, repeated and warm-up prompts would hit the cache
and the timed runs would skip their prefill.

    python benchmarks/spec_decode.py --out results/spec-decode-muse-spark-default.json
    python benchmarks/spec_decode.py --device cpu --num-prompts 2 --max-tokens 8 \\
        --concurrency 1,2 --speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a plain checkout (`python benchmarks/spec_decode.py`): the repository root makes
# `muse` and `benchmarks` importable without installing.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

from benchmarks.engines import free_memory, median, timed  # noqa: E402
from benchmarks.options import parse_list, resolve_device  # noqa: E402
from benchmarks.report import REPO_ROOT, environment, fmt, pct, table, write_json  # noqa: E402
from muse.presets import PRESETS, SHIPPED_CHECKPOINT  # noqa: E402
from muse.speculative.config import SpeculativeConfig  # noqa: E402
from muse.train.data.split import HELD_OUT  # noqa: E402
from muse.train.drafter_data import render_prompt, sample_prompts  # noqa: E402

FAMILIES = ("arithmetic", "tools", "instructions")
DEFAULT_SPEC = '{"method": "dspark"}'
DRAFTER_METHODS = ("dflash", "dspark")
MODES = ("plain", "speculative", "adaptive")

NOTES = {
    "prompts": "held-out chat prompts (train/held-out split by problem key, "
               "muse/train/data/split.py) of the default model's conversations: cut before one "
               "of their assistant turns and rendered with the chat template, generation prompt "
               "included; a prompt's family is its conversation's first exchange (a follow-up "
               "turn may be of another kind); identical renderings within a family are dropped",
    "mean_acceptance_length": "1 + accepted draft tokens / drafts: tokens emitted per target "
                              "forward of a request that had drafts, the one extra token "
                              "included (1 = no draft accepted; at most 1 + "
                              "num_speculative_tokens)",
    "drafts": "engine counter num_drafts: one per request and step with at least one draft",
    "acceptance_rate": "accepted draft tokens / draft tokens verified",
    "mean_draft_length": "draft tokens verified / drafts (below num_speculative_tokens near "
                         "max_tokens, where n-grams find no match, or where adaptive "
                         "verification trims)",
    "per_position": "accepted_per_position[j] / drafts: share of drafts whose accepted prefix "
                    "reaches draft position j + 1 (0-based j)",
    "conditional_per_position": "accepted_per_position[j] / accepted_per_position[j - 1] "
                                "(j = 0: / drafts): acceptance at position j given the drafts "
                                "before it were accepted",
    "greedy_equal_to_plain": "requests whose greedy output token ids with speculation equal "
                             "those of the plain engine, out of all requests",
    "settings": "greedy: temperature 0 with the speculative config as given; sampled_token / "
                "sampled_block: temperature --temperature (seeded per request), "
                "draft_sample_method probabilistic, rejection_sample_method token / block; "
                "model-free methods (ngram) draft one-hot whatever draft_sample_method says, so "
                "token and block verification follow the same law there. Adaptive verification "
                "is off in all three",
    "output_tok_s": "output tokens of all waves' requests / their wall time (median of "
                    "repeats, after one untimed warm-up of the same requests)",
    "per_request_tok_s": "output_tok_s / C; at C = 1 it is one user's decode rate (prefill "
                         "included)",
    "speedup": "output_tok_s of the mode / output_tok_s of plain at the same C",
    "modes": "plain: no speculation, the engine's default schedule (overlapped steps, decode "
             "CUDA graphs on a GPU); speculative: the config as given, adaptive verification "
             "off (each step read back before the next; draft and verify passes in CUDA "
             "graphs on a GPU); adaptive: the same with enable_adaptive_verification",
    "speed_workload": "max(1, speed_requests // C) waves of C prompts of the held-out mix "
                      "(the default model's task mix, its prompts of the families above; "
                      "wave w takes the next C), one "
                      "llm.generate each, its C requests submitted at once; greedy, up to "
                      "max_tokens output tokens each (exactly, past the end of turn, with "
                      "ignore_eos); the engine's max_num_seqs is at least C",
    "speed_equal_to_plain": "requests of the last timed run whose output equals the plain "
                            "run's, out of all its waves' requests",
}


# ---- options -------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(SHIPPED_CHECKPOINT),
                        help="a checkpoint folder or a preset (default: the shipped model)")
    parser.add_argument("--speculative-config", default=DEFAULT_SPEC, metavar="JSON",
                        help=f"as LLM(speculative_config=...) takes it (default: {DEFAULT_SPEC}, "
                             "the shipped drafter in <model>/drafter)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default="auto",
                        choices=("auto", "bfloat16", "float16", "float32"),
                        help="auto: the checkpoint's on a GPU, float32 on the CPU")
    parser.add_argument("--num-prompts", type=int, default=64,
                        help="held-out prompts per task family for the acceptance runs")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="output tokens per request, at most")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="speed: generate exactly --max-tokens per request, past the end "
                             "of turn (the model's text there is not what the drafter learnt)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="temperature of the sampled acceptance runs")
    parser.add_argument("--concurrency", type=parse_list, default=[1, 8, 32, 64],
                        help="requests run at once in the speed runs, comma separated")
    parser.add_argument("--speed-requests", type=int, default=16,
                        help="speed: requests per timed run, in waves of --concurrency "
                             "(several prompts, so that one prompt's acceptance does not "
                             "decide the batch-1 figure)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per concurrency and mode (median reported)")
    parser.add_argument("--sections", type=lambda s: parse_list(s, str),
                        default=["acceptance", "speed"],
                        help="acceptance, speed or both (comma separated)")
    parser.add_argument("--seed", type=int, default=1,
                        help="draws the held-out prompts and seeds the sampled requests (the "
                             "drafter's own evaluation prompts are drawn with its training "
                             "seed, 0 by default)")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--kv-cache-gib", type=float, default=8.0,
                        help="KV cache of each engine on the GPU, GiB (a fixed size: every "
                             "engine gets the same, whatever the engines before it left); "
                             "the CPU keeps the engine's default")
    engine.add_argument("--max-num-seqs", type=int, default=None,
                        help="default: the larger of --num-prompts and the largest "
                             "--concurrency")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per engine step (default: the engine's)")
    engine.add_argument("--enable-prefix-caching", action="store_true",
                        help="keep the engine's prefix cache on (see the module docstring)")
    engine.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    engine.add_argument("--detokenize", action="store_true",
                        help="keep muse's per-step detokenizer (off: ids in, ids out)")
    args = parser.parse_args(argv)
    try:
        args.spec = SpeculativeConfig.parse(args.speculative_config)
    except ValueError as error:
        parser.error(f"--speculative-config: {error}")
    if args.spec is None:
        parser.error("--speculative-config: give a config (a method to measure)")
    unknown = set(args.sections) - {"acceptance", "speed"}
    if unknown or not args.sections:
        parser.error(f"--sections: acceptance and/or speed, got {args.sections}")
    if min(args.num_prompts, args.max_tokens, args.repeats, args.speed_requests) < 1:
        parser.error("--num-prompts, --max-tokens, --repeats and --speed-requests must be "
                     "positive")
    if not args.concurrency or min(args.concurrency) < 1:
        parser.error("--concurrency: positive integers, comma separated")
    if not args.kv_cache_gib > 0:
        parser.error("--kv-cache-gib must be positive")
    if not 0 < args.temperature <= 100:
        parser.error("--temperature must be in (0, 100]")
    args.model = resolve_model(args.model)
    if args.max_num_seqs is None:
        args.max_num_seqs = max(args.num_prompts, max(args.concurrency))
    elif args.max_num_seqs < max(args.concurrency):
        parser.error("--max-num-seqs must hold the largest --concurrency")
    return args


def resolve_model(model: str) -> str:
    """A preset as named; a folder as given, else relative to the repository root."""
    if model in PRESETS or Path(model).is_dir():
        return model
    in_repo = REPO_ROOT / model
    return str(in_repo) if in_repo.is_dir() else model


def check_drafter(model: str, spec: SpeculativeConfig) -> None:
    """Fail before anything runs when a drafter method has no drafter checkpoint."""
    if spec.method not in DRAFTER_METHODS:
        return
    folder = Path(spec.model) if spec.model else Path(model) / "drafter"
    if not (folder / "config.json").is_file():
        raise SystemExit(
            f"speculative method {spec.method!r} needs a drafter checkpoint: {folder} has none. "
            "Train one (`muse train drafter`), set \"model\" in --speculative-config, or "
            "measure n-gram drafts: --speculative-config '{\"method\": \"ngram\"}'")


def spec_variant(spec: SpeculativeConfig, **overrides: Any) -> dict[str, Any]:
    return {**spec.to_dict(), **overrides}


# ---- prompts -------------------------------------------------------------------------------
@dataclasses.dataclass
class Prompts:
    families: dict[str, list[list[int]]]  # family -> rendered prompts (acceptance)
    mix: list[list[int]]  # the held-out stream in the default model's task mix (speed)
    source: str


def held_out_prompts(tokenizer: Any, per_family: int, mix_size: int, seed: int) -> Prompts:
    """`per_family` distinct prompts of each family and the first `mix_size` of the stream
    that are of those families. The stream follows the training mix of the default model's
    data generators, which also holds tasks the shipped model was never taught (the next
    version's unseen tools): prompts of those would measure that, not speculation."""
    num = max(6 * per_family, mix_size)
    source = "muse.train.drafter_data.sample_prompts"
    while True:
        drawn = sample_prompts(num, seed, HELD_OUT)
        families: dict[str, list[list[int]]] = {family: [] for family in FAMILIES}
        seen: set[tuple[int, ...]] = set()
        mix = []
        for prompt in drawn:
            group = families.get(prompt.task)
            if group is None:
                continue
            ids = list(render_prompt(tokenizer, prompt))
            if len(mix) < mix_size:
                mix.append(ids)
            if len(group) >= per_family or tuple(ids) in seen:
                continue
            seen.add(tuple(ids))
            group.append(ids)
        if len(mix) == mix_size and all(len(group) == per_family
                                        for group in families.values()):
            return Prompts(families, mix, source)
        if num > 64 * per_family + mix_size:
            short = {f: len(g) for f, g in families.items() if len(g) < per_family}
            raise SystemExit(f"too few distinct held-out prompts: {short}")
        num *= 2


# ---- engines -------------------------------------------------------------------------------
def build_llm(args: argparse.Namespace, speculative_config: dict[str, Any] | None
              ) -> tuple[Any, dict[str, Any]]:
    from muse import LLM

    kwargs: dict[str, Any] = {
        "dtype": args.dtype, "device": args.device, "seed": args.seed,
        "max_num_seqs": args.max_num_seqs, "enforce_eager": args.enforce_eager,
        "enable_prefix_caching": args.enable_prefix_caching,
        "speculative_config": speculative_config}
    if args.device == "cuda":
        kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    started = time.perf_counter()
    llm = LLM(args.model, **kwargs)
    engine = llm.engine
    info: dict[str, Any] = {
        "speculative_config": speculative_config,
        "build_s": round(time.perf_counter() - started, 2),
        "dtype": str(getattr(engine, "dtype", None)),
        "overlap_schedule": getattr(engine, "overlap_schedule", None),
        "max_model_len": getattr(engine, "max_model_len", None)}
    costs = getattr(engine, "step_costs", None)
    if costs is not None:
        info["step_costs"] = costs.to_dict()
    return llm, info


def release(device: Any) -> int | None:
    """Collect the engine just dropped (on CUDA also give its cached blocks back), so the next
    one starts on an empty device; the bytes still allocated on CUDA."""
    gc.collect()
    return free_memory(device)


class StatsWindow:
    """The engine's speculation counters accumulated inside a `with` block (`delta`)."""

    def __init__(self, llm: Any) -> None:
        self.stats = llm.engine.spec_stats

    def snapshot(self) -> tuple[int, int, int, list[int]]:
        s = self.stats
        if s is None:  # no speculation
            return 0, 0, 0, []
        return (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens,
                list(s.accepted_per_position))

    def __enter__(self) -> StatsWindow:
        self.before = self.snapshot()
        return self

    def __exit__(self, *exc: Any) -> None:
        after = self.snapshot()
        self.delta = {
            "num_drafts": after[0] - self.before[0],
            "num_draft_tokens": after[1] - self.before[1],
            "num_accepted_tokens": after[2] - self.before[2],
            "accepted_per_position": [a - b for a, b in zip(after[3], self.before[3])]}


def summarize(counts: dict[str, Any]) -> dict[str, Any]:
    """Counters (deltas) and the figures defined in NOTES."""
    drafts, tokens = counts["num_drafts"], counts["num_draft_tokens"]
    accepted, per_pos = counts["num_accepted_tokens"], counts["accepted_per_position"]
    conditional, previous = [], drafts
    for count in per_pos:
        conditional.append(count / previous if previous else None)
        previous = count
    return {**counts,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_rate": accepted / tokens if tokens else None,
            "mean_draft_length": tokens / drafts if drafts else None,
            "per_position": [c / drafts if drafts else None for c in per_pos],
            "conditional_per_position": conditional}


def add_counts(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The counters of several runs of one engine added up."""
    return {"num_drafts": sum(r["num_drafts"] for r in rows),
            "num_draft_tokens": sum(r["num_draft_tokens"] for r in rows),
            "num_accepted_tokens": sum(r["num_accepted_tokens"] for r in rows),
            "accepted_per_position": [sum(column) for column in
                                      zip(*(r["accepted_per_position"] for r in rows))]}


def generate_ids(llm: Any, prompts: Sequence[list[int]], params: Any) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params,
                           use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def first_mismatch(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ---- acceptance ----------------------------------------------------------------------------
def acceptance_params(args: argparse.Namespace, setting: str, count: int, family_index: int
                      ) -> list[Any]:
    from muse import SamplingParams

    if setting == "greedy":
        return [SamplingParams(temperature=0.0, max_tokens=args.max_tokens)] * count
    base = (args.seed * len(FAMILIES) + family_index) * 1_000_003
    return [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                           seed=base + i) for i in range(count)]


def run_acceptance(llm: Any, args: argparse.Namespace, setting: str, prompts: Prompts,
                   reference: dict[str, list[list[int]]] | None) -> dict[str, Any]:
    """Each family's run and the figures of all families together; greedy outputs are
    compared with `reference` (the plain engine's) where given."""
    result: dict[str, Any] = {}
    for index, family in enumerate(FAMILIES):
        ids = prompts.families[family]
        params = acceptance_params(args, setting, len(ids), index)
        with StatsWindow(llm) as window:
            outputs, wall = timed(lambda: generate_ids(llm, ids, params), args.device_obj)
        row = summarize(window.delta)
        row.update({"requests": len(ids), "output_tokens": sum(map(len, outputs)),
                    "wall_s": wall})
        if reference is not None:
            mismatches = [{"request": i, "first_differing_token": first_mismatch(a, b)}
                          for i, (a, b) in enumerate(zip(outputs, reference[family]))
                          if a != b]
            row["equal_to_plain"] = len(ids) - len(mismatches)
            row["mismatches"] = mismatches[:10]
        result[family] = row
    rows = [result[f] for f in FAMILIES]
    total = summarize(add_counts(rows))
    total.update({"requests": sum(r["requests"] for r in rows),
                  "output_tokens": sum(r["output_tokens"] for r in rows)})
    if reference is not None:
        total["equal_to_plain"] = sum(r["equal_to_plain"] for r in rows)
    result["all"] = total
    return result


# ---- speed ---------------------------------------------------------------------------------
def speed_waves(prompts: Prompts, concurrency: int, requests: int) -> list[list[list[int]]]:
    """max(1, requests // concurrency) waves of `concurrency` prompts of the held-out mix,
    taken in order (repeated if it is shorter)."""
    mix = prompts.mix
    waves = max(1, requests // concurrency)
    return [[mix[(w * concurrency + i) % len(mix)] for i in range(concurrency)]
            for w in range(waves)]


def run_speed(llm: Any, args: argparse.Namespace, prompts: Prompts, mode: str,
              plain_outputs: dict[int, list[list[int]]]) -> list[dict[str, Any]]:
    from muse import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                            ignore_eos=args.ignore_eos)
    rows = []
    for concurrency in args.concurrency:
        waves = speed_waves(prompts, concurrency, args.speed_requests)

        def run_waves() -> list[list[int]]:
            return [out for wave in waves for out in generate_ids(llm, wave, params)]

        run_waves()  # warm-up: kernels compile at new sizes
        walls, outputs = [], []
        with StatsWindow(llm) as window:
            for _ in range(args.repeats):
                outputs, wall = timed(run_waves, args.device_obj)
                walls.append(wall)
        tokens = sum(map(len, outputs))
        wall = median(walls)
        row: dict[str, Any] = {"concurrency": concurrency, "requests": len(outputs),
                               "output_tokens": tokens,
                               "wall_s": wall, "wall_s_runs": walls,
                               "output_tok_s": tokens / wall,
                               "per_request_tok_s": tokens / wall / concurrency}
        if mode == "plain":
            plain_outputs[concurrency] = outputs
        else:
            stats = summarize(window.delta)
            row.update({k: stats[k] for k in ("num_drafts", "mean_acceptance_length",
                                              "mean_draft_length", "acceptance_rate")})
            if concurrency in plain_outputs:
                row["equal_to_plain"] = sum(x == y for x, y in
                                            zip(outputs, plain_outputs[concurrency]))
        rows.append(row)
    return rows


def speed_table(results: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per concurrency: every mode's figures and its speedup over plain."""
    by_mode = {mode: {r["concurrency"]: r for r in rows} for mode, rows in results.items()}
    concurrencies = sorted({c for rows in by_mode.values() for c in rows})
    table_rows = []
    for c in concurrencies:
        row: dict[str, Any] = {"concurrency": c}
        plain = by_mode.get("plain", {}).get(c)
        for mode in MODES:
            figures = by_mode.get(mode, {}).get(c)
            if figures is None:
                continue
            entry = dict(figures)
            entry.pop("concurrency")
            if plain is not None:
                entry["speedup"] = figures["output_tok_s"] / plain["output_tok_s"]
            row[mode] = entry
        table_rows.append(row)
    return table_rows


# ---- report --------------------------------------------------------------------------------
def _rates(values: Sequence[float | None]) -> str:
    return " ".join("-" if v is None else f"{100 * v:.0f}" for v in values)


def report(record: dict[str, Any]) -> str:
    lines = []
    acceptance = record.get("acceptance") or {}
    if acceptance:
        k = record["config"]["speculative"]["num_speculative_tokens"]
        rows = []
        for setting, families in acceptance.items():
            for family in (*FAMILIES, "all"):
                row = families[family]
                equal = (f"{row['equal_to_plain']}/{row['requests']}"
                         if "equal_to_plain" in row else "")
                rows.append([setting, family, str(row["requests"]),
                             fmt(row["mean_acceptance_length"], 2),
                             pct(row["acceptance_rate"]), fmt(row["mean_draft_length"], 2),
                             _rates(row["per_position"]), equal])
        lines += [f"acceptance ({record['config']['num_prompts']} held-out prompts a family, "
                  f"up to {record['config']['max_tokens']} tokens, k = {k})",
                  table(["setting", "family", "reqs", "L", "accept", "drafted",
                         "per-position % (1.." + str(k) + ")", "greedy = plain"], rows),
                  "L = 1 + accepted / drafts; accept = accepted / draft tokens; drafted = "
                  "draft tokens per draft;\nper-position = drafts accepted through position "
                  "j / drafts; greedy = plain: outputs equal to the plain engine's"]
    speed = record.get("speed") or []
    if speed:
        rows = []
        for row in speed:
            cells = [str(row["concurrency"])]
            for mode in MODES:
                figures = row.get(mode)
                if figures is None:
                    cells += ["-"] * (2 if mode == "plain" else 5)
                    continue
                cells += [fmt(figures["output_tok_s"]), fmt(figures["per_request_tok_s"], 1)]
                if mode != "plain":
                    speedup = figures.get("speedup")
                    cells += ["-" if speedup is None else f"{speedup:.2f}x",
                              fmt(figures.get("mean_acceptance_length"), 2),
                              f"{figures.get('equal_to_plain', '-')}/{figures['requests']}"]
            rows.append(cells)
        if lines:
            lines.append("")
        ending = "EOS ignored" if record["config"].get("ignore_eos") else "to the end of turn"
        lines += [f"speed (greedy, up to {record['config']['max_tokens']} tokens a request, "
                  f"{ending}; median of {record['config']['repeats']})",
                  table(["C", "plain tok/s", "per req",
                         "spec tok/s", "per req", "speedup", "L", "= plain",
                         "adaptive tok/s", "per req", "speedup", "L", "= plain"], rows),
                  "per req = tok/s / C; speedup: over plain at the same C;\nL = mean "
                  "acceptance length of the timed runs; = plain: outputs equal to plain's"]
    return "\n".join(lines)


# ---- main ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = resolve_device(args.device)
    args.device_obj = device
    check_drafter(args.model, args.spec)
    env = environment(device)
    spec = args.spec
    configs = {
        "speculative": spec_variant(spec, enable_adaptive_verification=False),
        "adaptive": spec_variant(spec, enable_adaptive_verification=True),
        "sampled_token": spec_variant(spec, enable_adaptive_verification=False,
                                      draft_sample_method="probabilistic",
                                      rejection_sample_method="token"),
        "sampled_block": spec_variant(spec, enable_adaptive_verification=False,
                                      draft_sample_method="probabilistic",
                                      rejection_sample_method="block"),
    }
    config = {key: value for key, value in vars(args).items()
              if key not in ("spec", "device_obj")}
    config["speculative"] = spec.to_dict()
    record: dict[str, Any] = {"benchmark": "spec_decode", "environment": env,
                              "config": config, "engine_configs": configs, "notes": NOTES,
                              "engines": {}, "acceptance": {}, "speed": []}
    where = env["gpu"] or f"CPU ({env['cpu']})"
    print(f"spec_decode: {Path(args.model).name} on {where}, commit {env['git_commit']}; "
          f"speculative_config {json.dumps(spec.to_dict())}", flush=True)
    do_acceptance = "acceptance" in args.sections
    do_speed = "speed" in args.sections
    speed_results: dict[str, list[dict[str, Any]]] = {}
    plain_speed: dict[int, list[list[int]]] = {}
    started = time.perf_counter()

    def stage(name: str) -> None:
        print(f"  [{time.perf_counter() - started:6.1f} s] {name}", flush=True)

    # Plain engine: the greedy reference outputs and the plain speed.
    stage("plain engine")
    llm, record["engines"]["plain"] = build_llm(args, None)
    tokenizer = llm.tokenizer
    if tokenizer is None:
        raise SystemExit(f"{args.model} has no tokenizer: chat prompts cannot be rendered")
    prompts = held_out_prompts(tokenizer, args.num_prompts,
                               max(max(args.concurrency), args.speed_requests), args.seed)
    record["prompts"] = {
        "source": prompts.source, "split": HELD_OUT, "seed": args.seed,
        "per_family": {f: {"count": len(p), "mean_tokens": sum(map(len, p)) / len(p)}
                       for f, p in prompts.families.items()},
        "speed_mix_mean_tokens": sum(map(len, prompts.mix)) / len(prompts.mix)}
    if not args.detokenize:
        llm.tokenizer = None  # token ids in, token ids out: no detokenizing per step
    reference: dict[str, list[list[int]]] = {}
    if do_acceptance:
        for index, family in enumerate(FAMILIES):
            ids = prompts.families[family]
            reference[family] = generate_ids(llm, ids,
                                             acceptance_params(args, "greedy", len(ids), index))
    if do_speed:
        stage("plain speed")
        speed_results["plain"] = run_speed(llm, args, prompts, "plain", plain_speed)
        record["speed"] = speed_table(speed_results)
    llm.shutdown()
    llm = None
    record["engines"]["plain"]["allocated_after_free"] = release(device)
    write_json(args.out, record)

    order = [("speculative", do_acceptance or do_speed), ("adaptive", do_speed),
             ("sampled_token", do_acceptance), ("sampled_block", do_acceptance)]
    for name, wanted in order:
        if not wanted:
            continue
        stage(f"{name} engine")
        llm, record["engines"][name] = build_llm(args, configs[name])
        if not args.detokenize:
            llm.tokenizer = None
        if name == "speculative" and do_acceptance:
            record["acceptance"]["greedy"] = run_acceptance(llm, args, "greedy", prompts,
                                                            reference)
        if name in ("sampled_token", "sampled_block"):
            record["acceptance"][name] = run_acceptance(llm, args, name, prompts, None)
        if name in ("speculative", "adaptive") and do_speed:
            stage(f"{name} speed")
            speed_results[name] = run_speed(llm, args, prompts, name, plain_speed)
            record["speed"] = speed_table(speed_results)
        llm.shutdown()
        llm = None
        record["engines"][name]["allocated_after_free"] = release(device)
        write_json(args.out, record)
    record["wall_s"] = time.perf_counter() - started
    write_json(args.out, record)
    print(report(record), flush=True)
    return record


if __name__ == "__main__":
    main()
