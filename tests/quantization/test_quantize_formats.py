"""`muse quantize` beyond weight-only compressed-tensors: NVFP4 W4A4 and static FP8 with
activation scales from calibration prompts, ModelOpt's layout (`hf_quant_config.json`), the
prompt files, and the CLI's errors.

Bounds: a checkpoint muse writes loads back as its dequantized weights (greedy tokens equal,
logprobs within the engine's batching tolerance, 1e-4: weight-only GEMMs multiply by exactly
those weights); the calibration amax of every projection equals the one transformers' own
forward of the same model gives, within float32 rounding (relative 1e-4); W4A4 emulation with
the written NVFP4 activation scales moves the prompt logprobs of the random test model by at
most 0.5 against W4A16 (0.28 measured).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from muse import LLM, SamplingParams
from muse.checkpoint.layout import CheckpointError
from muse.cli import main as muse_main
from muse.presets import SHIPPED_CHECKPOINT
from muse.quantization.calibration import DEFAULT_PROMPTS, calibrate, read_prompts
from muse.quantization.config import layout_of
from muse.quantization.fp8 import Fp8LinearMethod, Fp8MoEMethod
from muse.quantization.nvfp4 import Nvfp4LinearMethod, Nvfp4MoEMethod
from muse.quantization.quantize import compressed_tensors_config, quantize_checkpoint
from tests.engine.helpers import assert_same_outputs
from tests.quantization.ct_checkpoints import _UnfusedExperts
from tests.quantization.dequantize import dequantized_copy

PROMPTS = [[5, 17, 99, 230, 41, 7, 300], [12, 12, 480, 3, 77], list(range(40, 70))]
OTHER_PROMPTS = [[500, 501, 502, 7, 7, 7, 9], list(range(300, 340))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3,
                        prompt_logprobs=2)
LAYER_1_MLP = r"re:model\.layers\.1\.mlp\..*"
ATTENTION = "model.layers.0.self_attn"


def prompt_file(directory: Path, prompts: list[list[int]]) -> Path:
    path = directory / "prompts.jsonl"
    path.write_text("".join(json.dumps({"token_ids": ids}) + "\n" for ids in prompts))
    return path


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    """Two calibration files of token ids (the test model has no tokenizer)."""
    return (prompt_file(tmp_path_factory.mktemp("prompts-a"), PROMPTS),
            prompt_file(tmp_path_factory.mktemp("prompts-b"), OTHER_PROMPTS))


def engine(path: Path, **args) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", kv_cache_memory_bytes=16 * 2**20,
               **args)


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in folder.glob("*.safetensors"):
        out.update(load_file(file))
    return out


def methods(llm: LLM) -> tuple[type, type, type]:
    layers = llm.engine.model.model.layers
    return (type(layers["0"].self_attn.qkv_proj.quant_method),
            type(layers["0"].mlp.experts.quant_method),
            type(layers["1"].mlp.experts.quant_method))


# ---- calibration ------------------------------------------------------------------------------

@torch.no_grad()
def transformers_amax(model: nn.Module, prompts: list[list[int]]) -> dict[str, float]:
    """Each linear's input amax in transformers' own forward of `model`, its experts
    unfused into per-expert linears (`mlp.experts.{e}.gate_proj`, ...)."""
    model = copy.deepcopy(model)
    for layer in model.model.layers:
        layer.mlp.experts = _UnfusedExperts(layer.mlp.experts)
    amax: dict[str, float] = {}

    def record(name, module, args):
        if args[0].numel():
            amax[name] = max(amax.get(name, 0.0), args[0].abs().amax().item())

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(lambda m, a, name=name: record(name, m, a))
    for ids in prompts:
        model(torch.tensor([ids]))
    return amax


def test_calibration_sees_what_transformers_computes(source, prompts):
    model, folder = source
    want = transformers_amax(model, PROMPTS)
    got = calibrate(folder, list(want), prompts[0], progress=False)
    assert len(want) >= 30  # attention, routers, LM head, the experts some token reached
    for name, amax in want.items():
        assert got[name] == pytest.approx(amax, rel=1e-4), name


def test_an_expert_no_token_reached_takes_its_layers_largest(source, tmp_path):
    _, folder = source
    one_token = prompt_file(tmp_path, [[5]])  # reaches 2 of each layer's 4 experts
    modules = [f"model.layers.0.mlp.experts.{e}.down_proj" for e in range(4)]
    got = calibrate(folder, modules, one_token, progress=False)
    assert len(set(got.values())) == 2 and max(got.values()) in got.values()
    assert sorted(got.values())[-2:] == [max(got.values())] * 2
    with pytest.raises(CheckpointError, match="no_such_proj"):
        calibrate(folder, ["model.layers.0.self_attn.no_such_proj"], one_token,
                  progress=False)


def test_static_fp8_scales_are_finite_positive_and_follow_the_prompts(source, prompts,
                                                                      tmp_path):
    """`--format fp8` with prompts: per-channel weights, a static per-tensor input scale
    (amax / 448) per projection, that other prompts change; muse reads them back."""
    _, folder = source
    written = []
    for index, file in enumerate(prompts):
        out = tmp_path / f"fp8-{index}"
        settings = quantize_checkpoint(folder, out, "fp8", ignore=[LAYER_1_MLP],
                                       calibration_prompts=file, progress=False)
        activations = settings["config_groups"]["group_0"]["input_activations"]
        assert (activations["strategy"], activations["dynamic"]) == ("tensor", False)
        written.append({name: tensor for name, tensor in tensors(out).items()
                        if name.endswith(".input_scale")})
    first, second = written
    assert set(first) == set(second) and len(first) == 2 * 4 + 4 * 3  # q,k,v,o x 2; experts
    for scales in written:
        assert all(s.shape == (1,) and torch.isfinite(s).all() and (s > 0).all()
                   for s in scales.values())
    changed = [name for name in first if not torch.equal(first[name], second[name])]
    assert len(changed) >= 0.9 * len(first)
    assert first[f"{ATTENTION}.q_proj.input_scale"] == first[f"{ATTENTION}.k_proj.input_scale"]
    llm = engine(tmp_path / "fp8-0")
    assert methods(llm)[:2] == (Fp8LinearMethod, Fp8MoEMethod)
    qkv = llm.engine.model.model.layers["0"].self_attn.qkv_proj
    assert torch.equal(qkv.input_scale, first[f"{ATTENTION}.q_proj.input_scale"].expand(3))


def test_prompt_files(tmp_path):
    from muse.tokenizer import MuseTokenizer

    tokenizer = MuseTokenizer.from_pretrained(SHIPPED_CHECKPOINT)
    shipped = read_prompts(None, SHIPPED_CHECKPOINT)
    lines = DEFAULT_PROMPTS.read_text().splitlines()
    assert len(shipped) == len(lines) >= 30
    assert shipped[0] == tokenizer.apply_chat_template(
        [{"role": "user", "content": lines[0]}], add_generation_prompt=True, tokenize=True)
    text = tmp_path / "prompts.txt"
    text.write_text("What is 2 + 2?\n\n  Name a colour.  \n")
    assert len(read_prompts(text, SHIPPED_CHECKPOINT)) == 2
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text(json.dumps({"prompt": "Once upon a time"}) + "\n"
                     + json.dumps({"messages": conversation}) + "\n"
                     + json.dumps({"token_ids": [1, 2, 3]}) + "\n")
    assert read_prompts(jsonl, SHIPPED_CHECKPOINT, max_length=5) == [
        tokenizer.encode("Once upon a time", add_special_tokens=True)[:5],
        tokenizer.apply_chat_template(conversation, tokenize=True)[:5], [1, 2, 3]]
    jsonl.write_text(json.dumps({"text": "no such key"}) + "\n")
    with pytest.raises(ValueError, match=r"prompts\.jsonl:1"):
        read_prompts(jsonl, SHIPPED_CHECKPOINT)


# ---- NVFP4 W4A4 in compressed-tensors' layout --------------------------------------------------

def test_nvfp4_w4a4_round_trip(source, prompts, tmp_path):
    """`--format nvfp4`: NVFP4 weights with the global scale shared by fused parts, and
    `input_global_scale` = 448 * 6 / amax; muse reads the activation scales (config
    `dynamic: "local"`), runs W4A16 as the dequantized weights, and W4A4 emulation with the
    written scales stays close."""
    _, folder = source
    out = tmp_path / "nvfp4"
    settings = quantize_checkpoint(folder, out, "nvfp4", ignore=[LAYER_1_MLP],
                                   calibration_prompts=prompts[0], progress=False)
    assert settings["config_groups"]["group_0"]["input_activations"]["dynamic"] == "local"
    stored = tensors(out)
    modules = [name.removesuffix(".weight_packed") for name in stored
               if name.endswith(".weight_packed")]
    for module in modules:
        scale = stored[f"{module}.input_global_scale"]
        assert scale.shape == (1,) and torch.isfinite(scale).all() and scale.item() > 0
    # One global scale for q/k/v and for each expert's gate/up (llm-compressor's fusion).
    for group in ([f"{ATTENTION}.{p}_proj" for p in "qkv"],
                  [f"model.layers.0.mlp.experts.2.{p}_proj" for p in ("gate", "up")]):
        scales = [stored[f"{name}.weight_global_scale"] for name in group]
        assert all(torch.equal(scale, scales[0]) for scale in scales), group
        assert 448 * 6 / scales[0].item() == pytest.approx(
            max(_amax(folder, name).item() for name in group), rel=1e-6)
    llm = engine(out)
    assert methods(llm)[:2] == (Nvfp4LinearMethod, Nvfp4MoEMethod)
    assert llm.engine.model.model.layers["0"].self_attn.qkv_proj.quant_method.layout \
        .static_input_scale
    got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    reference = engine(dequantized_copy(out, tmp_path / "dequantized"))
    assert_same_outputs(got, reference.generate(PROMPTS, PARAMS, use_tqdm=False))
    emulated = engine(out, quantization_emulate_activations=True).generate(
        PROMPTS, PARAMS, use_tqdm=False)
    # The prompts' logprobs (the same context in both runs; the replies may part).
    gap = max(abs(a.logprob - b.logprob) for mine, theirs in zip(got, emulated)
              for a, b in zip(mine.prompt_logprobs[1:], theirs.prompt_logprobs[1:]))
    assert gap < 0.5


def _amax(folder: Path, module: str) -> torch.Tensor:
    """The amax of a projection's weight in the source (Qwen3-MoE's per-expert or fused)."""
    stored = tensors(folder)
    name = f"{module}.weight"
    if name in stored:
        return stored[name].abs().amax()
    owner, _, part = module.rpartition(".")
    experts, _, expert = owner.rpartition(".")
    fused = stored[f"{experts}.gate_up_proj"][int(expert)]
    half = fused.shape[0] // 2
    return (fused[:half] if part == "gate_proj" else fused[half:]).abs().amax()


# ---- ModelOpt's layout ------------------------------------------------------------------------

@pytest.mark.parametrize("form", ["nvfp4", "fp8"])
def test_modelopt_round_trip(source, prompts, tmp_path, form):
    """`--layout modelopt`: `weight`, `weight_scale`, (`weight_scale_2`), `input_scale`
    (scalars) and `hf_quant_config.json`; muse loads it back as its dequantized weights."""
    _, folder = source
    out = tmp_path / form
    settings = quantize_checkpoint(folder, out, form, ignore=[LAYER_1_MLP],
                                   calibration_prompts=prompts[0], layout="modelopt",
                                   progress=False)
    written = json.loads((out / "hf_quant_config.json").read_text())
    assert written == settings and written["producer"]["name"] == "modelopt"
    quantization = written["quantization"]
    assert quantization["quant_algo"] == form.upper()
    assert quantization["kv_cache_quant_algo"] is None
    assert quantization.get("group_size") == (16 if form == "nvfp4" else None)
    assert {"lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.experts.3.down_proj"} \
        <= set(quantization["exclude_modules"])
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    stored = tensors(out)
    q = f"{ATTENTION}.q_proj"
    assert stored[f"{q}.weight"].dtype == (torch.uint8 if form == "nvfp4"
                                           else torch.float8_e4m3fn)
    scalars = ["input_scale"] + (["weight_scale_2"] if form == "nvfp4" else ["weight_scale"])
    for leaf in scalars:
        assert stored[f"{q}.{leaf}"].shape == () and stored[f"{q}.{leaf}"].item() > 0
    assert torch.equal(stored[f"{q}.{scalars[1]}"], stored[f"{ATTENTION}.v_proj.{scalars[1]}"])
    llm = engine(out)
    want = (Nvfp4LinearMethod, Nvfp4MoEMethod) if form == "nvfp4" else (Fp8LinearMethod,
                                                                         Fp8MoEMethod)
    assert methods(llm)[:2] == want
    reference = engine(dequantized_copy(out, tmp_path / "dequantized"))
    assert_same_outputs(llm.generate(PROMPTS, PARAMS, use_tqdm=False),
                        reference.generate(PROMPTS, PARAMS, use_tqdm=False))


# ---- configs and errors -----------------------------------------------------------------------

@pytest.mark.parametrize(("form", "preset"), [("nvfp4", "NVFP4"), ("nvfp4-w4a16", "NVFP4A16"),
                                              ("mxfp4", "MXFP4A16")])
def test_configs_are_compressed_tensors_presets(form, preset):
    """What muse writes in `config_groups` is compressed-tensors' own preset (its JSON), and
    muse's reader takes that preset's NVFP4 W4A4 (`dynamic: "local"`) as static scales."""
    from compressed_tensors.quantization import preset_name_to_scheme

    theirs = preset_name_to_scheme(preset, ["Linear"]).model_dump(mode="json")
    ours = compressed_tensors_config(form, [], static=form == "nvfp4")["config_groups"]["group_0"]
    for key in ("weights", "input_activations"):
        if theirs[key] is None:
            assert ours[key] is None, key
        else:
            assert {k: ours[key].get(k) for k in theirs[key]} == theirs[key], key
    settings = {"quant_method": "compressed-tensors", "format": ours["format"],
                "config_groups": {"group_0": theirs}}
    linear, _, marker, name = layout_of(settings)
    method = linear()
    if form == "mxfp4":
        assert marker == "weight_packed" and "MXFP4" in name
    else:
        assert method.layout.static_input_scale == (form == "nvfp4")


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        muse_main(["quantize", *argv])
    return exit_info.value.code, capsys.readouterr().err


def test_cli_errors(source, tmp_path, capsys):
    _, folder = source
    out = str(tmp_path / "out")
    code, err = run_cli([str(folder), out, "--format", "int4"], capsys)
    assert code == 2 and "invalid choice: 'int4'" in err
    code, err = run_cli([str(folder), out, "--format", "nvfp4", "--layout", "awq"], capsys)
    assert code == 2 and "invalid choice: 'awq'" in err
    code, err = run_cli([str(folder), out, "--format", "mxfp4", "--layout", "modelopt"], capsys)
    assert code == 2 and "modelopt layout holds nvfp4 and fp8" in err
    code, err = run_cli([str(folder), out, "--format", "nvfp4-w4a16", "--layout", "modelopt"],
                        capsys)
    assert code == 2 and "modelopt layout" in err
    code, err = run_cli([str(folder), out, "--format", "mxfp4", "--calibration-prompts",
                         str(tmp_path / "p.txt")], capsys)
    assert code == 2 and "weight-only" in err
    code, err = run_cli([str(folder), out, "--format", "nvfp4", "--calibration-prompts",
                         str(tmp_path / "missing.txt")], capsys)
    assert code == 2 and "missing.txt" in err
    code, err = run_cli([str(folder), out, "--format", "nvfp4"], capsys)  # shipped prompts
    assert code == 2 and "no tokenizer.json" in err
    assert not (tmp_path / "out" / "model.safetensors").exists()
    quantize_checkpoint(folder, tmp_path / "quantized", "mxfp4", progress=False)
    code, err = run_cli([str(tmp_path / "quantized"), out, "--format", "fp8"], capsys)
    assert code == 2 and "already quantized" in err
