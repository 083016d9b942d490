"""Who proposes each step's drafts: the n-gram lookup, or the block-diffusion drafter.

Both answer `propose(requests, rooms)` with, per request, up to `room` draft tokens and the
exact distribution q they were drawn from (None: one-hot). The drafter also learns, after each
step, the target's hidden states at its layers for the tokens the step committed (`observe`):
they become its context rows. A request's next block is anchored on its last token, whose
target hidden state is computed by the step that verifies the block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple
from pathlib import Path

import torch

from muse.engine.args import EngineArgs
from muse.engine.request import Request
from muse.model.decoder import EngineModel
from muse.speculative.config import SpeculativeConfig
from muse.speculative.drafter import ContextCache, MuseDrafter, load_drafter
from muse.speculative.ngram import WINDOW, propose_ngram
from muse.speculative.suffix import SuffixProposer

class Drafts(NamedTuple):
    """One request's drafts: the tokens, the distribution q they were drawn from (None:
    one-hot) and, from a drafter with a confidence head, each draft's predicted chance of
    being accepted given the ones before it."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    confidence: list[float] | None = None


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, requests: list[Request], rooms: list[int]) -> list[Drafts]:
        config = self.config
        return [Drafts(propose_ngram(r.token_ids(max(0, r.num_tokens - WINDOW), r.num_tokens),
                                     room, config.prompt_lookup_min, config.prompt_lookup_max))
                for r, room in zip(requests, rooms)]

    def observe(self, committed: list[tuple[Request, int, int]],
                features: torch.Tensor | None) -> None:
        """Nothing to learn from the target."""

    def retain(self, request_ids: set[str]) -> None:
        """Nothing kept per request."""


@dataclass
class _Context:
    cache: ContextCache
    next_position: int  # the position its next row should have
    num_preemptions: int
    # Rows committed since the last proposal: (features [n, K*d], positions [n]).
    pending: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


class DrafterProposer:
    """The drafter over every running request, with a context cache per request."""

    def __init__(self, drafter: MuseDrafter, config: SpeculativeConfig) -> None:
        self.drafter = drafter
        self.config = config
        self.contexts: dict[str, _Context] = {}

    def observe(self, committed: list[tuple[Request, int, int]],
                features: torch.Tensor | None) -> None:
        """`committed`: (request, first row in `features`, number of rows) of the tokens a
        step committed, whose rows of `features` [step tokens, K*d] are their target hidden
        states, at positions `request.num_computed_tokens - count` onwards."""
        if features is None:
            return
        for request, row, count in committed:
            if count == 0:
                continue
            first = request.num_computed_tokens - count
            context = self.contexts.get(request.request_id)
            if (context is None or first < context.next_position
                    or context.num_preemptions != request.num_preemptions):
                # New, or recomputed from the start after a preemption: a fresh cache. Rows
                # served by the prefix cache were never seen here; the drafter then works
                # from the rows it has (drafts may be worse, never wrong).
                context = _Context(self.drafter.new_cache(features.device), first,
                                   request.num_preemptions)
                self.contexts[request.request_id] = context
            positions = torch.arange(first, first + count, device=features.device)
            context.pending.append((features[row:row + count], positions))
            context.next_position = first + count

    def propose(self, requests: list[Request], rooms: list[int]) -> list[Drafts]:
        active = [(r, room) for r, room in zip(requests, rooms)
                  if room > 0 and r.request_id in self.contexts]
        proposals: dict[str, Drafts] = {}
        # A seeded request draws its drafts from its own generator, alone, so that its
        # output does not depend on the batch; the others draft together.
        sampled_alone = [[item] for item in active if item[0].generator is not None
                         and self._draft_temperature(item[0]) > 0]
        together = [item for item in active if [item] not in sampled_alone]
        for group in sampled_alone + ([together] if together else []):
            proposals.update(self._propose(group, group[0][0].generator
                                           if len(group) == 1 else None))
        return [proposals.get(r.request_id, Drafts([])) for r in requests]

    def _propose(self, active: list[tuple[Request, int]],
                 generator: torch.Generator | None) -> dict[str, Drafts]:
        contexts = [self.contexts[r.request_id] for r, _ in active]
        device = self.drafter.fc.weight.device
        features = [f for c in contexts for f, _ in c.pending]
        positions = [p for c in contexts for _, p in c.pending]
        width = self.drafter.config.num_target_features * self.drafter.config.hidden_size
        counts = [sum(f.shape[0] for f, _ in c.pending) for c in contexts]
        anchors = torch.tensor([r.token_ids(r.num_tokens - 1, r.num_tokens)[0]
                                for r, _ in active], device=device)
        anchor_positions = torch.tensor([r.num_tokens - 1 for r, _ in active], device=device)
        temperatures = [self._draft_temperature(r) for r, _ in active]
        proposal = self.drafter.propose(
            torch.cat(features).to(self.drafter.dtype) if features
            else torch.empty(0, width, dtype=self.drafter.dtype, device=device),
            torch.cat(positions) if positions
            else torch.empty(0, dtype=torch.long, device=device),
            counts, anchors, anchor_positions, [c.cache for c in contexts],
            torch.tensor(temperatures, device=device), generator)
        for context in contexts:
            context.pending.clear()
        tokens = proposal.tokens.tolist()
        confidence = proposal.confidence.tolist() if proposal.confidence is not None else None
        return {request.request_id: Drafts(
            tokens[index][:room],
            proposal.probs[index, :room] if temperatures[index] > 0 else None,
            confidence[index][:room] if confidence is not None else None)
            for index, (request, room) in enumerate(active)}

    def _draft_temperature(self, request: Request) -> float:
        """Greedy drafts unless `draft_sample_method` is probabilistic and the request samples
        (then the request's temperature: q is what the drafts are drawn from)."""
        params = request.params
        if self.config.draft_sample_method != "probabilistic" or params.greedy:
            return 0.0
        return params.temperature

    def retain(self, request_ids: set[str]) -> None:
        """Drop the contexts of requests no longer running (finished, aborted, preempted)."""
        for request_id in [i for i in self.contexts if i not in request_ids]:
            del self.contexts[request_id]


def make_proposer(config: SpeculativeConfig, model: EngineModel, args: EngineArgs,
                  device: torch.device, dtype: torch.dtype
                  ) -> NgramProposer | SuffixProposer | DrafterProposer:
    """The proposer of `config.method`. A drafter (its folder is `config.model`, or for
    `dspark` without one the target checkpoint's `drafter/`) borrows the target's embedding
    and LM head, and the target keeps the hidden states of the drafter's layers."""
    if config.method == "ngram":
        return NgramProposer(config)
    if config.method == "suffix":
        return SuffixProposer(config)
    folder = Path(config.model) if config.model else Path(args.model) / "drafter"
    if not (folder / "config.json").is_file():
        raise ValueError(f"speculative method {config.method!r} needs a drafter checkpoint: "
                         f"{folder} has none (set `speculative_config.model`)")
    drafter = load_drafter(folder, device, dtype).eval()
    drafter.config.check_target(model.config)
    if drafter.config.method != config.method:
        raise ValueError(f"the drafter in {folder} is a {drafter.config.method!r} drafter, "
                         f"not {config.method!r}")
    drafter.bind_target(model.model.embed_tokens, model.lm_head)
    layers = tuple(drafter.config.target_layer_ids)
    if list(layers) != sorted(set(layers)):
        raise ValueError(f"the drafter's target_layer_ids {list(layers)} must increase")
    model.capture_layers = layers
    return DrafterProposer(drafter, config)
