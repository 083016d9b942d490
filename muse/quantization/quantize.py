"""`muse quantize`: write a quantized copy of a checkpoint in compressed-tensors' layout.

Every projection of the decoder layers (`model.layers.*`: attention, dense MLP, the experts,
the latent MoE's pooler and unpooler) is quantized unless a pattern ignores it; the
embedding, the LM head, the routers (`mlp.gate`), the norms and everything outside the layers
(a vision tower, say) are copied unchanged. Stacked expert tensors (`mlp.experts.gate_up_proj`
[E, 2I, L], `down_proj` [E, L, I]) are written one projection per expert,
`mlp.experts.{e}.{gate,up,down}_proj`, the layout llm-compressor writes and vLLM and muse read.

Formats (weights only: activations stay in the model's dtype, or are quantized on the fly by
an engine that wants to):

- `fp8`: FP8 E4M3 per output channel, scale = row amax / 448 (llm-compressor's
  `FP8_DYNAMIC`: per-token dynamic activations);
- `nvfp4-w4a16`: NVFP4, blocks of 16 E2M1 values with an E4M3 block scale and a per-tensor
  global scale 448 * 6 / amax (llm-compressor's `NVFP4A16`).

The tensors are read, quantized and written one shard's worth at a time.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from muse.checkpoint.layout import CheckpointError, is_weights_file
from muse.checkpoint.reader import CheckpointReader
from muse.checkpoint.writer import TensorSpec, write_tensors
from muse.quantization.nvfp4 import BLOCK, E2M1_VALUES

FORMATS = ("fp8", "nvfp4-w4a16")
FP8_MAX = 448.0  # the largest float8_e4m3fn value
FP4_MAX = 6.0  # the largest E2M1 value
# Left unquantized whatever the patterns say: the tools' defaults (routers stay exact).
ALWAYS_IGNORED = ("re:.*\\.mlp\\.gate$",)
_LAYER_WEIGHT = re.compile(r"^model\.layers\.\d+\..+\.weight$")
_STACKED_EXPERTS = re.compile(r"^(?P<owner>model\.layers\.\d+\.mlp\.experts)\."
                              r"(?P<projection>gate_up_proj|down_proj)$")


# ---- the numbers ------------------------------------------------------------------------------

def quantize_fp8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-channel FP8: `weight` float8_e4m3fn and `weight_scale` float32 [out, 1]."""
    values = weight.to(torch.float32)
    scale = (values.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(
        torch.finfo(torch.float32).tiny)
    quantized = (values / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": quantized, "weight_scale": scale}


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """The 4-bit code (sign in bit 3) of the E2M1 value nearest to each entry."""
    table = torch.tensor(E2M1_VALUES)
    index = (values.abs()[..., None] - table).abs().argmin(dim=-1)
    return (index | ((values < 0).long() << 3)).to(torch.uint8)


def quantize_nvfp4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """NVFP4 as compressed-tensors stores it: `weight_packed` uint8 [out, in/2] (low nibble
    first), `weight_scale` float8_e4m3fn [out, in/16], `weight_global_scale` float32 [1], a
    divisor: w = e2m1 * weight_scale / weight_global_scale."""
    values = weight.to(torch.float32)
    if values.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 needs input widths divisible by {BLOCK}, got "
                         f"{values.shape[-1]}")
    tiny = torch.finfo(torch.float32).tiny
    global_scale = (FP8_MAX * FP4_MAX / values.abs().amax().clamp_min(tiny)).reshape(1)
    blocks = values.unflatten(-1, (-1, BLOCK))
    block_scale = (blocks.abs().amax(dim=-1) / FP4_MAX * global_scale).clamp(
        max=FP8_MAX).to(torch.float8_e4m3fn)
    step = (block_scale.to(torch.float32) / global_scale).clamp_min(tiny)[..., None]
    codes = e2m1_codes((blocks / step).clamp(-FP4_MAX, FP4_MAX)).flatten(-2)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return {"weight_packed": packed, "weight_scale": block_scale,
            "weight_global_scale": global_scale}


QUANTIZERS = {"fp8": quantize_fp8, "nvfp4-w4a16": quantize_nvfp4}


def quantization_config(layout: str, ignored: Sequence[str]) -> dict:
    """The `quantization_config` compressed-tensors writes for `layout`."""
    if layout == "fp8":
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                   "dynamic": False, "group_size": None}
        activations = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                       "dynamic": True, "group_size": None}
        form = "float-quantized"
    else:
        weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                   "symmetric": True, "dynamic": False, "group_size": BLOCK,
                   "scale_dtype": "torch.float8_e4m3fn"}
        activations = None
        form = "nvfp4-pack-quantized"
    return {"quant_method": "compressed-tensors", "format": form,
            "quantization_status": "compressed", "ignore": list(ignored),
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations,
                                          "format": form}}}


# ---- the checkpoint ---------------------------------------------------------------------------

def _matches(module: str, patterns: Sequence[str]) -> bool:
    """compressed-tensors' pattern forms: `re:REGEX` (matched from the start) or a name,
    here also a shell-style glob."""
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], module):
                return True
        elif module == pattern or fnmatch.fnmatchcase(module, pattern):
            return True
    return False


