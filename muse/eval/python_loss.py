"""Next-token loss on held-out Python files, through the engine's prompt logprobs, against a
unigram baseline (token frequencies of training files, add-one smoothed).

A model that learned nothing about code scores about the unigram loss; the ratio says how
much better than that it predicts.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Iterator

from muse.chat_format import BOS_ID
from muse.engine.sampling_params import SamplingParams
from muse.eval.progress import progress_bars
from muse.llm import LLM
from muse.tokenizer import MuseTokenizer
from muse.train.data.python_source import SourceFile, discover_files, read_source
from muse.train.data.split import HELD_OUT, TRAIN, in_split


def sampled_texts(files: list[SourceFile], split: str, seed: int) -> Iterator[str]:
    """Texts of `split`'s usable files in an order fixed by the seed and the keys (not by
    the machine's file-system order)."""
    chosen = [f for f in files if in_split(f.key, split)]
    chosen.sort(key=lambda f: hashlib.blake2b(f"{seed}/{f.key}".encode(), digest_size=8).digest())
    for file in chosen:
        text = read_source(file.path)
        if text is not None:
            yield text


def unigram_log_probs(texts: Iterator[str], tokenizer: MuseTokenizer, char_budget: int
                      ) -> list[float]:
    """Log-probability of every token id under add-one smoothed frequencies counted over
    about `char_budget` characters of `texts`."""
    counts: Counter[int] = Counter()
    used = 0
    for text in texts:
        if used >= char_budget:
            break
        counts.update(tokenizer.encode(text))
        used += len(text)
    total = sum(counts.values()) + tokenizer.vocab_size
    return [math.log((counts[token] + 1) / total) for token in range(tokenizer.vocab_size)]


def evaluate_python(llm: LLM, num_files: int, max_tokens: int, seed: int,
                    unigram_chars: int, include_packages: bool = True,
                    progress: bool | None = None) -> dict[str, float]:
    """Mean next-token loss (nats per token) of the model and of the unigram baseline over
    the first `max_tokens` tokens (from `<|bos|>`) of `num_files` held-out files."""
    tokenizer = llm.tokenizer
    files, _ = discover_files(include_packages)
    documents = []
    for text in sampled_texts(files, HELD_OUT, seed):
        if len(documents) == num_files:
            break
        documents.append([BOS_ID] + tokenizer.encode(text)[:max_tokens - 1])
    if not documents:
        raise ValueError("no held-out Python files were found on this machine")
    unigram = unigram_log_probs(sampled_texts(files, TRAIN, seed), tokenizer, unigram_chars)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in documents], params,
                           use_tqdm=progress_bars(progress, "python loss"))
    model_loss = unigram_loss = 0.0
    tokens = 0
    for ids, output in zip(documents, outputs):
        # Entry 0 is None: nothing predicts the first token.
        for token, logprob in zip(ids[1:], output.prompt_logprobs[1:]):
            model_loss -= logprob.logprob
            unigram_loss -= unigram[token]
            tokens += 1
    return {"files": len(documents), "tokens": tokens, "model_loss": model_loss / tokens,
            "unigram_loss": unigram_loss / tokens,
            "model_over_unigram": model_loss / unigram_loss}
