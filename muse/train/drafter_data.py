"""The drafter's data: the target's own answers to the prompts of the default model's tasks.

A drafter is only useful where it predicts what the target will write, so it is trained on
the target's outputs, not on the gold answers of the task generators. Prompts are the prompt
side of the conversations the default model was trained on (`muse/train/data/conversations.py`:
arithmetic, tool calls, instructions, with system prompts and follow-up exchanges): a
conversation is cut before one of its assistant turns (chosen at random), everything before
it is rendered with the target's chat template exactly as `LLM.chat` renders it (generation
prompt included), and the target answers through the engine (`muse.LLM`), greedily or by
sampling, up to `max_tokens`.

Training prompts come from the train split and evaluation prompts from the held-out split
(`muse/train/data/split.py`), drawn with different seeds, so no evaluated problem was trained
on; evaluation prompts that render like a training prompt are dropped all the same.
Evaluation answers are always greedy: under greedy verification a greedy drafter's accepted
prefix is then exactly the prefix of its draft that agrees with the stored answer.
"""

from __future__ import annotations

import gc
import logging
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from muse.engine.sampling_params import SamplingParams
from muse.llm import LLM
from muse.train.data.conversations import sample_conversation
from muse.train.data.split import HELD_OUT, TRAIN

logger = logging.getLogger("muse.train")


@dataclass(frozen=True)
class DrafterPrompt:
    """A conversation up to (not including) the assistant turn the target is to write."""

    task: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None


@dataclass
class DrafterExample:
    """A rendered prompt and the target's answer to it (its stop token included)."""

    task: str
    prompt_ids: list[int]
    response_ids: list[int]
    finish_reason: str | None = None

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def response_start(self) -> int:
        """Position of the first answer token."""
        return len(self.prompt_ids)


@dataclass
class DrafterData:
    train: list[DrafterExample]
    eval: list[DrafterExample]
    stats: dict[str, Any]


def sample_prompts(num: int, seed: int, split: str) -> list[DrafterPrompt]:
    """`num` prompts of `split`, a pure function of (seed, split). The task mix is the
    default model's text tasks' (`conversations.TEXT_TASKS`, by conversation); `task` names
    the conversation's first exchange even when the cut falls on a follow-up."""
    rng = random.Random(f"drafter/{split}/{seed}")
    prompts = []
    for _ in range(num):
        conversation = sample_conversation(rng, split)
        turns = [i for i, m in enumerate(conversation.messages) if m["role"] == "assistant"]
        cut = rng.choice(turns)
        prompts.append(DrafterPrompt(conversation.task, conversation.messages[:cut],
                                     conversation.tools))
    return prompts


def render_prompt(tokenizer: Any, prompt: DrafterPrompt) -> list[int]:
    """Token ids as `LLM.chat` renders the conversation: chat template, generation prompt."""
    return tokenizer.apply_chat_template(prompt.messages, tools=prompt.tools,
                                         add_generation_prompt=True, tokenize=True)


def generate_examples(llm: LLM, prompts: Sequence[DrafterPrompt], max_tokens: int,
                      temperature: float = 0.0, exclude: set[tuple[int, ...]] | None = None,
                      use_tqdm: Any = False) -> list[DrafterExample]:
    """The target's answers, one per prompt (prompts rendering like one in `exclude`, or
    like an earlier prompt when `exclude` is given, are dropped first)."""
    rendered: list[tuple[DrafterPrompt, list[int]]] = []
    seen = set(exclude) if exclude is not None else None
    for prompt in prompts:
        ids = render_prompt(llm.tokenizer, prompt)
        if seen is not None:
            if tuple(ids) in seen:
                continue
            seen.add(tuple(ids))
        rendered.append((prompt, ids))
    if not rendered:
        return []
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                            skip_special_tokens=False)
    outputs = llm.generate([{"prompt_token_ids": ids} for _, ids in rendered], params,
                           use_tqdm=use_tqdm)
    return [DrafterExample(prompt.task, ids, list(output.outputs[0].token_ids),
                           output.outputs[0].finish_reason)
            for (prompt, ids), output in zip(rendered, outputs)]


def describe(examples: Sequence[DrafterExample]) -> dict[str, Any]:
    """Counts and lengths of a set of examples, overall and per task."""
    def summary(group: Sequence[DrafterExample]) -> dict[str, Any]:
        count = max(len(group), 1)
        return {"examples": len(group),
                "response_tokens": sum(len(e.response_ids) for e in group),
                "mean_prompt_tokens": round(sum(len(e.prompt_ids) for e in group) / count, 1),
                "mean_response_tokens": round(sum(len(e.response_ids) for e in group) / count,
                                              1),
                "truncated_share": round(sum(e.finish_reason == "length" for e in group)
                                         / count, 4)}

    tasks = sorted({e.task for e in examples})
    return {**summary(examples),
            "tasks": {task: summary([e for e in examples if e.task == task]) for task in tasks}}


def build_data(target: str, num_train: int, num_eval: int, seed: int, max_tokens: int,
               temperature: float = 0.0, device: str = "auto",
               mask_token_id: int | None = None, use_tqdm: Any = False,
               **engine_args: Any) -> DrafterData:
    """Generate the training and held-out examples with one engine on `target`, then free
    it (its KV cache would otherwise hold the GPU memory training needs).

    With `mask_token_id`, answers holding that token are reported (`stats`) and fail the
    run: the mask token must be one the target never writes."""
    started = time.monotonic()
    if device != "cpu" and (device != "auto" or torch.cuda.is_available()):
        engine_args.setdefault("gpu_memory_utilization", 0.3)
        engine_args.setdefault("max_num_seqs", 512)
    llm = LLM(target, device=device, seed=seed, **engine_args)
    try:
        train_prompts = sample_prompts(num_train, seed, TRAIN)
        logger.info("data: the target answers %d training and %d held-out prompts on %s "
                    "(at most %d tokens each)", num_train, num_eval, llm.engine.device,
                    max_tokens)
        train = generate_examples(llm, train_prompts, max_tokens, temperature,
                                  use_tqdm=use_tqdm)
        train_ids = {tuple(e.prompt_ids) for e in train}
        held_out = sample_prompts(num_eval, seed, HELD_OUT)
        evaluation = generate_examples(llm, held_out, max_tokens, 0.0, exclude=train_ids,
                                       use_tqdm=use_tqdm)
        device_name = str(llm.engine.device)
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    seconds = time.monotonic() - started
    generated = sum(len(e.response_ids) for e in train + evaluation)
    stats = {"seed": seed, "max_tokens": max_tokens, "temperature": temperature,
             "train_split": TRAIN, "eval_split": HELD_OUT, "device": device_name,
             "train": describe(train), "eval": describe(evaluation),
             "eval_prompts_dropped": num_eval - len(evaluation),
             "generated_tokens": generated, "seconds": round(seconds, 1),
             "generated_tokens_per_s": round(generated / max(seconds, 1e-9), 1)}
    if mask_token_id is not None:
        hits = Counter(e.task for e in train + evaluation if mask_token_id in e.response_ids)
        stats["answers_with_mask_token"] = sum(hits.values())
        if hits:
            raise ValueError(f"the target wrote the mask token id {mask_token_id} in "
                             f"{sum(hits.values())} answers ({dict(hits)}): choose a token it "
                             f"never writes with --mask-token-id")
    logger.info("data: %d training and %d held-out answers, %d tokens generated in %.1f s "
                "(%.0f tokens/s)", len(train), len(evaluation), generated, seconds,
                stats["generated_tokens_per_s"])
    return DrafterData(train, evaluation, stats)
