"""`muse merge-lora`: the adapter folded into the base checkpoint's weights gives what PEFT's
own `merge_and_unload` gives, and the engine on the merged folder generates what the engine
with the adapter in a slot generates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")

from safetensors.torch import load_file, save_file  # noqa: E402

from muse import LLM, SamplingParams  # noqa: E402
from muse.checkpoint.layout import is_encoder_tensor  # noqa: E402
from muse.checkpoint.reader import CheckpointReader  # noqa: E402
from muse.init_checkpoint import init_random_checkpoint  # noqa: E402
from muse.lora import LoRARequest  # noqa: E402
from muse.lora.merge import merge_adapter  # noqa: E402
from muse.lora.peft_adapter import AdapterError  # noqa: E402
from muse.presets import get_preset  # noqa: E402
from muse.reference.model import MuseForCausalLM  # noqa: E402
from tests.lora.helpers import TINY, muse_adapter  # noqa: E402

PROMPTS = [{"prompt_token_ids": list(range(100 + 7 * i, 130 + 7 * i))} for i in range(3)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("merge")
    base = init_random_checkpoint(get_preset(TINY), root / "base", seed=3, dtype="float32")
    adapter = muse_adapter(root / "adapter", seed=5, scale=0.2)
    merged = root / "merged"
    subprocess.run([sys.executable, "-m", "muse.cli", "merge-lora", str(base), str(adapter),
                    str(merged)], check=True, capture_output=True)
    return {"base": base, "adapter": adapter, "merged": merged}


def test_merged_weights_equal_peft_merge_and_unload(folders) -> None:
    model = MuseForCausalLM(get_preset(TINY).text_config)
    decoder = {name: tensor for name, tensor in
               load_file(str(folders["base"] / "model.safetensors")).items()
               if not is_encoder_tensor(name)}
    missing, unexpected = model.load_state_dict(decoder, strict=False)
    assert not unexpected and all(name == "lm_head.weight" for name in missing)  # tied head
    expected = peft.PeftModel.from_pretrained(model, str(folders["adapter"])).merge_and_unload()
    expected = {name: tensor.detach() for name, tensor in expected.state_dict().items()}
    merged = load_file(str(folders["merged"] / "model.safetensors"))
    base = load_file(str(folders["base"] / "model.safetensors"))
    changed = [name for name in merged if not torch.equal(merged[name], base[name])]
    # Every adapted projection and both stacked-experts parameters of every layer changed.
    assert any(".experts.gate_up_proj" in name for name in changed)
    assert any(".self_attn.q_proj" in name for name in changed)
    assert set(changed) <= set(expected)
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, expected.get(name, base[name]), rtol=1e-5, atol=1e-6)
    assert {p.name for p in folders["merged"].iterdir()} >= {"config.json", "tokenizer.json"}


def test_engine_on_merged_weights_generates_what_the_adapter_slot_generates(folders) -> None:
    def generate(model: Path, lora: LoRARequest | None = None) -> list[list[int]]:
        llm = LLM(str(model), device="cpu", dtype="float32", enable_lora=lora is not None,
                  max_lora_rank=8)
        return [output.outputs[0].token_ids
                for output in llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=lora)]

    with_slot = generate(folders["base"], LoRARequest("a", 1, str(folders["adapter"])))
    assert generate(folders["merged"]) == with_slot
    assert generate(folders["base"]) != with_slot  # the adapter changes what is generated


def test_an_adapter_for_another_model_is_refused(folders, tmp_path) -> None:
    other = init_random_checkpoint(get_preset(TINY), tmp_path / "other", seed=3,
                                   dtype="float32")
    with CheckpointReader(other) as reader:
        tensors = {name: reader.get(name) for name in reader.names()}
    del tensors["model.layers.0.self_attn.q_proj.weight"]
    save_file(tensors, str(other / "model.safetensors"))
    with pytest.raises(AdapterError, match="model.layers.0.self_attn.q_proj"):
        merge_adapter(other, folders["adapter"], tmp_path / "out")
    with pytest.raises(ValueError, match="another folder"):
        merge_adapter(folders["base"], folders["adapter"], folders["base"])
