"""Logits -> next tokens for a batch of requests with different sampling parameters.

Order: logit bias, min_tokens (stop tokens masked), repetition / presence / frequency
penalties, then greedy argmax or temperature, top-k, top-p and min-p filtering and a draw.
Reported logprobs are those of the model's raw distribution (before any of the above), as
vLLM reports by default.

A draw is `argmax(probs / noise)` with exponential noise (the exponential race, an exact sample
of `probs`). Requests with a seed draw their noise from their own generator, so their tokens do
not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from muse.engine.request import TokenLogprobs
from muse.engine.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None
    grammar: Any = None


def _token_counts(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    counts = torch.zeros(len(rows), vocab, device=device)
    for i, tokens in enumerate(rows):
        if tokens:
            ids = torch.tensor(tokens, device=device)
            counts[i].index_add_(0, ids, torch.ones(len(tokens), device=device))
    return counts


def apply_logit_processing(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Bias, min_tokens and penalties, applied to a float32 copy of the logits."""
    logits = logits.clone()
    vocab, device = logits.shape[1], logits.device
    for i, row in enumerate(rows):
        params = row.params
        if params.logit_bias:
            ids = torch.tensor(list(params.logit_bias), device=device)
            logits[i, ids] += torch.tensor(list(params.logit_bias.values()), device=device)
        if len(row.output_token_ids) < params.min_tokens:
            stops = list(params.stop_token_ids)
            if not params.ignore_eos:
                stops += list(row.eos_token_ids)
            if stops:
                logits[i, torch.tensor(stops, device=device)] = float("-inf")
    wants_repetition = [r.params.repetition_penalty != 1.0 for r in rows]
    wants_output = [r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0
                    for r in rows]
    if any(wants_repetition):
        seen = _token_counts([r.prompt_token_ids + r.output_token_ids if want else []
                              for r, want in zip(rows, wants_repetition)], vocab, device) > 0
        penalty = torch.tensor([r.params.repetition_penalty for r in rows], device=device)[:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if any(wants_output):
        counts = _token_counts([r.output_token_ids if want else []
                                for r, want in zip(rows, wants_output)], vocab, device)
        presence = torch.tensor([r.params.presence_penalty for r in rows], device=device)[:, None]
        frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=device)[:, None]
        logits = logits - presence * (counts > 0) - frequency * counts
    return logits


def filtered_probabilities(logits: torch.Tensor, temperature: torch.Tensor,
                           top_k: torch.Tensor, top_p: torch.Tensor,
                           min_p: torch.Tensor) -> torch.Tensor:
    """The distribution each row samples from after temperature, top-k, top-p and min-p."""
    logits = logits / temperature[:, None]
    vocab = logits.shape[1]
    if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)[None]
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
        sorted_logits = sorted_logits.masked_fill(rank >= k[:, None], float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the more likely ones already reach top_p (always keep the first).
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_logits = sorted_logits.masked_fill(before >= top_p[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if bool((min_p > 0).any()):
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _exponential_noise(rows: list[SamplingRow], shape: tuple[int, int],
                       device: torch.device) -> torch.Tensor:
    noise = torch.empty(shape, device=device).exponential_()
    for i, row in enumerate(rows):
        if row.generator is not None:
            noise[i].exponential_(generator=row.generator)
    return noise


def _logprobs(raw_logprobs: torch.Tensor, tokens: torch.Tensor, num_top: int,
              row: int) -> TokenLogprobs:
    chosen = raw_logprobs[row, tokens[row]]
    rank = int((raw_logprobs[row] > chosen).sum()) + 1
    top_values, top_ids = raw_logprobs[row].topk(num_top)
    return TokenLogprobs(int(tokens[row]), float(chosen), rank,
                         list(zip(top_ids.tolist(), top_values.tolist())))


def sample(logits: torch.Tensor, rows: list[SamplingRow], grammar_compiler: Any = None
           ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One token per row of `logits` [rows, vocab] (float32)."""
    device = logits.device
    processed = apply_logit_processing(logits, rows)
    if grammar_compiler is not None:
        grammar_compiler.apply(processed, [row.grammar for row in rows])
    greedy = torch.tensor([r.params.greedy for r in rows], device=device)
    tokens = processed.argmax(dim=-1)
    if not bool(greedy.all()):
        temperature = torch.tensor([r.params.temperature if not r.params.greedy else 1.0
                                    for r in rows], device=device)
        probs = filtered_probabilities(
            processed, temperature,
            torch.tensor([r.params.top_k for r in rows], device=device),
            torch.tensor([r.params.top_p for r in rows], device=device),
            torch.tensor([r.params.min_p for r in rows], device=device))
        drawn = (probs / _exponential_noise(rows, probs.shape, device)).argmax(dim=-1)
        tokens = torch.where(greedy, tokens, drawn)
    logprobs: list[TokenLogprobs | None] = [None] * len(rows)
    if any(r.params.logprobs is not None for r in rows):
        raw = logits.log_softmax(dim=-1)
        for i, row in enumerate(rows):
            if row.params.logprobs is not None:
                logprobs[i] = _logprobs(raw, tokens, row.params.logprobs, i)
    return tokens.tolist(), logprobs


def prompt_logprobs(logits: torch.Tensor, next_tokens: torch.Tensor,
                    num_top: int) -> list[TokenLogprobs]:
    """Logprob of each following prompt token under the logits of the position before it."""
    raw = logits.log_softmax(dim=-1)
    return [_logprobs(raw, next_tokens, num_top, i) for i in range(next_tokens.shape[0])]
