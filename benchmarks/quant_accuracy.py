"""Accuracy of each `muse quantize` format: per-projection weight error and next-token KL.

For a checkpoint (`--model`, the shipped default model unless given) and, with `--qwen3-moe`,
a transformers-written Qwen3-MoE (random weights, `save_pretrained`, BF16, the shipped
model's tokenizer), each format of `--formats` is written into a temporary folder by the
`muse quantize` command, then compared with its source (`muse/quantization/report.py`):

- the relative weight error ||W_q - W|| / ||W|| of every quantized projection (attention,
  MLP, each expert's gate / up / down), W_q the engine's dequantized weight: max, median and
  mean, overall and per projection kind;
- KL(p_bf16 || p_quant) of the next-token distribution at every position of held-out texts
  (`--texts`; by default `benchmarks/data/quant_heldout.jsonl`, held-out conversations of the
  default model's three chat tasks), both models run by the engine on the CPU in float32:
  mean, median, p99, max, the worst text's mean and the top-1 agreement.

`muse eval` results of the same checkpoint and format found in `--eval-results`
(`eval-<model folder name>-<format>-cpu.json`) are referenced and summarized; `--eval` runs
`muse eval` on the BF16 checkpoint and each quantized one instead (slow: minutes per
checkpoint on a CPU).

    python benchmarks/quant_accuracy.py --qwen3-moe \\
        --out docs/results/quantization/accuracy-$(git rev-parse --short HEAD).json

`python benchmarks/quant_accuracy.py --write-texts FILE` writes the default text set again
(the same texts: seeded draws from the held-out split).
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runs from a plain checkout (`python benchmarks/quant_accuracy.py`): the repository root
# makes `muse` and `benchmarks` importable without installing.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks.report import REPO_ROOT, environment, table, write_json  # noqa: E402
from muse.presets import SHIPPED_CHECKPOINT  # noqa: E402
from muse.quantization import report  # noqa: E402

DEFAULT_FORMATS = ("fp8", "nvfp4-w4a16")
DEFAULT_TEXTS = Path(__file__).resolve().parent / "data" / "quant_heldout.jsonl"
EVAL_RESULTS = REPO_ROOT / "docs" / "results" / "quantization"
# The eval JSON file names' spelling of a format, where it differs from the format's name:
# the shipped `-nvfp4-` results are of the weight-only (W4A16) format, so a W4A4 `nvfp4`
# format must not pick them up.
EVAL_NAMES = {"nvfp4-w4a16": ("nvfp4-w4a16", "nvfp4"), "nvfp4": ("nvfp4-w4a4",)}
EVAL_SECTIONS = ("arithmetic", "tools", "instructions")
TEXTS_PER_TASK = 8
TEXTS_SEED = "quant-accuracy"
# The Qwen3-MoE measured with --qwen3-moe: small, random normal weights of this std (large
# enough that the next-token distributions are far from uniform), stored in BF16.
QWEN3_MOE = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, num_experts=8, num_experts_per_tok=2,
                 max_position_embeddings=4096, tie_word_embeddings=False)
QWEN3_MOE_STD = 0.05


# ---- inputs -----------------------------------------------------------------------------------

def held_out_texts(per_task: int = TEXTS_PER_TASK, seed: str = TEXTS_SEED) -> list[dict]:
    """`per_task` held-out conversations of each chat task of the default model (arithmetic,
    tool calls, instructions), rendered with its chat template: {"task", "text"} each."""
    from muse.tokenizer import MuseTokenizer
    from muse.train.data import conversations
    from muse.train.data.split import HELD_OUT

    tokenizer = MuseTokenizer.from_pretrained(SHIPPED_CHECKPOINT)
    rng = random.Random(seed)
    texts = []
    for make in (conversations.arithmetic_conversation, conversations.tool_conversation,
                 conversations.instruction_conversation):
        for _ in range(per_task):
            conversation = make(rng, HELD_OUT)
            texts.append({"task": conversation.task, "text": tokenizer.apply_chat_template(
                conversation.messages, tools=conversation.tools)})
    return texts


def read_texts(path: str | Path) -> list[str]:
    """A `.jsonl` file of {"text": ...} lines, a `.json` list of strings (or of such
    objects), or any other file as one text."""
    path = Path(path)
    if path.suffix == ".jsonl":
        items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    elif path.suffix == ".json":
        items = json.loads(path.read_text())
    else:
        return [path.read_text()]
    return [item if isinstance(item, str) else item["text"] for item in items]


def write_qwen3_moe(directory: str | Path, seed: int = 0, sizes: dict | None = None,
                    std: float = QWEN3_MOE_STD) -> Path:
    """A random `Qwen3MoeForCausalLM` saved by transformers' `save_pretrained` in BF16, with
    the shipped model's tokenizer (its vocabulary sets the model's)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from muse.tokenizer import MuseTokenizer

    directory = Path(directory)
    tokenizer = MuseTokenizer.from_pretrained(SHIPPED_CHECKPOINT)
    config = Qwen3MoeConfig(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id, **(sizes or QWEN3_MOE))
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0, std)
    model.to(torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def quantize(source: Path, destination: Path, layout: str) -> float:
    """`muse quantize SOURCE DESTINATION --format LAYOUT`; returns its seconds."""
    from muse.cli import main as muse_main

    started = time.monotonic()
    with contextlib.redirect_stdout(sys.stderr):
        muse_main(["quantize", str(source), str(destination), "--format", layout])
    return time.monotonic() - started


# ---- muse eval --------------------------------------------------------------------------------

def eval_summary(result: dict) -> dict:
    """The figures of the docs' table from a `muse eval` report."""
    summary: dict[str, Any] = {}
    if "arithmetic" in result:
        summary["arithmetic"] = result["arithmetic"]["overall"]["exact"]
        summary["arithmetic_count"] = result["arithmetic"]["overall"]["count"]
    if "tools" in result:
        summary |= {"tools_valid": result["tools"]["valid"],
                    "tools_correct": result["tools"]["correct"],
                    "tools_count": result["tools"]["count"]}
    if "instructions" in result:
        cells = result["instructions"].values()
        count = sum(cell["count"] for cell in cells)
        summary["instructions"] = sum(cell["count"] * cell["exact"] for cell in cells) / count
        summary["instructions_count"] = count
    return summary


def relative_to_bf16(summary: dict, bf16: dict | None) -> dict:
    """Each score as a share of the BF16 checkpoint's, and the worst."""
    if not bf16:
        return {}
    shares = {key: summary[key] / bf16[key] for key in
              ("arithmetic", "tools_valid", "tools_correct", "instructions")
              if key in summary and bf16.get(key)}
    if not shares:
        return {}
    worst = min(shares, key=shares.get)
    return {"of_bf16": shares, "worst_of_bf16": shares[worst], "worst": worst}


def _display(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


def stored_eval(folder: Path, model_name: str, layout: str) -> dict | None:
    """The `muse eval` results kept for this checkpoint and format, if any."""
    for name in EVAL_NAMES.get(layout, (layout,)):
        path = folder / f"eval-{model_name}-{name}-cpu.json"
        if path.is_file():
            result = json.loads(path.read_text())
            return {"path": _display(path), "command": result.get("command"),
                    **eval_summary(result)}
    return None


def run_eval(checkpoint: Path, num: int, dtype: str, out: Path | None) -> dict:
    """`muse eval` of the checkpoint on the CPU (arithmetic, tools, instructions)."""
    from muse.eval.options import EvalSettings
    from muse.eval.run import evaluate

    result = evaluate(str(checkpoint), EvalSettings(num=num, sections=EVAL_SECTIONS),
                      progress=False, device="cpu", dtype=dtype)
    entry: dict[str, Any] = {"num": num}
    if out is not None:
        write_json(out, result)
        entry["path"] = _display(out)
    return entry | eval_summary(result)


# ---- one model --------------------------------------------------------------------------------

def measure_model(name: str, source: Path, formats: Sequence[str], texts: Sequence[str],
                  work: Path, args: argparse.Namespace, with_eval: bool = True) -> dict:
    """Every format of one checkpoint: quantize, weight errors, KL (and, `with_eval`, the
    `muse eval` results)."""
    result: dict[str, Any] = {"path": _display(source), "formats": {}}
    reference = report.load_engine(source, args.dtype)
    eval_out = None if args.out is None else Path(args.out).with_suffix("")
    evals: dict[str, dict | None] = {}
    if not with_eval:
        pass
    elif args.eval:
        evals["bf16"] = run_eval(source, args.eval_num, args.dtype, eval_out and Path(
            f"{eval_out}-eval-{name}-bf16.json"))
    elif args.eval_results:
        evals["bf16"] = stored_eval(Path(args.eval_results), source.name, "bf16")
    if evals.get("bf16"):
        result["eval_bf16"] = evals["bf16"]
    for layout in formats:
        destination = work / f"{name}-{layout}"
        entry: dict[str, Any] = {"quantize_seconds": round(quantize(source, destination,
                                                                    layout), 1)}
        quantized = report.load_engine(destination, args.dtype, **args.engine_args)
        started = time.monotonic()
        entry |= report.compare_checkpoints(reference, quantized, texts, args.max_tokens,
                                            args.dtype, per_module=args.per_module)
        entry["measure_seconds"] = round(time.monotonic() - started, 1)
        quantized.shutdown()
        if not with_eval:
            found = None
        elif args.eval:
            found = run_eval(destination, args.eval_num, args.dtype, eval_out and Path(
                f"{eval_out}-eval-{name}-{layout}.json"))
        elif args.eval_results:
            found = stored_eval(Path(args.eval_results), source.name, layout)
        else:
            found = None
        if found:
            entry["eval"] = found | relative_to_bf16(found, evals.get("bf16"))
        result["formats"][layout] = entry
        if not args.keep:
            shutil.rmtree(destination, ignore_errors=True)
        print(f"{name} {layout}: done", file=sys.stderr)
    reference.shutdown()
    return result


# ---- the run ----------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default=str(SHIPPED_CHECKPOINT),
                        help="the unquantized checkpoint folder")
    parser.add_argument("--no-model", action="store_true",
                        help="measure only the Qwen3-MoE (with --qwen3-moe)")
    parser.add_argument("--formats", default=",".join(DEFAULT_FORMATS),
                        help="comma-separated `muse quantize --format` values")
    parser.add_argument("--qwen3-moe", action="store_true",
                        help="also build and measure a transformers Qwen3-MoE")
    parser.add_argument("--texts", default=str(DEFAULT_TEXTS),
                        help="held-out texts: .jsonl of {\"text\": ...}, .json list, or one text")
    parser.add_argument("--num-texts", type=int, default=None, help="use the first N texts")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="tokens per text, from its start (None: all)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="compute dtype of both models")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a `muse.LLM` argument of the quantized checkpoints' engine, e.g. "
                             "quantization_emulate_activations=true (VALUE read as JSON, "
                             "else as a string); repeatable")
    parser.add_argument("--eval", action="store_true",
                        help="run `muse eval` on the BF16 and each quantized checkpoint")
    parser.add_argument("--eval-num", type=int, default=40, help="`muse eval --num`")
    parser.add_argument("--eval-results", default=str(EVAL_RESULTS),
                        help="where stored `muse eval` JSONs are looked up ('' for nowhere)")
    parser.add_argument("--per-module", action="store_true",
                        help="every projection's error in the JSON, not only summaries")
    parser.add_argument("--work-dir", default=None,
                        help="write the checkpoints here (None: a temporary folder)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the quantized checkpoints (with --work-dir)")
    parser.add_argument("--out", default=None, help="write the JSON record here")
    parser.add_argument("--write-texts", default=None, metavar="FILE",
                        help="write the default held-out text set to FILE and exit")
    args = parser.parse_args(argv)
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    args.engine_args = {}
    for item in args.engine_arg:
        key, equals, value = item.partition("=")
        if not equals or not key:
            parser.error(f"--engine-arg wants KEY=VALUE, got {item!r}")
        try:
            args.engine_args[key] = json.loads(value)
        except json.JSONDecodeError:
            args.engine_args[key] = value
    if args.no_model and not args.qwen3_moe:
        parser.error("--no-model leaves nothing to measure without --qwen3-moe")
    if args.keep and args.work_dir is None:
        parser.error("--keep needs --work-dir")
    return args


