"""`muse quantize`: write a quantized copy of a checkpoint, in compressed-tensors' layout or
ModelOpt's.

Every projection of the decoder layers (`model.layers.*`: attention, dense MLP, the experts,
the latent MoE's pooler and unpooler) is quantized unless a pattern ignores it; the
embedding, the LM head, the routers (`mlp.gate`), the norms and everything outside the layers
(a vision tower, say) are copied unchanged. Stacked expert tensors (`mlp.experts.gate_up_proj`
[E, 2I, L], `down_proj` [E, L, I]) are written one projection per expert,
`mlp.experts.{e}.{gate,up,down}_proj`, the layout llm-compressor and ModelOpt write and vLLM
and muse read.

Formats (`--format`):

- `fp8`: FP8 E4M3 weights. compressed-tensors: per output channel, scale = row amax / 448,
  activations dynamic per token (llm-compressor's `FP8_DYNAMIC`), or static per tensor
  (`input_scale` = amax / 448) when calibration prompts are given. ModelOpt (`FP8`): per
  tensor, scale = amax / 448, and always a static `input_scale`.
- `nvfp4-w4a16`: NVFP4 weights only (llm-compressor's `NVFP4A16`): blocks of 16 E2M1 values,
  an E4M3 block scale each and a per-tensor global scale 448 * 6 / amax.
- `nvfp4`: the same weights plus static activation global scales from calibration (W4A4,
  llm-compressor's `NVFP4`, ModelOpt's `NVFP4`): `input_global_scale` = 448 * 6 / amax
  (compressed-tensors, a divisor) or `input_scale` = amax / (448 * 6) (ModelOpt, a multiplier).
- `mxfp4`: MXFP4 weights only (llm-compressor's `MXFP4A16`, compressed-tensors'
  `mxfp4-pack-quantized`): groups of 32 E2M1 values sharing an E8M0 power-of-two scale.

The per-tensor factors (NVFP4's global scale, ModelOpt FP8's weight scale) of the parts of a
fused engine layer (q/k/v, gate/up, per expert too) come from the amax of all the parts, as
llm-compressor and ModelOpt write them, so an engine that keeps one factor per fused layer
loses nothing. The tensors are read, quantized and written one shard's worth at a time.
"""

from __future__ import annotations

import fnmatch
import json
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from muse.checkpoint.layout import CheckpointError
from muse.checkpoint.reader import CheckpointReader
from muse.checkpoint.writer import (
    TensorSpec,
    check_destination,
    copy_other_files,
    write_tensors,
)
from muse.kernels.w4a16 import E2M1_MAGNITUDES
from muse.model.loader import FUSED_PARTS
from muse.quantization import ONLINE_FORMATS
from muse.quantization.mxfp4 import E8M0_BIAS
from muse.quantization.mxfp4 import GROUP as MX_GROUP
from muse.quantization.nvfp4 import BLOCK

FORMATS = ("nvfp4", "nvfp4-w4a16", "mxfp4", "fp8")
LAYOUTS = ("compressed-tensors", "modelopt")
MODELOPT_FORMATS = ("nvfp4", "fp8")
FP8_MAX = 448.0  # the largest float8_e4m3fn value
FP4_MAX = 6.0  # the largest E2M1 value
# An activation amax below this (a projection whose inputs were all zero) is taken as this,
# so that every written scale is finite and positive.
MIN_AMAX = 1e-8
MODELOPT_CONFIG = "hf_quant_config.json"
# Left unquantized whatever the patterns say: the tools' defaults (routers stay exact).
ALWAYS_IGNORED = ("re:.*\\.mlp\\.gate$",)
_LAYER_WEIGHT = re.compile(r"^model\.layers\.\d+\..+\.weight$")
_STACKED_EXPERTS = re.compile(r"^(?P<owner>model\.layers\.\d+\.mlp\.experts)\."
                              r"(?P<projection>gate_up_proj|down_proj)$")
_TINY = torch.finfo(torch.float32).tiny


# ---- the numbers ------------------------------------------------------------------------------

