"""The rollout engine of a GRPO run: a muse engine serving the adapter versions the trainer
hands over in memory, each rollout checked to have run with the version just handed over."""

from __future__ import annotations

from typing import Any

import torch

from muse.engine.sampling_params import SamplingParams
from muse.lora.request import LoRARequest
from muse.rl.rollout import Trajectory, rollout
from muse.rl.trainer_options import GRPOTrainArgs
from muse.rl.world import resolve_dtype

ADAPTER_NAME = "policy"


class RolloutWorker:
    """The muse engine with the adapter versions the trainer hands over."""

    def __init__(self, args: GRPOTrainArgs, device: torch.device) -> None:
        from muse.llm import LLM

        self.args = args
        engine_args: dict[str, Any] = {}
        if device.type == "cuda":
            engine_args["gpu_memory_utilization"] = args.gpu_memory_utilization
        self.llm = LLM(args.model, device=str(device), dtype=str(resolve_dtype(
            args.dtype, device)).removeprefix("torch."), seed=args.seed, init_std=args.init_std,
            enable_lora=True, max_loras=1, max_lora_rank=args.lora_rank, **engine_args)
        self.version = 0

    def sync(self, config: dict[str, Any], tensors: dict[str, torch.Tensor], version: int
             ) -> None:
        """Serve `tensors` as the adapter's `version` from the next request on."""
        self.llm.add_lora(LoRARequest(ADAPTER_NAME, version, config=config, tensors=tensors))
        self.version = version

    def rollout(self, tasks: list[dict[str, Any]], group_size: int, seed: int,
                temperature: float) -> list[list[Trajectory]]:
        """`group_size` trajectories per task with the current adapter version (checked)."""
        params = SamplingParams(temperature=temperature, max_tokens=self.args.max_tokens,
                                seed=seed, logprobs=0)
        groups = rollout(self.llm, tasks, params, group_size=group_size,
                         lora_request=LoRARequest(ADAPTER_NAME, self.version),
                         max_turns=self.args.max_turns,
                         max_total_tokens=self.args.max_total_tokens)
        stale = [t.lora_version for group in groups for t in group
                 if t.lora_version != self.version]
        if stale:
            raise RuntimeError(f"a rollout ran with adapter version {stale[0]!r}; the trainer "
                               f"handed over version {self.version}")
        return groups