class _Output:
    """One entry of the output: a tensor copied as it is, or a projection (`expert` set when
    it comes out of a stacked expert tensor) written quantized or not."""

    def __init__(self, name: str, source: str, shape: tuple[int, ...], dtype: torch.dtype,
                 expert: int | None = None, part: str | None = None,
                 quantized: bool = False) -> None:
        self.name, self.source, self.shape, self.dtype = name, source, shape, dtype
        self.expert, self.part, self.quantized = expert, part, quantized

    def read(self, reader: CheckpointReader) -> torch.Tensor:
        """The tensor (a projection's weight [out, in]) from the source checkpoint."""
        if self.expert is None:
            return reader.get_slice(self.source)[:]
        matrix = reader.get_slice(self.source)[self.expert]
        if self.part == "gate_proj":
            return matrix[:matrix.shape[0] // 2]
        if self.part == "up_proj":
            return matrix[matrix.shape[0] // 2:]
        return matrix


def _plan(reader: CheckpointReader, patterns: Sequence[str]) -> tuple[list[_Output], list[str]]:
    """Every output in the checkpoint's order, and the projections left unquantized."""
    outputs, ignored = [], []
    for name in reader.names():
        shape, dtype = reader.shape(name), reader.dtype(name)
        stacked = _STACKED_EXPERTS.match(name)
        if stacked is not None and len(shape) == 3:
            experts, rows, columns = shape
            parts = {"gate_proj": (rows // 2, columns), "up_proj": (rows // 2, columns)} \
                if stacked["projection"] == "gate_up_proj" else {"down_proj": (rows, columns)}
            for expert in range(experts):
                for part, part_shape in parts.items():
                    module = f"{stacked['owner']}.{expert}.{part}"
                    outputs.append(_Output(module, name, part_shape, dtype, expert, part))
        elif _LAYER_WEIGHT.match(name) and len(shape) == 2:
            outputs.append(_Output(name.removesuffix(".weight"), name, shape, dtype))
        else:
            outputs.append(_Output(name, name, shape, dtype))
    for output in outputs:
        is_projection = output.expert is not None or output.name != output.source
        if is_projection:
            output.quantized = not _matches(output.name, patterns)
            if not output.quantized:
                ignored.append(output.name)
    return outputs, ignored


def quantize_checkpoint(source: str | Path, destination: str | Path, layout: str,
                        ignore: Sequence[str] = (), progress: bool = True) -> dict:
    """Write the quantized checkpoint; returns its `quantization_config`."""
    if layout not in QUANTIZERS:
        raise ValueError(f"format must be one of {FORMATS}, got {layout!r}")
    source, destination = Path(source), Path(destination)
    if destination.exists() and source.resolve() == destination.resolve():
        raise ValueError("write the quantized checkpoint to another folder than its source")
    quantize = QUANTIZERS[layout]
    with CheckpointReader(source) as reader:
        outputs, ignored = _plan(reader, list(ignore) + list(ALWAYS_IGNORED))
        specs, producers = _specs(reader, outputs, quantize)
        with tqdm(total=len(specs), desc=f"muse quantize {layout}", unit="tensor",
                  disable=not progress, file=sys.stderr) as bar:
            def produce(spec: TensorSpec) -> torch.Tensor:
                bar.update(1)
                return producers[spec.name]()

            write_tensors(destination, specs, produce)
    settings = quantization_config(layout, ignored)
    _copy_other_files(source, destination, settings)
    return settings


def _specs(reader: CheckpointReader, outputs: list[_Output], quantize
           ) -> tuple[list[TensorSpec], dict]:
    """The output tensors in order, and a function making each; a module's quantized tensors
    are computed once, when the first of them is written."""
    specs: list[TensorSpec] = []
    producers: dict = {}
    cache: dict[str, dict[str, torch.Tensor]] = {}
    for output in outputs:
        if not output.quantized:
            key = output.name if output.name == output.source else f"{output.name}.weight"
            specs.append(TensorSpec(key, output.shape, output.dtype))
            producers[key] = lambda output=output: output.read(reader)
            continue
        # The outputs' shapes and dtypes, from quantizing a zero matrix of the shape.
        for leaf, tensor in quantize(torch.zeros(output.shape)).items():
            key = f"{output.name}.{leaf}"
            specs.append(TensorSpec(key, tuple(tensor.shape), tensor.dtype))

            def make(output=output, leaf=leaf) -> torch.Tensor:
                if output.name not in cache:
                    cache.clear()  # one module at a time
                    cache[output.name] = quantize(output.read(reader))
                return cache[output.name][leaf]
            producers[key] = make
    return specs, producers


def _copy_other_files(source: Path, destination: Path, settings: dict) -> None:
    """config.json with the quantization settings, and every other file and folder of the
    source (tokenizer, generation config, a drafter) as they are."""
    for path in source.iterdir():
        target = destination / path.name
        if path.name == "config.json" or (path.is_file() and is_weights_file(path.name)):
            continue
        if path.is_dir():
            shutil.copytree(path, target, dirs_exist_ok=True)
        else:
            shutil.copy2(path, target)
    config_path = source / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{source} has no config.json")
    config = json.loads(config_path.read_text())
    config["quantization_config"] = settings
    (destination / "config.json").write_text(json.dumps(config, indent=2) + "\n")