def quantize_fp8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-channel FP8: `weight` float8_e4m3fn and `weight_scale` float32 [out, 1]."""
    values = weight.to(torch.float32)
    scale = (values.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(_TINY)
    quantized = (values / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": quantized, "weight_scale": scale}


def quantize_fp8_tensor(weight: torch.Tensor, amax: torch.Tensor | None = None
                        ) -> dict[str, torch.Tensor]:
    """Per-tensor FP8 as ModelOpt stores it: `weight` float8_e4m3fn and a scalar
    `weight_scale` = amax / 448 (a multiplier); `amax` defaults to the weight's own."""
    values = weight.to(torch.float32)
    amax = values.abs().amax() if amax is None else torch.as_tensor(amax, dtype=torch.float32)
    scale = (amax / FP8_MAX).clamp_min(_TINY).reshape(())
    quantized = (values / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": quantized, "weight_scale": scale}


def e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """The 4-bit code (sign in bit 3) of the E2M1 value nearest to each entry (beyond 6:
    6), a tie going to the even code (round half to even, as compressed-tensors and the
    hardware round); the sign bit is the value's, so a negative rounding to zero is -0."""
    table = torch.tensor(E2M1_MAGNITUDES, device=values.device)
    midpoints = (table[:-1] + table[1:]) / 2
    magnitude = values.abs().to(torch.float32)
    # A value on a midpoint: `lower` gives the smaller code, `upper` the larger one; they
    # differ only there (between codes i and i + 1, i = lower), and the even one is kept.
    lower = torch.bucketize(magnitude, midpoints, out_int32=True).to(torch.uint8)
    upper = torch.bucketize(magnitude, midpoints, out_int32=True, right=True).to(torch.uint8)
    index = torch.where((lower & 1).bool(), upper, lower)
    return index | (torch.signbit(values).to(torch.uint8) << 3)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., n] -> uint8 [..., n / 2], the even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def quantize_nvfp4(weight: torch.Tensor, amax: torch.Tensor | None = None
                   ) -> dict[str, torch.Tensor]:
    """NVFP4 as compressed-tensors stores it: `weight_packed` uint8 [out, in/2] (low nibble
    first), `weight_scale` float8_e4m3fn [out, in/16], `weight_global_scale` float32 [1], a
    divisor: w = e2m1 * weight_scale / weight_global_scale. `amax` (default: the weight's
    own) sets the global scale 448 * 6 / amax: a fused layer's parts share theirs."""
    values = weight.to(torch.float32)
    if values.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 needs input widths divisible by {BLOCK}, got "
                         f"{values.shape[-1]}")
    amax = values.abs().amax() if amax is None else torch.as_tensor(amax, dtype=torch.float32)
    global_scale = (FP8_MAX * FP4_MAX / amax.clamp_min(_TINY)).reshape(1)
    blocks = values.unflatten(-1, (-1, BLOCK))
    block_scale = (blocks.abs().amax(dim=-1) / FP4_MAX * global_scale).clamp(
        max=FP8_MAX).to(torch.float8_e4m3fn)
    step = (block_scale.to(torch.float32) / global_scale).clamp_min(_TINY)[..., None]
    codes = e2m1_codes((blocks / step).clamp(-FP4_MAX, FP4_MAX)).flatten(-2)
    return {"weight_packed": pack_e2m1(codes), "weight_scale": block_scale,
            "weight_global_scale": global_scale}


def quantize_nvfp4_modelopt(weight: torch.Tensor, amax: torch.Tensor | None = None
                            ) -> dict[str, torch.Tensor]:
    """NVFP4 as ModelOpt stores it: `weight` uint8 [out, in/2], `weight_scale` float8_e4m3fn
    [out, in/16] = block amax / (6 * weight_scale_2), and the scalar `weight_scale_2` =
    amax / (6 * 448), a multiplier: w = e2m1 * weight_scale * weight_scale_2."""
    values = weight.to(torch.float32)
    if values.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 needs input widths divisible by {BLOCK}, got "
                         f"{values.shape[-1]}")
    amax = values.abs().amax() if amax is None else torch.as_tensor(amax, dtype=torch.float32)
    factor = (amax / (FP4_MAX * FP8_MAX)).clamp_min(_TINY).reshape(())
    blocks = values.unflatten(-1, (-1, BLOCK))
    block_scale = (blocks.abs().amax(dim=-1) / (FP4_MAX * factor)).clamp(
        max=FP8_MAX).to(torch.float8_e4m3fn)
    step = (block_scale.to(torch.float32) * factor).clamp_min(_TINY)[..., None]
    codes = e2m1_codes((blocks / step).clamp(-FP4_MAX, FP4_MAX)).flatten(-2)
    return {"weight": pack_e2m1(codes), "weight_scale": block_scale, "weight_scale_2": factor}


