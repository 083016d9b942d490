"""muse: inference and serving for the Muse Spark model family."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineArgs"]


def __getattr__(name: str) -> Any:
    # Imported on first use so `muse info` and friends start without loading torch.
    if name == "LLM":
        from muse.llm import LLM

        return LLM
    if name == "SamplingParams":
        from muse.engine.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineArgs":
        from muse.engine.args import EngineArgs

        return EngineArgs
    raise AttributeError(f"module 'muse' has no attribute {name!r}")
