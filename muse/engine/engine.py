"""The engine core: admission, the step loop, and request bookkeeping around the scheduler."""

from __future__ import annotations

import copy
import logging
import multiprocessing
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from muse.config import FULL, SLIDING, MuseSparkConfig, with_overrides
from muse.disagg.config import KVTransferConfig
from muse.disagg.connector import ConnectorLayerHooks, KVConnector, load_connector
from muse.disagg.encoder_connector import ECTransferConfig, connected_encoders
from muse.disagg.engine_kv import EngineKV, enter_blocks
from muse.disagg.kv_import import check_kv_transfer_params
from muse.disagg.transport import KVTransferError
from muse.engine.args import EngineArgs
from muse.engine.cuda_graphs import DecodeGraphs, prefill_query_lens
from muse.engine.grammar_jobs import CompileJob, GrammarJobs, threads_per_compile
from muse.engine.kv_budget import block_bytes, split_blocks
from muse.engine.metadata import HostBatch
from muse.engine.piecewise_graphs import PiecewiseGraphs, cuda_capture
from muse.engine.rank_memory import shared_kv_budget
from muse.engine.host_kv_store import HostKVStore
from muse.engine.kv_cache import KVCacheManager
from muse.engine.kv_offload import DiskIndex, KVOffload, disk_tier_root, host_blocks, shard_name
from muse.engine.request import Request, RequestStatus
from muse.engine.executor import (Executor, MultiprocExecutor, UniExecutor, WorkerError,
                                  WorkerProcess, free_init_method, stop_workers)
from muse.engine.runner import LaunchedStep, ModelRunner, PreparedStep, allocate_kv_caches
from muse.engine.worker import ModelWorker
from muse.engine.sampling_params import (InvalidRequestError, SamplingParams, check_output_room,
                                         validate_prompt)
from muse.engine.scheduler import Scheduler
from muse.model.decoder import EngineModel
from muse.multimodal.encoder_cache import EncoderCache, encode_with_cache
from muse.multimodal.encoder_workers import (EncoderRecipe, EncoderWorkerPool, check_encoders,
                                             close_encoders)
from muse.multimodal.engine_inputs import (Encoders, build_media_encoders, has_encoders,
                                           load_media_encoders)
from muse.multimodal.media import DEFAULT_VIDEO_FPS
from muse.multimodal.processor import KINDS as MEDIA_KINDS
from muse.multimodal.processor import (MuseSparkProcessor, ProcessorConfig, ProcessorError,
                                      preset_processor_config)
from muse.speculative.config import SpeculativeConfig
from muse.speculative.draft_kv import draft_block_bytes
from muse.speculative.metrics import SpecDecodingStats
from muse.speculative.adaptive import (AcceptanceTracker, StepCosts, choose_query_len, survival,
                                      worth_drafting)
from muse.speculative.sampling import verified_in_graph
from muse.speculative.proposer import (DrafterProposer, Drafts, NgramProposer, SuffixProposer,
                                      make_proposer)
from muse.checkpoint.configs import load_config
from muse.checkpoint.reader import CheckpointReader
from muse.kernels.backends import select_backends
from muse.model.loader import load_checkpoint, load_named_tensors
from muse.presets import PRESETS, get_preset
from muse.lora.manager import AdapterUse, LoadedAdapter, LoRAManager
from muse.lora.peft_adapter import AdapterError
from muse.lora.request import LoRARequest, parse_lora_module
from muse.quantization.common import QuantOptions, quant_options
from muse.quantization.config import load_quantization_config, quantization_of
from muse.quantization.quantize import TensorSource, quantized_tensors
from muse.reference.model import MuseForCausalLM, init_weights, init_weights_on_device

logger = logging.getLogger("muse")

# With nothing to run but requests waiting for their grammar, a step waits this long for a
# compile to end instead of spinning (and taking a core from the compile threads).
GRAMMAR_WAIT_S = 0.01

# Adaptive verification that finds drafting not worth its cost still drafts every this many
# steps, so that the acceptance it decides from follows the requests.
PROBE_EVERY = 8


def verify_query_lens(num_speculative_tokens: int) -> list[int]:
    """The query lengths of verify steps that get their own CUDA graphs (and step costs):
    2 and 4 where shorter than 1 + k, and 1 + k. A step takes the shortest that holds its
    longest request."""
    longest = 1 + num_speculative_tokens
    return sorted({q for q in (2, 4) if q < longest} | {longest})


# Presets up to this many parameters draw their weights on the CPU, identically on every
# device (tests compare engine and reference built from the same seed); larger ones draw them
# on the device: minutes faster, and no float32 copy of billions of weights in host memory.
HOST_INIT_MAX_PARAMETERS = 2**28


def load_engine_model(args: EngineArgs, device: torch.device
                      ) -> tuple[MuseSparkConfig, EngineModel, torch.dtype]:
    """A preset gets seeded random weights; a folder is loaded as a checkpoint."""
    config = get_preset(args.model) if args.model in PRESETS else load_config(args.model)
    config = with_overrides(config, args.hf_overrides)
    dtype = args.resolve_dtype(config.dtype, device)
    backends = select_backends(device, args.attention_backend, args.moe_backend)
    quant_config = None
    if args.model not in PRESETS:
        with CheckpointReader(args.model) as reader:
            quant_config = load_quantization_config(args.model, reader.names())
        if quant_config is not None:
            logger.info("quantized checkpoint: %s", quant_config)
    options = QuantOptions(weight_only=args.quantization_weight_only,
                           emulate_activations=args.quantization_emulate_activations)
    if args.quantization is not None:
        if quant_config is not None:
            raise ValueError(f"`quantization` {args.quantization!r} quantizes an unquantized "
                             f"model, and {args.model} is already quantized ({quant_config})")
        with quant_options(options):
            return config, quantized_online(args, config, backends, dtype, device), dtype
    with torch.device(device), quant_options(options):
        model = EngineModel(config.text_config, backends, dtype, quant_config)
    if args.model not in PRESETS:
        load_checkpoint(model, args.model)
        return config, model, dtype
    std = args.init_std or config.text_config.initializer_range
    if sum(p.numel() for p in model.parameters()) > HOST_INIT_MAX_PARAMETERS:
        init_weights_on_device(model, args.seed, std)
        return config, model, dtype
    # The reference's seeded weights, drawn in its parameter order, so that an engine and a
    # reference model built from one seed are the same model.
    reference = MuseForCausalLM(config.text_config)
    init_weights(reference, args.seed, std)
    load_named_tensors(model, reference.state_dict().items(), f"preset {args.model}")
    return config, model, dtype


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created inside the block take `dtype` (a model drawn in its own dtype, not
    in float32 first)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def quantized_online(args: EngineArgs, config: MuseSparkConfig, backends, dtype: torch.dtype,
                     device: torch.device) -> EngineModel:
    """The engine model of an unquantized checkpoint or preset, its weights quantized to
    `args.quantization` as they load (`muse quantize`'s tensors, made one module at a time
    on the weights' device: a preset's random weights are drawn there in the model dtype)."""
    if args.model in PRESETS:
        with torch.device(device), default_dtype(dtype):
            reference = MuseForCausalLM(config.text_config)
        init_weights_on_device(reference, args.seed,
                               args.init_std or config.text_config.initializer_range)
        source, where = TensorSource(reference.state_dict()), f"preset {args.model}"
        context = nullcontext(source)
    else:
        context, where = CheckpointReader(args.model), f"checkpoint {args.model}"
    with context as source:
        settings, names, tensors = quantized_tensors(source, args.quantization)
        quant_config = quantization_of(settings, names)
        logger.info("%s quantized as it loads: %s", where, quant_config)
        with torch.device(device):
            model = EngineModel(config.text_config, backends, dtype, quant_config)
        load_named_tensors(model, tensors, f"{where} ({args.quantization})")
    return model