def mx_exponents(group_amax: torch.Tensor) -> torch.Tensor:
    """The E8M0 scale (a uint8 biased exponent) of groups with these amax values, as
    compressed-tensors and the OCP MX reference pick it: the amax rounded to a power of two
    (up when its mantissa is 1.75 or more, where the E2M1 rounding of the largest value
    would pass 6), divided by 4 (2 ** floor(log2 6)); a zero group gets the smallest scale."""
    bits = group_amax.to(torch.float32).contiguous().view(torch.int32)
    rounded = ((bits + (1 << 21)) & 0x7F800000).view(torch.float32)  # sign and mantissa off
    exponent = torch.floor(torch.log2(rounded)) - 2 + E8M0_BIAS
    exponent = torch.where(rounded > 0, exponent, torch.zeros_like(exponent))
    return exponent.clamp(0, 254).to(torch.uint8)


def quantize_mxfp4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """MXFP4 as compressed-tensors stores it: `weight_packed` uint8 [out, in/2] (low nibble
    first) and `weight_scale` uint8 [out, in/32], E8M0 exponents: w = e2m1 * 2 ** (s - 127)."""
    values = weight.to(torch.float32)
    if values.shape[-1] % MX_GROUP:
        raise ValueError(f"MXFP4 needs input widths divisible by {MX_GROUP}, got "
                         f"{values.shape[-1]}")
    groups = values.unflatten(-1, (-1, MX_GROUP))
    exponents = mx_exponents(groups.abs().amax(dim=-1))
    step = torch.exp2(exponents.to(torch.float32) - E8M0_BIAS)[..., None]
    codes = e2m1_codes((groups / step).clamp(-FP4_MAX, FP4_MAX)).flatten(-2)
    return {"weight_packed": pack_e2m1(codes), "weight_scale": exponents}


# ---- the schemes ------------------------------------------------------------------------------

