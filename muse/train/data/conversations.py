"""Whole conversations in the Muse chat format, drawn from a weighted registry of tasks.

A conversation is an optional system prompt (carrying the tool list when tools are offered)
and one to three exchanges. Every assistant turn opens with a reasoning block (empty in
`DIRECT_ANSWER_SHARE` of conversations: answers with thinking off). Media tasks
(images, video, audio) have content-part user turns, which the chat template renders as
placeholders; the pixels, frames or waveforms travel in `Conversation.media`, in
placeholder order, for the processor to expand. `conversation_tasks` gives the registry a
model trains on: the text tasks, plus the media tasks its encoders can take.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np
from PIL import Image

from muse.train.data import (arithmetic, instructions, natural_tools, tools, unseen_tools,
                             vision_tasks)
from muse.train.data.split import TRAIN, split_items

SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are Muse, a small assistant. Be brief.",
                  "Answer the user's question.", "You are a careful assistant that shows its work."]
SYSTEM_PROMPT_SHARE = 0.4
# Share of conversations with a second exchange, and of those, with a third.
FOLLOW_UP_SHARE = 0.2
# Share of conversations answered with thinking off (`enable_thinking: false`): every reply
# opens with an empty reasoning block, as the generation prompt then writes it, and answers
# at once. Without them a model writes its reasoning after the empty block anyway.
DIRECT_ANSWER_SHARE = 0.05
# Of unseen-tool conversations: users' kind of tools and requests (`natural_tools`), whose
# values sit where a sentence puts them rather than behind their argument's name.
NATURAL_TOOL_SHARE = 0.25


@dataclass
class Conversation:
    """Messages in the OpenAI chat shape plus the tools offered (None for no tools).

    `task` names the kind of the first exchange; training logs its loss under that name.
    """

    task: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    # "image" / "video" / "audio" -> the items of the placeholders of that kind, in order.
    media: dict[str, list[Any]] = field(default_factory=dict)
    # Texts of the assistant's reasoning whose tokens training may weigh more in the loss
    # (`--verdict-loss-weight`): the unseen-tool verdict, the one sentence that decides.
    emphasized: tuple[str, ...] = ()


@dataclass(frozen=True)
class Task:
    name: str
    weight: float
    make: Callable[[random.Random, str], Conversation]


def _system(rng: random.Random) -> list[dict[str, Any]]:
    if rng.random() < SYSTEM_PROMPT_SHARE:
        return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
    return []


def _plain_exchange(rng: random.Random, split: str, allow_addition: bool = True
                    ) -> list[dict[str, Any]]:
    """An arithmetic or instruction exchange, for follow-ups and tool-free turns."""
    if rng.random() < 0.6:
        operations = arithmetic.OPERATIONS if allow_addition else ("sub", "mul")
        problem = arithmetic.sample_problem(rng, split, operation=rng.choice(operations))
        return arithmetic.exchange(problem, rng)
    return instructions.exchange(instructions.sample_case(rng, split))


def _follow_ups(rng: random.Random, split: str, allow_addition: bool = True
                ) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    while len(messages) < 4 and rng.random() < FOLLOW_UP_SHARE:
        messages += _plain_exchange(rng, split, allow_addition)
    return messages


def arithmetic_conversation(rng: random.Random, split: str) -> Conversation:
    problem = arithmetic.sample_problem(rng, split)
    messages = _system(rng) + arithmetic.exchange(problem, rng) + _follow_ups(rng, split)
    return Conversation("arithmetic", messages)


def instruction_conversation(rng: random.Random, split: str) -> Conversation:
    case = instructions.sample_case(rng, split)
    messages = _system(rng) + instructions.exchange(case) + _follow_ups(rng, split)
    return Conversation("instructions", messages)


def tool_conversation(rng: random.Random, split: str) -> Conversation:
    """Tools offered in the system turn; usually the request needs one of them, sometimes it
    needs one that is not offered (the assistant declines) or none and the assistant answers
    directly (an offered calculator is always used for additions, so tool-free turns then
    avoid addition)."""
    draw = rng.random()
    if draw < tools.MISSING_SHARE:
        case = tools.sample_case(rng, split, rng.choice(sorted(tools.ACTIONS)))
        offered = tools.offered_tools(rng, None, missing=case.name)
        answer = rng.choice(split_items(unseen_tools.DECLINE_TEMPLATES, split)).format(
            action=tools.ACTIONS[case.name])
        first = [{"role": "user", "content": case.request},
                 tools.declining_message(case, offered, answer)]
    elif draw < 0.85:
        case = tools.sample_case(rng, split)
        offered = tools.offered_tools(rng, case.name)
        if split == TRAIN and rng.random() < tools.RENAMED_SHARE:
            case, offered = tools.renamed_arguments(rng, case, offered)
        first = tools.exchange(case, offered)
    else:
        offered = tools.offered_tools(rng, None)
        first = []
    names = {schema["function"]["name"] for schema in offered}
    allow_addition = "add_numbers" not in names
    if not first:
        first = _plain_exchange(rng, split, allow_addition)
    messages = _system(rng) + first + _follow_ups(rng, split, allow_addition)
    return Conversation("tools", messages, offered)


def unseen_tool_conversation(rng: random.Random, split: str) -> Conversation:
    """Tools with made-up names and arguments: a call copying values from the request, a
    choice among several tools, or no call when none fits; a share of them
    (`NATURAL_TOOL_SHARE`) are tools as users write them, asked as people ask."""
    sample = natural_tools.sample_case if rng.random() < NATURAL_TOOL_SHARE \
        else unseen_tools.sample_case
    case = sample(rng, split)
    return Conversation("unseen_tools", _system(rng) + unseen_tools.exchange(case),
                        unseen_tools.offered_schemas(case),
                        emphasized=(unseen_tools.verdict(case),))


def rescale_randomly(image: Image.Image, rng: random.Random) -> Image.Image:
    """The picture at another size and aspect ratio, as users' images come; the processor
    then brings it within the model's pixel range."""
    scale, aspect = rng.uniform(0.6, 1.6), rng.uniform(0.8, 1.25)
    width = max(28, round(image.width * scale * aspect ** 0.5))
    height = max(28, round(image.height * scale / aspect ** 0.5))
    return image.resize((width, height), Image.Resampling.BILINEAR)


