"""Adapters made with `peft` on muse's own reference model, for the LoRA tests."""

from __future__ import annotations

from pathlib import Path

import torch

from muse.presets import get_preset
from muse.reference.model import MuseForCausalLM

TINY = "muse-spark-tiny"
# Every linear of the tiny preset's decoder (attention, dense MLP, the latent MoE's pooler and
# unpooler, the shared expert) and the routed experts' stacked parameters.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "pooler", "unpooler"]
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def muse_adapter(directory: Path, seed: int, rank: int = 4, scale: float = 0.5,
                 **config: object) -> Path:
    """A random adapter (not zero-initialised) on the tiny preset's reference model, saved
    in the PEFT layout."""
    import peft

    torch.manual_seed(seed)
    model = MuseForCausalLM(get_preset(TINY).text_config)
    settings = dict(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                    init_lora_weights=False, target_parameters=EXPERT_PARAMETERS)
    settings.update(config)
    adapted = peft.get_peft_model(model, peft.LoraConfig(**settings))
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.copy_(scale * torch.randn_like(param))
    adapted.save_pretrained(str(directory))
    return directory
