"""Calibration: the largest activation each quantized projection sees on a set of prompts,
from which `muse quantize` writes static activation scales (NVFP4 W4A4's global input scale,
FP8's `input_scale`).

The prompts run one at a time through the reference decoder (`muse.reference`, float32, on the
CPU) loaded from the source checkpoint. Forward pre-hooks on its linears record each one's
input amax under the checkpoint's module name (`model.layers.3.self_attn.q_proj`); the routed
experts record, per expert, the tokens routed to it: the input of `experts.{e}.gate_proj` and
`up_proj`, and the SwiGLU output that enters `experts.{e}.down_proj`. An expert that no
calibration token reached takes the largest amax of the same projection among its layer's
other experts (a scale that covers what the layer's experts saw).

Prompt files (`--calibration-prompts FILE`):

- a `.jsonl` file: one JSON object per line, with `"messages"` (a chat conversation, rendered
  with the checkpoint's chat template; a generation prompt is added unless the last message is
  the assistant's), `"prompt"` (text, tokenized as it is after `<|bos|>`) or `"token_ids"`
  (a list of token ids, for checkpoints without a tokenizer);
- any other file: plain text, one prompt per non-empty line, each a user message rendered with
  the chat template and a generation prompt (what the model sees when it is served).

Without a file the prompts shipped in `muse/assets/calibration_prompts.txt` are used (a few
dozen varied lines: arithmetic, code, tool requests, prose, other languages).
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from muse.checkpoint.layout import CheckpointError
from muse.checkpoint.loading import load_reference_model
from muse.reference.layers import Experts

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "assets" / "calibration_prompts.txt"
_EXPERT_MODULE = re.compile(r"^(?P<owner>.+\.experts)\.(?P<expert>\d+)\.(?P<projection>\w+)$")


def read_prompts(path: str | Path | None, source: str | Path,
                 max_length: int | None = None) -> list[list[int]]:
    """The calibration prompts of `path` (None: the shipped ones) as token ids, each cut to
    `max_length` tokens; texts are tokenized with the tokenizer of the checkpoint `source`."""
    path = Path(path) if path is not None else DEFAULT_PROMPTS
    if not path.is_file():
        raise FileNotFoundError(f"calibration prompts file {path} does not exist")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    tokenizer = None

    def get_tokenizer():
        nonlocal tokenizer
        if tokenizer is None:
            if not (Path(source) / "tokenizer.json").is_file():
                raise ValueError(f"{source} has no tokenizer.json to tokenize the calibration "
                                 f"prompts of {path}; give a .jsonl file of "
                                 '{"token_ids": [...]} lines')
            from muse.tokenizer import MuseTokenizer
            tokenizer = MuseTokenizer.from_pretrained(source)
        return tokenizer

    prompts = []
    for number, line in enumerate(lines, 1):
        if path.suffix != ".jsonl":
            ids = get_tokenizer().apply_chat_template(
                [{"role": "user", "content": line.strip()}], add_generation_prompt=True,
                tokenize=True)
        else:
            ids = _jsonl_prompt(line, get_tokenizer, f"{path}:{number}")
        if ids:
            prompts.append(list(ids)[:max_length] if max_length else list(ids))
    if not prompts:
        raise ValueError(f"{path} holds no calibration prompts")
    return prompts


def _jsonl_prompt(line: str, get_tokenizer, where: str) -> list[int]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not a JSON object: {error}") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: each line must be a JSON object")
    if "token_ids" in record:
        ids = record["token_ids"]
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ValueError(f"{where}: token_ids must be a list of integers")
        return ids
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: messages must be a non-empty list of chat messages")
        return get_tokenizer().apply_chat_template(
            messages, add_generation_prompt=messages[-1].get("role") != "assistant",
            tokenize=True)
    if "prompt" in record:
        return get_tokenizer().encode(str(record["prompt"]), add_special_tokens=True)
    raise ValueError(f'{where}: a calibration line needs "messages", "prompt" or "token_ids"')


class ActivationRecorder:
    """Running amax of the inputs of named projections."""

    def __init__(self) -> None:
        self.amax: dict[str, float] = {}

    def record(self, name: str, x: torch.Tensor) -> None:
        if x.numel():
            seen = x.detach().abs().amax().float().item()
            self.amax[name] = max(self.amax.get(name, 0.0), seen)

    def observe(self, model: nn.Module) -> list:
        """Hook every linear and every routed-experts module of the reference `model`."""
        handles = []
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                handles.append(module.register_forward_pre_hook(
                    lambda module, args, name=name: self.record(name, args[0])))
            elif isinstance(module, Experts):
                self._observe_experts(name, module)
        return handles

    def _observe_experts(self, name: str, experts: Experts) -> None:
        """Wrap `experts.expert_forward` (one expert on its routed tokens): the SwiGLU
        between its two projections is recomputed here to see what enters down_proj."""
        original = experts.expert_forward
        inter = experts.intermediate

        def expert_forward(expert: int, x: torch.Tensor) -> torch.Tensor:
            self.record(f"{name}.{expert}.gate_proj", x)
            self.record(f"{name}.{expert}.up_proj", x)
            gate_up = x @ experts.gate_up_proj[expert].t()
            hidden = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
            self.record(f"{name}.{expert}.down_proj", hidden)
            return original(expert, x)

        experts.expert_forward = expert_forward

    def lookup(self, modules: Iterable[str]) -> dict[str, float]:
        """The amax of each of `modules`; experts that no token reached take the largest of
        their layer's experts for the same projection."""
        out = {}
        for module in modules:
            if module in self.amax:
                out[module] = self.amax[module]
                continue
            match = _EXPERT_MODULE.match(module)
            if match is not None:
                pattern = re.compile(re.escape(match["owner"]) + r"\.\d+\."
                                     + re.escape(match["projection"]) + "$")
                seen = [amax for name, amax in self.amax.items() if pattern.match(name)]
                if seen:
                    out[module] = max(seen)
                    continue
            raise CheckpointError(f"calibration saw no input of `{module}`: the reference "
                                  "model has no such projection, or no prompt reached it")
        return out


@torch.no_grad()
def calibrate(source: str | Path, modules: Iterable[str], prompts: str | Path | None = None,
              progress: bool = True) -> dict[str, float]:
    """The input amax of each projection in `modules` (checkpoint module names) over the
    calibration prompts (a file, or None for the shipped ones), through the reference model
    of the checkpoint `source` in float32."""
    model = load_reference_model(source, dtype=torch.float32, device="cpu")
    ids = read_prompts(prompts, source, model.config.max_position_embeddings)
    recorder = ActivationRecorder()
    handles = recorder.observe(model)
    try:
        for prompt in tqdm(ids, desc="calibration", unit="prompt", disable=not progress,
                           file=sys.stderr):
            model(torch.tensor([prompt]))
    finally:
        for handle in handles:
            handle.remove()
    return recorder.lookup(modules)
