"""Who proposes each step's drafts: the n-gram lookup, or the block-diffusion drafter.

Both answer `propose(requests, rooms)` with, per request, up to `room` draft tokens and the
exact distribution q they were drawn from (None: one-hot), and see after each step the requests
whose tokens it committed (`observe`). The drafter reads its context rows from the draft KV
group, which the target's forward fills (`draft_kv.py`). A request's next block is anchored on
its last token, whose target hidden state is computed by the step that verifies the block.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from muse.engine.args import EngineArgs
from muse.engine.request import Request
from muse.engine.runner import LaunchedStep
from muse.engine.transfer import to_device
from muse.model.decoder import EngineModel
from muse.speculative.config import SpeculativeConfig
from muse.speculative.draft_graphs import DraftGraphs
from muse.speculative.draft_kv import DraftKV
from muse.speculative.drafter import DraftProposal, MuseDrafter, load_drafter
from muse.speculative.ngram import WINDOW, propose_ngram
from muse.speculative.sampling import uses_output_tokens
from muse.speculative.suffix import SuffixProposer

class Drafts(NamedTuple):
    """One request's drafts: the tokens, the distribution q they were drawn from (None:
    one-hot) and, from a drafter with a confidence head, each draft's predicted chance of
    being accepted given the ones before it."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    confidence: list[float] | None = None
    # (tensor [requests, G], row): drafts left on the device, `tokens` then placeholders.
    device: tuple[torch.Tensor, int] | None = None


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, requests: list[Request], rooms: list[int]) -> list[Drafts]:
        config = self.config
        return [Drafts(propose_ngram(r.token_ids(max(0, r.num_tokens - WINDOW), r.num_tokens),
                                     room, config.prompt_lookup_min, config.prompt_lookup_max))
                for r, room in zip(requests, rooms)]

    def observe(self, committed: list[Request]) -> None:
        """Nothing to learn from the target."""

    def retain(self, request_ids: set[str]) -> None:
        """Nothing kept per request."""


