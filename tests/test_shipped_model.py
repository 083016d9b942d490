"""The shipped default model really answers (catches a broken checkpoint or loader)."""

import pytest

from muse import LLM, SamplingParams
from muse.eval.run import check_model
from muse.presets import SHIPPED_CHECKPOINT

pytestmark = pytest.mark.skipif(not (SHIPPED_CHECKPOINT / "config.json").is_file(),
                                reason="no shipped checkpoint in this tree")

# Below the acceptance bars (measured on 200 problems per category, docs/training.md) so a
# small CPU sample of a healthy model clears them, while a broken one cannot.
LOWER_BARS = {
    "arithmetic.add.2.exact": 0.8,
    "arithmetic.sub.2.exact": 0.6,
    "tools.valid": 0.8,
    "tools.correct": 0.7,
    "replies.ends_with_end_of_turn": 0.9,
}


def test_shipped_model_clears_lower_bars():
    assert check_model(str(SHIPPED_CHECKPOINT), LOWER_BARS, num=10) == []


def test_chat_answers_with_reasoning_then_the_sum():
    llm = LLM(str(SHIPPED_CHECKPOINT), device="cpu")
    reply = llm.chat([{"role": "user", "content": "What is 37+45?"}],
                     SamplingParams(temperature=0.0, max_tokens=64,
                                    skip_special_tokens=False))[0].outputs[0]
    assert reply.finish_reason == "stop" and reply.stop_reason == 7  # ended by <|end|>
    assert reply.reasoning_content.endswith("So 82.") and reply.text.strip() == "82"
