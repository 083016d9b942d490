"""Training batches: rows of whole conversations plus one Python chunk, with a loss mask.

Each row holds `seq_len + 1` tokens: whole conversations up to about `conversation_share` of
the row (a conversation is never cut, so every assistant turn sees its question), and a
Python chunk filling the rest, placed before or after them. Every token carries a source id:
0 for no loss, 1 for Python (loss on every token but `<|bos|>`), 2.. for a conversation task
(loss on assistant turns only, their `<|end|>` included, so the model learns to stop).
A second mask marks the tokens of the texts a conversation emphasizes (`emphasized`: the
unseen-tool verdict), which training may weigh more (`--verdict-loss-weight`).

Conversations with media are expanded by the model's processor: each placeholder becomes as
many tokens as its encoder gives, and the batch lists every item (`MediaInput`: its encoder
input, its row and its spans there) for the model to encode and write over those tokens.

Batch `step` is a pure function of (seed, step): resuming at a step replays exactly the data
an uninterrupted run would have seen, and data loader workers need no coordination.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from muse.chat_format import (ASSISTANT_ID, BOS_ID, END_OF_TURN_ID, PAD_ID,
                               THINK_END_ID, THINK_START_ID)
from muse.reference.multimodal import MediaInput
from muse.tokenizer import MuseTokenizer
from muse.train.data.conversations import TASK_NAMES, Conversation, Task, sample_conversation
from muse.train.data.python_source import PythonCorpus
from muse.train.data.split import TRAIN

NO_LOSS = 0
PYTHON_SOURCE = 1
SOURCES: tuple[str, ...] = ("none", "python", *TASK_NAMES)
TASK_SOURCE = {name: index for index, name in enumerate(TASK_NAMES, start=2)}


@dataclass(frozen=True)
class MixtureConfig:
    seq_len: int = 1024
    batch_size: int = 32
    conversation_share: float = 0.65
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.conversation_share <= 1.0:
            raise ValueError(f"conversation_share must be in [0, 1], got "
                             f"{self.conversation_share}")
        for name in ("seq_len", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def assistant_mask(token_ids: list[int]) -> list[bool]:
    """True for tokens the assistant wrote: after `<|assistant|>`, through its `<|end|>`.

    An empty reasoning block opening a reply (`<think></think>`, a direct answer) is context:
    the generation prompt writes it when thinking is off, so the model learns to answer
    after it, never to skip its reasoning by writing one itself."""
    direct = (ASSISTANT_ID, THINK_START_ID, THINK_END_ID)
    given = {start + offset for start in range(len(token_ids) - 2)
             if tuple(token_ids[start:start + 3]) == direct for offset in (1, 2)}
    mask, inside = [], False
    for index, token in enumerate(token_ids):
        mask.append(inside and index not in given)
        if token == ASSISTANT_ID:
            inside = True
        elif token == END_OF_TURN_ID:
            inside = False
    return mask


def encode_conversation(conversation: Conversation, tokenizer: MuseTokenizer,
                        processor: Any = None) -> tuple[list[int], list[int], list[MediaInput]]:
    """Token ids of the rendered conversation (media placeholders expanded by `processor`, a
    `MuseSparkProcessor`), each token's source id, and its media items (spans from 0)."""
    ids = tokenizer.apply_chat_template(conversation.messages, tools=conversation.tools,
                                        tokenize=True)
    media: list[MediaInput] = []
    if conversation.media:
        if processor is None:
            raise ValueError(f"a {conversation.task} conversation needs the model's processor")
        out = processor(ids, images=conversation.media.get("image", []),
                        videos=conversation.media.get("video", []),
                        audios=conversation.media.get("audio", []))
        ids = out.input_ids
        media = [MediaInput(item.kind, item.data, list(item.spans)) for item in out.media]
    source = TASK_SOURCE[conversation.task]
    return ids, [source if inside else NO_LOSS for inside in assistant_mask(ids)], media