class DrafterProposer:
    """The drafter over every running request, reading its context rows from the draft KV
    group (`DraftKV`), which the engine allocates once it has sized its cache (`allocate`)."""

    def __init__(self, drafter: MuseDrafter, config: SpeculativeConfig) -> None:
        self.drafter = drafter
        self.config = config
        # Greedy drafts stay on the device, feeding the verify step's inputs there, unless
        # something on the host needs them first: the adaptive choice (the confidences) or a
        # penalty (the drafts count as output).
        self.drafts_on_device = (config.draft_sample_method == "greedy"
                                 and not config.enable_adaptive_verification)
        self.kv: DraftKV | None = None
        self.graphs: DraftGraphs | None = None
        self.block_tables: Callable[[Request], dict[str, list[int]]] | None = None
        # Drafts queued by `draft_ahead` for the next step: request id -> row, and the tensor.
        self.ahead: tuple[dict[str, int], torch.Tensor] | None = None
        self.steps_drafted_ahead = 0

    def allocate(self, model: EngineModel, num_blocks: dict[str, int], block_size: int,
                 block_tables: Callable[[Request], dict[str, list[int]]],
                 device: torch.device) -> DraftKV:
        """The draft KV group beside the target's cache; the target's forward fills it."""
        if DraftKV.kind not in num_blocks:
            raise ValueError("a drafter keeps its context rows in the pages of the target's "
                             "global-attention layers, and this model has none")
        self.kv = DraftKV(self.drafter, num_blocks[DraftKV.kind], block_size, device)
        self.block_tables = block_tables
        model.context_writer = self.kv.write
        return self.kv

    def draft_next(self, anchors: torch.Tensor, positions: torch.Tensor,
                   tables: dict[str, torch.Tensor]) -> torch.Tensor:
        """Greedy drafts [R, G] anchored at `anchors` / `positions` [R] over the step's block
        tables by kind: `draft_ahead`'s pass, for a verify graph to hold right after its
        verification (`DecodeGraphs(draft_next=...)`). Only fixed-shape tensor work."""
        return self.kv.draft_greedily(anchors, positions, tables[DraftKV.kind])

    def capture_graphs(self, max_batch: int, table_width: int, device: torch.device) -> None:
        self.graphs = DraftGraphs(self.kv, max_batch, table_width, device,
                                  greedy=self.config.draft_sample_method == "greedy")
        self.graphs.capture()

    def run_dummy(self, num_requests: int) -> None:
        """Draft for `num_requests` requests with empty contexts, as a step would (through
        the graphs where captured): what the step-cost profile times."""
        anchors, tables = [0] * num_requests, [[0]] * num_requests
        if self.graphs is not None and self.graphs.covers(num_requests, 1):
            self.graphs.replay(self.graphs.prepare(anchors, anchors, tables,
                                                   [0.0] * num_requests), num_requests)
            return
        device = self.kv.pools[0][0].device
        self.kv.propose(to_device(anchors, device), to_device(anchors, device),
                        to_device(tables, device), None)

    def observe(self, committed: list[Request]) -> None:
        """Nothing to learn: the target's forward wrote the context rows."""

    def retain(self, request_ids: set[str]) -> None:
        """Nothing kept per request."""

    def propose(self, requests: list[Request], rooms: list[int]) -> list[Drafts]:
        ahead, self.ahead = self.ahead, None
        active = [(r, room) for r, room in zip(requests, rooms) if room > 0]
        if ahead is not None and all(r.request_id in ahead[0] for r, _ in active):
            rows, tokens = ahead
            self.steps_drafted_ahead += 1
            return [Drafts([0] * min(room, tokens.shape[1]), device=(tokens, rows[r.request_id]))
                    if room > 0 else Drafts([]) for r, room in zip(requests, rooms)]
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

    def draft_ahead(self, step: LaunchedStep) -> None:
        """Queue the next step's drafts behind this step's verification, before the host reads
        it back. Each request's next anchor is the token its verification emits last, one
        position past its accepted drafts: both known only on the device, and enough for the
        drafter, whose context rows the verify pass has just written. The drafter's device
        time then overlaps the host's reading and bookkeeping of the step, and `propose` finds
        the next step's drafts made. Only where drafts stay on the device (greedy drafts that
        nothing on the host reads); a request that left or changed course since simply
        drafts again."""
        self.ahead = None
        verified, requests = step.verified, step.sampled
        if (not self.drafts_on_device or verified is None
                or any(r.grammar is not None or uses_output_tokens(r.params) for r in requests)):
            return
        rows = {r.request_id: row for row, r in enumerate(requests)}
        if verified.next_drafts is not None:  # the verify graph drafted them already
            self.ahead = (rows, verified.next_drafts)
            return
        device = verified.accepted.device
        # The blocks of every row the verify pass wrote: the next anchor is at most one past.
        tables = [self.block_tables(r)[DraftKV.kind][:-(-(position + len(drafts) + 1)
                                                       // self.kv.block_size)]
                  for r, position, drafts in zip(requests, step.draft_anchors, step.drafts)]
        positions = to_device(step.draft_anchors, device) + verified.accepted + 1
        anchors = verified.outputs.gather(1, verified.accepted[:, None]).squeeze(1)
        proposal = self._draft(anchors, positions, tables, [0.0] * len(requests), None)
        self.ahead = (rows, proposal.tokens)

    def _propose(self, active: list[tuple[Request, int]],
                 generator: torch.Generator | None) -> dict[str, Drafts]:
        anchors = [r.token_ids(r.num_tokens - 1, r.num_tokens)[0] for r, _ in active]
        positions = [r.num_tokens - 1 for r, _ in active]
        # The blocks holding each request's context rows: those before its anchor.
        tables = [self.block_tables(r)[DraftKV.kind][:max(1, -(-position // self.kv.block_size))]
                  for (r, _), position in zip(active, positions)]
        temperatures = [self._draft_temperature(r) for r, _ in active]
        proposal = self._draft(anchors, positions, tables, temperatures, generator)
        if self.drafts_on_device and not any(uses_output_tokens(r.params) for r, _ in active):
            return {request.request_id: Drafts([0] * min(room, proposal.tokens.shape[1]),
                                               device=(proposal.tokens, index))
                    for index, (request, room) in enumerate(active)}
        tokens = proposal.tokens.tolist()
        confidence = proposal.confidence.tolist() if proposal.confidence is not None else None
        return {request.request_id: Drafts(
            tokens[index][:room],
            proposal.probs[index, :room].clone() if temperatures[index] > 0 else None,
            confidence[index][:room] if confidence is not None else None)
            for index, (request, room) in enumerate(active)}

    def _draft(self, anchors: list[int] | torch.Tensor, positions: list[int] | torch.Tensor,
               tables: list[list[int]], temperatures: list[float],
               generator: torch.Generator | None) -> DraftProposal:
        """One block per request (anchor tokens and positions on the host or the device),
        through the draft graphs where they cover the batch."""
        width = max(len(table) for table in tables)
        if (generator is None and self.graphs is not None
                and self.graphs.covers(len(tables), width)):
            size = self.graphs.prepare(anchors, positions, tables, temperatures)
            return self.graphs.replay(size, len(tables))
        device = self.kv.pools[0][0].device
        return self.kv.propose(
            _on_device(anchors, device), _on_device(positions, device),
            to_device([t + [0] * (width - len(t)) for t in tables], device),
            to_device(temperatures, device, torch.float32) if any(temperatures) else None,
            generator)

    def _draft_temperature(self, request: Request) -> float:
        """Greedy drafts unless `draft_sample_method` is probabilistic and the request samples
        (then the request's temperature: q is what the drafts are drawn from)."""
        params = request.params
        if self.config.draft_sample_method != "probabilistic" or params.greedy:
            return 0.0
        return params.temperature


def _on_device(values: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    return values if isinstance(values, torch.Tensor) else to_device(values, device)


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
    model.capture_layers = layers  # their outputs feed `DrafterProposer.allocate`'s writer
    return DrafterProposer(drafter, config)