def load_tokenizer(args: EngineArgs):
    """The tokenizer named, the checkpoint's own, or the base tokenizer for presets."""
    from muse.tokenizer import BASE_TOKENIZER_DIR, MuseTokenizer

    source = args.tokenizer
    if source is None:
        own = Path(args.model)
        source = own if (own / "tokenizer.json").is_file() else None
        if source is None and args.model in PRESETS:
            source = BASE_TOKENIZER_DIR
    return MuseTokenizer.from_pretrained(source) if source is not None else None


class EngineCore:
    def __init__(self, args: EngineArgs) -> None:
        args.validate()
        self.args = args
        self.device = args.rank_device(0)
        self.world_size = args.parallel_config().world_size
        self.speculative = SpeculativeConfig.parse(args.speculative_config)
        self.spec_stats = SpecDecodingStats(self.speculative.num_speculative_tokens) \
            if self.speculative is not None else None
        self.proposer: NgramProposer | SuffixProposer | DrafterProposer | None = None
        # Adaptive verification: the step costs (profiled once the model runs), the acceptance
        # seen per draft position, and the steps run without drafts since the last probe.
        self.step_costs: StepCosts | None = None
        self.acceptance = AcceptanceTracker(self.speculative.num_speculative_tokens) \
            if self.speculative is not None else None
        self.steps_without_drafts = 0
        # With several ranks each step is read back before the next is built (the other
        # ranks get the step's token ids from the host), and runs eagerly. Speculation reads
        # each step back too: the next step's drafts start after the tokens it accepted.
        self.overlap_schedule = (args.overlap_schedule and self.world_size == 1
                                 and self.speculative is None)
        worker_processes, on_shutdown = self._start_world() if self.world_size > 1 \
            else ([], None)
        try:
            self._build(worker_processes, on_shutdown)
        except BaseException:
            # The workers would otherwise wait for this rank until the world's timeout.
            stop_workers(worker_processes, on_shutdown)
            close_encoders(getattr(self, "encoders", None))
            raise

    def _build(self, worker_processes: list[WorkerProcess],
               on_shutdown: Callable[[], None] | None) -> None:
        """The model, its KV cache and the executor (rank 0's share, with the workers')."""
        args = self.args
        self.model_config, model, self.dtype = load_engine_model(args, self.device)
        self.kv_cache_dtype = args.resolve_kv_cache_dtype(self.dtype)
        self.config = self.model_config.text_config
        self.model = model.eval()
        self.lora = self._lora_manager()
        self.tokenizer = load_tokenizer(args)
        self.encoders = self._media_encoders()
        # What the workers encode with: behind an EC connector with `ec_transfer_config`.
        self.ec_config = ECTransferConfig.parse(args.ec_transfer_config)
        if self.ec_config is not None and self.encoders is None:
            raise ValueError("`ec_transfer_config` needs a model with media encoders")
        self.worker_encoders = connected_encoders(self.encoders, self.ec_config, args.model,
                                                  args.seed, self.dtype, self.device)
        # Made at start-up, so that a bad processor_config.json fails the engine, not a request.
        self._processor = self._media_processor() if self.encoders is not None else None
        self.eos_token_ids = tuple(self.config.eos_token_ids)
        if self.speculative is not None:
            self.proposer = make_proposer(self.speculative, self.model, args, self.device,
                                          self.dtype)

        # Per rank: each holds its share of the K/V heads and of the layers (a pipeline
        # stage's); every rank gets the block counts of the smallest rank budget, sized as if
        # that budget covered 1/pp of the layers (stages with more global layers use a bit
        # more).
        budget = shared_kv_budget(self.model, args, self.device, self.dtype) \
            * args.parallel_config().pipeline_parallel_size
        drafter = self.proposer.drafter if isinstance(self.proposer, DrafterProposer) else None
        num_blocks = split_blocks(self.config, budget, args.block_size, self.kv_cache_dtype,
                                  args.max_num_seqs, args.max_num_batched_tokens,
                                  args.max_model_len or self.config.max_position_embeddings,
                                  self.model.num_kv_heads,
                                  draft_block_bytes(drafter.config, args.block_size, self.dtype)
                                  if drafter is not None else 0)
        if min(num_blocks.values()) < 2:
            raise ValueError(f"a KV cache budget of {budget / 2**20:.1f} MiB is too small for "
                             "this model; raise `kv_cache_memory_bytes` or "
                             "`gpu_memory_utilization`, or free GPU memory")
        self.num_blocks = num_blocks
        self.max_model_len = self._check_capacity(num_blocks)
        kv_caches = allocate_kv_caches(self.model, num_blocks, args.block_size,
                                       self.kv_cache_dtype, self.device)
        self.block_bytes = block_bytes(self.config, args.block_size, self.kv_cache_dtype,
                                       self.model.num_kv_heads)
        self.host_blocks = host_blocks(int(args.kv_offload_gb * 2**30), num_blocks,
                                       self.block_bytes) if args.kv_offload_gb else {}
        self.disk_root = disk_tier_root(args, self.kv_cache_dtype) \
            if args.kv_offload_disk is not None else None
        if drafter is not None:
            self.proposer.allocate(self.model, num_blocks, args.block_size,
                                   lambda request: self.kv_cache.block_tables(request),
                                   self.device)
        self.encoder_cache = EncoderCache(args.encoder_cache_bytes) \
            if self.encoders is not None else None
        worker = ModelWorker(self.model, kv_caches, self.device, args.block_size,
                             self._graphs(kv_caches), self.worker_encoders, self.encoder_cache,
                             HostKVStore(self.model.layer_types, kv_caches, self.host_blocks,
                                         self.disk_root, shard_name(0, 0))
                             if self.host_blocks else None, self._piecewise_graphs(kv_caches))
        if worker_processes:
            from muse.distributed.parallel_state import get_world_group

            get_world_group().broadcast_object((num_blocks, self.host_blocks), src=0)
            self.executor: Executor = MultiprocExecutor(worker, worker_processes,
                                                        args.distributed_timeout_s, on_shutdown)
        else:
            self.executor = UniExecutor(worker)
        self._init_scheduling()
        # Speculation's overlapped schedule (`muse.speculative.chained_step`): a greedy verify
        # step whose next drafts stay on the device is followed by the next one, made there,
        # before it is read back (not with a KV connector, whose per-layer hooks read the
        # host's batch).
        self.chain_verify_steps = (args.overlap_schedule and not worker_processes
                                   and isinstance(self.proposer, DrafterProposer)
                                   and self.proposer.drafts_on_device
                                   and self.kv_connector is None)
        self.runner.chain_from_sampled_steps = self.chain_verify_steps
        self.chained_steps = 0
        if self.speculative is not None and self.speculative.enable_adaptive_verification:
            self.step_costs = self._profile_step_costs()
        sizes = self.block_bytes
        if self.host_blocks:
            logger.info("KV offload: %s in host memory%s, %s", ", ".join(
                f"{n * args.block_size:,} tokens of {kind} layers"
                for kind, n in self.host_blocks.items()),
                f", then {args.kv_offload_disk_gb:g} GiB in {self.disk_root}"
                if self.disk_root is not None else "", args.kv_offload_write_policy)
        logger.info("KV cache: %s (%.1f MiB, %s); max_model_len %d",
                    ", ".join(f"{(n - 1) * args.block_size:,} tokens in {kind} layers"
                              for kind, n in num_blocks.items()),
                    sum(n * sizes[k] for k, n in num_blocks.items()) / 2**20,
                    str(self.kv_cache_dtype).removeprefix("torch."), self.max_model_len)
        if args.calculate_kv_scales:
            # After every dummy run above (memory profile, graph capture, step costs).
            self.model.calculate_kv_scales_on_next_step()

    def _media_encoders(self) -> Encoders | None:
        """The vision / audio encoders the model's config names, beside the decoder: a
        preset's seeded random ones, a checkpoint's loaded from its `vision_tower.*` /
        `audio_tower.*` tensors (None without encoders). With several ranks every first-stage
        rank builds its own copy the same way (`worker_main.worker_media_encoders`).
        With `encoder_workers` this rank's encoders run in processes of their own."""
        args = self.args
        if args.encoder_workers and has_encoders(self.model_config):
            recipe = EncoderRecipe(self.model_config, args.model, args.model in PRESETS,
                                   args.seed, self.dtype, self.device)
            # A worker that hangs fails the step after the ranks' timeout, as a hung rank.
            return EncoderWorkerPool(recipe, args.encoder_workers, self.device,
                                     timeout_s=args.distributed_timeout_s)
        if args.model in PRESETS:
            return build_media_encoders(self.model_config, args.seed, self.dtype, self.device)
        return load_media_encoders(self.model_config, args.model, self.dtype, self.device)

    def _media_processor(self) -> MuseSparkProcessor:
        """The processor with a checkpoint's processor_config.json (the defaults when it has
        none), or a preset's settings."""
        settings = ProcessorConfig.load(self.args.model) \
            if self.args.model not in PRESETS else preset_processor_config(self.args.model)
        return MuseSparkProcessor(self.model_config, settings, self.tokenizer)

    def _init_scheduling(self) -> None:
        """What one data-parallel rank schedules with: its queue, the block manager of its KV
        cache, its requests."""
        args = self.args
        offload = None
        if self.host_blocks:
            disk = DiskIndex(self.disk_root, self.block_bytes,
                             int(args.kv_offload_disk_gb * 2**30)) \
                if self.disk_root is not None else None
            offload = KVOffload(self.host_blocks, self.block_bytes,
                                args.kv_offload_write_policy, disk)
        self.kv_cache = KVCacheManager(args.block_size, self.num_blocks,
                                       self.config.sliding_window, args.enable_prefix_caching,
                                       offload)
        self.kv_connector = self._kv_connector()
        if self.kv_connector is not None and self.kv_connector.has_layer_hooks:
            self.model.layer_hooks.append(ConnectorLayerHooks(self.kv_connector))
            self.executor.worker.eager_layers = True
        self.runner = ModelRunner(self.kv_cache, self.executor, self.device)
        if self.speculative is not None:
            self.runner.rejection_sample_method = self.speculative.rejection_sample_method
        self.scheduler = Scheduler(self.kv_cache, args.max_num_seqs, args.max_num_batched_tokens,
                                   args.resolve_max_num_encoder_input_tokens(),
                                   self.encoder_cache)
        if self.kv_connector is not None:
            self.scheduler.on_finish = self.kv_connector.request_finished
        self.requests: dict[str, list[Request]] = {}  # group id -> its n samples
        self.pending_siblings: dict[str, list[Request]] = {}  # parent id -> waiting samples
        self.in_flight: LaunchedStep | None = None  # launched, tokens not read back yet
        # Requests whose grammar is compiling: not scheduled, no KV blocks (group id -> job).
        self.grammar_waiting: dict[str, CompileJob] = {}
        # Requests whose prompt's blocks are being pulled from a prefill instance: not
        # scheduled yet (group id -> (the pull, its structured-output spec, compiled grammar)).
        self.kv_waiting: dict[str, tuple[Future, Any, Any]] = {}
        self.grammar_jobs: GrammarJobs | None = None  # made with the first constrained request
        # An encoder instance's requests, answered at the next step once their media are
        # encoded (group id -> samples): they never reach the scheduler.
        self.encode_waiting: dict[str, list[Request]] = {}

    def _kv_connector(self) -> KVConnector | None:
        """The KV connector `kv_transfer_config` names (`muse/disagg/connector.py`), if any."""
        config = KVTransferConfig.parse(self.args.kv_transfer_config)
        if config is None:
            return None
        return load_connector(EngineKV.of(self.kv_cache, self.executor.worker.kv_caches,
                                          self.model.layer_types, self.block_bytes), config)

    def serve_kv_pulls(self) -> None:
        """Let the KV connector answer transfers (a prefill instance's pulls): each step
        does; call it while idle too."""
        if self.kv_connector is not None:
            self.kv_connector.serve()

    def data_parallel_replica(self) -> EngineCore:
        """The scheduling side of another data-parallel rank: its own queue, KV block manager
        and requests over the same world, model config, tokenizer and executor (whose other
        ranks hold that rank's model replica and KV tensors)."""
        replica = copy.copy(self)
        replica._init_scheduling()
        return replica

    @property
    def replicas(self) -> list[EngineCore]:
        """The data-parallel ranks' schedulers: this one alone."""
        return [self]

    def _start_world(self) -> tuple[list[WorkerProcess], Callable[[], None] | None]:
        """Start a worker per rank but this one (a local process, or a Ray actor), then join
        the world as rank 0. Returns the workers and what releases their resources."""
        on_shutdown = None
        if self.args.executor_backend == "ray":
            from muse.engine.ray_workers import start_ray_workers

            workers = start_ray_workers(self.args, self.world_size)
            init_method, processes, on_shutdown = (workers.init_method, workers.handles,
                                                   workers.shutdown)
        else:
            from muse.engine.worker_main import run_worker

            init_method = free_init_method()
            spawn = multiprocessing.get_context("spawn")
            processes = [spawn.Process(target=run_worker, args=(rank, self.args, init_method),
                                       name=f"muse-worker-{rank}", daemon=True)
                         for rank in range(1, self.world_size)]
            for process in processes:
                process.start()
        try:
            self._join_world(init_method, processes)
        except BaseException:
            stop_workers(processes, on_shutdown)
            raise
        return processes, on_shutdown

    def _join_world(self, init_method: str, processes: list[WorkerProcess]) -> None:
        """Join the world as rank 0, watching the workers meanwhile: one that dies before it
        joins (a crash at import or while loading) fails this at once rather than after the
        rendezvous timeout."""
        from muse.distributed.parallel_state import init_distributed

        failure: list[BaseException] = []

        def join() -> None:
            try:
                init_distributed(self.args.parallel_config(), 0, init_method,
                                 backend="nccl" if self.device.type == "cuda" else "gloo",
                                 local_rank=self.device.index,
                                 timeout_s=self.args.distributed_timeout_s)
            except BaseException as error:  # re-raised below, in the caller's thread
                failure.append(error)

        thread = threading.Thread(target=join, name="muse-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            dead = [(rank, p.exitcode) for rank, p in enumerate(processes, start=1)
                    if not p.is_alive()]
            if dead and thread.is_alive():
                raise WorkerError("worker " + ", ".join(
                    f"rank {rank} exited with code {code}" for rank, code in dead)
                    + " before joining the world; see its log")
        if failure:
            raise failure[0]
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread

    def shutdown(self) -> None:
        """Stop the worker processes (if any) and leave the world; stop the encoder workers
        (with `encoder_workers`)."""
        try:
            if self.kv_connector is not None:
                self.kv_connector.close()
            self.executor.shutdown()
        finally:
            close_encoders(self.encoders)

    def check_health(self) -> None:
        """Raise if a worker rank or an encoder worker is gone, even while no step runs."""
        self.executor.check_health()
        check_encoders(self.encoders)

    def _check_capacity(self, num_blocks: dict[str, int]) -> int:
        """`max_model_len`, checked against the model and against what the cache can hold."""
        limit = self.config.max_position_embeddings
        wanted = self.args.max_model_len
        if wanted is not None and wanted > limit:
            raise ValueError(f"`max_model_len` {wanted} exceeds the model's limit {limit}")
        max_len = wanted or limit
        block_size = self.args.block_size
        if FULL in num_blocks:
            capacity = (num_blocks[FULL] - 1) * block_size
            if capacity < max_len and wanted is not None:
                raise ValueError(f"`max_model_len` {wanted} does not fit in the KV cache, which "
                                 f"holds {capacity} tokens; lower it or give the cache more "
                                 "memory")
            max_len = min(max_len, capacity)
        if SLIDING in num_blocks:
            chunk = self.config.sliding_window + self.args.max_num_batched_tokens
            need = min(-(-chunk // block_size) + 2, -(-max_len // block_size))
            if num_blocks[SLIDING] - 1 < need:
                raise ValueError("the KV cache is too small for one sliding-window sequence; "
                                 "give it more memory or lower `max_num_batched_tokens`")
        return max_len

    def _graphs(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> list[DecodeGraphs]:
        """Captured decode graphs, with speculation verify graphs of each query length (and
        the drafter's), and one-request prefill graphs, on CUDA unless `enforce_eager`."""
        # Emulated W4A4 experts ask the host for their expert counts: not capturable.
        if self.device.type != "cuda" or self.args.enforce_eager or self.world_size > 1 \
                or self.args.quantization_emulate_activations:
            return []
        block_size, max_batch = self.args.block_size, self.args.max_num_seqs
        full_width = -(-self.max_model_len // block_size)

        # Verify graphs also draft the next blocks where the drafts stay on the device.
        draft_next = self.proposer.draft_next if isinstance(self.proposer, DrafterProposer) \
            and self.proposer.drafts_on_device else None
        if isinstance(self.proposer, DrafterProposer):
            self.proposer.kv.compile()  # before any capture: the warm-ups compile

        def capture(query_len: int, batch: int = max_batch, pool: tuple | None = None,
                    verify: bool = False) -> DecodeGraphs:
            widths = {kind: full_width for kind in self.num_blocks}
            if SLIDING in widths:
                # The queries need the blocks of their windows, which straddle at most two
                # more than the window and the queries span.
                span = self.config.sliding_window + query_len - 1
                widths[SLIDING] = min(full_width, -(-span // block_size) + 2)
            graphs = DecodeGraphs(self.model, kv_caches, widths, batch, block_size,
                                  self.device, query_len, greedy_verification=verify,
                                  draft_next=draft_next if verify else None)
            graphs.capture(pool)
            return graphs

        graphs = [capture(1)]
        if self.speculative is not None:
            if isinstance(self.proposer, DrafterProposer):
                self.proposer.capture_graphs(max_batch, full_width, self.device)
            graphs += [capture(q, verify=True) for q in
                       verify_query_lens(self.speculative.num_speculative_tokens)]
        longest = min(self.args.prefill_graph_max_tokens, self.args.max_num_batched_tokens,
                      self.max_model_len)
        # One memory pool for the prefill graphs, the longest captured first.
        pool = torch.cuda.graph_pool_handle()
        graphs += [capture(q, batch=1, pool=pool) for q in
                   reversed(prefill_query_lens(longest, above=graphs[-1].query_len))]
        return graphs

    def _piecewise_graphs(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
                          ) -> PiecewiseGraphs | None:
        """Piecewise graphs for mixed steps (`enable_piecewise_cuda_graph`), where graphs are
        captured at all, without LoRA (its per-token slots are not among the pieces'
        inputs) and without a drafter (its context rows come from layers inside pieces)."""
        args = self.args
        if not args.enable_piecewise_cuda_graph or self.device.type != "cuda" \
                or args.enforce_eager or self.world_size > 1 \
                or args.quantization_emulate_activations or args.enable_lora \
                or isinstance(self.proposer, DrafterProposer):
            return None
        largest = min(args.piecewise_cuda_graph_max_tokens, args.max_num_batched_tokens)
        graphs = PiecewiseGraphs(self.model, kv_caches, largest, self.device)
        graphs.capture(cuda_capture(torch.cuda.graph_pool_handle()))
        return graphs

    # ---- requests ------------------------------------------------------------------------
    def _generator(self, params: SamplingParams, index: int) -> torch.Generator | None:
        if params.seed is None:
            return None
        # Sample i of a seeded request gets its own stream, derived from (seed, i).
        return torch.Generator(device=self.device).manual_seed(
            (params.seed * 1_000_003 + index) % 2**63)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams,
                    multi_modal_data: dict[str, Any] | None = None,
                    cache_salt: str | None = None,
                    kv_transfer_params: dict[str, Any] | None = None,
                    lora_request: LoRARequest | str | None = None) -> list[Request]:
        """Validate and queue a request; its `n` samples share the prompt's KV.

        `multi_modal_data` (vLLM's shape): {"image": [...], "video": [...], "audio": [...]},
        one item (or a list) per kind, the k-th of a kind for the prompt's k-th placeholder of
        that kind; the prompt's placeholders are expanded (`muse.multimodal.processor`).
        `cache_salt` (vLLM's): only requests with the same salt share prefix-cache blocks.
        `lora_request`: the adapter the request runs with (read and made resident now), or
        the name of a loaded one.
        `kv_transfer_params` (disaggregation, as vLLM's): `do_remote_decode` on a prefill
        instance keeps the request's blocks for a decode instance to pull;
        `do_remote_prefill` with `remote_host`, `remote_port`, `remote_request_id` on a decode
        instance pulls the prompt's blocks from that prefill instance first (computing the
        prompt here if the pull fails).

        A constrained request whose grammar is not cached waits, unscheduled, while its
        grammar compiles beside the loop; a compile that fails later fails it from `step`."""
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use",
                                      param="request_id")
        media: list = []
        if multi_modal_data:
            prompt_token_ids, media = self._process_media(prompt_token_ids, multi_modal_data)
        validate_prompt(prompt_token_ids, self.config.vocab_size, self.max_model_len)
        params.validate(self.config.vocab_size)
        if media:
            check_output_room(prompt_token_ids, params, self.max_model_len)
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError("cache_salt must be a non-empty string",
                                      param="cache_salt")
        if kv_transfer_params is not None:
            check_kv_transfer_params(kv_transfer_params)
        adapter = self._adapter_for(lora_request)
        spec = params.structured_output
        compiled = None
        if spec is not None:
            spec.check(self.args.max_grammar_bytes)
            compiled = self._grammar_jobs().cache.get(spec.grammar_key)
        pull = None  # valid so far: the connector may bring the prompt's blocks
        if self.kv_connector is not None and not media and adapter is None:
            pull = self.kv_connector.start_load_kv(request_id, prompt_token_ids, cache_salt,
                                                   kv_transfer_params)
        samples = []
        for index in range(params.n):
            samples.append(Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{index}",
                group_id=request_id,
                prompt_token_ids=list(prompt_token_ids), params=params,
                eos_token_ids=self.eos_token_ids, sample_index=index,
                parent=samples[0] if index else None,
                generator=self._generator(params, index), media=media,
                cache_salt=cache_salt, lora=adapter, hold_kv_for_transfer=bool(
                    self.kv_connector is not None
                    and self.kv_connector.delay_free(kv_transfer_params))))
        self.requests[request_id] = samples
        if self.ec_config is not None and self.ec_config.encodes_only:
            self.encode_waiting[request_id] = samples
        elif pull is not None:  # queued once its prompt's blocks are here (`_take_pulled_kv`)
            self.kv_waiting[request_id] = (pull, spec, compiled)
        else:
            self._admit(request_id, samples, spec, compiled)
        return samples

    def _admit(self, request_id: str, samples: list[Request], spec, compiled) -> None:
        """Queue a request, or first compile its grammar if it is not cached."""
        if spec is not None and compiled is None:
            self.grammar_waiting[request_id] = self.grammar_jobs.submit(spec)
        else:
            self._queue(samples, compiled)

    def _take_pulled_kv(self) -> None:
        """Enter the blocks of finished pulls and queue their requests (a failed pull: the
        request computes its whole prompt here)."""
        for group_id, (pull, spec, compiled) in list(self.kv_waiting.items()):
            if not pull.done():
                continue
            del self.kv_waiting[group_id]
            try:
                enter_blocks(self.kv_connector.kv, *pull.result())
            except KVTransferError as error:
                logger.warning("%s; computing the prompt here instead", error)
            self._admit(group_id, self.requests[group_id], spec, compiled)

    def _process_media(self, prompt_token_ids: list[int], data: dict[str, Any]
                       ) -> tuple[list[int], list]:
        """The expanded prompt ids and the processed media items of a request."""
        if self.encoders is None:
            raise InvalidRequestError(
                "this engine takes no media: the model has no vision or audio encoder",
                param="multi_modal_data")
        unknown = sorted(set(data) - set(MEDIA_KINDS))
        if unknown:
            raise InvalidRequestError(f"multi_modal_data keys must be among {list(MEDIA_KINDS)}; "
                                      f"got {unknown}", param="multi_modal_data")
        # One item (an array is one clip or one image, not a list) or a list of them.
        items = {kind: [] if data.get(kind) is None else data[kind] for kind in MEDIA_KINDS}
        items = {kind: list(value) if isinstance(value, (list, tuple)) else [value]
                 for kind, value in items.items()}
        try:
            out = self._processor(prompt_token_ids, images=items["image"],
                                  videos=items["video"], audios=items["audio"])
        except ProcessorError as error:
            raise InvalidRequestError(str(error), param="multi_modal_data") from None
        return out.input_ids, out.media

    def expand_media_prompt(self, prompt_token_ids: list[int],
                            multi_modal_data: dict[str, Any]) -> list[int]:
        """The prompt ids a request with this media would run: its placeholders expanded
        (`/tokenize`); nothing is queued or encoded."""
        return self._process_media(prompt_token_ids, multi_modal_data)[0]

    def video_fps(self) -> float:
        """The frames a second a video is sampled at unless a request asks otherwise: the
        model's processor setting (`processor_config.json`)."""
        return self._processor.config.video_fps if self._processor is not None \
            else DEFAULT_VIDEO_FPS

    def media_kinds(self) -> list[str]:
        """The media kinds this engine takes ("image", "video", "audio"): those its loaded
        encoders read, so the server can refuse other parts before decoding them."""
        if self.encoders is None:
            return []
        return list(self.encoders.media_kinds)

    def encoder_cache_stats(self) -> dict[str, int]:
        """The driver worker's encoder-output cache counters (`EncoderCache.stats()`), or {}
        without one."""
        cache = getattr(getattr(self.executor, "worker", None), "encoder_cache", None)
        return cache.stats() if cache is not None else {}

    def _queue(self, samples: list[Request], compiled) -> None:
        """Hand a request to the scheduler, each sample with its own matcher if constrained."""
        if compiled is not None:
            for sample in samples:
                sample.grammar = self.runner.grammar_compiler.matcher(
                    compiled, sample.params.structured_output, sample.prompt_token_ids)
        self.scheduler.add(samples[0])
        if len(samples) > 1:
            self.pending_siblings[samples[0].request_id] = samples[1:]

    def _grammar_jobs(self) -> GrammarJobs:
        if self.grammar_jobs is None:
            if self.tokenizer is None:
                raise InvalidRequestError("structured output needs a tokenizer, and this model "
                                          "has none", param="response_format")
            from muse.engine.grammar_cache import GrammarCache
            from muse.engine.grammar_compiler import GrammarCompiler

            num_threads = self.args.grammar_compile_threads
            self.runner.grammar_compiler = GrammarCompiler(
                self.tokenizer, self.config.vocab_size, list(self.eos_token_ids),
                max_threads=threads_per_compile(num_threads))
            self.grammar_jobs = GrammarJobs(self.runner.grammar_compiler,
                                            GrammarCache(self.args.grammar_cache_bytes),
                                            num_threads, self.args.grammar_compile_timeout_s)
        return self.grammar_jobs

    def _take_compiled_grammars(self) -> list[Request]:
        """Queue the requests whose grammar is ready; fail those whose compile failed.
        Returns the failed samples."""
        collected = set(self.grammar_jobs.collect())
        failed = []
        for group_id, job in list(self.grammar_waiting.items()):
            if job not in collected:
                continue
            del self.grammar_waiting[group_id]
            samples = self.requests[group_id]
            if job.error is None:
                self._queue(samples, job.compiled)
                continue
            for sample in samples:
                sample.error = job.error
                self.scheduler.finish(sample, RequestStatus.FINISHED, "error")
            del self.requests[group_id]
            failed += samples
        return failed

    def abort(self, request_id: str) -> None:
        """Stop a request (all its samples) and free its blocks now."""
        job = self.grammar_waiting.pop(request_id, None)
        if job is not None and job not in self.grammar_waiting.values():
            self.grammar_jobs.cancel(job)
        self.kv_waiting.pop(request_id, None)  # its pull ends on its own, unread
        self.encode_waiting.pop(request_id, None)
        for request in self.requests.pop(request_id, []):
            self.pending_siblings.pop(request.request_id, None)
            if not request.is_finished:
                self.scheduler.finish(request, RequestStatus.ABORTED, "abort")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: later requests compute their prompts afresh."""
        self.kv_cache.reset_prefix_cache()

    # ---- LoRA adapters -------------------------------------------------------------------
    def _lora_manager(self) -> LoRAManager | None:
        """The adapter slots (with `enable_lora`); `lora_modules` are read now, so a bad one
        fails the start, and made resident when first used."""
        args = self.args
        if not args.enable_lora:
            return None
        manager = LoRAManager(self.model, args.max_loras, args.max_lora_rank, self.dtype,
                              self.device, slots_in_use=self._lora_slots_in_use)
        for lora_int_id, module in enumerate(args.lora_modules, start=1):
            name, path = parse_lora_module(module)
            manager.add(LoRARequest(name, lora_int_id, path))
        return manager

    def _lora_slots_in_use(self) -> set[int]:
        return {sample.lora.slot for samples in self.requests.values() for sample in samples
                if sample.lora is not None}

    def _checked_lora(self) -> LoRAManager:
        if self.lora is None:
            raise InvalidRequestError("this engine serves no LoRA adapters: start it with "
                                      "enable_lora (--enable-lora)", param="model")
        return self.lora

    def _adapter_for(self, lora_request: LoRARequest | str | None) -> AdapterUse | None:
        if lora_request is None:
            return None
        manager = self._checked_lora()
        if isinstance(lora_request, str):  # a loaded adapter's name (the API's `model`)
            loaded = manager.get(lora_request)
            if loaded is None:
                raise InvalidRequestError(f"no adapter named {lora_request!r} is loaded",
                                          param="model")
            lora_request = LoRARequest(loaded.name, loaded.lora_int_id)
        try:
            return manager.resolve(lora_request).use()
        except AdapterError as error:
            raise InvalidRequestError(str(error), param="lora_request") from None

    def add_lora(self, lora_request: LoRARequest) -> LoadedAdapter:
        """Read an adapter (or new weights for a loaded name: the next version, used by every
        step from now on, in-flight requests' included)."""
        try:
            return self._checked_lora().add(lora_request)
        except AdapterError as error:
            raise InvalidRequestError(str(error), param="lora_path") from None

    def remove_lora(self, lora_name: str) -> None:
        try:
            self._checked_lora().remove(lora_name)
        except KeyError:
            raise InvalidRequestError(f"no adapter named {lora_name!r} is loaded",
                                      param="lora_name", status=404) from None
        except AdapterError as error:
            raise InvalidRequestError(str(error), param="lora_name") from None

    def list_loras(self) -> list[LoadedAdapter]:
        return list(self.lora.adapters.values()) if self.lora is not None else []

    def _fork_siblings(self, parent: Request) -> None:
        for child in self.pending_siblings.pop(parent.request_id, []):
            shareable = (parent.num_prompt_tokens - 1) // self.args.block_size \
                * self.args.block_size
            child.num_computed_tokens = self.kv_cache.fork(parent, child, shareable)
            self.scheduler.add(child, front=True)

    # ---- the loop ------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one scheduled step; returns the requests that produced output or finished.

        With the overlapped schedule the step is launched before the previous one is read
        back, so the host's bookkeeping runs while the device computes, and the requests
        returned are those of the previous step. Requests whose grammar failed to compile
        are returned finished, with `error` set; an encoder instance's requests, finished
        once encoded."""
        ended = self._collect_grammars() + self._encode_only()
        self.serve_kv_pulls()
        self._take_pulled_kv()
        previous, self.in_flight = self.in_flight, None
        changed: list[Request] = []
        if previous is not None and previous.verified is not None:
            # A verify step left in flight: the next one is made on the device behind it
            # when nothing else changed, and only then is it read back.
            chained = self._launch_chained(previous)
            changed = self._resolve(previous)
            previous = None
            if chained is not None:
                self.in_flight = self._settle_chained(chained)
                return ended + changed
        if self.speculative is not None:
            self._propose_drafts()
        scheduled = self.scheduler.schedule().scheduled
        if not scheduled and previous is None and not ended and not changed:
            if self.grammar_waiting:
                self.grammar_jobs.wait(GRAMMAR_WAIT_S)
                return []
            if self.kv_waiting:
                wait_futures([pull for pull, _, _ in self.kv_waiting.values()],
                             timeout=GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)
                return []
        launched = self._launched(self.runner.launch(scheduled, previous)) \
            if scheduled else None
        if launched is not None and isinstance(self.proposer, DrafterProposer):
            self.proposer.draft_ahead(launched)
        if previous is not None:
            changed += self._resolve(previous)
        if launched is not None:
            if self.overlap_schedule and not any(
                    r.needs_token_values for r in launched.sampled) \
                    or self._may_chain(launched):
                self.in_flight = launched
            else:
                changed += self._resolve(launched)
        # A request in both steps is reported once.
        return ended + list(dict.fromkeys(changed))

    def _may_chain(self, step: LaunchedStep) -> bool:
        """Whether a launched step may be followed by a verify step made on the device: every
        request verified greedily, either with a full block of drafts or with none (a greedy
        step without drafts, such as a prompt's last chunk, reads back as a verification of
        none), nothing else in the step, the next drafts queued on the device for exactly its
        requests, no adapter."""
        if not self.chain_verify_steps or step.verified is None or not step.sampled:
            return False
        ahead = self.proposer.ahead
        if ahead is None or len(ahead[0]) != len(step.sampled):
            return False
        num_drafts = self._chained_drafts()
        full = all(item.num_new_tokens == num_drafts + 1 and len(drafts) == num_drafts
                   for item, drafts in zip(step.scheduled, step.drafts))
        return ((full or not any(step.drafts))
                and len(step.scheduled) == len(step.sampled)
                and verified_in_graph(step.verified.rows)
                and all(r.lora is None for r in step.sampled))

    def _chained_drafts(self) -> int:
        """The number of drafts a chained verify step verifies per request: a full block."""
        return min(self.speculative.num_speculative_tokens, self.proposer.ahead[1].shape[1])

    def _launch_chained(self, previous: LaunchedStep) -> LaunchedStep | None:
        """The verify step after `previous` (launched, not read back), made on the device,
        when it is the step the scheduler would make whatever `previous` accepts: the same
        requests, all still running and none waiting to join, each with room for a full
        block of drafts even if `previous` accepted all of its own. None, launching nothing,
        otherwise. Blocks are allocated for that longest case."""
        if not self._may_chain(previous) or self.scheduler.waiting or self.pending_siblings:
            return None
        requests = previous.sampled
        if len(self.scheduler.running) != len(requests) or any(
                r.is_finished or r.request_id not in self.proposer.ahead[0] for r in requests):
            return None
        # Each request holds one pending token now; `previous` emits at most `emitted` (its
        # drafts and one more), the chained step at most q.
        emitted, q = len(previous.drafts[0]) + 1, self._chained_drafts() + 1
        for request in requests:
            if self.max_model_len - request.num_tokens < emitted + q - 1 or (
                    request.params.max_tokens is not None
                    and request.params.max_tokens - request.num_output_tokens < emitted + q - 1):
                return None
        if not all(self.kv_cache.allocate(request, q) for request in requests):
            return None  # the blocks allocated so far serve the next steps anyway
        rows, tokens = self.proposer.ahead
        step = self.runner.launch_chained(
            previous, (tokens, [rows[r.request_id] for r in requests]), q - 1)
        self.chained_steps += 1
        return step

    def _settle_chained(self, step: LaunchedStep) -> LaunchedStep:
        """A chained step's requests, once the step before it is read back: each continues
        from its last emitted token, as if the scheduler had scheduled it (those that ended
        meanwhile are skipped when the step is read back). The next drafts are then queued
        behind it."""
        for item in step.scheduled:
            request = item.request
            step.starts.append(request.num_computed_tokens)
            step.draft_anchors.append(request.num_computed_tokens)
            if request.is_finished:
                continue
            request.spec_token_ids = [0] * (item.num_new_tokens - 1)
            request.num_computed_tokens += item.num_new_tokens
            request.add_pending_token(self.max_model_len)
        if any(item.request.is_finished for item in step.scheduled):
            self.proposer.ahead = None  # the next step drafts afresh, without them
        else:
            self.proposer.draft_ahead(step)
        return step

    def _propose_drafts(self) -> None:
        """Drafts for every running request that decodes next: at most
        `num_speculative_tokens`, and never past `max_tokens` or `max_model_len`. Requests
        with a grammar decode plainly (their matcher cannot take tokens back)."""
        spec, running = self.speculative, self.scheduler.running
        self.proposer.retain({r.request_id for r in running})
        ready, rooms = [], []
        for request in running:
            if (request.grammar is not None or request.num_pending_tokens
                    or request.num_computed_tokens != request.num_tokens - 1):
                continue
            room = min(spec.num_speculative_tokens,
                       self.max_model_len - request.num_tokens - 1)
            if request.params.max_tokens is not None:
                room = min(room, request.params.max_tokens - request.num_output_tokens - 1)
            ready.append(request)
            rooms.append(room)
        if self.step_costs is not None and not self._worth_drafting():
            return
        proposals = self.proposer.propose(ready, rooms)
        if self.step_costs is not None:
            proposals = self._adapt_drafts(ready, proposals)
        for request, drafts in zip(ready, proposals):
            request.spec_token_ids, request.spec_token_probs = drafts.tokens, drafts.probs
            request.spec_token_device = drafts.device

    def _worth_drafting(self) -> bool:
        """Adaptive verification: draft this step only if, at the acceptance seen so far, a
        step with drafts (the drafter's time included) beats plain decoding; otherwise draft
        every `PROBE_EVERY` steps anyway, so that the acceptance stays current."""
        k = self.speculative.num_speculative_tokens
        if worth_drafting(self.acceptance.survival(k), len(self.scheduler.running),
                          self.step_costs) or self.steps_without_drafts >= PROBE_EVERY:
            self.steps_without_drafts = 0
            return True
        self.steps_without_drafts += 1
        return False

    def _adapt_drafts(self, ready: list[Request], proposals: list[Drafts]) -> list[Drafts]:
        """Adaptive verification: the step verifies the number of drafts per request that
        maximises its expected tokens per second. Each draft's chance to survive comes from
        the drafter (its confidence head, else its own probability of a sampled draft) or from
        the acceptance seen so far; the profiled step costs price the shapes. Only draft-side
        information decides, so the output stays lossless: a trimmed draft is a shorter
        draft."""
        rows = []
        for drafts in proposals:
            if drafts.confidence is not None:
                rows.append(survival(drafts.confidence))
            elif drafts.probs is not None:
                picked = drafts.probs[torch.arange(len(drafts.tokens)),
                                      torch.tensor(drafts.tokens)]
                rows.append(survival(picked))
            else:
                rows.append(self.acceptance.survival(len(drafts.tokens)))
        verified = choose_query_len(rows, len(self.scheduler.running), self.step_costs) - 1
        return [Drafts(d.tokens[:verified], d.probs[:verified] if d.probs is not None else None)
                for d in proposals]

    def _profile_step_costs(self) -> StepCosts:
        """Step times at batch sizes 1, 2, 4, ... `max_num_seqs` for plain decoding and each
        verify shape (dummy requests over the null block, through the graphs where captured),
        and the drafter's, measured once."""
        largest = self.args.max_num_seqs
        sizes = sorted({min(2 ** i, largest) for i in range(largest.bit_length() + 1)})
        kinds, block_size = list(self.num_blocks), self.args.block_size
        worker = self.executor.worker
        synchronize = torch.cuda.synchronize if self.device.type == "cuda" else None

        def run_step(requests: int, query_len: int) -> None:
            # Verify shapes priced as greedy verification runs them (in the graph where it fits).
            batch = HostBatch.dummy(kinds, query_len, block_size, requests)
            worker.execute(batch, list(range(batch.num_tokens)), greedy_verify=query_len > 1)

        run_draft = self.proposer.run_dummy if isinstance(self.proposer, DrafterProposer) \
            else None
        costs = StepCosts.profile(
            run_step, sizes, [1] + verify_query_lens(self.speculative.num_speculative_tokens),
            run_draft, repeats=3 if synchronize else 1, synchronize=synchronize,
            warmup=1 if synchronize else 0)
        logger.info("speculative step costs: %s", costs)
        return costs

    def plan_step(self) -> tuple[list[Request], PreparedStep | None]:
        """The first half of a step run together with other data-parallel ranks: this rank's
        requests whose grammar failed, and its scheduled batch (None when it has nothing to
        run). `finish_step` takes the logits."""
        failed = self._collect_grammars()
        self.serve_kv_pulls()
        self._take_pulled_kv()
        scheduled = self.scheduler.schedule().scheduled
        return failed, self.runner.prepare(scheduled) if scheduled else None

    def finish_step(self, prepared: PreparedStep, logits: torch.Tensor) -> list[Request]:
        """Sample from a planned step's logits and apply the tokens to its requests."""
        return self._resolve(self._launched(self.runner.sample(prepared, logits)))

    def _collect_grammars(self) -> list[Request]:
        # Collected even when nobody waits: a compile whose requests were aborted still
        # ends up in the bounded cache, not held outside it.
        if self.grammar_jobs is not None and self.grammar_jobs.has_pending:
            return self._take_compiled_grammars()
        return []

    def _launched(self, step: LaunchedStep) -> LaunchedStep:
        """Advance the requests of a step whose kernels are queued."""
        for item in step.scheduled:
            item.request.num_computed_tokens += item.num_new_tokens
        for request in step.sampled:
            request.add_pending_token(self.max_model_len)
            if request.request_id in self.pending_siblings:
                # The prompt's KV is queued on the device, ahead of anything a sibling runs.
                self._fork_siblings(request)
        return step

    def _resolve(self, step: LaunchedStep) -> list[Request]:
        """Read a launched step's tokens back and apply them to its requests."""
        if all(item.request.is_finished for item in step.scheduled):
            # Every request ended (or was aborted) while the step ran: nothing to read, so no
            # wait for the device, whose writes for it land before any later step's.
            return []
        if step.verified is not None:
            # Speculative: each request emits its accepted drafts and one more token.
            emitted_tokens, emitted_logprobs = step.verified.read()
            tokens = dict(zip(step.sampled, emitted_tokens))
            logprobs = dict(zip(step.sampled, emitted_logprobs))
            for request, drafts, emitted in zip(step.sampled, step.drafts, emitted_tokens):
                if drafts and not request.is_finished:
                    self.spec_stats.record(len(drafts), len(emitted) - 1)
                    self.acceptance.record(len(drafts), len(emitted) - 1)
        else:
            tokens = {r: [t] for r, t in zip(step.sampled, step.token_values())}
            logprobs = {r: [lp] for r, lp in zip(step.sampled, step.read_logprobs())}
        changed = []
        committed: list[Request] = []  # requests whose tokens this step computed
        for item, start in zip(step.scheduled, step.starts):
            request = item.request
            if request.is_finished:
                continue  # aborted, or ended by the step before while this one ran
            if request.request_id in step.prompt_logprobs:
                # Entry i is for prompt token i (the first has none). A request recomputed
                # after preemption already holds the entries of its earlier chunks.
                if not request.prompt_logprobs:
                    request.prompt_logprobs.append(None)
                entries = step.prompt_logprobs[request.request_id]
                known = len(request.prompt_logprobs) - (start + 1)
                request.prompt_logprobs.extend(entries[max(known, 0):])
            if request not in tokens:
                self.kv_cache.on_computed(request)
                committed.append(request)
                continue
            reason = None
            for token, token_logprobs in zip(tokens[request], logprobs[request]):
                if request.grammar is not None:
                    request.grammar.accept_token(token)
                request.append_token(token, token_logprobs)
                reason = request.check_stop(self.max_model_len)
                if reason is not None:
                    break  # a stop inside an accepted span: the tokens after it are dropped
            if request.spec_token_ids:
                # The step computed every draft's K/V; only the tokens kept are valid (the
                # rest is overwritten by later steps and never registered).
                request.num_computed_tokens = request.num_tokens - 1
                request.spec_token_ids, request.spec_token_probs = [], None
                request.spec_token_device = None
            # After the append: the step launched since may already count this token computed.
            self.kv_cache.on_computed(request)
            committed.append(request)
            if reason is not None:
                self.scheduler.finish(request, RequestStatus.FINISHED, reason)
                self._forget_if_done(request.group_id)
            changed.append(request)
        if self.proposer is not None:
            self.proposer.observe(committed)
        return changed

    def _encode_only(self) -> list[Request]:
        """An encoder instance's step: waiting requests' media encoded in one pass of at
        most the encoder budget's tokens (at least one request), saved by the EC connector;
        then those requests finish without tokens."""
        budget = self.args.resolve_max_num_encoder_input_tokens()
        taken: list[str] = []
        items: list = []
        tokens = 0
        for group_id, samples in self.encode_waiting.items():
            more = sum(item.num_tokens for item in samples[0].media)
            if taken and tokens + more > budget:
                break
            taken.append(group_id)
            items += samples[0].media
            tokens += more
        if items:
            encode_with_cache(self.executor.worker.encoder_cache, items,
                              self.worker_encoders.encode)
        done = []
        for group_id in taken:
            for sample in self.encode_waiting.pop(group_id):
                self.scheduler.finish(sample, RequestStatus.FINISHED, "length")
                done.append(sample)
            self._forget_if_done(group_id)
        return done

    def finish_request(self, request: Request, reason: str,
                       num_output_tokens: int | None = None) -> None:
        """End one sample early (a stop string met by the front end), keeping its first
        `num_output_tokens` output tokens when given."""
        if num_output_tokens is not None:
            request.truncate_output(num_output_tokens)
        if not request.is_finished:
            self.scheduler.finish(request, RequestStatus.FINISHED, reason)
            self._forget_if_done(request.group_id)

    def _forget_if_done(self, group_id: str) -> None:
        if all(s.is_finished for s in self.requests.get(group_id, [])):
            self.requests.pop(group_id, None)
