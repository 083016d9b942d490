"""The accuracy report of `muse quantize`'s formats (`muse/quantization/report.py`,
`benchmarks/quant_accuracy.py`) on the shipped default model, and a negative control.

Bounds (measured on the shipped model, CPU, float32 compute):

- FP8 per channel: every projection's relative weight error < 0.035 (measured max 0.0265,
  median 0.0258, over 240 projections; E4M3's 3 mantissa bits);
- NVFP4 (W4A16): < 0.12 (measured max 0.0959, median 0.0952);
- next-token KL(p_bf16 || p_quant) in nats, mean over every position of the three held-out
  texts used here (one per chat task, at most 128 tokens each, 384 positions): FP8 < 0.04
  (measured 0.0177; 95% of the positions keep their most likely token), NVFP4 < 0.2
  (measured 0.105; 86%);
- negative control: the FP8 checkpoint with one projection's FP8 rows permuted (its scales
  left in place) fails the FP8 weight bound on that projection alone (measured 1.42) and the
  FP8 KL bound (measured 0.44).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from benchmarks import quant_accuracy
from muse.checkpoint import load_reference_model
from muse.presets import SHIPPED_CHECKPOINT
from muse.quantization import report

FORMATS = ("fp8", "nvfp4-w4a16")
WEIGHT_BOUND = {"fp8": 0.035, "nvfp4-w4a16": 0.12}
KL_BOUND = {"fp8": 0.04, "nvfp4-w4a16": 0.2}
MAX_TOKENS = 128
PROJECTIONS = 240  # 8 layers x (q, k, v, o, pooler, unpooler, 8 experts x gate, up, down)
CORRUPTED = "model.layers.3.self_attn.o_proj"


@pytest.fixture(scope="module")
def texts_file(tmp_path_factory):
    """One held-out text of each chat task of the default text set."""
    texts = quant_accuracy.read_texts(quant_accuracy.DEFAULT_TEXTS)
    per_task = quant_accuracy.TEXTS_PER_TASK
    path = tmp_path_factory.mktemp("texts") / "texts.json"
    path.write_text(json.dumps([texts[0], texts[per_task], texts[2 * per_task]]))
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory, texts_file):
    """The script on the shipped model, both formats, its checkpoints kept."""
    work = tmp_path_factory.mktemp("work")
    out = work / "accuracy.json"
    record = quant_accuracy.main(["--formats", ",".join(FORMATS), "--texts", str(texts_file),
                                  "--max-tokens", str(MAX_TOKENS), "--per-module",
                                  "--work-dir", str(work), "--keep", "--out", str(out)])
    assert json.loads(out.read_text())["models"].keys() == record["models"].keys()
    return record, work


def test_every_quantized_projection_is_within_the_weight_bound(run):
    record, _ = run
    formats = record["models"]["muse-spark-default"]["formats"]
    assert list(formats) == list(FORMATS)
    for layout, entry in formats.items():
        weights = entry["weights"]
        assert weights["all"]["count"] == PROJECTIONS == len(weights["modules"])
        assert weights["all"]["max"] < WEIGHT_BOUND[layout], layout
        assert weights["all"]["median"] > WEIGHT_BOUND[layout] / 10, layout  # it was rounded
        assert {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.pooler", "mlp.unpooler", "mlp.experts.gate_proj", "mlp.experts.up_proj",
                "mlp.experts.down_proj"} == set(weights["per_kind"])
        assert weights["per_kind"]["mlp.experts.down_proj"]["count"] == 64


def test_next_token_kl_is_within_the_bound(run):
    record, _ = run
    for layout, entry in record["models"]["muse-spark-default"]["formats"].items():
        kl = entry["kl"]
        assert kl["texts"] == 3 and kl["positions"] <= 3 * MAX_TOKENS
        assert 0 < kl["mean"] < KL_BOUND[layout], layout
        assert kl["median"] <= kl["mean"] <= kl["max"] and kl["p99"] <= kl["max"]
        assert 0.5 < kl["top1_agreement"] <= 1


def test_the_record_names_its_commit_and_the_stored_eval_results(run):
    record, _ = run
    assert record["environment"]["git_commit"]
    model = record["models"]["muse-spark-default"]
    assert model["eval_bf16"]["path"].endswith("eval-muse-spark-default-bf16-cpu.json")
    # The run of the current quantizer (one global scale per fused layer) comes before the
    # earlier `-nvfp4-` one.
    assert model["formats"]["nvfp4-w4a16"]["eval"]["path"].endswith(
        "eval-muse-spark-default-nvfp4-w4a16-cpu.json")
    assert 0.9 < model["formats"]["fp8"]["eval"]["worst_of_bf16"] <= 1.1
    assert "muse-spark-default" in quant_accuracy.format_table(record)


def test_a_corrupted_checkpoint_fails_the_bounds(run, texts_file, tmp_path):
    """One projection's FP8 rows permuted, its per-channel scales left in place: that
    projection alone leaves the FP8 weight bound, and the KL leaves its bound too."""
    _, work = run
    quantized = work / "muse-spark-default-fp8"
    broken = tmp_path / "broken"
    shutil.copytree(quantized, broken)
    tensors = load_file(broken / "model.safetensors")
    name = f"{CORRUPTED}.weight"
    rows = tensors[name].shape[0]
    tensors[name] = tensors[name][torch.randperm(rows, generator=torch.Generator().manual_seed(0))]
    save_file(tensors, broken / "model.safetensors")
    reference = report.load_engine(SHIPPED_CHECKPOINT)
    errors = report.weight_errors(reference, broken)
    failing = [e.module for e in errors if e.relative_error >= WEIGHT_BOUND["fp8"]]
    assert failing == [CORRUPTED]
    kl = report.next_token_kl(reference, broken, quant_accuracy.read_texts(texts_file),
                              MAX_TOKENS)
    assert kl.mean > KL_BOUND["fp8"]


def test_the_engine_logprobs_are_the_reference_models(texts_file):
    """The logits rows read from the engine line up with the positions of the text: they are
    the reference model's (float32, same weights)."""
    llm = report.load_engine(SHIPPED_CHECKPOINT)
    ids = report.encode_texts(llm, quant_accuracy.read_texts(texts_file), 48)[1]
    with torch.no_grad():
        want = load_reference_model(SHIPPED_CHECKPOINT)(torch.tensor([ids])).logits[0]
    got = report.next_token_logprobs(llm, ids)
    assert got.shape == (len(ids), want.shape[-1])
    torch.testing.assert_close(got, want.double().log_softmax(-1), atol=1e-4, rtol=0)


def test_kl_and_relative_error():
    logits = torch.randn(5, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    p = logits.log_softmax(-1)
    assert report.kl_per_position(p, p).abs().max() == 0
    q = (logits * 0.5).log_softmax(-1)
    want = (p.exp() * (p - q)).sum(-1)
    torch.testing.assert_close(report.kl_per_position(p, q), want)
    weight = torch.randn(4, 8)
    assert report.relative_error(weight * 1.01, weight) == pytest.approx(0.01, rel=1e-5)
    assert report.projection_kind("model.layers.12.mlp.experts.31.down_proj") == \
        "mlp.experts.down_proj"
