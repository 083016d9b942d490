"""`muse serve`: flags (named as vLLM names them), the engine process and uvicorn.

Every flag can also come from an environment variable `MUSE_<FLAG>` (`--api-key` from
`MUSE_API_KEY`, `--max-model-len` from `MUSE_MAX_MODEL_LEN`, the model from `MUSE_MODEL`);
a flag on the command line wins.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from muse.engine.args import EXECUTOR_BACKENDS, KV_CACHE_DTYPES, EngineArgs
from muse.multimodal.media import DEFAULT_LIMIT_MM_PER_PROMPT, MediaLimits, parse_mm_limits, \
    parse_video_fps
from muse.quantization import ONLINE_FORMATS

logger = logging.getLogger("muse.server")
ENV_PREFIX = "MUSE_"
TRUE_WORDS, FALSE_WORDS = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


def _origins(text: str) -> list[str]:
    """`["https://a.example", ...]` (JSON) or `https://a.example,https://b.example`."""
    text = text.strip()
    if text.startswith("["):
        return list(json.loads(text))
    return [origin.strip() for origin in text.split(",") if origin.strip()]


def add_serve_arguments(parser: argparse.ArgumentParser, default_model: str) -> None:
    add = parser.add_argument
    add("model", nargs="?", default=default_model,
        help="a checkpoint folder or a preset (random weights) (default: the shipped model, "
             "%(default)s)")
    add("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    add("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    add("--served-model-name", nargs="+", default=None,
        help="names clients may give as `model`; the first is the one /v1/models reports "
             "(default: the checkpoint folder's name; the model argument as typed is also "
             "accepted)")
    add("--api-key", default=None,
        help="require `Authorization: Bearer KEY` on every route but /health; prefer the "
             "MUSE_API_KEY environment variable, which `ps` does not show (default: none)")
    add("--max-model-len", type=int, default=None,
        help="context length, prompt and output together (default: the model's maximum, "
             "capped by the KV cache)")
    add("--max-num-seqs", type=int, default=256,
        help="most sequences in one batch (default: %(default)s)")
    add("--max-num-batched-tokens", type=int, default=8192,
        help="token budget of one engine step (default: %(default)s)")
    add("--max-num-encoder-input-tokens", type=int, default=None,
        help="encoder output tokens of the media items one step may newly encode; a larger "
             "item still runs, alone (default: --max-num-batched-tokens)")
    add("--encoder-cache-gb", type=float, default=0.25,
        help="GiB of image / video / audio encoder outputs kept for reuse (default: "
             "%(default)s)")
    add("--encoder-workers", type=int, default=0,
        help="run the image / video / audio encoders in this many processes of their own, "
             "each with the encoders' weights on the engine's device; a step's items are "
             "shared among them (default: %(default)s: in the engine's process)")
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
        help="reuse the KV cache of shared prompt prefixes (default: on)")
    add("--kv-offload-gb", "--hicache-size", type=float, default=0.0,
        help="GiB of host memory per GPU (rank) below the GPU KV cache: cached prefixes "
             "evicted from the GPU load back from it instead of being recomputed (default: "
             "%(default)s: none)")
    add("--kv-offload-write-policy", "--hicache-write-policy", default="write_through",
        choices=["write_through", "write_back"],
        help="when full blocks reach host memory: as soon as they are computed, or when the "
             "GPU evicts them (default: %(default)s)")
    add("--kv-offload-disk", default=None, metavar="DIR",
        help="a directory below host memory for prefixes it evicts, kept across restarts "
             "(default: none)")
    add("--kv-offload-disk-gb", type=float, default=64.0,
        help="GiB the --kv-offload-disk directory may hold (default: %(default)s)")
    add("--block-size", type=int, default=16,
        help="tokens per KV-cache block (default: %(default)s)")
    add("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="weight and activation dtype (default: %(default)s: bfloat16 on a GPU, "
             "float32 on the CPU)")
    add("--device", default="auto",
        help="cpu, cuda or cuda:N (default: %(default)s: cuda when present)")
    add("--seed", type=int, default=0,
        help="seed of a preset's random weights (default: %(default)s)")
    add("--gpu-memory-utilization", type=float, default=0.9,
        help="fraction of GPU memory for weights, activations and KV cache "
             "(default: %(default)s)")
    add("--kv-cache-memory-bytes", type=int, default=None,
        help="KV-cache size in bytes, instead of the share left by "
             "--gpu-memory-utilization (default: computed)")
    add("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
        help="KV-cache storage: auto is the model's dtype; fp8 / fp8_e4m3 store float8 E4M3 "
             "with per-layer scales, twice the tokens in the same memory (default: "
             "%(default)s)")
    add("--calculate-kv-scales", action="store_true",
        help="with an FP8 KV cache, set its scales from the first step's keys and values "
             "instead of the checkpoint's k_scale / v_scale or 1.0 (default: off)")
    add("--quantization", "-q", default=None, choices=list(ONLINE_FORMATS),
        help="quantize an unquantized model as it loads, as `muse quantize --format` would "
             "write it (default: as stored)")
    add("--enforce-eager", action="store_true",
        help="run every step eagerly, no CUDA graphs for decode batches (default: off)")
    add("--prefill-graph-max-tokens", type=int, default=EngineArgs.prefill_graph_max_tokens,
        help="one-request prefill steps of up to this many tokens replay captured CUDA graphs "
             "(padded to the next of 16, 24, 32, 48, ...); 0: they run eagerly (default: "
             f"{EngineArgs.prefill_graph_max_tokens})")
    add("--enable-piecewise-cuda-graph", action=argparse.BooleanOptionalAction,
        default=EngineArgs.enable_piecewise_cuda_graph,
        help="steps no whole-step graph covers (several prefills, prefills with decodes) "
             "replay every layer's work but attention from CUDA graphs captured per token "
             "count (SGLang's flag; not with LoRA or a drafter) (default: on)")
    add("--piecewise-cuda-graph-max-tokens", type=int,
        default=EngineArgs.piecewise_cuda_graph_max_tokens,
        help="the largest step the piecewise graphs take (token counts 16, 24, 32, 48, ... "
             f"up to it) (default: {EngineArgs.piecewise_cuda_graph_max_tokens})")
    add("--disable-overlap-schedule", action="store_true",
        help="read each step back before launching the next (default: off: the next step "
             "is launched first, so host work overlaps the GPU)")
    add("--reasoning-parser", choices=["muse"], default=None,
        help="split a leading <think> block into reasoning_content (default: none)")
    add("--tool-call-parser", choices=["muse"], default=None,
        help="turn <tool_call> blocks into tool_calls (default: none)")
    add("--enable-auto-tool-choice", action="store_true",
        help='allow tool_choice "auto" (needs --tool-call-parser) (default: off)')
    add("--chat-template", default=None,
        help="a Jinja2 chat template file replacing the model's own (default: the model's)")
    add("--max-queued-requests", type=int, default=1024,
        help="answer 429 when more samples than this (prompts x n) would wait for the "
             "engine (default: %(default)s)")
    add("--max-request-body-bytes", type=int, default=None,
        help="answer 413 to larger request bodies, before reading them (default: 4 MiB "
             "above the longest prompt the model accepts)")
    add("--request-body-timeout", type=float, default=30.0,
        help="seconds a client has to send its whole request body, else 408 "
             "(default: %(default)s)")
    add("--header-read-timeout", type=float, default=10.0,
        help="seconds a client has to send a request's headers, else the connection is "
             "closed (default: %(default)s)")
    add("--max-response-logprobs", type=int, default=100_000,
        help="most logprob entries one response may hold: n x max_tokens x (1 + top "
             "logprobs) (default: %(default)s)")
    add("--allowed-origins", type=_origins, default=None,
        help="CORS: origins whose browser pages may call the API, as a JSON list or "
             "comma-separated (default: none, CORS off)")
    add("--allowed-media-domains", nargs="+", default=None,
        help="media URLs may name only these hosts (exact names or IP addresses), which are "
             "trusted: their addresses may be private or loopback (default: none: any host "
             "whose addresses are all public)")
    add("--allowed-local-media-path", default=None,
        help="a folder whose files media parts may name as file: URLs (default: none, "
             "file: URLs refused)")
    add("--media-fetch-timeout", type=float, default=MediaLimits.media_fetch_timeout_s,
        help="seconds to fetch one media URL, redirects included (default: %(default)s)")
    add("--max-media-bytes", type=int, default=MediaLimits.max_media_bytes,
        help="largest media part, fetched or base64, in bytes (default: %(default)s)")
    add("--max-image-pixels", type=int, default=MediaLimits.max_image_pixels,
        help="largest image, width x height, checked before decoding (default: "
             "%(default)s)")
    add("--max-video-frames", type=int, default=MediaLimits.max_video_frames,
        help="most frames sampled from one video; a longer one is sampled evenly over its "
             "length (default: %(default)s)")
    add("--max-audio-seconds", type=float, default=MediaLimits.max_audio_seconds,
        help="longest audio clip in seconds (default: %(default)s)")
    add("--limit-mm-per-prompt", type=parse_mm_limits,
        default=dict(DEFAULT_LIMIT_MM_PER_PROMPT),
        help="most media parts of each kind in one request, as a JSON object, e.g. "
             "'{\"image\": 4, \"video\": 1}'; kinds left out keep their default (default: "
             f"{json.dumps(DEFAULT_LIMIT_MM_PER_PROMPT)})")
    add("--mm-processor-kwargs", type=parse_video_fps, default=None,
        help="how media are prepared unless a request says otherwise (vLLM's flag), as JSON: "
             "'{\"fps\": 1.0}' samples videos at 1 frame a second (default: the model's "
             "processor_config.json)")
    add("--restart-engine", action="store_true",
        help="start a new engine core when it dies, instead of exiting with an error "
             "(default: off)")
    add("--disable-log-stats", action="store_true",
        help="no periodic throughput / queue / KV-usage log lines (default: off: one every "
             "5 s while busy)")
    add("--tensor-parallel-size", "-tp", type=int, default=1,
        help="ranks that split attention heads and expert / dense intermediate widths "
             "(default: %(default)s)")
    add("--enable-expert-parallel", action="store_true",
        help="split whole experts over the ranks instead of each expert's width (default: off)")
    add("--pipeline-parallel-size", "-pp", type=int, default=1,
        help="contiguous layer stages, one rank group each (default: %(default)s)")
    add("--data-parallel-size", "-dp", type=int, default=1,
        help="data-parallel ranks, each scheduling its own requests; with "
             "--enable-expert-parallel their MoE layers run together (default: %(default)s)")
    add("--prefill-context-parallel-size", type=int, default=1,
        help="ranks that split each step's tokens, so a long prompt's prefill runs on all of "
             "them (default: %(default)s)")
    add("--distributed-executor-backend", choices=list(EXECUTOR_BACKENDS), default=None,
        help="uni: one process; mp: a process per rank on this host; ray: ranks as Ray actors "
             "across the nodes of a Ray cluster (muse[ray]) (default: mp when more than one "
             "rank, else uni)")
    add("--kv-transfer-config", default=None,
        help="prefill / decode disaggregation, vLLM's JSON: {\"kv_role\": \"kv_producer\"} "
             "(a prefill instance; \"kv_ip\", \"kv_port\": where decode instances pull KV "
             "blocks, default 127.0.0.1:14579) or {\"kv_role\": \"kv_consumer\"} (a decode "
             "instance); `muse router` sends requests to both (default: none)")
    add("--ec-transfer-config", default=None,
        help="encoder disaggregation, vLLM's JSON: {\"ec_role\": \"ec_producer\", "
             "\"ec_connector\": \"ECSharedStorageConnector\", \"ec_connector_extra_config\": "
             "{\"shared_storage_path\": DIR}} makes an encoder instance (it encodes requests' "
             "media into DIR and answers without tokens); \"ec_consumer\" reads them from "
             "there before encoding; `muse router --encode` sends media requests to encoder "
             "instances first (default: none)")
    add("--speculative-config", default=None,
        help="speculative decoding as JSON, vLLM's names, e.g. '{\"method\": \"ngram\", "
             "\"num_speculative_tokens\": 5}' (default: off)")
    add("--hf-overrides", default=None,
        help="fields of the model's config replaced, as JSON, e.g. '{\"num_hidden_layers\": "
             "2}' (a preset cut to two layers); \"vision_config\" / \"audio_config\": null "
             "leave an encoder out (default: none)")
    add("--enable-lora", action="store_true",
        help="serve LoRA adapters: a request's `model` names one (default: off)")
    add("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
        help="PEFT adapter folders to serve, as name=path or JSON {\"name\": ..., \"path\": "
             "...}; more can be loaded at run time with POST /v1/load_lora_adapter (default: "
             "none)")
    add("--max-loras", type=int, default=1,
        help="adapters resident on the device at once (others wait in host memory) "
             "(default: %(default)s)")
    add("--max-lora-rank", type=int, default=16,
        help="the largest adapter rank served (default: %(default)s)")
    add("--attention-backend", default="auto",
        help="attention kernels by name: torch or triton (default: %(default)s: triton on "
             "CUDA)")
    add("--moe-backend", default="auto",
        help="MoE kernels by name: torch or triton (default: %(default)s: triton on CUDA)")
    add("--engine-in-process", action="store_true",
        help="run the engine core in a thread of the server process (default: off)")
    apply_environment_defaults(parser)


def apply_environment_defaults(parser: argparse.ArgumentParser,
                               environ: dict[str, str] | None = None) -> None:
    """Take each flag's default from `MUSE_<FLAG>` when that variable is set."""
    environ = os.environ if environ is None else environ
    for action in parser._actions:
        if action.dest == "help":
            continue
        name = ENV_PREFIX + action.dest.upper()
        if name not in environ:
            continue
        parser.set_defaults(**{action.dest: _from_environment(action, name, environ[name])})