def format_table(record: dict) -> str:
    headers = ["model", "format", "projections", "err max", "err median", "KL mean",
               "KL p99", "KL max", "top-1 same", "eval of BF16 (worst)"]
    rows = []
    for name, model in record["models"].items():
        for layout, entry in model["formats"].items():
            weights, kl = entry["weights"]["all"], entry["kl"]
            found = entry.get("eval", {})
            worst = f"{100 * found['worst_of_bf16']:.1f}% ({found['worst']})" \
                if "worst_of_bf16" in found else "-"
            rows.append([name, layout, str(weights["count"]), f"{weights['max']:.4f}",
                         f"{weights['median']:.4f}", f"{kl['mean']:.4f}", f"{kl['p99']:.3f}",
                         f"{kl['max']:.3f}", f"{100 * kl['top1_agreement']:.1f}%", worst])
    return table(headers, rows)


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.write_texts:
        path = Path(args.write_texts)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(item) + "\n" for item in held_out_texts()))
        print(f"wrote {path}")
        return {}
    texts = read_texts(args.texts)[:args.num_texts]
    record: dict[str, Any] = {
        "benchmark": "quant_accuracy",
        "environment": environment(torch.device("cpu")),
        "config": {"formats": args.formats, "texts": _display(Path(args.texts)),
                   "num_texts": len(texts), "max_tokens": args.max_tokens,
                   "dtype": args.dtype, "device": "cpu", "eval": args.eval,
                   "quantized_engine_args": args.engine_args,
                   "qwen3_moe": ({"sizes": QWEN3_MOE, "std": QWEN3_MOE_STD, "seed": 0,
                                  "dtype": "bfloat16"} if args.qwen3_moe else None),
                   "command": [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]},
        "models": {},
    }
    with contextlib.ExitStack() as stack:
        if args.work_dir:
            work = Path(args.work_dir)
            work.mkdir(parents=True, exist_ok=True)
        else:
            work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="quant-acc-")))
        if not args.no_model:
            source = Path(args.model)
            record["models"][source.name] = measure_model(source.name, source, args.formats,
                                                          texts, work, args)
            write_json(args.out, record)
        if args.qwen3_moe:
            source = write_qwen3_moe(work / "qwen3-moe-bf16")
            # Random weights: `muse eval` would measure nothing.
            record["models"]["qwen3-moe"] = measure_model("qwen3-moe", source, args.formats,
                                                          texts, work, args, with_eval=False)
            record["models"]["qwen3-moe"]["path"] = "(built: transformers Qwen3MoeForCausalLM)"
            if not args.keep:
                shutil.rmtree(source, ignore_errors=True)
    record["kl_note"] = ("KL(p_bf16 || p_quant) in nats per position; p99 and max over all "
                         "positions of all texts")
    print(format_table(record))
    write_json(args.out, record)
    if args.out:
        print(f"wrote {args.out}")
    return record


if __name__ == "__main__":
    main()
