"""`muse serve`: flags (named as vLLM names them), the engine process and uvicorn."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from muse.engine.args import EngineArgs

logger = logging.getLogger("muse.server")


def add_serve_arguments(parser: argparse.ArgumentParser, default_model: str) -> None:
    parser.add_argument("model", nargs="?", default=default_model,
                        help="a checkpoint folder or a preset (random weights)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients use (default: the model argument)")
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY`")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="auto",
                        choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run every step eagerly (no CUDA graphs for decode batches)")
    parser.add_argument("--disable-overlap-schedule", action="store_true",
                        help="read each step back before launching the next (by default the "
                             "next step is launched first, so host work overlaps the GPU)")
    parser.add_argument("--reasoning-parser", choices=["muse"], default=None)
    parser.add_argument("--tool-call-parser", choices=["muse"], default=None)
    parser.add_argument("--enable-auto-tool-choice", action="store_true")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja2 chat template file replacing the model's own")
    parser.add_argument("--max-queued-requests", type=int, default=1024,
                        help="answer 503 when more requests than this wait for the engine")
    parser.add_argument("--engine-in-process", action="store_true",
                        help="run the engine core in a thread of the server process")


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=args.model, dtype=args.dtype, device=args.device, seed=args.seed,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        overlap_schedule=not args.disable_overlap_schedule)


def build_from_args(args: argparse.Namespace):
    """The app for these flags (the engine starts with the app's lifespan)."""
    from muse.engine.engine import load_tokenizer
    from muse.server.app import build_app
    from muse.server.engine_client import ProcessEngineClient, ThreadEngineClient
    from muse.server.serving import ServerOptions

    engine_args = engine_args_from(args)
    engine_args.validate()
    tokenizer = load_tokenizer(engine_args)
    if tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer; the server needs one")
    if args.chat_template:
        tokenizer.chat_template = Path(args.chat_template).read_text()
    model_name = Path(args.model).name if Path(args.model).is_dir() else args.model
    options = ServerOptions(
        served_model_name=args.served_model_name or model_name, api_key=args.api_key,
        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        max_queued_requests=args.max_queued_requests)
    client = ThreadEngineClient(engine_args) if args.engine_in_process \
        else ProcessEngineClient(engine_args)
    return build_app(client, tokenizer, options)


def serve(args: argparse.Namespace) -> None:
    import uvicorn

    app = build_from_args(args)
    logger.info("serving %s at http://%s:%d/v1", args.model, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info",
                timeout_graceful_shutdown=5)
