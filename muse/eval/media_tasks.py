"""The `vision`, `video` and `audio` sections: held-out media questions with short answers.

Cases come from the held-out split of the training generators, so the questions are asked in
phrasings (and, for audio, voices, speeds and pitches) training never used:

- `vision`: `vision_tasks.sample_image_case` (colour, shape, count, position, read);
- `video`: `vision_tasks.sample_video_case` (direction, shape, colour);
- `audio`: `speech.sample_audio_case` (number, word, arithmetic), synthesized with espeak-ng
  now, so this section needs the binary (see `speech.find_espeak`).

`--num` cases per kind, the kinds in turn. Each case's user turn is rendered with the chat
template up to the generation prompt and sent with its pixels, frames or waveform in
`multi_modal_data`; the reply is greedy. A case is right when the reply's content equals the
answer, ignoring case, surrounding spaces and one trailing period. Reported per kind and
overall as `exact` with `count`.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from muse.engine.sampling_params import SamplingParams
from muse.eval.generation import SectionResult, reply_budget
from muse.eval.progress import progress_bars
from muse.eval.replies import Reply, read_reply
from muse.llm import LLM
from muse.train.data import speech, vision_tasks
from muse.train.data.split import HELD_OUT

# Which media key of `multi_modal_data` each section fills.
MEDIA_KEYS = {"vision": "image", "video": "video", "audio": "audio"}
SECTION_KINDS = {"vision": vision_tasks.IMAGE_KINDS, "video": vision_tasks.VIDEO_KINDS,
                 "audio": speech.KINDS}
LABELS = {"vision": "vision", "video": "video", "audio": "spoken audio"}
# The v2 model's targets, as dotted paths into the report.
MEDIA_BARS: dict[str, float] = {
    "vision.by_kind.colour.exact": 0.90,
    "vision.by_kind.shape.exact": 0.90,
    "vision.by_kind.count.exact": 0.80,
    "video.by_kind.direction.exact": 0.80,
    "audio.by_kind.number.exact": 0.90,
}


@dataclass
class MediaCase:
    """One question: its kind, the messages up to and with the right answer, and the media."""

    kind: str
    messages: list[dict[str, Any]]  # [user turn, assistant turn with the answer]
    answer: str
    media: Any  # a PIL image, uint8 frames [T, H, W, 3] or a float32 waveform
    note: str = ""  # what a report shows beside the question (the spoken text and voice)

    @property
    def question(self) -> str:
        return self.messages[0]["content"][-1].get("text", "")


def normalize(text: str) -> str:
    """An answer as compared: stripped, lower case, one trailing period removed."""
    text = text.strip()
    if text.endswith("."):
        text = text[:-1].rstrip()
    return text.lower()


def is_right(content: str, answer: str) -> bool:
    return normalize(content) == normalize(answer)


def _image_case(rng: random.Random, kind: str) -> MediaCase:
    case = vision_tasks.sample_image_case(rng, HELD_OUT, kind)
    return MediaCase(kind, case.messages(), case.answer, case.image)


def _video_case(rng: random.Random, kind: str) -> MediaCase:
    case = vision_tasks.sample_video_case(rng, HELD_OUT, kind)
    return MediaCase(kind, case.messages(), case.answer, case.frames)


def _audio_case(rng: random.Random, kind: str) -> MediaCase:
    case = speech.sample_audio_case(rng, HELD_OUT, kind)
    return MediaCase(kind, case.messages(), case.answer, case.audio,
                     f'"{case.text}" in voice {case.voice}')


CASE_MAKERS: dict[str, Callable[[random.Random, str], MediaCase]] = {
    "vision": _image_case, "video": _video_case, "audio": _audio_case}


def held_out_cases(section: str, seed: int, num: int) -> list[MediaCase]:
    """`num` held-out cases per kind of `section`, the kinds in turn."""
    rng = random.Random(f"eval-{section}/{seed}")
    kinds = SECTION_KINDS[section]
    return [CASE_MAKERS[section](rng, kinds[index % len(kinds)])
            for index in range(num * len(kinds))]


def generate_media_replies(llm: LLM, section: str, cases: list[MediaCase], max_tokens: int,
                           progress: bool | None = None) -> list[Reply]:
    """Greedy replies to each case's user turn, its media in `multi_modal_data`."""
    if not cases:
        return []
    key = MEDIA_KEYS[section]
    prompts = [{"prompt_token_ids": llm.tokenizer.apply_chat_template(
        case.messages[:1], add_generation_prompt=True, tokenize=True),
        "multi_modal_data": {key: [case.media]}} for case in cases]
    params = [SamplingParams(temperature=0.0, skip_special_tokens=False,
                             max_tokens=reply_budget(llm, case.messages[1], max_tokens))
              for case in cases]
    outputs = llm.generate(prompts, params,
                           use_tqdm=progress_bars(progress, LABELS[section]))
    return [read_reply(output.outputs[0], llm.tokenizer) for output in outputs]


def summarize(section: str, cases: list[MediaCase], right: list[bool]) -> dict[str, Any]:
    """`count` and `exact` overall and, under `by_kind`, per kind that has cases."""
    def cell(flags: list[bool]) -> dict[str, Any]:
        return {"count": len(flags), "exact": sum(flags) / len(flags) if flags else 0.0}

    by_kind = {kind: cell([ok for case, ok in zip(cases, right) if case.kind == kind])
               for kind in SECTION_KINDS[section]}
    return {**cell(right), "by_kind": {kind: c for kind, c in by_kind.items() if c["count"]}}


def _examples(section: str, cases: list[MediaCase], replies: list[Reply],
              right: list[bool]) -> list[dict[str, Any]]:
    """The first case of each kind, and its first miss."""
    examples = []
    for kind in SECTION_KINDS[section]:
        indices = [index for index, case in enumerate(cases) if case.kind == kind]
        shown = indices[:1] + [index for index in indices if not right[index]][:1]
        for index in dict.fromkeys(shown):
            case = cases[index]
            example = {"kind": kind, "question": case.question, "reply": replies[index].text,
                       "expected": case.answer, "ok": right[index]}
            if case.note:
                example["media"] = case.note
            examples.append(example)
    return examples


def check_section(section: str) -> None:
    """Raise when `section` is not a media section or cannot run on this machine (audio
    without espeak-ng), so `muse eval` fails before it loads the model."""
    if section not in MEDIA_KEYS:
        raise ValueError(f"section must be one of {list(MEDIA_KEYS)}, got {section!r}")
    if section == "audio" and speech.find_espeak() is None:
        raise RuntimeError("the audio section needs espeak-ng: install it, set MUSE_ESPEAK_NG "
                           "or source scripts/espeak_env.sh")


def evaluate_media(llm: LLM, section: str, num: int, seed: int, max_tokens: int,
                   progress: bool | None = None) -> SectionResult:
    """Section `section` (one of MEDIA_KEYS) on `num` held-out cases per kind."""
    check_section(section)
    cases = held_out_cases(section, seed, num)
    replies = generate_media_replies(llm, section, cases, max_tokens, progress)
    right = [is_right(reply.content, case.answer) for case, reply in zip(cases, replies)]
    return SectionResult(summarize(section, cases, right), replies,
                         _examples(section, cases, replies, right))
