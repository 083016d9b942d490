"""Logits -> next tokens for a batch of requests with different sampling parameters.

Order: logit bias, min_tokens (stop tokens masked), repetition / presence / frequency
penalties, then greedy argmax or temperature, top-k, top-p and min-p filtering and a draw.
Reported logprobs are those of the model's raw distribution (before any of the above), as
vLLM reports by default.

A draw is `argmax(probs / noise)` with exponential noise (the exponential race, an exact sample
of `probs`). Requests with a seed draw their noise from their own generator, so their tokens do
not depend on what else is in the batch.

Per-row parameters reach the device in one copy, top-k / top-p need no vocabulary sort
(`muse.kernels.sampling`), and an all-greedy batch is an argmax and nothing more.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from muse.engine.request import TokenLogprobs
from muse.engine.sampling_params import SamplingParams
from muse.engine.transfer import HostCopy, to_device
from muse.kernels.sampling import top_k_top_p_filter


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...]
    generator: torch.Generator | None
    grammar: Any = None
    num_pending_tokens: int = 0  # sampled by the step in flight, not in output_token_ids yet


def _token_counts(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    counts = torch.zeros(len(rows), vocab, device=device)
    for i, tokens in enumerate(rows):
        if tokens:
            ids = to_device(tokens, device)
            counts[i].index_add_(0, ids, torch.ones(len(tokens), device=device))
    return counts


def apply_logit_processing(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Bias, min_tokens and penalties, applied to a float32 copy of the logits."""
    logits = logits.clone()
    vocab, device = logits.shape[1], logits.device
    for i, row in enumerate(rows):
        params = row.params
        if params.logit_bias:
            ids = to_device(list(params.logit_bias), device)
            logits[i, ids] += to_device(list(params.logit_bias.values()), device, logits.dtype)
        if len(row.output_token_ids) + row.num_pending_tokens < params.min_tokens:
            stops = list(params.stop_token_ids)
            if not params.ignore_eos:
                stops += list(row.eos_token_ids)
            if stops:
                logits[i, to_device(stops, device)] = float("-inf")
    wants_repetition = [r.params.repetition_penalty != 1.0 for r in rows]
    wants_output = [r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0
                    for r in rows]
    if any(wants_repetition):
        seen = _token_counts([r.prompt_token_ids + r.output_token_ids if want else []
                              for r, want in zip(rows, wants_repetition)], vocab, device) > 0
        penalty = to_device([r.params.repetition_penalty for r in rows], device,
                            logits.dtype)[:, None]
        penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalised, logits)
    if any(wants_output):
        counts = _token_counts([r.output_token_ids if want else []
                                for r, want in zip(rows, wants_output)], vocab, device)
        presence = to_device([r.params.presence_penalty for r in rows], device,
                             logits.dtype)[:, None]
        frequency = to_device([r.params.frequency_penalty for r in rows], device,
                              logits.dtype)[:, None]
        logits = logits - presence * (counts > 0) - frequency * counts
    return logits


@dataclass
class RowParameters:
    """Per-row sampling parameters on the device, plus what the host knows about them."""

    temperature: torch.Tensor  # [rows] float32, 1.0 on greedy rows
    top_k: torch.Tensor  # [rows] int64, 0 = no limit
    top_p: torch.Tensor  # [rows] float32
    min_p: torch.Tensor  # [rows] float32
    greedy: torch.Tensor  # [rows] bool
    max_top_k: int
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def from_rows(cls, rows: list[SamplingRow], vocab: int,
                  device: torch.device) -> RowParameters:
        """All parameters in one host -> device copy."""
        # Greedy rows take the argmax whatever is drawn, so they are given neutral filters
        # and do not make the others pay for a large top_k.
        table = [(1.0, 0, 1.0, 0.0, 1.0) if r.params.greedy else
                 (r.params.temperature, min(r.params.top_k, vocab), r.params.top_p,
                  r.params.min_p, 0.0)
                 for r in rows]
        # float32 holds every top_k exactly (capped at the vocabulary, far below 2**24) and
        # keeps the float parameters at the precision the per-parameter tensors had.
        packed = to_device(table, device, torch.float32)
        return cls(temperature=packed[:, 0], top_k=packed[:, 1].long(), top_p=packed[:, 2],
                   min_p=packed[:, 3], greedy=packed[:, 4] > 0,
                   # A top_k of the whole vocabulary cuts nothing; topk need not go that far.
                   max_top_k=max((t[1] for t in table if t[1] < vocab), default=0),
                   any_top_p=any(t[2] < 1.0 for t in table),
                   any_min_p=any(t[3] > 0.0 for t in table))


