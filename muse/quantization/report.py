"""How far a quantized checkpoint is from the checkpoint it was made from.

Two measures, both taken from what the engine runs:

- **weight error**: per checkpoint projection (`...self_attn.q_proj`,
  `...mlp.experts.3.gate_proj`), ||W_q - W|| / ||W|| (Frobenius), W read by the engine's
  loader from the unquantized checkpoint and W_q the quantized layer's `dequantized()` weight
  (the weight the weight-only GEMMs multiply by). Fused engine layers (q/k/v, gate/up, a
  layer's experts) are split back into the checkpoint's projections;
- **next-token KL**: KL(p_ref || p_quant) of the next-token distributions at every position
  of each text, both models run by the engine (`muse.LLM`) on the same token ids. The full
  logits rows are read where the engine computes them (the model's `compute_logits`), for
  a prompt-logprobs request that predicts every position.

Both models are built with the same compute dtype (float32 by default), so the figures are
those of the weights' rounding alone.
"""

from __future__ import annotations

import contextlib
import math
import re
import statistics
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Union

import torch

from muse.engine.sampling_params import SamplingParams
from muse.layers.fused_moe import FusedMoE
from muse.llm import LLM
from muse.quantization.config import checkpoint_modules

ModelSource = Union[str, Path, LLM]
KV_CACHE_BYTES = 64 * 2**20
_LAYER_PREFIX = re.compile(r"^model\.layers\.\d+\.")
_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def load_engine(path: str | Path, dtype: str = "float32", device: str = "cpu",
                kv_cache_memory_bytes: int = KV_CACHE_BYTES, **engine_args) -> LLM:
    """The checkpoint in the engine, one process, without prefix caching (every position of
    a text is computed); `engine_args` go to `muse.LLM` (e.g. how quantized layers run)."""
    return LLM(str(path), device=device, dtype=dtype, kv_cache_memory_bytes=kv_cache_memory_bytes,
               enable_prefix_caching=False, **engine_args)


@contextlib.contextmanager
def _engine(source: ModelSource, dtype: str) -> Iterator[LLM]:
    """`source` itself when it is an engine, else one built for the duration."""
    if isinstance(source, LLM):
        yield source
        return
    llm = load_engine(source, dtype)
    try:
        yield llm
    finally:
        llm.shutdown()


# ---- weight error -----------------------------------------------------------------------------

@dataclass
class WeightError:
    """One checkpoint projection: its name, its kind (the name without the layer and expert
    index, e.g. `mlp.experts.gate_proj`), its shape [out, in] and the relative error."""

    module: str
    kind: str
    shape: tuple[int, int]
    relative_error: float


def projection_kind(module: str) -> str:
    """`model.layers.3.mlp.experts.5.up_proj` -> `mlp.experts.up_proj`."""
    return _EXPERT_INDEX.sub(".experts.", _LAYER_PREFIX.sub("", module))


def relative_error(approximate: torch.Tensor, exact: torch.Tensor) -> float:
    """||approximate - exact|| / ||exact|| (Frobenius), in float64."""
    exact = exact.to(torch.float64)
    norm = exact.norm().item()
    difference = (approximate.to(torch.float64) - exact).norm().item()
    return difference / norm if norm > 0 else (0.0 if difference == 0 else math.inf)


