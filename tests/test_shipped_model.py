"""The shipped default model really answers (catches a broken checkpoint or loader)."""

import dataclasses

import numpy as np
import pytest

from muse import LLM, SamplingParams
from muse.eval import media_tasks
from muse.eval.run import check_model
from muse.presets import SHIPPED_CHECKPOINT
from muse.train.data import speech

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


@pytest.mark.skipif(speech.find_espeak() is None, reason="espeak-ng not found")
def test_spoken_numbers_are_heard_through_the_silence_around_them():
    # Recordings open and close with silence; the model was trained on clips cut close to
    # the speech, and its processor cuts the silence the same way (without the cut, half a
    # second before the number leaves it about one right in six).
    named = speech.QUESTIONS["number"]  # questions naming the task (the silence is tested)
    cases = [case for case in media_tasks.held_out_cases("audio", 3, 16)
             if case.kind == "number" and case.question in named][:8]
    assert len(cases) == 8
    silence = np.zeros(12_000, dtype=np.float32)
    padded = [dataclasses.replace(case, media=np.concatenate([silence, case.media, silence]))
              for case in cases]
    llm = LLM(str(SHIPPED_CHECKPOINT), device="cpu")
    replies = media_tasks.generate_media_replies(llm, "audio", padded, max_tokens=32,
                                                 progress=False)
    right = [media_tasks.is_right(reply.content, case.answer)
             for reply, case in zip(replies, cases)]
    assert sum(right) >= 7, [(reply.content, case.answer) for reply, case in zip(replies, cases)]
