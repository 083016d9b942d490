"""Shared pieces of the engine tests: a tiny engine, a reference greedy decoder, prompt sets."""

from __future__ import annotations

import random

import torch

from muse import LLM
from muse.reference.model import MuseForCausalLM
from tests.conftest import DEVICE


def tiny_llm(**engine_args) -> LLM:
    """The tiny preset in float32 on the test device."""
    # An explicit KV budget: on a GPU the default takes most of the free memory, which would
    # leave nothing for the next engine a test builds.
    engine_args.setdefault("kv_cache_memory_bytes", 32 * 2**20)
    return LLM("muse-spark-tiny", init_std=0.1, device=DEVICE, dtype="float32", **engine_args)


def random_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 8192) for _ in range(length)]


def reference_from_engine(engine) -> MuseForCausalLM:
    """A float32 reference model holding exactly the engine's weights."""
    reference = MuseForCausalLM(engine.config)
    reference.load_state_dict({k: v.float().cpu() for k, v in engine.model.state_dict().items()})
    return reference.eval()


@torch.no_grad()
def reference_greedy(model: MuseForCausalLM, prompts: list[list[int]], max_tokens: int
                     ) -> tuple[list[list[int]], float]:
    """Greedy tokens of every prompt (one left-padded batch per step), and the smallest
    top-1/top-2 logit gap met on the way."""
    sequences = [list(p) for p in prompts]
    smallest_gap = float("inf")
    for _ in range(max_tokens):
        width = max(len(s) for s in sequences)
        ids = torch.tensor([[0] * (width - len(s)) + s for s in sequences])
        mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences])
        logits = model(ids, attention_mask=mask).logits[:, -1]
        top = logits.topk(2).values
        smallest_gap = min(smallest_gap, float((top[:, 0] - top[:, 1]).min()))
        for sequence, token in zip(sequences, logits.argmax(-1).tolist()):
            sequence.append(token)
    return [s[len(p):] for s, p in zip(sequences, prompts)], smallest_gap


def mixed_prompts(vocab: int, window: int, count: int = 32, seed: int = 0) -> list[list[int]]:
    """Prompts of mixed length, several over 3x the window, some sharing long prefixes."""
    rng = random.Random(seed)
    shared = [rng.randrange(32, vocab) for _ in range(3 * window + 5)]
    prompts = []
    for i in range(count):
        if i % 4 == 0:
            length = rng.randrange(3 * window + 1, 5 * window)
        else:
            length = rng.randrange(2, 2 * window)
        tokens = [rng.randrange(32, vocab) for _ in range(length)]
        if i % 3 == 0:
            tokens = shared[:rng.randrange(window, len(shared))] + tokens
        prompts.append(tokens)
    return prompts
