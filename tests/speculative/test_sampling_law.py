"""At temperature 1 speculative decoding samples the shipped model's law: a two-sample test on
the first two generated tokens of fixed prompts finds no difference from plain sampling, and
finds the difference a slightly wrong sampler makes (the test has the power to fail)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from muse import LLM, SamplingParams
from muse.speculative.drafter import MuseDrafter, save_drafter
from muse.speculative.drafter_config import DrafterConfig
from tests.conftest import REPO_ROOT

scipy_stats = pytest.importorskip("scipy.stats")

SHIPPED = REPO_ROOT / "checkpoints" / "muse-spark-default"
QUESTIONS = ["What is 37+45?", "Name a colour."]
SAMPLES = 2000  # per prompt and engine
COPIES = 20  # requests per prompt, each with n = SAMPLES / COPIES samples
# A run makes six comparisons: at 1e-3 a right sampler failed about one run in 170 (once, in
# CI, p = 0.00077); the wrong sampler below gives p near 1e-51.
P_VALUE = 1e-4


def engine(**args) -> LLM:
    return LLM(str(SHIPPED), device="cpu", dtype="float32", max_num_seqs=256,
               kv_cache_memory_bytes=64 * 2**20, **args)


def first_two_tokens(llm: LLM, prompts: list[list[int]], temperature: float = 1.0
                     ) -> list[Counter]:
    # A third token leaves room for one draft at the second: that token is verified.
    params = SamplingParams(temperature=temperature, max_tokens=3, n=SAMPLES // COPIES,
                            ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts for _ in range(COPIES)],
                           params)
    return [Counter(tuple(o.token_ids[:2]) for out in outputs[i * COPIES:(i + 1) * COPIES]
                    for o in out.outputs) for i in range(len(prompts))]


def same_law(a: Counter, b: Counter) -> float:
    """p-value of a chi-square two-sample test; outcomes rarer than 5 expected are pooled."""
    outcomes = sorted(set(a) | set(b), key=lambda o: -(a[o] + b[o]))
    rows, rare = [], [0, 0]
    for outcome in outcomes:
        if a[outcome] + b[outcome] >= 10:
            rows.append([a[outcome], b[outcome]])
        else:
            rare[0] += a[outcome]
            rare[1] += b[outcome]
    if sum(rare) >= 10:
        rows.append(rare)
    if len(rows) < 2:
        return 1.0
    return float(scipy_stats.chi2_contingency(rows).pvalue)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    from muse.tokenizer import MuseTokenizer

    tokenizer = MuseTokenizer.from_pretrained(SHIPPED)
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                          add_generation_prompt=True, tokenize=True)
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def plain_law(prompts) -> list[Counter]:
    return first_two_tokens(engine(), prompts)


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random drafter for the shipped model: its drafts are mostly rejected, so the
    corrections (the residual distributions) carry the law."""
    from muse.checkpoint.configs import load_config

    target = load_config(str(SHIPPED)).text_config
    config = DrafterConfig.for_target(target, 3, num_target_features=2, method="dspark",
                                      block_size=4)
    drafter = MuseDrafter(config)
    drafter.init_weights(1)
    folder = tmp_path_factory.mktemp("drafter")
    save_drafter(drafter, folder)
    return folder


@pytest.mark.parametrize("speculative", [
    {"method": "dspark", "draft_sample_method": "greedy", "num_speculative_tokens": 3},
    {"method": "dspark", "draft_sample_method": "probabilistic",
     "rejection_sample_method": "token", "num_speculative_tokens": 3},
    {"method": "dspark", "draft_sample_method": "probabilistic",
     "rejection_sample_method": "block", "num_speculative_tokens": 3},
], ids=["one-hot", "drafter-token", "drafter-block"])
def test_speculative_sampling_has_the_plain_law(prompts, plain_law, drafter_dir, speculative):
    llm = engine(speculative_config=speculative | {"model": str(drafter_dir)})
    law = first_two_tokens(llm, prompts)
    assert llm.engine.spec_stats.num_draft_tokens > 0
    for mine, plain in zip(law, plain_law):
        assert same_law(mine, plain) > P_VALUE, (mine.most_common(5), plain.most_common(5))


def test_the_test_tells_a_slightly_wrong_sampler_apart(prompts, plain_law):
    law = first_two_tokens(engine(), prompts, temperature=1.3)
    assert min(same_law(mine, plain) for mine, plain in zip(law, plain_law)) < P_VALUE