class Scheme:
    """A format in a layout: the tensors of one quantized projection, and the config."""

    def __init__(self, form: str, layout: str = "compressed-tensors",
                 calibrated: bool = False) -> None:
        if form not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {form!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if layout == "modelopt" and form not in MODELOPT_FORMATS:
            raise ValueError(f"the modelopt layout holds {' and '.join(MODELOPT_FORMATS)} "
                             f"(ModelOpt's NVFP4 and FP8, with activation scales), not "
                             f"{form!r}; use --layout compressed-tensors")
        self.form, self.layout = form, layout
        # Static activation scales: always for W4A4 and ModelOpt, for compressed-tensors FP8
        # when calibration prompts are given.
        self.static = form == "nvfp4" or layout == "modelopt" or (form == "fp8" and calibrated)
        if calibrated and not self.static:
            raise ValueError(f"--format {form} is weight-only: it has no activation scales "
                             "to calibrate (use --format nvfp4 or fp8)")
        # The per-tensor factor of a fused layer's parts comes from all of them.
        self.shared_factor = form in ("nvfp4", "nvfp4-w4a16") or layout == "modelopt"

    def __repr__(self) -> str:
        return f"{self.form} ({self.layout})"

    def weights(self, weight: torch.Tensor, amax: torch.Tensor | None) -> dict[str, torch.Tensor]:
        if self.form == "mxfp4":
            return quantize_mxfp4(weight)
        if self.form == "fp8":
            return quantize_fp8_tensor(weight, amax) if self.layout == "modelopt" \
                else quantize_fp8(weight)
        if self.layout == "modelopt":
            return quantize_nvfp4_modelopt(weight, amax)
        return quantize_nvfp4(weight, amax)

    def activations(self, amax: float) -> dict[str, torch.Tensor]:
        """The static activation scale of a projection whose inputs reach `amax`."""
        if not self.static:
            return {}
        amax = max(float(amax), MIN_AMAX)
        if self.layout == "modelopt":
            top = FP8_MAX * (FP4_MAX if self.form == "nvfp4" else 1.0)
            return {"input_scale": torch.tensor(amax / top, dtype=torch.float32)}
        if self.form == "nvfp4":  # compressed-tensors: a divisor
            return {"input_global_scale": torch.tensor([FP8_MAX * FP4_MAX / amax])}
        return {"input_scale": torch.tensor([amax / FP8_MAX])}

    def tensors(self, weight: torch.Tensor, amax: torch.Tensor | None,
                activation_amax: float | None) -> dict[str, torch.Tensor]:
        out = self.weights(weight, amax if self.shared_factor else None)
        if self.static:
            assert activation_amax is not None, "static scales need calibration"
            out |= self.activations(activation_amax)
        return out

    def config(self, ignored: Sequence[str]) -> dict:
        """compressed-tensors' `quantization_config`, or ModelOpt's `hf_quant_config.json`."""
        if self.layout == "modelopt":
            from muse import __version__
            quantization = {"quant_algo": "NVFP4" if self.form == "nvfp4" else "FP8",
                            "kv_cache_quant_algo": None, "exclude_modules": list(ignored)}
            if self.form == "nvfp4":
                quantization["group_size"] = BLOCK
            return {"producer": {"name": "modelopt", "version": __version__,
                                 "writer": "muse quantize"},
                    "quantization": quantization}
        return compressed_tensors_config(self.form, ignored, self.static)


def compressed_tensors_config(form: str, ignored: Sequence[str], static: bool = False) -> dict:
    """The `quantization_config` compressed-tensors writes for `form`."""
    fp4 = {"num_bits": 4, "type": "float", "symmetric": True}
    activations = None
    if form == "fp8":
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                   "dynamic": False, "group_size": None}
        activations = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                       "dynamic": True, "group_size": None}
        if static:
            activations |= {"strategy": "tensor", "dynamic": False, "observer": "static_minmax"}
        layout = "float-quantized"
    elif form == "mxfp4":
        weights = fp4 | {"strategy": "group", "dynamic": False, "group_size": MX_GROUP,
                         "scale_dtype": "torch.uint8"}
        layout = "mxfp4-pack-quantized"
    else:
        weights = fp4 | {"strategy": "tensor_group", "dynamic": False, "group_size": BLOCK,
                         "scale_dtype": "torch.float8_e4m3fn"}
        if form == "nvfp4":
            # Per-block activation scales at run time under a calibrated global one.
            activations = fp4 | {"strategy": "tensor_group", "dynamic": "local",
                                 "group_size": BLOCK, "scale_dtype": "torch.float8_e4m3fn",
                                 "observer": "static_minmax"}
        layout = "nvfp4-pack-quantized"
    return {"quant_method": "compressed-tensors", "format": layout,
            "quantization_status": "compressed", "ignore": list(ignored),
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations,
                                          "format": layout}}}


def quantization_config(form: str, ignored: Sequence[str]) -> dict:
    """The `quantization_config` compressed-tensors writes for `form` (no calibration)."""
    return Scheme(form).config(ignored)


def summary(settings: dict) -> str:
    """One line on a written config: its format and how many modules stay unquantized."""
    if "quantization" in settings:  # ModelOpt
        quantization = settings["quantization"]
        return (f"ModelOpt {quantization['quant_algo']}; {len(quantization['exclude_modules'])}"
                " modules left unquantized")
    return f"{settings['format']}; {len(settings['ignore'])} modules left unquantized"


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