def _from_environment(action: argparse.Action, name: str, text: str):
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
        word = text.strip().lower()
        if word not in TRUE_WORDS | FALSE_WORDS:
            raise SystemExit(f"muse serve: error: {name}={text!r} must be one of "
                             f"{sorted(TRUE_WORDS | FALSE_WORDS - {''})}")
        return word in TRUE_WORDS
    convert = action.type or str
    try:
        value = [convert(item) for item in text.split()] if action.nargs == "+" \
            else convert(text)
    except (TypeError, ValueError) as error:
        raise SystemExit(f"muse serve: error: {name}={text!r}: {error}") from None
    if action.choices is not None and value not in action.choices:
        raise SystemExit(f"muse serve: error: {name}={text!r} must be one of "
                         f"{list(action.choices)}")
    return value


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=args.model, dtype=args.dtype, device=args.device, seed=args.seed,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        max_num_encoder_input_tokens=args.max_num_encoder_input_tokens,
        encoder_cache_gb=args.encoder_cache_gb, encoder_workers=args.encoder_workers,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_offload_gb=args.kv_offload_gb, kv_offload_write_policy=args.kv_offload_write_policy,
        kv_offload_disk=args.kv_offload_disk, kv_offload_disk_gb=args.kv_offload_disk_gb,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
        quantization=args.quantization,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        prefill_graph_max_tokens=args.prefill_graph_max_tokens,
        enable_piecewise_cuda_graph=args.enable_piecewise_cuda_graph,
        piecewise_cuda_graph_max_tokens=args.piecewise_cuda_graph_max_tokens,
        overlap_schedule=not args.disable_overlap_schedule,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size,
        prefill_context_parallel_size=args.prefill_context_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        attention_backend=args.attention_backend, moe_backend=args.moe_backend,
        speculative_config=args.speculative_config, kv_transfer_config=args.kv_transfer_config,
        hf_overrides=args.hf_overrides, ec_transfer_config=args.ec_transfer_config,
        enable_lora=args.enable_lora, lora_modules=list(args.lora_modules),
        max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)