def _quantized_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(name, layer) of every engine layer whose quant method dequantizes its weight."""
    for name, layer in model.named_modules():
        method = getattr(layer, "quant_method", None)
        if method is not None and callable(getattr(method, "dequantized", None)):
            yield name, layer


def _linear_parts(name: str, layer: torch.nn.Module, weight: torch.Tensor
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """A linear layer's [out, in] weight as its checkpoint projections' rows."""
    modules = checkpoint_modules(layer, name)
    sizes = list(layer.output_partition_sizes)
    if len(modules) != len(sizes):
        raise ValueError(f"{name}: {len(modules)} checkpoint projections for "
                         f"{len(sizes)} output parts")
    yield from zip(modules, weight.split(sizes, dim=0))


def _expert_parts(name: str, projection: str, weight: torch.Tensor
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """An experts tensor (`gate_up` [E, 2I, L] or `down` [E, L, I]) as per-expert
    projections, `{name}.{e}.gate_proj` / `up_proj` / `down_proj`."""
    for expert in range(weight.shape[0]):
        if projection == "gate_up":
            gate, up = weight[expert].chunk(2, dim=0)
            yield f"{name}.{expert}.gate_proj", gate
            yield f"{name}.{expert}.up_proj", up
        else:
            yield f"{name}.{expert}.down_proj", weight[expert]


@torch.no_grad()
def weight_errors(reference: ModelSource, quantized: ModelSource, dtype: str = "float32"
                  ) -> list[WeightError]:
    """The relative error of every quantized projection of `quantized` against the same
    projection of `reference` (its unquantized source), in the engine's layer order."""
    with _engine(reference, dtype) as plain, _engine(quantized, dtype) as rounded:
        plain_layers = dict(plain.engine.model.named_modules())
        errors = []
        for name, layer in _quantized_layers(rounded.engine.model):
            source = plain_layers.get(name)
            if source is None:
                raise ValueError(f"`{name}` is quantized but the reference has no such layer")
            if isinstance(layer, FusedMoE):
                pairs = []
                for projection in ("gate_up", "down"):
                    exact = getattr(source, f"{projection}_proj")
                    approximate = layer.quant_method.dequantized(layer, projection)
                    pairs += list(zip(_expert_parts(name, projection, approximate),
                                      _expert_parts(name, projection, exact)))
            else:
                if getattr(source, "quant_method", None) is not None and \
                        callable(getattr(source.quant_method, "dequantized", None)):
                    raise ValueError(f"`{name}` is quantized in the reference too")
                pairs = list(zip(_linear_parts(name, layer, layer.quant_method.dequantized(layer)),
                                 _linear_parts(name, source, source.weight)))
            for (module, approximate), (_, exact) in pairs:
                if approximate.shape != exact.shape:
                    raise ValueError(f"{module}: shape {tuple(approximate.shape)} quantized, "
                                     f"{tuple(exact.shape)} in the reference")
                errors.append(WeightError(module, projection_kind(module),
                                          tuple(exact.shape), relative_error(approximate, exact)))
    if not errors:
        raise ValueError("the quantized model has no quantized layer")
    return errors


def summarize_weight_errors(errors: Sequence[WeightError]) -> dict:
    """Max (and which projection), median and mean over all projections, and the same per
    projection kind."""
    def summary(items: Sequence[WeightError]) -> dict:
        values = [e.relative_error for e in items]
        worst = max(items, key=lambda e: e.relative_error)
        return {"count": len(values), "max": worst.relative_error, "max_module": worst.module,
                "median": statistics.median(values), "mean": statistics.fmean(values)}

    kinds: dict[str, list[WeightError]] = {}
    for error in errors:
        kinds.setdefault(error.kind, []).append(error)
    return {"all": summary(errors), "per_kind": {kind: summary(items)
                                                 for kind, items in kinds.items()}}


# ---- next-token KL ----------------------------------------------------------------------------

@contextlib.contextmanager
def _captured_logits(llm: LLM) -> Iterator[list[torch.Tensor]]:
    """Every logits tensor the engine's model computes while the block runs (one process)."""
    model = llm.engine.model
    captured: list[torch.Tensor] = []
    compute = model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute(hidden)
        captured.append(logits.detach().to("cpu", torch.float32))
        return logits

    model.compute_logits = recording
    try:
        yield captured
    finally:
        del model.compute_logits  # the class's method again


