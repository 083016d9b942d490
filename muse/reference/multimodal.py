"""The reference Muse Spark model with its encoders: the decoder fed media embeddings.

`MuseSparkForConditionalGeneration` is the text reference decoder (`MuseForCausalLM`) plus
the vision and audio encoders of `muse.multimodal`, under the checkpoint's tensor names
(`model.*`, `lm_head.*`, `vision_tower.*`, `audio_tower.*`). Given media items, each with
the spans its placeholder tokens take in a row, it embeds the token ids, encodes all images
and videos in one packed vision pass and all clips in one packed audio pass, and writes each
item's encoder rows over its spans before the decoder runs. Everything is differentiable, so
training uses it; the engine's multimodal steps are tested against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from muse.config import MuseSparkConfig
from muse.multimodal.engine_inputs import MediaEncoders, encode_by_tower
from muse.reference.model import CausalLMOutput, MuseForCausalLM, initial_value

ENCODER_PREFIXES = ("vision_tower.", "audio_tower.")


@dataclass
class MediaInput:
    """One media item of a batch: its encoder input and where its tokens are.

    row: the batch row; spans: (start, length) of its placeholder tokens in that row, in
    encoder-output order (a video has one span per frame group). Spans may run past the end
    of the row (a row cut before the item ended): those positions are simply not written."""

    kind: str  # "image", "video" or "audio"
    data: torch.Tensor  # the processor's output: [C, H, W], [T, C, H, W] or [samples]
    spans: list[tuple[int, int]]
    row: int = 0


class MuseSparkForConditionalGeneration(MuseForCausalLM):
    """Decoder + LM head + vision / audio encoders (either may be absent)."""

    def __init__(self, config: MuseSparkConfig) -> None:
        super().__init__(config.text_config)
        self.model_config = config
        encoders = MediaEncoders(config)
        self.vision_tower = encoders.vision_tower
        self.audio_tower = encoders.audio_tower

    def init_weights(self, seed: int, std: float | None = None) -> None:
        """The decoder as `MuseForCausalLM.init_weights` draws it (the same values for the
        same seed); the encoders with PyTorch's default initialisation of their layers
        (LayerNorm at one and zero, linear layers uniform in +-1/sqrt(fan_in)), seeded."""
        std = self.config.initializer_range if std is None else std
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if not name.startswith(ENCODER_PREFIXES):
                    param.copy_(initial_value(name, param.shape, generator, std))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            for tower in (self.vision_tower, self.audio_tower):
                for module in tower.modules() if tower is not None else ():
                    if module is not tower and hasattr(module, "reset_parameters"):
                        module.reset_parameters()

    def encode_media(self, media: Sequence[MediaInput]) -> list[torch.Tensor]:
        """Each item's encoder output [tokens, text hidden], in the order given."""
        return encode_by_tower(self.vision_tower, self.audio_tower, media)

    def embed(self, input_ids: torch.Tensor, media: Sequence[MediaInput]) -> torch.Tensor:
        """[batch, length, hidden] token embeddings with every item's encoder rows at its
        spans (out of place, so gradients reach the encoders)."""
        embeds = self.model.embed_tokens(input_ids)
        if not media:
            return embeds
        length = input_ids.shape[1]
        rows, columns, values = [], [], []
        for item, encoded in zip(media, self.encode_media(media)):
            taken = 0
            for start, span_length in item.spans:
                end = min(start + span_length, length)
                if end > start:
                    columns.append(torch.arange(start, end))
                    rows.append(torch.full((end - start,), item.row))
                    values.append(encoded[taken:taken + end - start])
                taken += span_length
        if not values:
            return embeds
        index = (torch.cat(rows).to(embeds.device), torch.cat(columns).to(embeds.device))
        return embeds.index_put(index, torch.cat(values).to(embeds.dtype))

    def forward(self, input_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None,
                hidden_layers: Sequence[int] = (),
                media: Sequence[MediaInput] = ()) -> CausalLMOutput:
        if media:
            if inputs_embeds is not None:
                raise ValueError("give media with input_ids, not with inputs_embeds")
            inputs_embeds = self.embed(input_ids, media)
        return super().forward(input_ids, attention_mask, position_ids, inputs_embeds,
                               hidden_layers)
