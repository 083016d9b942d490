"""The two engines on a shape, with random weights: building, prompting and timing them."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from benchmarks.shapes import hf_config, transformers_text_config
from muse.config import TextConfig

# Random prompt ids start here, clear of special and placeholder tokens at the bottom of the
# vocabulary.
FIRST_PROMPT_ID = 256


def random_prompt(rng: np.random.Generator, length: int, vocab_size: int) -> list[int]:
    return rng.integers(FIRST_PROMPT_ID, vocab_size, size=length).tolist()


def build_muse(shape: str, device: torch.device, dtype: str, *, enforce_eager: bool = False,
               detokenize: bool = False,
               **engine_args: Any) -> tuple[Any, dict[str, Any]]:
    """A muse LLM on a preset, and a record of how it was configured.

    `engine_args` go to EngineArgs as given; those left None are dropped (engine default).
    """
    from muse import LLM

    kwargs = {k: v for k, v in engine_args.items() if v is not None}
    llm = LLM(shape, dtype=dtype, device=str(device), enforce_eager=enforce_eager, **kwargs)
    if not detokenize:
        # Token ids in, token ids out, as transformers' generate: no detokenizing per step.
        llm.tokenizer = None
    info = {"detokenize": detokenize, "enforce_eager": enforce_eager,
            "engine_args": dataclasses.asdict(llm.engine.args),
            "max_model_len_resolved": llm.engine.max_model_len,
            # rank 0's share (a data-parallel engine's first replica's)
            "parameters": sum(p.numel() for p in llm.engine.replicas[0].model.parameters())}
    return llm, info


def build_transformers(text: TextConfig, device: torch.device, dtype: torch.dtype, *,
                       attn_implementation: str | None = None,
                       experts_implementation: str | None = None
                       ) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A Qwen3(-MoE) causal LM of `text`'s shape with random weights, built on `device`.

    Constructed inside a `torch.device` context in `dtype`, so every weight is allocated and
    initialized (normal(0, initializer_range), norms at one) on the device, never on the host.
    """
    import transformers

    transformers.logging.set_verbosity_error()
    stand_in, _ = transformers_text_config(text)
    config = hf_config(stand_in)
    cls = transformers.Qwen3MoeForCausalLM if stand_in.is_moe else transformers.Qwen3ForCausalLM
    kwargs: dict[str, Any] = {}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if experts_implementation and stand_in.is_moe:
        kwargs["experts_implementation"] = experts_implementation
    with torch.device(device):
        model = cls._from_config(config, dtype=dtype, **kwargs)
    model.eval().requires_grad_(False)
    info = {"class": cls.__name__,
            "attn_implementation": model.config._attn_implementation,
            "experts_implementation": getattr(model.config, "_experts_implementation", None)
            if stand_in.is_moe else None,
            "parameters": sum(p.numel() for p in model.parameters())}
    return model, info


def left_pad(prompts: Sequence[Sequence[int]], device: torch.device, pad_id: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def hf_generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], new_tokens: int,
                static_cache: bool = False, pad_id: int = 0) -> torch.Tensor:
    """Greedy generation of exactly `new_tokens` tokens for a left-padded batch."""
    ids, mask = left_pad(prompts, model.device, pad_id)
    kwargs: dict[str, Any] = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens,
                              "do_sample": False, "pad_token_id": pad_id}
    if static_cache:
        kwargs["cache_implementation"] = "static"
    out = model.generate(ids, attention_mask=mask, **kwargs)
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, "
                           f"asked for {new_tokens}")
    return out


def free_memory(device: torch.device) -> int | None:
    """On CUDA, collect garbage and give cached blocks back; the bytes still allocated."""
    if device.type != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)



def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """fn's result and its wall time, with the device idle before and after."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - start


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))
