"""Labelled examples for training the media encoders alone (`muse train encoders`).

The generated pictures, clips and speech know what they show, so each encoder output token
can be given a label of its own before any decoder reads it:

- an image token: the class of what covers its square (`vision_tasks.label_map`: the
  background, a (shape, colour) pair or a written digit / word);
- a video token: the same over the two frames of its frame group, and on the shape's tokens
  the direction the shape moves;
- a clip: what is said (a number 0-99 or a word) or, for a spoken sum, its two operands and
  its operation.

Pictures and clips are resized by the model's processor exactly as in decoder training
(`conversations.rescale_randomly`, then `preprocess_image` / `preprocess_video`), and a pixel
label map follows the same geometry (nearest-neighbour), so a token's label is read off the
square of pixels it encodes.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from muse.train.data import speech, vision_tasks
from muse.train.data.conversations import rescale_randomly
from muse.train.data.split import TRAIN

IGNORE = -100  # no label (torch's cross-entropy ignore_index)
# A token is labelled with the object covering the most of its square when that object
# covers at least this share of it (a thin stroke of text covers little).
MIN_COVER = 0.05
DIRECTIONS = tuple(sorted(vision_tasks.DIRECTIONS))
# Spoken words and numbers share one head: numbers 0..MAX_NUMBER, then speech.WORDS.
NUM_SPOKEN_CLASSES = speech.MAX_NUMBER + 1 + len(speech.WORDS)
OPERATORS = tuple(sorted(speech.SPOKEN_SUMS))
MAX_OPERAND = max(speech.ADD_SUB_MAX, speech.MUL_MAX)
_SUM = re.compile(r"(\d+)([-+*])(\d+)=")


# What a token shows, split in two so each part is learned from every token that has it:
# its object (0 background, then SHAPES, then the TEXTS) and, on a shape, its colour.
NUM_OBJECTS = 1 + len(vision_tasks.SHAPES) + len(vision_tasks.TEXTS)
NUM_COLOURS = len(vision_tasks.COLOURS)


@dataclass
class VisionExample:
    kind: str  # "image" or "video"
    pixels: torch.Tensor  # the processor's output
    what: np.ndarray  # int64 [tokens]: pixel classes (vision_tasks.label_map)
    motion: np.ndarray  # int64 [tokens]: a DIRECTIONS index on a moving shape, else IGNORE


def object_and_colour(what: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Pixel classes -> (object class, colour index or IGNORE)."""
    shapes = len(vision_tasks.SHAPES) * NUM_COLOURS
    is_shape = (what >= 1) & (what <= shapes)
    objects = np.where(is_shape, (what - 1) // NUM_COLOURS + 1,
                       np.where(what > shapes, what - shapes + len(vision_tasks.SHAPES), 0))
    colours = np.where(is_shape, (what - 1) % NUM_COLOURS, IGNORE)
    return objects, colours


@dataclass
class AudioExample:
    waveform: torch.Tensor  # the processor's output, float32 [samples]
    spoken: int  # a class of NUM_SPOKEN_CLASSES, or IGNORE for a sum
    operands: tuple[int, int, int]  # (a, OPERATORS index, b) of a sum, else IGNOREs


def token_labels(pixel_labels: np.ndarray, height: int, width: int, token_pixels: int
                 ) -> np.ndarray:
    """Per token of a picture processed to height x width (raster order of the tokens'
    `token_pixels`-wide squares): the non-background class covering most of its square
    when it covers at least MIN_COVER of it, else the background."""
    resized = np.asarray(Image.fromarray(pixel_labels).resize((width, height),
                                                              Image.Resampling.NEAREST))
    rows, columns = height // token_pixels, width // token_pixels
    squares = resized.reshape(rows, token_pixels, columns, token_pixels) \
        .transpose(0, 2, 1, 3).reshape(rows * columns, token_pixels ** 2).astype(np.int64)
    classes = int(resized.max()) + 1
    counts = np.bincount((squares + np.arange(len(squares))[:, None] * classes).ravel(),
                         minlength=len(squares) * classes).reshape(len(squares), classes)
    counts[:, vision_tasks.BACKGROUND_CLASS] = 0
    best = counts.argmax(axis=1)
    covered = counts[np.arange(len(squares)), best] >= MIN_COVER * token_pixels ** 2
    return np.where(covered, best, vision_tasks.BACKGROUND_CLASS)