def fused_group(module: str) -> str | None:
    """The engine layer that fuses the checkpoint projection `module` with others
    (`...self_attn.qkv_proj` for q/k/v, `...gate_up_proj` for gate/up), or None."""
    owner, _, projection = module.rpartition(".")
    fused = FUSED_PARTS.get(projection)
    return f"{owner}.{fused[0]}" if fused is not None else None


class _Output:
    """One entry of the output: a tensor copied as it is, or a projection (`expert` set when
    it comes out of a stacked expert tensor) written quantized or not."""

    def __init__(self, name: str, source: str, shape: tuple[int, ...], dtype: torch.dtype,
                 expert: int | None = None, part: str | None = None,
                 quantized: bool = False) -> None:
        self.name, self.source, self.shape, self.dtype = name, source, shape, dtype
        self.expert, self.part, self.quantized = expert, part, quantized

    @property
    def is_projection(self) -> bool:
        return self.expert is not None or self.name != self.source

    def read(self, reader: CheckpointReader | TensorSource) -> torch.Tensor:
        """The tensor (a projection's weight [out, in]) from the source checkpoint."""
        if self.expert is None:
            return reader.get_slice(self.source)[:]
        matrix = reader.get_slice(self.source)[self.expert]
        if self.part == "gate_proj":
            return matrix[:matrix.shape[0] // 2]
        if self.part == "up_proj":
            return matrix[matrix.shape[0] // 2:]
        return matrix


def _plan(reader: CheckpointReader | TensorSource, patterns: Sequence[str]) -> tuple[list[_Output], list[str]]:
    """Every output in the checkpoint's order, and the modules left unquantized."""
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
        if output.is_projection:
            output.quantized = not _matches(output.name, patterns)
            if not output.quantized:
                ignored.append(output.name)
    if "lm_head.weight" in reader:
        ignored.append("lm_head")
    return outputs, ignored


def _check_source(source: Path) -> None:
    config_path = source / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{source} has no config.json")
    if "quantization_config" in json.loads(config_path.read_text()) \
            or (source / MODELOPT_CONFIG).is_file():
        raise CheckpointError(f"{source} is already quantized; muse quantize reads a BF16 / "
                              "float checkpoint")


def quantize_checkpoint(source: str | Path, destination: str | Path, form: str,
                        ignore: Sequence[str] = (), progress: bool = True,
                        calibration_prompts: str | Path | None = None,
                        layout: str = "compressed-tensors") -> dict:
    """Write the quantized checkpoint of format `form` in `layout`; returns the quantization
    config written (compressed-tensors' `quantization_config`, or the content of ModelOpt's
    `hf_quant_config.json`). Static activation scales come from `calibration_prompts` (a
    file, see `muse.quantization.calibration`), or the shipped prompts when the scheme needs
    them and none are given."""
    scheme = Scheme(form, layout, calibrated=calibration_prompts is not None)
    source, destination = Path(source), Path(destination)
    check_destination(destination, [source], "the quantized checkpoint")
    _check_source(source)
    with CheckpointReader(source) as reader:
        outputs, ignored = _plan(reader, list(ignore) + list(ALWAYS_IGNORED))
        quantized = [output for output in outputs if output.quantized]
        activation_amax = None
        if scheme.static:
            from muse.quantization.calibration import calibrate
            activation_amax = calibrate(source, [output.name for output in quantized],
                                        calibration_prompts, progress=progress)
        specs, producers = _specs(reader, outputs, scheme, activation_amax)
        with tqdm(total=len(specs), desc=f"muse quantize {scheme}", unit="tensor",
                  disable=not progress, file=sys.stderr) as bar:
            def produce(spec: TensorSpec) -> torch.Tensor:
                bar.update(1)
                return producers[spec.name]()

            write_tensors(destination, specs, produce)
    settings = scheme.config(ignored)
    _copy_other_files(source, destination, settings, scheme.layout)
    return settings


def quantized_tensors(source: CheckpointReader | TensorSource, form: str,
                      ignore: Sequence[str] = ()
                      ) -> tuple[dict, list[str], Iterator[tuple[str, torch.Tensor]]]:
    """The tensors `muse quantize --format form` would write for `source`, made one module at
    a time on the source tensors' device (the engine's online quantization): the
    quantization config, every tensor name, and an iterator over (name, tensor)."""
    if form not in ONLINE_FORMATS:
        raise ValueError(f"online quantization takes {', '.join(ONLINE_FORMATS)} (weight "
                         f"scales only); {form!r} needs calibrated activation scales: write "
                         "the checkpoint with `muse quantize`")
    scheme = Scheme(form)
    outputs, ignored = _plan(source, list(ignore) + list(ALWAYS_IGNORED))
    specs, producers = _specs(source, outputs, scheme, None)
    names = [spec.name for spec in specs]
    return scheme.config(ignored), names, ((name, producers[name]()) for name in names)


class TensorSource:
    """Tensors in memory (a model's state dict) read the way a `CheckpointReader` reads a
    checkpoint, so that `quantized_tensors` can quantize a model built in memory."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self.tensors[name].dtype

    def get_slice(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors


def _specs(reader: CheckpointReader | TensorSource, outputs: list[_Output], scheme: Scheme,
           activation_amax: dict[str, float] | None
           ) -> tuple[list[TensorSpec], dict[str, Callable[[], torch.Tensor]]]:
    """The output tensors in order, and a function making each; a module's quantized tensors
    are computed once, when the first of them is written."""
    specs: list[TensorSpec] = []
    producers: dict[str, Callable[[], torch.Tensor]] = {}
    cache: dict[str, dict[str, torch.Tensor]] = {}
    members: dict[str, list[_Output]] = {}
    for output in outputs:
        group = fused_group(output.name) if output.quantized else None
        if group is not None:
            members.setdefault(group, []).append(output)
    group_amax: dict[str, torch.Tensor] = {}

    def amax_of(output: _Output) -> torch.Tensor | None:
        """The amax setting a per-tensor factor: over every quantized part of the fused
        layer (read once per layer), or None (the weight's own)."""
        group = fused_group(output.name)
        if not scheme.shared_factor or group not in members:
            return None
        if group not in group_amax:
            group_amax[group] = torch.stack([part.read(reader).to(torch.float32).abs().amax()
                                             for part in members[group]]).amax()
        return group_amax[group]

    for output in outputs:
        if not output.quantized:
            key = output.name if output.name == output.source else f"{output.name}.weight"
            specs.append(TensorSpec(key, output.shape, output.dtype))
            producers[key] = lambda output=output: output.read(reader)
            continue
        act = activation_amax[output.name] if activation_amax is not None else None
        # The outputs' shapes and dtypes, from quantizing one zero row: matrices have a row
        # per output feature, scalars and per-tensor vectors their own shape.
        rows, columns = output.shape
        for leaf, tensor in scheme.tensors(torch.zeros(1, columns), torch.ones(()),
                                           1.0).items():
            key = f"{output.name}.{leaf}"
            shape = (rows, *tensor.shape[1:]) if tensor.dim() == 2 else tuple(tensor.shape)
            specs.append(TensorSpec(key, shape, tensor.dtype))

            def make(output=output, leaf=leaf, act=act) -> torch.Tensor:
                if output.name not in cache:
                    cache.clear()  # one module at a time
                    cache[output.name] = scheme.tensors(output.read(reader), amax_of(output),
                                                        act)
                return cache[output.name][leaf]
            producers[key] = make
    return specs, producers


def _copy_other_files(source: Path, destination: Path, settings: dict, layout: str) -> None:
    """config.json (with compressed-tensors' `quantization_config`, or unchanged next to
    ModelOpt's `hf_quant_config.json`), and every other file and folder of the source
    (tokenizer, generation config, a drafter) as they are."""
    copy_other_files(source, destination, skip=("config.json",))
    config = json.loads((source / "config.json").read_text())
    modelopt_path = destination / MODELOPT_CONFIG
    if layout == "modelopt":
        modelopt_path.write_text(json.dumps(settings, indent=2) + "\n")
    else:
        config["quantization_config"] = settings
        modelopt_path.unlink(missing_ok=True)  # a stale one from an earlier write
    (destination / "config.json").write_text(json.dumps(config, indent=2) + "\n")