def emphasis_mask(token_ids: list[int], sources: list[int], conversation: Conversation,
                  tokenizer: MuseTokenizer) -> list[bool]:
    """True for the tokens of each of `conversation.emphasized`, found as its last occurrence
    among the trained (assistant) tokens. Each text is encoded after a space, as it follows
    the sentence before it in the reasoning; one not found is an error, not a silent loss of
    its weight."""
    mask = [False] * len(token_ids)
    for text in conversation.emphasized:
        wanted = tokenizer.encode(" " + text)
        starts = [start for start in range(len(token_ids) - len(wanted), -1, -1)
                  if token_ids[start:start + len(wanted)] == wanted
                  and all(sources[start:start + len(wanted)])]
        if not starts:
            raise ValueError(f"emphasized text {text!r} is not among the assistant's tokens "
                             f"of a {conversation.task} conversation")
        mask[starts[0]:starts[0] + len(wanted)] = [True] * len(wanted)
    return mask


def _shifted(media: list[MediaInput], offset: int, row: int) -> list[MediaInput]:
    return [MediaInput(item.kind, item.data, [(start + offset, n) for start, n in item.spans],
                       row) for item in media]


class TrainingBatches(torch.utils.data.Dataset):
    """Map-style dataset whose item `step` is that step's whole batch.

    tasks: the conversation tasks (default: the text tasks); processor: the model's
    `MuseSparkProcessor`, needed when a task has media."""

    def __init__(self, config: MixtureConfig, tokenizer: MuseTokenizer,
                 python: PythonCorpus | None, tasks: list[Task] | None = None,
                 processor: Any = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.python = python if python is not None and python.texts else None
        self.tasks = tasks
        self.processor = processor

    def row(self, step: int, index: int
            ) -> tuple[list[int], list[int], list[bool], list[MediaInput]]:
        """Tokens, source ids, the emphasis mask (`emphasis_mask`) and media items (row
        `index`) of one row (`seq_len + 1` tokens)."""
        length = self.config.seq_len + 1
        rng = random.Random(f"{self.config.seed}/{step}/{index}")
        budget = round(length * self.config.conversation_share) if self.python else length
        ids: list[int] = []
        sources: list[int] = []
        emphasis: list[bool] = []
        media: list[MediaInput] = []
        while len(ids) < budget:
            conversation = sample_conversation(rng, TRAIN, self.tasks)
            conversation_ids, conversation_sources, conversation_media = encode_conversation(
                conversation, self.tokenizer, self.processor)
            size = len(conversation_ids)
            # Taking a conversation when at least half of it fits the budget makes the
            # expected share equal the budget rather than overshoot it.
            if len(ids) + size > length or len(ids) + size / 2 > budget:
                break
            media += _shifted(conversation_media, len(ids), index)
            ids += conversation_ids
            sources += conversation_sources
            emphasis += emphasis_mask(conversation_ids, conversation_sources, conversation,
                                      self.tokenizer)
        rest = length - len(ids)
        if rest and self.python:
            chunk = self.python.sample_tokens(rng, rest, self.tokenizer)
            chunk_sources = [NO_LOSS if t == BOS_ID else PYTHON_SOURCE for t in chunk]
            plain = [False] * len(chunk)
            if rng.random() < 0.5:
                return (chunk + ids, chunk_sources + sources, plain + emphasis,
                        _shifted(media, len(chunk), index))
            return ids + chunk, sources + chunk_sources, emphasis + plain, media
        return (ids + [PAD_ID] * rest, sources + [NO_LOSS] * rest, emphasis + [False] * rest,
                media)

    def __getitem__(self, step: int) -> dict[str, Any]:
        rows = [self.row(step, index) for index in range(self.config.batch_size)]
        tokens = torch.from_numpy(np.array([row[0] for row in rows], dtype=np.int64))
        sources = torch.from_numpy(np.array([row[1] for row in rows], dtype=np.uint8))
        emphasis = torch.from_numpy(np.array([row[2] for row in rows], dtype=np.bool_))
        # Position t predicts token t + 1, so a label's source says whether it is trained on.
        return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "sources": sources[:, 1:],
                "emphasis": emphasis[:, 1:], "media": [item for row in rows for item in row[3]]}