def next_token_logprobs(llm: LLM, token_ids: Sequence[int]) -> torch.Tensor:
    """log p(. | ids[:i + 1]) for every position i of the text, [len(ids), vocab] float64:
    one request whose prompt logprobs ask for every position's logits row (and one sampled
    token for the last)."""
    if llm.engine.model is None:
        raise ValueError("the engine's model is not in this process")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    with _captured_logits(llm) as captured:
        llm.generate([{"prompt_token_ids": list(token_ids)}], params, use_tqdm=False)
    rows = torch.cat(captured)
    if rows.shape[0] != len(token_ids):
        raise RuntimeError(f"the engine computed {rows.shape[0]} logits rows for a text of "
                           f"{len(token_ids)} tokens")
    return rows.to(torch.float64).log_softmax(dim=-1)


def kl_per_position(reference_logprobs: torch.Tensor, quantized_logprobs: torch.Tensor
                    ) -> torch.Tensor:
    """KL(p_ref || p_quant) per row, in nats."""
    p = reference_logprobs.exp()
    return (p * (reference_logprobs - quantized_logprobs)).sum(dim=-1).clamp_min(0.0)


def encode_texts(llm: LLM, texts: Sequence[str], max_tokens: int | None = None
                 ) -> list[list[int]]:
    """Each text's token ids (special-token strings as their ids), starting with the BOS
    token, cut to `max_tokens`."""
    tokenizer = llm.tokenizer
    bos = tokenizer.bos_token_id
    encoded = []
    for text in texts:
        ids = tokenizer.encode(text)
        if not ids or ids[0] != bos:
            ids = [bos] + ids
        encoded.append(ids[:max_tokens] if max_tokens else ids)
    return encoded


@dataclass
class KLReport:
    """Next-token KL over every position of every text, in nats."""

    texts: int
    positions: int
    mean: float
    median: float
    p99: float
    max: float
    max_at: tuple[int, int]  # (text, position) of the largest
    per_text_mean_max: float  # the worst text's mean
    top1_agreement: float  # share of positions whose most likely token is the same


def _quantile(values: torch.Tensor, q: float) -> float:
    return torch.quantile(values, q).item() if values.numel() else math.nan


def next_token_kl(reference: ModelSource, quantized: ModelSource, texts: Sequence[str],
                  max_tokens: int | None = None, dtype: str = "float32") -> KLReport:
    """KL(p_ref || p_quant) at every position of each text (tokenized by the reference's
    tokenizer, at most `max_tokens` tokens each)."""
    with _engine(reference, dtype) as plain, _engine(quantized, dtype) as rounded:
        documents = encode_texts(plain, texts, max_tokens)
        per_text, agree = [], 0
        for ids in documents:
            want = next_token_logprobs(plain, ids)
            got = next_token_logprobs(rounded, ids)
            per_text.append(kl_per_position(want, got))
            agree += (want.argmax(-1) == got.argmax(-1)).sum().item()
    if not per_text:
        raise ValueError("no texts to measure")
    values = torch.cat(per_text)
    flat = int(values.argmax())
    text = 0
    while flat >= per_text[text].numel():
        flat -= per_text[text].numel()
        text += 1
    return KLReport(texts=len(per_text), positions=values.numel(), mean=values.mean().item(),
                    median=_quantile(values, 0.5), p99=_quantile(values, 0.99),
                    max=values.max().item(), max_at=(text, flat),
                    per_text_mean_max=max(v.mean().item() for v in per_text),
                    top1_agreement=agree / values.numel())


# ---- both -------------------------------------------------------------------------------------

def compare_checkpoints(reference: ModelSource, quantized: ModelSource, texts: Sequence[str],
                        max_tokens: int | None = None, dtype: str = "float32",
                        per_module: bool = False) -> dict:
    """Both measures of `quantized` against `reference`, as a JSON-ready dict: the weight
    errors' summary (and every projection's with `per_module`) and the KL report."""
    with _engine(reference, dtype) as plain, _engine(quantized, dtype) as rounded:
        errors = weight_errors(plain, rounded)
        kl = next_token_kl(plain, rounded, texts, max_tokens)
    result = {"weights": summarize_weight_errors(errors), "kl": asdict(kl)}
    if per_module:
        result["weights"]["modules"] = {e.module: e.relative_error for e in errors}
    return result
