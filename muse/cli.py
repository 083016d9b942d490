"""The `muse` command line: one subcommand per job, each a thin layer over the library."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from muse.config import LAYER_TYPES, ConfigError, MuseSparkConfig
from muse.presets import PRESETS, default_model, get_preset


def resolve_config(preset_or_path: str) -> MuseSparkConfig:
    """A preset name, or a checkpoint folder holding a config.json."""
    if preset_or_path in PRESETS:
        return get_preset(preset_or_path)
    from muse.checkpoint import load_config

    return load_config(preset_or_path)


def cmd_info(args: argparse.Namespace) -> None:
    from muse.info import format_info, model_info
    from muse.parallel_plan import format_plan, parallel_plan

    config = resolve_config(args.model)
    info = model_info(config, context=args.context, kv_dtype=args.kv_dtype)
    parallel = _parallel_from(args)
    plan = parallel_plan(config, parallel, context=args.context, weight_dtype=args.dtype,
                         kv_dtype=args.kv_dtype, gpu_memory_gib=args.gpu_memory_gib,
                         gpu_memory_utilization=args.gpu_memory_utilization)
    if args.json:
        print(json.dumps(info.to_dict() | {"parallel": plan.to_dict()}, indent=2))
    else:
        print(format_info(info) + "\n" + format_plan(plan))


def _add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    """The parallel layout's flags (vLLM's names), as `muse serve` takes them."""
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="GPUs each layer's heads, MLP widths and vocabulary are split over")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                        help="pipeline stages, each holding an equal run of layers")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                        help="replicas of the attention and dense weights, each serving its "
                             "own sequences")
    parser.add_argument("--prefill-context-parallel-size", "-pcp", type=int, default=1,
                        help="GPUs a sequence's tokens (and KV cache) are spread over")
    parser.add_argument("--enable-expert-parallel", "-ep", action="store_true",
                        help="hold whole experts, split over the data x prefill-context x "
                             "tensor parallel GPUs of a stage, instead of splitting each expert "
                             "over TP (default: off)")


def _parallel_from(args: argparse.Namespace):
    """The layout of `_add_layout_arguments`' flags (named as ParallelConfig's fields)."""
    import dataclasses

    from muse.distributed.config import ParallelConfig

    return ParallelConfig(**{field.name: getattr(args, field.name)
                             for field in dataclasses.fields(ParallelConfig)})


def cmd_plan(args: argparse.Namespace) -> None:
    from muse.plan.gpus import GPUS
    from muse.plan.projection import project
    from muse.plan.report import format_projection

    parallel = _parallel_from(args)
    parallel.validate()
    memory_efficiency, compute_efficiency = args.memory_efficiency, args.compute_efficiency
    if args.layer_timings is not None:
        from muse.plan.projection import efficiencies_from_layer_timings

        memory_efficiency, compute_efficiency = efficiencies_from_layer_timings(
            json.loads(Path(args.layer_timings).read_text()))
    if args.num_gpus != parallel.world_size:
        raise SystemExit(f"muse plan: error: --num-gpus {args.num_gpus} is not the layout's "
                         f"{parallel.world_size} GPUs (TP x PP x DP x PCP)")
    try:
        concurrency = tuple(int(level) for level in args.concurrency.split(","))
        projection = project(
            resolve_config(args.model), parallel, GPUS[args.gpu], args.weight_format,
            args.kv_cache_dtype, args.context, concurrency, args.gpu_memory_utilization,
            memory_efficiency, compute_efficiency, args.num_speculative_tokens,
            args.acceptance_length)
    except ValueError as error:
        raise SystemExit(f"muse plan: error: {error}") from None
    print(json.dumps(projection.to_dict(), indent=2) if args.json
          else format_projection(projection))


def cmd_init(args: argparse.Namespace) -> None:
    from muse.init_checkpoint import init_random_checkpoint

    config = resolve_config(args.preset)
    init_random_checkpoint(config, args.out, seed=args.seed, dtype=args.dtype)
    print(f"wrote a random {config.name or args.preset} checkpoint (seed {args.seed}) to {args.out}")


def cmd_train_tokenizer(args: argparse.Namespace) -> None:
    from muse.tokenizer import train_tokenizer

    files = [Path(f) for f in args.files]
    tokenizer = train_tokenizer(files, vocab_size=args.vocab_size, out_dir=Path(args.out))
    print(f"trained a {tokenizer.vocab_size}-token tokenizer on {len(files)} files -> {args.out}")


DEFAULT_MODEL = default_model()


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Ends a flag's help with "(default: VALUE)" where the default is a value. Flags without
    an argument, and flags whose default is None, state their default in words instead:
    "(default: off)", "(default: the model's maximum)"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if "(default: " in help_text or action.default is None or action.nargs == 0:
            return help_text
        return super()._get_help_string(action)


def _engine_args(args: argparse.Namespace) -> dict:
    return {"dtype": args.dtype, "device": args.device, "max_model_len": args.max_model_len,
            "seed": args.seed, "enforce_eager": args.enforce_eager,
            "prefill_graph_max_tokens": args.prefill_graph_max_tokens,
            "enable_piecewise_cuda_graph": args.enable_piecewise_cuda_graph,
            "overlap_schedule": not args.disable_overlap_schedule,
            "kv_cache_dtype": args.kv_cache_dtype,
            "calculate_kv_scales": args.calculate_kv_scales,
            "quantization": args.quantization,
            "speculative_config": args.speculative_config,
            "hf_overrides": args.hf_overrides}


def _sampling(args: argparse.Namespace):
    from muse.engine.sampling_params import SamplingParams

    # Special tokens stay visible so a reply shows its reasoning block and tool calls.
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          max_tokens=args.max_tokens, seed=args.sampling_seed,
                          skip_special_tokens=False)


def cmd_generate(args: argparse.Namespace) -> None:
    from muse.llm import LLM

    llm = LLM(args.model, **_engine_args(args))
    for output in llm.generate(args.prompt, _sampling(args)):
        print(output.outputs[0].text)


def cmd_chat(args: argparse.Namespace) -> None:
    """A conversation on the terminal; with --message, one exchange and exit."""
    from muse.llm import LLM

    llm = LLM(args.model, **_engine_args(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    turns = list(args.message) if args.message else None
    while True:
        if turns is not None:
            if not turns:
                return
            text = turns.pop(0)
        else:
            try:
                text = input("user> ")
            except EOFError:
                return
        messages.append({"role": "user", "content": text})
        output = llm.chat(messages, _sampling(args), use_tqdm=False)[0].outputs[0]
        if output.reasoning_content:
            thinking = "\n".join(f"thinking: {line}"
                                  for line in output.reasoning_content.splitlines())
            # Dimmed on a terminal so the answer stands out; the prefix marks it in pipes.
            print(f"\033[2m{thinking}\033[0m" if sys.stdout.isatty() else thinking)
        print(output.text)
        # The template renders reasoning_content back as the turn's think block.
        messages.append({"role": "assistant", "content": output.text,
                         "reasoning_content": output.reasoning_content})


def cmd_serve(args: argparse.Namespace) -> None:
    from muse.server.launch import serve

    serve(args)


def cmd_train_pretrain(args: argparse.Namespace) -> None:
    from muse.train.pretrain import run_from_args

    run_from_args(args)


def cmd_train_encoders(args: argparse.Namespace) -> None:
    from muse.train.encoders import run_from_args

    run_from_args(args)


def cmd_train_drafter(args: argparse.Namespace) -> None:
    from muse.train.drafter import run_from_args

    run_from_args(args)


def cmd_train_grpo(args: argparse.Namespace) -> None:
    from muse.rl.trainer import run_from_args

    run_from_args(args)


def cmd_eval(args: argparse.Namespace) -> None:
    from muse.eval.run import run_from_args

    run_from_args(args)


def cmd_quantize(args: argparse.Namespace) -> None:
    from muse.quantization.quantize import quantize_checkpoint, summary

    settings = quantize_checkpoint(args.source, args.destination, args.format, args.ignore,
                                   calibration_prompts=args.calibration_prompts,
                                   layout=args.layout)
    print(f"wrote {args.destination} ({args.layout} layout, {summary(settings)})")


def cmd_merge_lora(args: argparse.Namespace) -> None:
    from muse.lora.merge import merge_adapter

    changed = merge_adapter(args.base, args.adapter, args.destination)
    print(f"wrote {args.destination} ({len(changed)} tensors with the adapter folded in)")


def cmd_average(args: argparse.Namespace) -> None:
    from muse.checkpoint.average import average_checkpoints

    used = average_checkpoints(args.sources, args.destination, args.weights)
    print(f"wrote {args.destination} (weights {', '.join(f'{w:g}' for w in used)})")


def cmd_grow(args: argparse.Namespace) -> None:
    from muse.checkpoint.grow import grow_checkpoint

    plan = grow_checkpoint(args.source, args.destination, args.insert_after, args.layer_types)
    print(f"wrote {args.destination} ({len(plan.sources)} decoder layers, "
          f"{sum(plan.new)} new: {', '.join(str(j) for j, new in enumerate(plan.new) if new)})")


def cmd_bench_serve(args: argparse.Namespace) -> None:
    from muse.bench.serve import run_from_args

    run_from_args(args)


def _add_storage_flags(parser: argparse.ArgumentParser) -> None:
    """How weights and the KV cache are stored: `muse generate`, `chat` and `eval`."""
    from muse.engine.args import KV_CACHE_DTYPES
    from muse.quantization import ONLINE_FORMATS

    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="KV-cache storage; auto: the model's dtype; fp8 / fp8_e4m3: "
                             "float8 E4M3 with per-layer scales (one byte an element: twice the "
                             "tokens of bfloat16)")
    parser.add_argument("--calculate-kv-scales", action="store_true",
                        help="with an FP8 KV cache, set its scales from the first step's keys "
                             "and values instead of the checkpoint's or 1.0 (default: off)")
    parser.add_argument("--quantization", "-q", default=None, choices=list(ONLINE_FORMATS),
                        help="quantize an unquantized model as it loads, as `muse quantize "
                             "--format` would write it (default: as stored)")


def _add_generation_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16",
                                                            "float16"],
                        help="weights and activations; auto: the checkpoint's dtype on a GPU, "
                             "float32 on a CPU")
    parser.add_argument("--device", default="auto",
                        help="cpu, cuda, cuda:N, or auto (cuda when available)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt plus reply in tokens (default: the model's limit, "
                             "capped by the KV cache)")
    parser.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights")
    _add_storage_flags(parser)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sampling temperature; 0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="sample from the smallest set of tokens with this probability "
                             "mass; 1 keeps all")
    parser.add_argument("--top-k", type=int, default=0,
                        help="sample from the k most likely tokens; 0 keeps all")
    parser.add_argument("--max-tokens", type=int, default=128,
                        help="most tokens generated per reply")
    parser.add_argument("--sampling-seed", type=int, default=None,
                        help="seed of the sampler (default: none, so sampling at a temperature "
                             "above 0 differs from run to run)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run every step eagerly (no CUDA graphs for decode batches) "
                             "(default: off)")
    parser.add_argument("--prefill-graph-max-tokens", type=int, default=1024,
                        help="one-request prefill steps of up to this many tokens replay "
                             "captured CUDA graphs (padded to the next of 16, 24, 32, 48, ...); "
                             "0: they run eagerly")
    parser.add_argument("--enable-piecewise-cuda-graph", action=argparse.BooleanOptionalAction,
                        default=True,
                        help="steps no whole-step graph covers replay every layer's work but "
                             "attention from CUDA graphs (default: on)")
    parser.add_argument("--speculative-config", default=None,
                        help="speculative decoding as JSON, vLLM's names, e.g. "
                             "'{\"method\": \"dspark\"}' for the shipped drafter "
                             "(default: off)")
    parser.add_argument("--hf-overrides", default=None,
                        help="fields of the model's config replaced, as JSON, e.g. "
                             "'{\"num_hidden_layers\": 2}' (default: none)")
    parser.add_argument("--disable-overlap-schedule", action="store_true",
                        help="read each step back before launching the next (when off, the "
                             "next step is launched first, so host work overlaps the GPU) "
                             "(default: off)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="muse", description=__doc__,
                                     formatter_class=DefaultsHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="parameter counts and KV-cache sizes of a model",
                          formatter_class=DefaultsHelpFormatter)
    info.add_argument("model", help=f"a preset ({', '.join(PRESETS)}) or a checkpoint folder")
    info.add_argument("--context", type=int, default=None,
                      help="context length for the KV-cache figure (default: the model's maximum)")
    info.add_argument("--kv-dtype", default="bfloat16",
                      choices=["bfloat16", "float16", "float32", "fp8", "fp8_e4m3"],
                      help="KV-cache dtype of the byte figures")
    info.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                      help="weight dtype of the per-GPU byte figures (default: the config's)")
    _add_layout_arguments(info)
    info.add_argument("--gpu-memory-gib", type=float, default=None,
                      help="memory of one GPU in GiB (an H200 has about 140): adds the KV "
                           "budget and the tokens and sequences that fit (default: none, not "
                           "computed)")
    info.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                      help="fraction of --gpu-memory-gib for weights and KV cache")
    info.add_argument("--json", action="store_true",
                      help="machine-readable output (default: off, a table)")
    info.set_defaults(func=cmd_info)

    _add_plan_parser(sub)

    init = sub.add_parser("init", help="write a seeded random checkpoint of a preset",
                          formatter_class=DefaultsHelpFormatter)
    init.add_argument("out", help="output folder")
    init.add_argument("--preset", required=True, help=f"one of {', '.join(PRESETS)}")
    init.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    init.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                      help="weight dtype (default: the config's)")
    init.set_defaults(func=cmd_init)

    generate = sub.add_parser("generate", help="complete prompts offline",
                              formatter_class=DefaultsHelpFormatter)
    generate.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                          help="a checkpoint folder or a preset (random weights)")
    generate.add_argument("--prompt", action="append", required=True,
                          help="a prompt (repeat for several)")
    _add_generation_flags(generate)
    generate.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="chat with a model on the terminal",
                          formatter_class=DefaultsHelpFormatter)
    chat.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                      help="a checkpoint folder or a preset (random weights)")
    chat.add_argument("--message", action="append",
                      help="send this turn (repeat for several) and exit (default: none, an "
                           "interactive conversation)")
    chat.add_argument("--system", default=None, help="a system prompt (default: none)")
    _add_generation_flags(chat)
    chat.set_defaults(func=cmd_chat)

    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    from muse.server.launch import add_serve_arguments

    add_serve_arguments(serve, DEFAULT_MODEL)
    serve.set_defaults(func=cmd_serve)

    router = sub.add_parser("router", help="an OpenAI-compatible proxy that sends each "
                            "request's prefill and decode to disaggregated instances")
    from muse.router.launch import add_router_arguments

    add_router_arguments(router)
    router.set_defaults(func=cmd_router)

    tok = sub.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer on text files",
                         formatter_class=DefaultsHelpFormatter)
    tok.add_argument("out", help="output folder")
    tok.add_argument("files", nargs="+", help="training text files")
    tok.add_argument("--vocab-size", type=int, default=8192,
                     help="tokens in the vocabulary, special and byte tokens included (fewer "
                          "when the files hold too few distinct pairs)")
    tok.set_defaults(func=cmd_train_tokenizer)

    from muse.eval.options import add_arguments as add_eval_arguments
    from muse.train.options import add_arguments as add_pretrain_arguments

    train = sub.add_parser("train", help="train a model", formatter_class=DefaultsHelpFormatter)
    train_sub = train.add_subparsers(dest="train_command", required=True)
    pretrain = train_sub.add_parser("pretrain", help="pretrain from scratch on local data",
                                    formatter_class=DefaultsHelpFormatter)
    add_pretrain_arguments(pretrain)
    pretrain.set_defaults(func=cmd_train_pretrain)
    from muse.train.encoder_options import add_arguments as add_encoder_arguments

    encoders = train_sub.add_parser(
        "encoders", help="train the vision and audio encoders alone on labelled generated "
                         "media, before pretrain --init-from; see docs/training.md",
        formatter_class=DefaultsHelpFormatter)
    add_encoder_arguments(encoders)
    encoders.set_defaults(func=cmd_train_encoders)
    from muse.train.drafter_options import add_arguments as add_drafter_arguments

    drafter = train_sub.add_parser(
        "drafter", help="train the block-diffusion drafter of a target model on its own "
                        "answers; see docs/training.md", formatter_class=DefaultsHelpFormatter)
    add_drafter_arguments(drafter)
    drafter.set_defaults(func=cmd_train_drafter)
    from muse.rl.trainer_options import add_arguments as add_grpo_arguments

    grpo = train_sub.add_parser(
        "grpo", help="train a LoRA adapter with GRPO on rollouts by the engine (torchrun for "
                     "FSDP2 over several processes)", formatter_class=DefaultsHelpFormatter)
    add_grpo_arguments(grpo)
    grpo.set_defaults(func=cmd_train_grpo)

    evaluate = sub.add_parser("eval", help="score a model on held-out tasks (arithmetic, "
                                           "tool calls, instructions, Python)",
                              formatter_class=DefaultsHelpFormatter)
    evaluate.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                          help="a checkpoint folder or a preset (random weights)")
    add_eval_arguments(evaluate)
    _add_storage_flags(evaluate)
    evaluate.set_defaults(func=cmd_eval)

    quantize = sub.add_parser(
        "quantize", help="write a quantized copy of a checkpoint (compressed-tensors or "
                         "ModelOpt layout); see docs/formats.md",
        formatter_class=DefaultsHelpFormatter)
    quantize.add_argument("source", help="the checkpoint folder to quantize")
    quantize.add_argument("destination", help="the folder to write")
    quantize.add_argument("--format", required=True,
                          choices=["nvfp4", "nvfp4-w4a16", "mxfp4", "fp8"],
                          help="nvfp4: NVFP4 weights (blocks of 16, FP8 block scales, a "
                               "global scale) and calibrated activation global scales (W4A4); "
                               "nvfp4-w4a16: the weights only; mxfp4: MXFP4 weights (blocks "
                               "of 32, power-of-two scales); fp8: FP8 E4M3 weights (static "
                               "activation scales with --calibration-prompts)")
    quantize.add_argument("--ignore", action="append", default=[], metavar="PATTERN",
                          help="leave matching projections unquantized: a module name, a "
                               "glob, or re:REGEX (repeat for several; routers always stay)")
    quantize.add_argument("--calibration-prompts", default=None, metavar="FILE",
                          help="prompts for the activation scales: one per line (user "
                               "messages), or .jsonl lines with \"messages\", \"prompt\" or "
                               "\"token_ids\" (default: the prompts shipped in muse/assets)")
    quantize.add_argument("--layout", default="compressed-tensors",
                          choices=["compressed-tensors", "modelopt"],
                          help="compressed-tensors (llm-compressor's; every format) or "
                               "modelopt (hf_quant_config.json; nvfp4 and fp8)")
    quantize.set_defaults(func=cmd_quantize)

    merge_lora = sub.add_parser(
        "merge-lora", help="write a checkpoint with a PEFT LoRA adapter folded into its "
                           "weights (W + scaling * B @ A)", formatter_class=DefaultsHelpFormatter)
    merge_lora.add_argument("base", help="the checkpoint folder the adapter was trained on")
    merge_lora.add_argument("adapter", help="the adapter folder (adapter_config.json + "
                                            "adapter_model.safetensors)")
    merge_lora.add_argument("destination", help="the folder to write")
    merge_lora.set_defaults(func=cmd_merge_lora)

    average = sub.add_parser(
        "average", help="write the weighted average of checkpoints of one architecture (a "
                        "model soup; a fine-tuned model and its start: an interpolation)",
        formatter_class=DefaultsHelpFormatter)
    average.add_argument("sources", nargs="+", help="two or more checkpoint folders; the "
                                                    "first one's other files are copied")
    average.add_argument("--output", dest="destination", required=True,
                         help="the folder to write")
    average.add_argument("--weights", type=float, nargs="+", default=None,
                         help="one weight per source, normalised to sum to one "
                              "(default: equal)")
    average.set_defaults(func=cmd_average)

    grow = sub.add_parser(
        "grow", help="write a deeper checkpoint: new decoder layers, each a copy of the layer "
                     "before it with its residual outputs zeroed (the same function)",
        formatter_class=DefaultsHelpFormatter)
    grow.add_argument("source", help="a Muse checkpoint folder")
    grow.add_argument("--output", dest="destination", required=True, help="the folder to write")
    grow.add_argument("--insert-after", type=int, nargs="+", required=True,
                      help="source layer indices, each followed by one new layer")
    grow.add_argument("--layer-types", nargs="+", default=None,
                      choices=LAYER_TYPES,
                      help="the new layers' kinds, in the order of --insert-after "
                           "(default: each copied layer's)")
    grow.set_defaults(func=cmd_grow)

    from muse.bench.options import add_arguments as add_bench_serve_arguments

    bench = sub.add_parser("bench", help="benchmark a running server",
                           formatter_class=DefaultsHelpFormatter)
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_serve = bench_sub.add_parser(
        "serve", help="load an OpenAI-compatible server with agentic, shared-prefix or random "
                      "traffic; see docs/benchmarking.md", formatter_class=DefaultsHelpFormatter)
    add_bench_serve_arguments(bench_serve)
    bench_serve.set_defaults(func=cmd_bench_serve)
    return parser


def cmd_router(args: argparse.Namespace) -> None:
    from muse.router.launch import run_router

    run_router(args)


def _add_plan_parser(sub) -> None:
    from muse.plan.gpus import GPUS
    from muse.plan.projection import (COMPUTE_EFFICIENCY, MEMORY_EFFICIENCY, WEIGHT_FORMATS)

    plan = sub.add_parser("plan", help="memory per GPU and projected speeds of a model on a "
                          "GPU fleet (docs/performance.md, \"muse plan\")",
                          formatter_class=DefaultsHelpFormatter)
    plan.add_argument("model", help=f"a preset ({', '.join(PRESETS)}) or a checkpoint folder")
    plan.add_argument("--gpu", choices=sorted(GPUS), default="h200", help="the GPU model")
    plan.add_argument("--num-gpus", type=int, default=1,
                      help="GPUs in all: TP x PP x DP x PCP of the layout")
    _add_layout_arguments(plan)
    plan.add_argument("--weight-format", choices=sorted(WEIGHT_FORMATS), default="bf16",
                      help="format of the linear layers' weights")
    plan.add_argument("--kv-cache-dtype", choices=["bfloat16", "fp8"], default="bfloat16",
                      help="KV-cache storage")
    plan.add_argument("--context", type=int, default=8192,
                      help="tokens of each sequence's context")
    plan.add_argument("--concurrency", default="1,128",
                      help="comma-separated numbers of sequences decoding at once")
    plan.add_argument("--num-speculative-tokens", type=int, default=0,
                      help="drafts verified a step (speculative decoding; 0: none)")
    plan.add_argument("--acceptance-length", type=float, default=1.0,
                      help="tokens a step emits on average with speculation")
    plan.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                      help="fraction of a GPU's memory for weights and KV cache")
    plan.add_argument("--memory-efficiency", type=float, default=MEMORY_EFFICIENCY,
                      help="fraction of the HBM bandwidth a decode step reaches (measured on "
                           "the H200 with a proxy shape)")
    plan.add_argument("--compute-efficiency", type=float, default=COMPUTE_EFFICIENCY,
                      help="fraction of the datasheet dense rate the GEMMs reach (measured on "
                           "the H200 with a proxy shape)")
    plan.add_argument("--layer-timings", default=None, metavar="JSON",
                      help="take both efficiencies from full-size layers measured by "
                           "benchmarks/real_size.py (e.g. docs/results/performance/"
                           "real-size-bf16-9c858ad.json) instead (default: none)")
    plan.add_argument("--json", action="store_true",
                      help="machine-readable output (default: off, a table)")
    plan.set_defaults(func=cmd_plan)


def main(argv: list[str] | None = None) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as error:
        print(f"muse {args.command}: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
