"""LoRA adapters made with `peft` on transformers Qwen3 and Qwen3-MoE checkpoints: the engine's
greedy tokens with the adapter equal transformers + peft's, token for token (float32, CPU), and
a batch that mixes two adapters and the base model equals each request run alone."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from muse import LLM, SamplingParams  # noqa: E402
from muse.lora import LoRARequest  # noqa: E402

VOCAB = 384
NEW_TOKENS = 12
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def base_model(moe: bool, seed: int = 0) -> torch.nn.Module:
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  tie_word_embeddings=False)
    if moe:
        config = transformers.Qwen3MoeConfig(**common, intermediate_size=96,
                                             moe_intermediate_size=32, num_experts=4,
                                             num_experts_per_tok=2)
    else:
        config = transformers.Qwen3Config(**common, intermediate_size=96)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name
                        else 0.15 * torch.randn_like(param))
    return model


def make_adapter(model: torch.nn.Module, directory: Path, moe: bool, seed: int,
                 rank: int = 4) -> torch.nn.Module:
    """A random (not zero-initialised) adapter, saved in the PEFT layout; the peft model."""
    extra = {}
    if moe:
        extra["target_parameters"] = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ATTENTION + MLP,
                             init_lora_weights=False, **extra)
    torch.manual_seed(seed)
    adapted = peft.get_peft_model(model, config, adapter_name="default")
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.copy_(0.2 * torch.randn_like(param))
    adapted.save_pretrained(str(directory))
    return adapted


def greedy(model: torch.nn.Module, prompt: list[int], steps: int = NEW_TOKENS) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


PROMPTS = [[5, 17, 99, 3, 250, 8, 77], [300, 12, 4, 4, 61], list(range(40, 70))]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=[False, True], ids=["qwen3", "qwen3_moe"])
def checkpoint(request, tmp_path_factory) -> dict:
    """The base checkpoint, two adapters, and transformers + peft's greedy tokens."""
    moe = request.param
    root = tmp_path_factory.mktemp("qwen3_moe" if moe else "qwen3")
    base = base_model(moe)
    base.save_pretrained(str(root / "base"))
    expected = {None: [greedy(base, p) for p in PROMPTS]}
    for name, seed in (("first", 1), ("second", 2)):
        adapted = make_adapter(base_model(moe), root / name, moe, seed)
        expected[name] = [greedy(adapted, p) for p in PROMPTS]
    return {"root": root, "expected": expected, "moe": moe}


def engine(root: Path, **args) -> LLM:
    return LLM(str(root / "base"), device="cpu", dtype="float32", enable_lora=True,
               max_loras=2, max_lora_rank=8, **args)


def adapter(root: Path, name: str) -> LoRARequest:
    return LoRARequest(name, {"first": 1, "second": 2}[name], str(root / name))


def tokens(outputs) -> list[list[int]]:
    return [list(out.outputs[0].token_ids) for out in outputs]


def test_each_adapter_alone_matches_transformers_and_peft(checkpoint) -> None:
    root, expected = checkpoint["root"], checkpoint["expected"]
    llm = engine(root)
    assert tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)) \
        == expected[None]
    for name in ("first", "second"):
        got = tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                  lora_request=adapter(root, name)))
        assert got == expected[name], name
    # The adapters change the model (the comparison can fail).
    assert expected["first"] != expected[None] and expected["second"] != expected["first"]


def test_a_batch_mixing_adapters_and_the_base_equals_each_alone(checkpoint) -> None:
    root, expected = checkpoint["root"], checkpoint["expected"]
    llm = engine(root, max_num_batched_tokens=64)
    choices = [None, "first", "second", "first", None, "second"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(choices))]
    got = tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY,
                              lora_request=[adapter(root, c) if c else None for c in choices]))
    assert got == [expected[c][i % len(PROMPTS)] for i, c in enumerate(choices)]


def test_an_experts_only_adapter_matches_and_changes_the_model(checkpoint, tmp_path) -> None:
    """The routed experts' LoRA alone (PEFT `target_parameters`), so the comparison covers
    the deltas inside the experts, not only the attention's."""
    if not checkpoint["moe"]:
        pytest.skip("the dense model has no experts")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[], init_lora_weights=False,
                             target_parameters=["mlp.experts.gate_up_proj",
                                                "mlp.experts.down_proj"])
    torch.manual_seed(3)
    adapted = peft.get_peft_model(base_model(moe=True), config)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn_like(param))
    adapted.save_pretrained(str(tmp_path / "experts"))
    expected = [greedy(adapted, p) for p in PROMPTS]
    assert expected != checkpoint["expected"][None]
    llm = engine(checkpoint["root"])
    got = tokens(llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                              lora_request=LoRARequest("experts", 3, str(tmp_path / "experts"))))
    assert got == expected
