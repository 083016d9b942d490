"""A step's tokens for requests that brought drafts: the target's distributions at every draft
position, then lossless verification.

Request r with drafts x_1..x_g has g + 1 logits rows (its last known token and each draft).
Row i is processed exactly as plain decoding would process it after x_1..x_i were sampled:
logit bias, min_tokens, penalties (which count the drafts as output), temperature, top-k,
top-p, min-p. That gives p_1..p_{g+1}; greedy requests keep the longest prefix equal to the
argmax, the others are verified token-wise or by block verification (`rejection_sample_method`)
with the request's own generator for the noise, so a seeded request reproduces. Drafts of
model-free speculators are one-hot (q = None). The logprobs of emitted tokens are the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Any

import torch

from muse.engine.request import TokenLogprobs
from muse.engine.sampler import (RowParameters, SamplingRow, apply_logit_processing,
                                 filtered_probabilities, gather_logprobs)
from muse.engine.sampling_params import SamplingParams
from muse.engine.transfer import HostCopy, to_device
from muse.speculative.verification import (accepted_count, verify_block, verify_greedy,
                                           verify_tokenwise)


@dataclass
class VerifiedDrafts:
    """A verification queued on the device: each request's accepted count t [R] and emitted
    tokens [R, G + 1] (row r's first t + 1: its accepted drafts and one more; the entries
    after them are not to be read), on their way to the host.
    Until `read` waits for them, the device may take more work that reads them (the next
    step's drafts)."""

    accepted: torch.Tensor
    outputs: torch.Tensor
    copy: HostCopy  # [R, G + 2]: the count, then the tokens
    rows: list[SamplingRow]
    starts: list[int]
    raw_logprobs: torch.Tensor | None  # the logits' log-softmax, where logprobs are asked for
    # The next step's greedy drafts [R, G'], where the verify graph made them right after.
    next_drafts: torch.Tensor | None = None

    def read(self) -> tuple[list[list[int]], list[list[TokenLogprobs | None]]]:
        """Each request's emitted tokens and their logprobs (None where not asked for)."""
        emitted = [tokens[1:tokens[0] + 2] for tokens in self.copy.tolist()]
        return emitted, _logprobs(self.raw_logprobs, self.rows, self.starts, emitted)


def sample_with_drafts(logits: torch.Tensor, rows: list[SamplingRow], drafts: list[list[int]],
                       rejection_sample_method: str = "token",
                       draft_probs: list[torch.Tensor | None] | None = None,
                       device_drafts: tuple[torch.Tensor, list[int]] | None = None,
                       grammar_compiler: Any = None) -> VerifiedDrafts:
    """`logits` holds, request after request, the g_r + 1 rows of each request's step;
    `draft_probs[r]` [g_r, vocab] is the distribution request r's drafts were drawn from
    (None: one-hot). With `device_drafts` (tensor [N, G], row of each request) the drafts'
    values are that tensor's and `drafts` only gives their counts. A request with a grammar
    (it never drafts: its matcher cannot take tokens back) samples its one row under its
    grammar's mask, as in a step without drafts. Nothing is read back here: the result's
    `read` does it."""
    device = logits.device
    num_requests, vocab = len(rows), logits.shape[1]
    width = max(len(d) for d in drafts)
    starts = list(accumulate((len(d) + 1 for d in drafts), initial=0))
    greedy = [row.params.greedy for row in rows]
    # The rows of each request's logits (its last row repeated past its drafts), the drafts
    # padded to the widest, their counts and the greedy mask: one copy to the device.
    index = [min(s + i, e - 1) for s, e in zip(starts, starts[1:]) for i in range(width + 1)]
    padded = device_drafts[1] if device_drafts is not None \
        else [token for d in drafts for token in d + [0] * (width - len(d))]
    staged = to_device(index + padded + [len(d) for d in drafts] + greedy, device)
    index, draft_tokens, num_drafts, greedy_mask = staged.split(
        [len(index), len(padded), num_requests, num_requests])
    index = index.view(num_requests, width + 1)
    if device_drafts is not None:
        draft_tokens = device_drafts[0].index_select(0, draft_tokens)[:, :width]
    else:
        draft_tokens = draft_tokens.view(num_requests, width)
    greedy_mask = greedy_mask.bool()

    expanded = [row_i for row, draft in zip(rows, drafts) for row_i in _draft_rows(row, draft)]
    processed = apply_logit_processing(logits, expanded) \
        if any(_processes_logits(row.params) for row in rows) else logits
    if grammar_compiler is not None and any(row.grammar is not None for row in rows):
        if processed is logits:
            processed = logits.clone()  # the raw logits still give the logprobs
        grammar_compiler.apply(processed, [row.grammar for row in expanded])
    if all(greedy) and processed is logits:
        # Plain argmax rows: the drafts kept are those equal to their row's best token, so the
        # emitted tokens are best[:t + 1] (the entries after them are never read), with no
        # gather of whole logits rows.
        outputs = logits.argmax(dim=-1)[index]
        accepted = accepted_count("token", draft_tokens == outputs[:, :width], num_drafts)
    elif all(greedy):
        accepted, outputs = verify_greedy(processed[index], draft_tokens, num_drafts)
    else:
        probs = filtered_probabilities(processed,
                                       RowParameters.from_rows(expanded, vocab, device))
        uniforms, exponentials = _noise(rows, width, vocab, device)
        verify = verify_block if rejection_sample_method == "block" else verify_tokenwise
        q = _draft_distributions(draft_probs, drafts, width, vocab, device)
        accepted, outputs = verify(probs[index], draft_tokens, num_drafts, q, uniforms,
                                   exponentials)
        if any(greedy):
            t, out = verify_greedy(processed[index], draft_tokens, num_drafts)
            accepted = torch.where(greedy_mask, t, accepted)
            outputs = torch.where(greedy_mask[:, None], out, outputs)

    # One read-back: each request's count, then its tokens. The logprobs' log-softmax is
    # taken now, as `logits` may be a graph's output that a later replay overwrites.
    raw = logits.log_softmax(dim=-1) \
        if any(row.params.logprobs is not None for row in rows) else None
    return VerifiedDrafts(accepted, outputs,
                          HostCopy(torch.cat([accepted[:, None], outputs], dim=1)), rows,
                          starts, raw)


def verified_in_graph(rows: list[SamplingRow]) -> bool:
    """Whether a verify step of these requests may take the greedy verification its CUDA
    graph holds (`ModelWorker.execute(greedy_verify=True)`): every request greedy, with no
    logit processing, grammar or logprobs, so the argmax of the raw logits is all it needs."""
    return all(row.params.greedy and row.params.logprobs is None and row.grammar is None
               and not _processes_logits(row.params) for row in rows)


def drafts_verified_in_graph(verified: torch.Tensor, rows: list[SamplingRow],
                             drafts: list[list[int]], next_drafts: torch.Tensor | None = None
                             ) -> VerifiedDrafts:
    """`VerifiedDrafts` from a verify graph's greedy verification [R, 1 + Q] (count, then
    the argmax of each query row): the same read-back as `sample_with_drafts` gives."""
    starts = list(accumulate((len(d) + 1 for d in drafts), initial=0))
    return VerifiedDrafts(verified[:, 0], verified[:, 1:], HostCopy(verified), rows, starts,
                          None, next_drafts)


def verified_without_drafts(tokens: torch.Tensor, rows: list[SamplingRow]) -> VerifiedDrafts:
    """A step's sampled tokens [R] as the verification of no drafts: each request accepted
    none and emits its one token. Greedy rows without logprobs (`verified_in_graph`) only:
    the same tokens and read-back as a plain step's, in the form a chained verify step is
    made from."""
    accepted = torch.zeros_like(tokens)
    outputs = tokens[:, None]
    return VerifiedDrafts(accepted, outputs, HostCopy(torch.stack([accepted, tokens], dim=1)),
                          rows, list(range(len(rows))), None)


def _processes_logits(params: SamplingParams) -> bool:
    """Whether `apply_logit_processing` changes anything for a request with these params."""
    return bool(params.logit_bias) or params.min_tokens > 0 or uses_output_tokens(params)


def uses_output_tokens(params: SamplingParams) -> bool:
    """Whether sampling reads the output tokens themselves (penalties), not just their count."""
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0)