def filtered_probabilities(logits: torch.Tensor, params: RowParameters) -> torch.Tensor:
    """The distribution each row samples from after temperature, top-k, top-p and min-p."""
    logits = logits / params.temperature[:, None]
    logits = top_k_top_p_filter(logits, params.top_k, params.top_p,
                                max_top_k=params.max_top_k, any_top_p=params.any_top_p)
    probs = logits.softmax(dim=-1)
    if params.any_min_p:
        threshold = params.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < threshold, torch.zeros_like(probs), probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def _exponential_noise(rows: list[SamplingRow], shape: tuple[int, int],
                       device: torch.device) -> torch.Tensor:
    noise = torch.empty(shape, device=device).exponential_()
    for i, row in enumerate(rows):
        if row.generator is not None:
            noise[i].exponential_(generator=row.generator)
    # A draw of exactly 0 would make probs / noise NaN for a token of probability 0, and
    # argmax would pick it; the smallest normal float changes no other comparison.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)


class LogprobsTable:
    """TokenLogprobs of `tokens[i]` under the log-softmax row `raw_logprobs[i]` [N, vocab]:
    its logprob, its rank and the top `num_top[i]` alternatives.

    Computed for all rows on the device and copied back in one transfer, queued behind the
    kernels and waited for only in `entries()`: a read-back per row cost about 80 us each on
    the H200 (three decode steps' worth at 256 rows asking for logprobs, as every RL rollout
    does), and waiting at sampling time kept the overlapped schedule from running ahead.
    """

    def __init__(self, raw_logprobs: torch.Tensor, tokens: torch.Tensor | Sequence[int],
                 num_top: Sequence[int]) -> None:
        self.num_top = list(num_top)
        self.width = max(self.num_top, default=0)
        self.host: HostCopy | None = None
        if not self.num_top:
            return
        tokens = torch.as_tensor(tokens, device=raw_logprobs.device).long()
        chosen = raw_logprobs.gather(1, tokens[:, None])
        rank = (raw_logprobs > chosen).sum(dim=1, keepdim=True) + 1
        columns = [tokens[:, None].double(), chosen.double(), rank.double()]
        if self.width:
            top_values, top_ids = raw_logprobs.topk(self.width, dim=1)
            columns += [top_ids.double(), top_values.double()]
        # float64 holds token ids, ranks and float32 logprobs exactly: one copy for everything.
        self.host = HostCopy(torch.cat(columns, dim=1))

    def entries(self) -> list[TokenLogprobs]:
        if self.host is None:
            return []
        result = []
        for values, wanted in zip(self.host.tolist(), self.num_top):
            ids, top = values[3:3 + self.width], values[3 + self.width:]
            result.append(TokenLogprobs(int(values[0]), values[1], int(values[2]),
                                        [(int(ids[j]), top[j]) for j in range(wanted)]))
        return result


def gather_logprobs(raw_logprobs: torch.Tensor, tokens: torch.Tensor | Sequence[int],
                    num_top: Sequence[int]) -> list[TokenLogprobs]:
    """`LogprobsTable`'s entries, read back now."""
    return LogprobsTable(raw_logprobs, tokens, num_top).entries()


def sample(logits: torch.Tensor, rows: list[SamplingRow], grammar_compiler: Any = None
           ) -> tuple[list[int], list[TokenLogprobs | None]]:
    """One token per row of `logits` [rows, vocab] (float32)."""
    tokens, read_logprobs = sample_on_device(logits, rows, grammar_compiler)
    return tokens.tolist(), read_logprobs()


def sample_on_device(logits: torch.Tensor, rows: list[SamplingRow], grammar_compiler: Any = None
                     ) -> tuple[torch.Tensor, Callable[[], list[TokenLogprobs | None]]]:
    """`sample`, with the tokens left on the device and the logprobs behind a reader: reading
    either back waits for the step, so a caller that overlaps the host with the device reads
    them later."""
    device = logits.device
    processed = apply_logit_processing(logits, rows)
    if grammar_compiler is not None:
        grammar_compiler.apply(processed, [row.grammar for row in rows])
    if all(r.params.greedy for r in rows):
        tokens = processed.argmax(dim=-1)
    else:
        params = RowParameters.from_rows(rows, processed.shape[1], device)
        probs = filtered_probabilities(processed, params)
        drawn = (probs / _exponential_noise(rows, probs.shape, device)).argmax(dim=-1)
        tokens = torch.where(params.greedy, processed.argmax(dim=-1), drawn)
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    table = None
    if wanted:
        index = to_device(wanted, device)
        table = LogprobsTable(logits[index].log_softmax(dim=-1), tokens[index],
                              [rows[i].params.logprobs for i in wanted])

    def read_logprobs() -> list[TokenLogprobs | None]:
        logprobs: list[TokenLogprobs | None] = [None] * len(rows)
        if table is not None:
            for i, entry in zip(wanted, table.entries()):
                logprobs[i] = entry
        return logprobs

    return tokens, read_logprobs


def prompt_logprobs(logits: torch.Tensor, next_tokens: torch.Tensor,
                    num_top: int) -> list[TokenLogprobs]:
    """Logprob of each following prompt token under the logits of the position before it."""
    return gather_logprobs(logits.log_softmax(dim=-1), next_tokens,
                           [num_top] * next_tokens.shape[0])
