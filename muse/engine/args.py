"""Engine settings; names follow vLLM's engine arguments where they mean the same thing."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from muse.config import parse_overrides
from muse.distributed.config import ParallelConfig
from muse.engine.structured_output import DEFAULT_MAX_GRAMMAR_BYTES
from muse.presets import PRESETS
from muse.quantization import ONLINE_FORMATS

EXECUTOR_BACKENDS = ("uni", "mp", "ray")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The KV cache's storage; "auto" is the model's dtype (vLLM's and SGLang's names).
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass
class EngineArgs:
    model: str = "muse-spark-tiny"  # a preset name (random weights) or a checkpoint folder
    tokenizer: str | None = None  # default: the checkpoint's own, else the base tokenizer
    dtype: str = "auto"  # auto: the checkpoint's dtype on GPU, float32 on CPU
    device: str = "auto"
    seed: int = 0  # seeds random weights of presets and unseeded sampling
    max_model_len: int | None = None  # default: the model's limit, capped by KV capacity
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    # Encoder output tokens of the media items a step may newly encode (vLLM's
    # SchedulerConfig name); default: `max_num_batched_tokens`. Items already in the encoder
    # cache cost nothing; a single item larger than the budget still runs, alone.
    max_num_encoder_input_tokens: int | None = None
    # GiB of encoder outputs kept for reuse across steps and requests (0.25: 256 MiB).
    encoder_cache_gb: float = 0.25
    # Vision / audio encoders in this many processes of their own (0: in the engine's
    # process); see muse.multimodal.encoder_workers.
    encoder_workers: int = 0
    enable_prefix_caching: bool = True
    # The prefix cache's lower tiers (muse.engine.kv_offload): GiB of host memory per rank
    # (SGLang's `--hicache-size`; 0: none), when blocks reach it, and a directory of files
    # below it that outlives the process, within its own GiB budget.
    kv_offload_gb: float = 0.0
    kv_offload_write_policy: str = "write_through"
    kv_offload_disk: str | None = None
    kv_offload_disk_gb: float = 64.0
    kv_cache_memory_bytes: int | None = None  # explicit KV budget (default on CPU: 256 MiB)
    gpu_memory_utilization: float = 0.9
    # fp8 / fp8_e4m3: K/V stored as float8_e4m3fn with per-layer scales (the checkpoint's
    # k_scale / v_scale, else 1.0; `calculate_kv_scales`: from the first step's K/V).
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False
    # Quantized checkpoints (muse.quantization.common.QuantOptions): FP8 linears weight-only
    # (W8A16) even where FP8 tensor cores run them W8A8; or activations quantized as W4A4 /
    # W8A8 kernels would, where none runs (NVFP4 with activation scales: eager, no graphs).
    quantization_weight_only: bool = False
    quantization_emulate_activations: bool = False
    # Online quantization (vLLM's `--quantization`): an unquantized model (a checkpoint, or a
    # preset's random weights) quantized as it loads, as `muse quantize --format` would write
    # it: fp8, nvfp4-w4a16 or mxfp4 (formats without calibrated activation scales).
    quantization: str | None = None
    init_std: float | None = None  # weight scale of a preset's random weights
    enforce_eager: bool = False  # on CUDA, decode steps replay captured CUDA graphs unless set
    # One-request prefill steps of up to this many tokens replay captured graphs too (0: none).
    prefill_graph_max_tokens: int = 1024
    # Steps no whole-step graph covers (several prefills, prefills mixed with decodes) of up
    # to `piecewise_cuda_graph_max_tokens` tokens replay piecewise graphs: every layer's work
    # but attention captured per token-count bucket (SGLang's flags; vLLM's PIECEWISE mode).
    # Mixed steps 1.6-1.9x faster on the H200 (docs/performance.md).
    enable_piecewise_cuda_graph: bool = True
    piecewise_cuda_graph_max_tokens: int = 512
    # Launch step n+1 before reading step n's tokens back, so host work overlaps the device.
    overlap_schedule: bool = True
    # Structured output: a grammar not compiled this long after its request arrived fails
    # the request (400); larger schema / tools JSON is refused before compiling (400).
    grammar_compile_timeout_s: float = 10.0
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES
    grammar_cache_bytes: int = 256 * 2**20  # compiled grammars kept for reuse, LRU
    grammar_compile_threads: int = 2  # compiles run beside the engine loop, this many at once
    # Kernel backends by name (muse.kernels.backends); "auto": Triton on CUDA, torch elsewhere.
    attention_backend: str = "auto"
    moe_backend: str = "auto"
    # Parallelism (vLLM's names and meanings; see muse.distributed.config.ParallelConfig).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    enable_expert_parallel: bool = False
    # "uni": one process (world size 1); "mp": a process per rank on this host (the default
    # when the world is larger); "ray": the other ranks as Ray actors, on any node of the
    # Ray cluster (`pip install muse[ray]`).
    distributed_executor_backend: str | None = None
    # A collective between ranks that takes longer than this fails (a hung rank).
    distributed_timeout_s: float = 600.0
    # vLLM's `hf_overrides`: fields of the model's config replaced (a dict or its JSON text),
    # e.g. {"num_hidden_layers": 2} for a preset cut to two layers (muse.config.with_overrides).
    hf_overrides: Any = None
    # Speculative decoding (vLLM's names): a dict, its JSON text or a SpeculativeConfig.
    speculative_config: Any = None
    # Prefill / decode disaggregation (vLLM's `--kv-transfer-config`; muse.disagg.config).
    kv_transfer_config: Any = None
    # Encoder disaggregation (vLLM's `--ec-transfer-config`; muse.disagg.encoder_connector).
    ec_transfer_config: Any = None
    # LoRA adapters (vLLM's names; muse.lora): slots for `max_loras` adapters resident at once,
    # of ranks up to `max_lora_rank`; `lora_modules` ("name=path" or {"name", "path"}) are
    # loaded at start-up.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    lora_modules: list = field(default_factory=list)

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            prefill_context_parallel_size=self.prefill_context_parallel_size,
            enable_expert_parallel=self.enable_expert_parallel)

    @property
    def executor_backend(self) -> str:
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "mp" if self.parallel_config().world_size > 1 else "uni"

    def rank_device(self, rank: int) -> torch.device:
        """The device of a rank: its own GPU (rank r on cuda:r), or the CPU."""
        device = self.resolve_device()
        if device.type != "cuda":
            return device
        return torch.device("cuda", (device.index or 0) + rank)

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return DTYPES.get(checkpoint_dtype, torch.bfloat16) if device.type == "cuda" \
                else torch.float32
        if self.dtype not in DTYPES:
            raise ValueError(f"`dtype` must be one of {['auto', *DTYPES]}, got {self.dtype!r}")
        return DTYPES[self.dtype]

    def resolve_max_num_encoder_input_tokens(self) -> int:
        return self.max_num_encoder_input_tokens or self.max_num_batched_tokens

    @property
    def encoder_cache_bytes(self) -> int:
        return int(self.encoder_cache_gb * 2**30)

    def resolve_kv_cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype for a model computing in `model_dtype`."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or model_dtype

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size",
                     "max_grammar_bytes", "grammar_compile_threads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        value = self.max_num_encoder_input_tokens
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError("`max_num_encoder_input_tokens` must be a positive integer, got "
                             f"{value!r}")
        if isinstance(self.encoder_cache_gb, bool) \
                or not isinstance(self.encoder_cache_gb, (int, float)) \
                or not self.encoder_cache_gb >= 0:
            raise ValueError("`encoder_cache_gb` must be a non-negative number, got "
                             f"{self.encoder_cache_gb!r}")
        if isinstance(self.encoder_workers, bool) or not isinstance(self.encoder_workers, int) \
                or self.encoder_workers < 0:
            raise ValueError("`encoder_workers` must be a non-negative integer, got "
                             f"{self.encoder_workers!r}")
        self._validate_kv_offload()
        from muse.disagg.config import KVTransferConfig

        if KVTransferConfig.parse(self.kv_transfer_config) is not None \
                and self.parallel_config().world_size > 1:
            raise ValueError("`kv_transfer_config` runs on one rank per instance so far: use "
                             "it without tensor, pipeline, data or context parallelism")
        from muse.disagg.encoder_connector import ECTransferConfig

        ec = ECTransferConfig.parse(self.ec_transfer_config)
        if ec is not None and ec.encodes_only and self.parallel_config().world_size > 1:
            raise ValueError("an encoder instance (`ec_role`: ec_producer) runs on one rank")
        if isinstance(self.prefill_graph_max_tokens, bool) \
                or not isinstance(self.prefill_graph_max_tokens, int) \
                or self.prefill_graph_max_tokens < 0:
            raise ValueError("`prefill_graph_max_tokens` must be a non-negative integer, got "
                             f"{self.prefill_graph_max_tokens!r}")
        if isinstance(self.piecewise_cuda_graph_max_tokens, bool) \
                or not isinstance(self.piecewise_cuda_graph_max_tokens, int) \
                or self.piecewise_cuda_graph_max_tokens < 16:
            raise ValueError("`piecewise_cuda_graph_max_tokens` must be an integer of at least "
                             f"16, got {self.piecewise_cuda_graph_max_tokens!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"`max_model_len` must be at least 2, got {self.max_model_len}")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError("`grammar_compile_timeout_s` must be positive, got "
                             f"{self.grammar_compile_timeout_s}")
        if not isinstance(self.grammar_cache_bytes, int) or self.grammar_cache_bytes < 0:
            raise ValueError("`grammar_cache_bytes` must be a non-negative integer, got "
                             f"{self.grammar_cache_bytes!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("`gpu_memory_utilization` must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if self.quantization_weight_only and self.quantization_emulate_activations:
            raise ValueError("`quantization_weight_only` and `quantization_emulate_activations` "
                             "exclude each other: choose one")
        if self.quantization is not None:
            if self.quantization not in ONLINE_FORMATS:
                raise ValueError(f"`quantization` must be one of {list(ONLINE_FORMATS)} (or "
                                 f"unset), got {self.quantization!r}; formats with activation "
                                 "scales need calibration: write them with `muse quantize`")
        self._validate_model()
        parse_overrides(self.hf_overrides)
        self._validate_device()
        self._validate_kv_cache_dtype()
        self._validate_parallel()
        from muse.speculative.config import SpeculativeConfig

        self._validate_lora()
        if SpeculativeConfig.parse(self.speculative_config) is not None \
                and self.parallel_config().world_size > 1:
            raise ValueError("`speculative_config` runs on one rank so far: use it without "
                             "tensor, pipeline, data or context parallelism")
        from muse.kernels.backends import ATTENTION_BACKENDS, AUTO, MOE_BACKENDS

        for name, registry in (("attention_backend", ATTENTION_BACKENDS),
                               ("moe_backend", MOE_BACKENDS)):
            value = getattr(self, name)
            if value != AUTO and value not in registry:
                raise ValueError(f"`{name}` must be {AUTO!r} or one of {sorted(registry)}, "
                                 f"got {value!r}")

    def _validate_lora(self) -> None:
        if not self.enable_lora:
            if self.lora_modules:
                raise ValueError("`lora_modules` needs `enable_lora`")
            return
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        if self.parallel_config().world_size > 1:
            raise ValueError("`enable_lora` runs on one rank so far: use it without tensor, "
                             "pipeline, data or context parallelism")
        if self.kv_transfer_config is not None:
            raise ValueError("`enable_lora` with `kv_transfer_config` is not supported yet")
        from muse.lora.request import parse_lora_module

        for module in self.lora_modules:
            parse_lora_module(module)

    def _validate_kv_offload(self) -> None:
        from muse.engine.kv_offload import WRITE_POLICIES

        for name in ("kv_offload_gb", "kv_offload_disk_gb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"`{name}` must be a non-negative number, got {value!r}")
        if self.kv_offload_write_policy not in WRITE_POLICIES:
            raise ValueError(f"`kv_offload_write_policy` must be one of {list(WRITE_POLICIES)}, "
                             f"got {self.kv_offload_write_policy!r}")
        if self.kv_offload_gb and not self.enable_prefix_caching:
            raise ValueError("`kv_offload_gb` keeps cached prefixes: it needs prefix caching")
        if self.kv_offload_disk is not None:
            if not self.kv_offload_gb:
                raise ValueError("`kv_offload_disk` sits below host memory: set `kv_offload_gb` "
                                 "too")
            if self.data_parallel_size > 1:
                raise ValueError("`kv_offload_disk` with `data_parallel_size` > 1 is not "
                                 "supported yet: the replicas would share one directory")

    def _validate_kv_cache_dtype(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"`kv_cache_dtype` must be one of {list(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}")
        fp8 = KV_CACHE_DTYPES[self.kv_cache_dtype] is not None
        if self.calculate_kv_scales and not fp8:
            raise ValueError("`calculate_kv_scales` needs an FP8 KV cache: set "
                             "`kv_cache_dtype` to 'fp8'")
        device = self.resolve_device()
        if fp8 and device.type == "cuda" and self.attention_backend != "torch" \
                and torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError("`kv_cache_dtype` 'fp8' with the Triton attention kernels needs a "
                             "GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
                             "use `attention_backend` 'torch' on this one")

    def _validate_parallel(self) -> None:
        config = self.parallel_config()
        config.validate()
        if config.data_parallel_size > 1 and config.pipeline_parallel_size > 1:
            raise ValueError("`data_parallel_size` > 1 with `pipeline_parallel_size` > 1 is not "
                             "supported: use one of them")
        if config.enable_expert_parallel and config.prefill_context_parallel_size > 1:
            raise ValueError("`enable_expert_parallel` with `prefill_context_parallel_size` > 1 "
                             "is not supported: use one of them")
        if config.prefill_context_parallel_size > 1 and config.pipeline_parallel_size > 1:
            raise ValueError("`prefill_context_parallel_size` > 1 with "
                             "`pipeline_parallel_size` > 1 is not supported: use one of them")
        backend = self.executor_backend
        if backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"`distributed_executor_backend` must be one of "
                             f"{EXECUTOR_BACKENDS}, got {backend!r}")
        if backend == "uni" and config.world_size > 1:
            raise ValueError(f"a world of {config.world_size} ranks needs the 'mp' or 'ray' "
                             "executor, not 'uni'")
        if backend == "ray":
            try:
                import ray  # noqa: F401
            except ImportError:
                raise ValueError("the 'ray' executor needs Ray: pip install 'muse[ray]'") \
                    from None
        device = self.resolve_device()
        if device.type == "cuda" and (device.index or 0) + config.world_size \
                > torch.cuda.device_count():
            raise ValueError(f"{config.world_size} ranks need as many GPUs; this machine has "
                             f"{torch.cuda.device_count()}")

    def _validate_model(self) -> None:
        # Checked before anything loads, so a typo is not reported as a missing file inside
        # the folder (config, tokenizer) the user never meant.
        if self.model in PRESETS or Path(self.model).is_dir():
            return
        problem = "is not a folder" if Path(self.model).exists() else "does not exist"
        raise ValueError(f"checkpoint folder {self.model!r} {problem} (and it is not a preset: "
                         f"one of {', '.join(PRESETS)})")

    def _validate_device(self) -> None:
        if self.device == "auto":
            return
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise ValueError("`device` must be 'auto', 'cpu', 'cuda' or 'cuda:<index>', got "
                             f"{self.device!r}") from None
        if device.type != "cuda":
            return
        if not torch.cuda.is_available():
            raise ValueError(f"`device` is {self.device!r}, but CUDA is not available on this "
                             "machine; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"`device` is {self.device!r}, but this machine has "
                             f"{torch.cuda.device_count()} GPU(s)")