def image_example(rng: random.Random, processor: Any) -> VisionExample:
    """A scene of 1-5 shapes (a written text in 30% of them) at a random size and aspect."""
    scene = vision_tasks.sample_scene(rng, TRAIN, rng.randint(1, 5), rng.random() < 0.3)
    pixels = processor.preprocess_image(rescale_randomly(vision_tasks.draw_scene(scene), rng))
    what = token_labels(vision_tasks.label_map(scene), pixels.shape[-2], pixels.shape[-1],
                        processor.factor)
    return VisionExample("image", pixels, what, np.full_like(what, IGNORE))


def video_example(rng: random.Random, processor: Any) -> VisionExample:
    """A moving-shape clip keeping 4, 6 or 8 of its frames, as in decoder training."""
    case = vision_tasks.sample_video_case(rng, TRAIN)
    keep = np.linspace(0, len(case.frames) - 1, rng.choice((4, 6, 8))).round().astype(np.int64)
    frames = case.frames[keep]
    pixels, _ = processor.preprocess_video((frames, np.arange(len(frames), dtype=np.float64)))
    temporal = processor.vision.temporal_patch_size
    assert len(pixels) == len(frames), "the processor keeps every frame of an even count <= 8"
    shape_class = vision_tasks.shape_class(case.shape, case.colour)
    what, motion = [], []
    for group in range(len(frames) // temporal):
        drawn = (frames[group * temporal:(group + 1) * temporal] != 255).any(axis=(0, -1))
        labels = token_labels(np.where(drawn, shape_class, 0).astype(np.uint8),
                              pixels.shape[-2], pixels.shape[-1], processor.factor)
        what.append(labels)
        motion.append(np.where(labels == shape_class, DIRECTIONS.index(case.direction), IGNORE))
    return VisionExample("video", pixels, np.concatenate(what), np.concatenate(motion))


def audio_example(rng: random.Random, pool: speech.SpeechPool, processor: Any) -> AudioExample:
    """A clip of the pool, augmented as in decoder training, with what it says."""
    case = pool.sample_case(rng)
    waveform = processor.preprocess_audio(case.audio)
    if case.kind == "arithmetic":
        a, operator, b = _SUM.search(case.reasoning).groups()
        return AudioExample(waveform, IGNORE, (int(a), OPERATORS.index(operator), int(b)))
    spoken = int(case.answer) if case.kind == "number" \
        else speech.MAX_NUMBER + 1 + speech.WORDS.index(case.answer)
    return AudioExample(waveform, spoken, (IGNORE, IGNORE, IGNORE))


class EncoderBatches(torch.utils.data.Dataset):
    """Map-style dataset whose item `step` is that step's whole batch, a pure function of
    (seed, step) like `mixture.TrainingBatches`."""

    def __init__(self, processor: Any, seed: int, images: int, videos: int, clips: int,
                 pool: speech.SpeechPool | None) -> None:
        self.processor = processor
        self.seed = seed
        self.images = images if processor.vision is not None else 0
        self.videos = videos if processor.vision is not None else 0
        self.clips = clips if pool is not None else 0
        self.pool = pool

    def __len__(self) -> int:
        return 2 ** 62

    def __getitem__(self, step: int) -> dict[str, Any]:
        rng = random.Random(f"encoders/{self.seed}/{step}")
        vision = [image_example(rng, self.processor) for _ in range(self.images)]
        vision += [video_example(rng, self.processor) for _ in range(self.videos)]
        audio = [audio_example(rng, self.pool, self.processor) for _ in range(self.clips)]
        batch: dict[str, Any] = {"vision": [example.pixels for example in vision],
                                 "vision_kinds": [example.kind for example in vision],
                                 "audio": [example.waveform for example in audio]}
        if vision:
            objects, colours = object_and_colour(np.concatenate([e.what for e in vision]))
            batch["object"], batch["colour"] = torch.from_numpy(objects), torch.from_numpy(colours)
            batch["motion"] = torch.from_numpy(np.concatenate([e.motion for e in vision]))
        if audio:
            batch["spoken"] = torch.tensor([example.spoken for example in audio])
            batch["operands"] = torch.tensor([example.operands for example in audio])
        return batch
