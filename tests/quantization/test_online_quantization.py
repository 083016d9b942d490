"""Online quantization (`quantization=` / `--quantization`): an unquantized model loaded into
the quantized layers with the tensors `muse quantize` would write, so it runs exactly as the
written checkpoint does; a preset's random weights can be quantized too (benchmarks)."""

from __future__ import annotations

import pytest

from muse import LLM, SamplingParams
from muse.quantization.common import Fp4LinearMethod
from muse.quantization.fp8 import Fp8LinearMethod
from muse.quantization.quantize import ONLINE_FORMATS, quantize_checkpoint
from tests.engine.helpers import assert_same_outputs
from tests.quantization.test_muse_quantize import PARAMS, PROMPTS, engine


@pytest.mark.parametrize("form", ONLINE_FORMATS)
def test_online_quantization_is_the_written_checkpoint(source, tmp_path, form):
    _, folder = source
    written = tmp_path / form
    quantize_checkpoint(folder, written, form, progress=False)
    online = engine(folder, quantization=form)
    qkv = online.engine.model.model.layers["0"].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, Fp8LinearMethod if form == "fp8" else Fp4LinearMethod)
    assert_same_outputs(online.generate(PROMPTS, PARAMS), engine(written).generate(PROMPTS,
                                                                                    PARAMS))


def test_a_preset_quantized_as_it_loads():
    llm = LLM("muse-spark-tiny", device="cpu", dtype="float32", quantization="nvfp4-w4a16",
              kv_cache_memory_bytes=16 * 2**20)
    layer = llm.engine.model.model.layers["0"]
    assert isinstance(layer.self_attn.o_proj.quant_method, Fp4LinearMethod)
    assert layer.mlp.experts.fp4["gate_up"].format == "nvfp4"
    out = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]


def test_formats_that_need_calibration_or_a_quantized_model_are_refused(source, tmp_path):
    _, folder = source
    with pytest.raises(ValueError, match="muse quantize"):
        engine(folder, quantization="nvfp4")
    written = tmp_path / "fp8"
    quantize_checkpoint(folder, written, "fp8", progress=False)
    with pytest.raises(ValueError, match="already quantized"):
        engine(written, quantization="mxfp4")