# Wrappers around a media question in training: a dozen phrasings per question kind are few
# for a small model to learn what is asked rather than the phrasings themselves.
QUESTION_PREFIXES = ("", "", "", "Hey, ", "Quick question: ", "Look carefully. ", "Please answer: ",
                     "I have a question. ", "One thing: ", "Tell me this: ")
QUESTION_SUFFIXES = ("", "", "", " Answer in one word.", " Be brief.", " Just the answer, please.",
                     " Thanks!", " Reply with a single word.")


def _reworded(messages: list[dict[str, Any]], rng: random.Random, split: str
              ) -> list[dict[str, Any]]:
    """The media question (the first user turn's text part) with a random lead-in and
    ending, in training."""
    if split != TRAIN:
        return messages
    for message in messages:
        if message["role"] == "user" and isinstance(message["content"], list):
            for part in message["content"]:
                if part["type"] == "text":
                    text = part["text"]
                    if rng.random() < 0.3:
                        text = text[0].lower() + text[1:]
                    part["text"] = rng.choice(QUESTION_PREFIXES) + text + \
                        rng.choice(QUESTION_SUFFIXES)
            break
    return messages


def image_conversation(rng: random.Random, split: str) -> Conversation:
    case = vision_tasks.sample_image_case(rng, split)
    return Conversation("image", _system(rng) + _reworded(case.messages(), rng, split),
                        media={"image": [rescale_randomly(case.image, rng)]})


