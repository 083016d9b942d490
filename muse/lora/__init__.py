"""LoRA adapters: PEFT-layout loading, per-slot weights beside the engine's layers, and the
adapters an engine serves (`LoRARequest` selects one per request)."""

from muse.lora.request import LoRARequest

__all__ = ["LoRARequest"]