def _draft_rows(row: SamplingRow, draft: list[int]) -> list[SamplingRow]:
    """The request's row for each of its g + 1 logits rows: the i-th as if drafts 1..i had
    been sampled. Only penalties read the output tokens themselves (copied per row); the
    others just count them, and rows that do neither share the request's row."""
    if uses_output_tokens(row.params):
        return [replace(row, output_token_ids=row.output_token_ids + draft[:i])
                for i in range(len(draft) + 1)]
    if row.params.min_tokens > 0:
        return [replace(row, num_pending_tokens=row.num_pending_tokens + i)
                for i in range(len(draft) + 1)]
    return [row] * (len(draft) + 1)


def _draft_distributions(draft_probs: list[torch.Tensor | None] | None,
                         drafts: list[list[int]], width: int, vocab: int,
                         device: torch.device) -> torch.Tensor | None:
    """q [R, G, V]: the given distributions, one-hot rows for drafts without one; None when
    every draft is one-hot (verification then needs no q at all)."""
    if draft_probs is None or all(q is None for q in draft_probs):
        return None
    q = torch.zeros(len(drafts), width, vocab, device=device)
    for r, (probs, draft) in enumerate(zip(draft_probs, drafts)):
        if probs is not None:
            q[r, :len(draft)] = probs[:len(draft)].to(device, torch.float32)
        elif draft:
            q[r, torch.arange(len(draft)), torch.tensor(draft)] = 1.0
    return q


def _noise(rows: list[SamplingRow], width: int, vocab: int, device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The tests' uniforms and the final token's exponentials, from each request's own
    generator when it has one."""
    uniforms = torch.rand(len(rows), width, device=device)
    exponentials = torch.empty(len(rows), vocab, device=device).exponential_()
    for r, row in enumerate(rows):
        if row.generator is not None:
            uniforms[r] = torch.rand(width, device=device, generator=row.generator)
            exponentials[r].exponential_(generator=row.generator)
    return uniforms, exponentials


def _logprobs(raw: torch.Tensor | None, rows: list[SamplingRow], starts: list[int],
              emitted: list[list[int]]) -> list[list[TokenLogprobs | None]]:
    """Each emitted token's logprobs for the rows asking for them, in one read-back."""
    asking = [row.params.logprobs is not None for row in rows]
    if not any(asking):
        return [[None] * len(tokens) for tokens in emitted]
    positions, tokens, num_top = [], [], []
    for row, start, emitted_tokens, asks in zip(rows, starts, emitted, asking):
        if asks:
            positions += range(start, start + len(emitted_tokens))
            tokens += emitted_tokens
            num_top += [row.params.logprobs] * len(emitted_tokens)
    found = iter(gather_logprobs(raw[to_device(positions, raw.device)], tokens, num_top))
    return [[next(found) for _ in emitted_tokens] if asks else [None] * len(emitted_tokens)
            for emitted_tokens, asks in zip(emitted, asking)]