# Frame rates a training clip is said to have been sampled at: the time markers then take
# the values users' videos give them.
VIDEO_FPS = (1.0, 2.0, 3.0, 4.0, 5.0, 8.0, 10.0, 15.0, 24.0, 30.0)


def video_conversation(rng: random.Random, split: str) -> Conversation:
    """A moving-shape clip of 4 to 8 of its frames (evenly spaced), with timestamps."""
    case = vision_tasks.sample_video_case(rng, split)
    count = rng.choice((4, 6, 8))
    keep = np.linspace(0, len(case.frames) - 1, count).round().astype(np.int64)
    timestamps = np.arange(count, dtype=np.float64) / rng.choice(VIDEO_FPS)
    return Conversation("video", _system(rng) + _reworded(case.messages(), rng, split),
                        media={"video": [(case.frames[keep], timestamps)]})


def audio_conversation(rng: random.Random, split: str, pool: Any) -> Conversation:
    """A spoken number, word or sum drawn from `pool` (a `speech.SpeechPool`)."""
    case = pool.sample_case(rng)
    return Conversation("audio", _system(rng) + _reworded(case.messages(), rng, split),
                        media={"audio": [case.audio]})


# Weights by conversation count (a model without encoders trains on the text tasks alone,
# in these proportions). The media tasks' short answers need many examples, the text tasks
# of the first version fewer: its skills are kept, not learned anew.
TEXT_TASKS: list[Task] = [
    Task("arithmetic", 0.15, arithmetic_conversation),
    Task("tools", 0.08, tool_conversation),
    Task("instructions", 0.07, instruction_conversation),
    Task("unseen_tools", 0.25, unseen_tool_conversation),
]
IMAGE_TASK = Task("image", 0.22, image_conversation)
VIDEO_TASK = Task("video", 0.1, video_conversation)
AUDIO_WEIGHT = 0.13
# Every task name, in a fixed order: training logs a loss per name.
TASK_NAMES: tuple[str, ...] = (*(task.name for task in TEXT_TASKS), "image", "video", "audio")


def conversation_tasks(vision: bool = False, speech_pool: Any = None,
                       weights: Mapping[str, float] | None = None) -> list[Task]:
    """The text tasks, plus image and video tasks with `vision`, plus the audio task with a
    pool of spoken clips; `weights` replaces the default weights of the tasks it names."""
    tasks = list(TEXT_TASKS)
    if vision:
        tasks += [IMAGE_TASK, VIDEO_TASK]
    if speech_pool is not None:
        tasks.append(Task("audio", AUDIO_WEIGHT, partial(audio_conversation, pool=speech_pool)))
    weights = weights or {}
    unknown = sorted(set(weights) - set(TASK_NAMES))
    if unknown:
        raise ValueError(f"task weights: unknown task(s) {unknown}; the tasks are "
                         f"{list(TASK_NAMES)}")
    if any(not weight >= 0 for weight in weights.values()):  # also refuses NaN
        raise ValueError(f"task weights must be >= 0, got {weights}")
    tasks = [replace(task, weight=weights.get(task.name, task.weight)) for task in tasks]
    if not sum(task.weight for task in tasks) > 0:
        raise ValueError(f"the tasks' weights must not all be zero: {weights}")
    return tasks


def answered_directly(conversation: Conversation) -> Conversation:
    """The conversation with every reply's reasoning emptied: `<think></think>` and then the
    answer, the call or the refusal (no reasoning, so no verdict to emphasize)."""
    messages = [{**message, "reasoning_content": ""} if message["role"] == "assistant"
                else message for message in conversation.messages]
    return replace(conversation, messages=messages, emphasized=())


def sample_conversation(rng: random.Random, split: str,
                        tasks: list[Task] | None = None) -> Conversation:
    tasks = TEXT_TASKS if tasks is None else tasks
    task = rng.choices(tasks, weights=[t.weight for t in tasks])[0]
    conversation = task.make(rng, split)
    if rng.random() < DIRECT_ANSWER_SHARE:
        return answered_directly(conversation)
    return conversation
