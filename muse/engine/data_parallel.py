"""Data parallelism: several schedulers, one step.

Each data-parallel rank schedules its own requests against its own KV cache (its queue, block
manager and requests are an `EngineCore` replica here; its model replica and KV tensors live
in its worker processes). A request goes to the rank with the fewest unfinished requests and
stays there. The ranks step together: every step carries each rank's batch (or nothing), so
that with `enable_expert_parallel` their MoE layers, which gather every rank's tokens, meet;
an idle rank then runs a one-token dummy batch. The scheduling of all ranks runs in this one
process, beside the driver of rank 0; the forward passes run on every rank at once.
"""

from __future__ import annotations

from typing import Any

import torch

from muse.engine.args import EngineArgs
from muse.engine.engine import GRAMMAR_WAIT_S, EngineCore
from muse.engine.executor import MultiprocExecutor
from muse.engine.request import Request
from muse.engine.sampling_params import InvalidRequestError, SamplingParams
from muse.multimodal.encoder_workers import check_encoders, close_encoders


class DataParallelEngine:
    """The `EngineCore` interface over `data_parallel_size` ranks."""

    def __init__(self, args: EngineArgs) -> None:
        first = EngineCore(args)
        self.replicas = [first] + [first.data_parallel_replica()
                                   for _ in range(args.data_parallel_size - 1)]
        assert isinstance(first.executor, MultiprocExecutor)
        self.executor = first.executor
        self.owner: dict[str, EngineCore] = {}  # request (group) id -> its rank's replica
        # What every rank shares.
        self.args, self.config, self.model_config = first.args, first.config, first.model_config
        self.tokenizer, self.eos_token_ids = first.tokenizer, first.eos_token_ids
        self.max_model_len = first.max_model_len
        self.device = first.device  # rank 0's, where this process's replica runs

    @property
    def requests(self) -> dict[str, list[Request]]:
        return {group: samples for replica in self.replicas
                for group, samples in replica.requests.items()}

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams,
                    multi_modal_data: dict[str, Any] | None = None,
                    cache_salt: str | None = None,
                    kv_transfer_params: dict[str, Any] | None = None,
                    lora_request: Any = None) -> list[Request]:
        if request_id in self.owner:
            raise InvalidRequestError(f"request id {request_id!r} is already in use",
                                      param="request_id")
        replica = min(self.replicas, key=lambda r: len(r.requests))
        samples = replica.add_request(request_id, prompt_token_ids, params, multi_modal_data,
                                      cache_salt, kv_transfer_params, lora_request)
        self.owner[request_id] = replica
        return samples

    def abort(self, request_id: str) -> None:
        replica = self.owner.pop(request_id, None)
        if replica is not None:
            replica.abort(request_id)

    def finish_request(self, request: Request, reason: str,
                       num_output_tokens: int | None = None) -> None:
        self.owner[request.group_id].finish_request(request, reason, num_output_tokens)
        self._forget_finished([request])

    def has_unfinished(self) -> bool:
        return any(replica.has_unfinished() for replica in self.replicas)

    def reset_prefix_cache(self) -> None:
        for replica in self.replicas:
            replica.reset_prefix_cache()

    # LoRA runs on one rank so far (`EngineArgs` refuses it with data parallelism): the first
    # replica answers as an engine without adapters does.
    def add_lora(self, lora_request: Any) -> Any:
        return self.replicas[0].add_lora(lora_request)

    def remove_lora(self, lora_name: str) -> None:
        self.replicas[0].remove_lora(lora_name)

    def list_loras(self) -> list:
        return []

    def expand_media_prompt(self, prompt_token_ids: list[int],
                            multi_modal_data: dict[str, Any]) -> list[int]:
        return self.replicas[0].expand_media_prompt(prompt_token_ids, multi_modal_data)

    def serve_kv_pulls(self) -> None:
        for replica in self.replicas:
            replica.serve_kv_pulls()

    def step(self) -> list[Request]:
        """One step of every rank with work; returns the requests that changed."""
        plans = [replica.plan_step() for replica in self.replicas]
        changed = [request for failed, _ in plans for request in failed]
        prepared = [plan for _, plan in plans]
        if all(plan is None for plan in prepared):
            waiting = next((r for r in self.replicas if r.grammar_waiting), None)
            if waiting is not None and not changed:
                waiting.grammar_jobs.wait(GRAMMAR_WAIT_S)
        else:
            logits = self.executor.execute_data_parallel(
                [plan.batch if plan is not None else None for plan in prepared],
                [plan.delta if plan is not None else None for plan in prepared],
                [plan.logits_rows if plan is not None else [] for plan in prepared])
            for replica, plan, rows in zip(self.replicas, prepared, logits):
                if plan is not None:
                    changed += replica.finish_step(plan, _logits(rows))
        self._forget_finished(changed)
        return changed

    def _forget_finished(self, changed: list[Request]) -> None:
        for request in changed:
            owner = self.owner.get(request.group_id)
            if owner is not None and request.group_id not in owner.requests:
                del self.owner[request.group_id]

    def check_health(self) -> None:
        self.executor.check_health()
        check_encoders(self.replicas[0].encoders)

    def shutdown(self) -> None:
        try:
            self.executor.shutdown()
        finally:
            close_encoders(self.replicas[0].encoders)


def _logits(rows: torch.Tensor | None) -> torch.Tensor:
    # A rank that ran but needs no logits (prefill chunks without prompt logprobs) gets none.
    return rows if rows is not None else torch.empty(0, 0)


Engine = EngineCore | DataParallelEngine


def make_engine(args: EngineArgs) -> Engine:
    """The engine for these arguments: one scheduler, or one per data-parallel rank."""
    if args.data_parallel_size > 1:
        return DataParallelEngine(args)
    return EngineCore(args)