def media_limits_from(args: argparse.Namespace) -> MediaLimits:
    return MediaLimits(
        max_media_bytes=args.max_media_bytes, media_fetch_timeout_s=args.media_fetch_timeout,
        max_image_pixels=args.max_image_pixels, max_video_frames=args.max_video_frames,
        max_audio_seconds=args.max_audio_seconds,
        allowed_media_domains=tuple(args.allowed_media_domains)
        if args.allowed_media_domains is not None else None,
        allowed_local_media_path=args.allowed_local_media_path)


def build_from_args(args: argparse.Namespace, on_engine_death=None):
    """The app for these flags (the engine starts with the app's lifespan)."""
    from muse.engine.engine import load_tokenizer
    from muse.server.app import build_app
    from muse.server.engine_client import ProcessEngineClient, ThreadEngineClient
    from muse.server.serving import ServerOptions

    engine_args = engine_args_from(args)
    engine_args.validate()
    media_limits = media_limits_from(args)
    tokenizer = load_tokenizer(engine_args)
    if tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer; the server needs one")
    if args.chat_template:
        tokenizer.chat_template = Path(args.chat_template).read_text()
    names = list(args.served_model_name or [])
    folder_name = Path(args.model).name if Path(args.model).is_dir() else args.model
    served = names[0] if names else folder_name
    options = ServerOptions(
        served_model_name=served,
        model_aliases=frozenset(names[1:] if names else [args.model]),
        api_key=args.api_key, reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        max_queued_requests=args.max_queued_requests,
        max_response_logprobs=args.max_response_logprobs,
        max_request_body_bytes=args.max_request_body_bytes,
        request_body_timeout_s=args.request_body_timeout,
        allowed_origins=args.allowed_origins,
        log_stats_interval_s=None if args.disable_log_stats else 5.0,
        max_token_bytes=tokenizer.max_token_bytes, media_limits=media_limits,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        video_fps=args.mm_processor_kwargs)
    client = ThreadEngineClient(engine_args) if args.engine_in_process \
        else ProcessEngineClient(engine_args, restart=args.restart_engine)
    return build_app(client, tokenizer, options, on_engine_death)


def serve(args: argparse.Namespace) -> None:
    """Serve until stopped; exit with status 1 if the engine core dies (without
    --restart-engine), so that a supervisor restarts the whole server."""
    import uvicorn

    from muse.server.http_protocol import protocol_with_header_timeout

    server: uvicorn.Server | None = None
    death: list[str] = []

    def on_engine_death(reason: str) -> None:
        death.append(reason)
        logger.error("the engine core died (%s); the server is shutting down", reason)
        if server is not None:
            server.should_exit = True

    app = build_from_args(args, on_engine_death)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=5,
                            http=protocol_with_header_timeout(args.header_read_timeout))
    server = uvicorn.Server(config)
    # The port is bound before the app starts its engine: otherwise the engine's own
    # rendezvous port (a free one from the OS, with several ranks) could be this port
    # whenever it lies in the ephemeral range.
    sock = config.bind_socket()
    logger.info("serving %s at http://%s:%d/v1", args.model, args.host, args.port)
    server.run(sockets=[sock])
    if not server.started:
        sys.exit(3)  # as uvicorn.run: the app did not start (its log says why)
    if death:
        logger.error("exiting with status 1: the engine core died (%s)", death[0])
        sys.exit(1)
