"""Training batches: rows of whole conversations plus one Python chunk, with a loss mask.

Each row holds `seq_len + 1` tokens: whole conversations up to about `conversation_share` of
the row (a conversation is never cut, so every assistant turn sees its question), and a
Python chunk filling the rest, placed before or after them. Every token carries a source id:
0 for no loss, 1 for Python (loss on every token but `<|bos|>`), 2.. for a conversation task
(loss on assistant turns only, their `<|end|>` included, so the model learns to stop).

Batch `step` is a pure function of (seed, step): resuming at a step replays exactly the data
an uninterrupted run would have seen, and data loader workers need no coordination.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from muse.chat_format import ASSISTANT_ID, BOS_ID, END_OF_TURN_ID, PAD_ID
from muse.tokenizer import MuseTokenizer
from muse.train.data.conversations import TASKS, Conversation, sample_conversation
from muse.train.data.python_source import PythonCorpus
from muse.train.data.split import TRAIN

NO_LOSS = 0
PYTHON_SOURCE = 1
SOURCES: tuple[str, ...] = ("none", "python", *(task.name for task in TASKS))
TASK_SOURCE = {task.name: index for index, task in enumerate(TASKS, start=2)}


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
    """True for tokens the assistant wrote: after `<|assistant|>`, through its `<|end|>`."""
    mask, inside = [], False
    for token in token_ids:
        mask.append(inside)
        if token == ASSISTANT_ID:
            inside = True
        elif token == END_OF_TURN_ID:
            inside = False
    return mask


def encode_conversation(conversation: Conversation, tokenizer: MuseTokenizer
                        ) -> tuple[list[int], list[int]]:
    """Token ids of the rendered conversation and each token's source id."""
    ids = tokenizer.apply_chat_template(conversation.messages, tools=conversation.tools,
                                        tokenize=True)
    source = TASK_SOURCE[conversation.task]
    return ids, [source if inside else NO_LOSS for inside in assistant_mask(ids)]


class TrainingBatches(torch.utils.data.Dataset):
    """Map-style dataset whose item `step` is that step's whole batch."""

    def __init__(self, config: MixtureConfig, tokenizer: MuseTokenizer,
                 python: PythonCorpus | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.python = python if python is not None and python.texts else None

    def row(self, step: int, index: int) -> tuple[list[int], list[int]]:
        """Tokens and source ids of one row (`seq_len + 1` long)."""
        length = self.config.seq_len + 1
        rng = random.Random(f"{self.config.seed}/{step}/{index}")
        budget = round(length * self.config.conversation_share) if self.python else length
        ids: list[int] = []
        sources: list[int] = []
        while len(ids) < budget:
            conversation_ids, conversation_sources = encode_conversation(
                sample_conversation(rng, TRAIN), self.tokenizer)
            size = len(conversation_ids)
            # Taking a conversation when at least half of it fits the budget makes the
            # expected share equal the budget rather than overshoot it.
            if len(ids) + size > length or len(ids) + size / 2 > budget:
                break
            ids += conversation_ids
            sources += conversation_sources
        rest = length - len(ids)
        if rest and self.python:
            chunk = self.python.sample_tokens(rng, rest, self.tokenizer)
            chunk_sources = [NO_LOSS if t == BOS_ID else PYTHON_SOURCE for t in chunk]
            if rng.random() < 0.5:
                return chunk + ids, chunk_sources + sources
            return ids + chunk, sources + chunk_sources
        return ids + [PAD_ID] * rest, sources + [NO_LOSS] * rest

    def __getitem__(self, step: int) -> dict[str, torch.Tensor]:
        rows = [self.row(step, index) for index in range(self.config.batch_size)]
        tokens = torch.from_numpy(np.array([ids for ids, _ in rows], dtype=np.int64))
        sources = torch.from_numpy(np.array([src for _, src in rows], dtype=np.uint8))
        # Position t predicts token t + 1, so a label's source says whether it is trained on.
        return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "sources": sources[:, 1:]}
