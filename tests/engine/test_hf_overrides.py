"""`hf_overrides` (vLLM's): the engine runs the model the overridden config describes, on every
rank, and refuses overrides it cannot apply."""

from __future__ import annotations

import pytest
import torch

from muse import SamplingParams
from tests.engine.helpers import assert_greedy_is_well_defined, reference_from_engine, tiny_llm


def test_a_cut_preset_is_the_reference_model_of_its_config():
    llm = tiny_llm(hf_overrides={"num_hidden_layers": 2})
    assert llm.engine.config.num_hidden_layers == 2
    assert len(llm.engine.model.model.layers) == 2
    prompts = [[5, 9, 11, 40, 2], [17, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert_greedy_is_well_defined(llm, prompts, got)
    reference = reference_from_engine(llm.engine)
    assert reference.config.num_hidden_layers == 2
    for prompt, tokens in zip(prompts, got):
        sequence = list(prompt)
        for _ in range(6):
            logits = reference(torch.tensor([sequence])).logits[0, -1]
            sequence.append(int(logits.argmax()))
        assert sequence[len(prompt):] == tokens


def test_bad_overrides_are_a_clear_error():
    with pytest.raises(ValueError, match="not fields of the model's config"):
        tiny_llm(hf_overrides={"hidden": 3})
