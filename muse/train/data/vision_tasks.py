"""Questions about synthetic pictures and clips drawn with Pillow, with short text answers.

An image is a white square split into a 3x3 grid; one to five shapes (circle, square,
triangle, star, diamond, hexagon) in named colours sit in distinct cells, and a digit or a
short word may be written in black in a free cell. Shapes are filled without antialiasing, so
every shape pixel has its palette colour exactly and the answers can be checked from the
pixels. No two shapes share both colour and kind, so "the red circle" names one shape.

Image questions ask for the colour or kind of a lone shape, the number of shapes, where a
shape is, or what is written. Video questions ask which way a single shape moves (left,
right, up, down), which shape it is, or its colour; frames are uint8 arrays [T, H, W, 3].

The reasoning describes what is seen (the shapes in reading order, then their count and any
text; or the moving shape), then restates what the question asks, so the answer is read
off the description right after the question has been recognised.

The user turn is a content-part list with an `{"type": "image"}` (or `"video"`) placeholder,
which the chat template renders and HF processors accept; the pixels travel beside it.
Phrasings and written words are split by `split.split_items`, so held-out cases are asked in
phrasings training never used; training also asks in phrasings composed from parts
(`question_parts`), none close to a held-out one.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from muse.train.data.question_parts import composed_questions
from muse.train.data.split import HELD_OUT, TRAIN, split_items

IMAGE_SIZE = 224
VIDEO_SIZE = 96
VIDEO_FRAMES = 8
BACKGROUND = (255, 255, 255)
TEXT_COLOUR = (0, 0, 0)
# No neutral colour, so the greys of antialiased black text never match a shape's colour.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30), "green": (30, 160, 60), "blue": (30, 70, 220),
    "yellow": (240, 210, 30), "orange": (245, 140, 20), "purple": (140, 50, 190),
    "pink": (240, 120, 180), "brown": (130, 80, 40),
}
# Other shades a user's picture gives each colour's name: Pillow's (CSS) named colours of that
# name and its near relatives ("pink" is (255, 192, 203), "brown" (165, 42, 42)). A model
# that saw only the palette above read Pillow's brown as red and misread the shape of
# anything in its light pink. Training fills half its shapes with one of these, a little
# jittered (SHADE_SHARE, SHADE_JITTER); held-out pictures keep the palette, so figures stay
# comparable.
COLOUR_SHADES: dict[str, tuple[tuple[int, int, int], ...]] = {
    "red": ((255, 0, 0), (220, 20, 60), (200, 16, 16), (238, 44, 44)),
    "green": ((0, 128, 0), (0, 255, 0), (34, 139, 34), (50, 205, 50), (46, 139, 87),
              (0, 100, 0)),
    "blue": ((0, 0, 255), (65, 105, 225), (0, 0, 205), (30, 144, 255), (0, 0, 139)),
    "yellow": ((255, 255, 0), (255, 215, 0), (250, 250, 110)),
    "orange": ((255, 165, 0), (255, 140, 0), (255, 117, 24)),
    "purple": ((128, 0, 128), (102, 51, 153), (148, 0, 211), (138, 43, 226), (147, 112, 219)),
    "pink": ((255, 192, 203), (255, 105, 180), (255, 182, 193), (255, 20, 147),
             (219, 112, 147)),
    "brown": ((165, 42, 42), (139, 69, 19), (160, 82, 45), (101, 67, 33), (150, 75, 0)),
}
SHADE_SHARE = 0.5
SHADE_JITTER = 12
SHAPES = ("circle", "square", "triangle", "star", "diamond", "hexagon")
# Grid cells by (row, column).
POSITIONS = {(0, 0): "top left", (0, 1): "top", (0, 2): "top right",
             (1, 0): "left", (1, 1): "center", (1, 2): "right",
             (2, 0): "bottom left", (2, 1): "bottom", (2, 2): "bottom right"}
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
WORDS = ("cat", "sun", "box", "tree", "fish", "moon", "bird", "lamp", "door", "key", "cup",
         "hat", "ship", "rain", "milk", "frog", "star", "gold", "wind", "road")
IMAGE_KINDS = ("colour", "shape", "count", "position", "read")
VIDEO_KINDS = ("direction", "shape", "colour")

IMAGE_QUESTIONS: dict[str, tuple[str, ...]] = {
    "colour": (
        "What colour is the shape?", "What color is the shape in the picture?",
        "Which colour is the shape?", "Name the colour of the shape.",
        "What is the colour of the object?", "Tell me the shape's colour.",
        "The shape is what color?", "What color is the object in this image?",
        "Give the colour of the shape.", "In what colour is the shape drawn?",
        "Which color has the shape?", "Say the colour of the only shape."),
    "shape": (
        "What shape is in the image?", "Which shape is drawn?", "Name the shape.",
        "What kind of shape is this?", "What shape do you see?",
        "Tell me which shape is in the picture.", "Identify the shape.",
        "Which geometric shape appears here?", "What is the shape in this picture?",
        "What shape is shown?", "Say what shape is drawn.", "The picture shows which shape?"),
    "count": (
        "How many shapes are there?", "How many shapes are in the image?",
        "Count the shapes.", "What is the number of shapes?",
        "How many shapes do you see?", "Count the shapes in the picture.",
        "How many objects are drawn?", "Give the number of shapes shown.",
        "Tell me how many shapes there are.", "How many shapes does the picture contain?",
        "What's the shape count?", "Number of shapes in this image?"),
    "position": (
        "Where is the {colour} {shape}?", "Where is the {colour} {shape} in the image?",
        "In which part of the picture is the {colour} {shape}?",
        "Where can you see the {colour} {shape}?", "Locate the {colour} {shape}.",
        "What is the position of the {colour} {shape}?",
        "Tell me where the {colour} {shape} is.", "Which region holds the {colour} {shape}?",
        "Where was the {colour} {shape} drawn?", "Find the {colour} {shape}: where is it?",
        "Say where the {colour} {shape} sits.", "Where in the image is the {colour} {shape}?"),
    "read": (
        "What is written in the image?", "Read the text in the picture.",
        "What does the text say?", "Which word or number is written here?",
        "Read what is written.", "What text appears in the image?",
        "Tell me what is written in the picture.", "What is the written text?",
        "What do the letters or digits say?", "Transcribe the text in the image.",
        "What word or digit is shown?", "Say what the image has written on it."),
}
# What each kind of question asks, restated at the end of the reasoning right before the
# answer: the answer is then read off the description just above, and a question phrased
# in a way training never showed only has to be recognised as one of these.
IMAGE_TOPICS = {"colour": "for the colour of the shape", "shape": "which shape it is",
                "count": "how many shapes there are",
                "position": "where the {colour} {shape} is", "read": "what is written"}
VIDEO_TOPICS = {"direction": "which way the shape moves", "shape": "which shape moves",
                "colour": "for the colour of the moving shape"}
VIDEO_QUESTIONS: dict[str, tuple[str, ...]] = {
    "direction": (
        "Which way does the shape move?", "In which direction is the shape moving?",
        "Does the shape move left, right, up or down?", "Where is the shape going?",
        "What direction does the object travel?", "Which direction does it move in?",
        "Tell me the direction of motion.", "How does the shape move: left, right, up or down?",
        "Which way is the object moving?", "Name the direction the shape moves.",
        "In what direction does the shape go?", "Say which way the shape travels."),
    "shape": (
        "Which shape appears in the video?", "What shape is moving?",
        "What kind of shape is in the clip?", "Name the shape in the video.",
        "Which shape do you see moving?", "What shape is shown in this video?",
        "Identify the moving shape.", "Tell me which shape moves.",
        "What is the shape in the clip?", "Which geometric shape is in the video?",
        "What shape travels across the frames?", "Say what shape appears."),
    "colour": (
        "What colour is the moving shape?", "What color is the shape in the video?",
        "Which colour is the object in the clip?", "Name the colour of the moving shape.",
        "Tell me the colour of the shape that moves.", "What is the shape's color?",
        "In what colour is the moving object drawn?", "Which color moves across the video?",
        "Give the colour of the shape in the clip.", "What colour does the moving shape have?",
        "Say the colour of the object in the video.", "The moving shape is what colour?"),
}


@dataclass(frozen=True)
class Shape:
    kind: str  # one of SHAPES
    colour: str  # a key of COLOURS
    cell: tuple[int, int]  # (row, column) in the 3x3 grid
    center: tuple[int, int]  # (x, y) in pixels
    radius: int
    fill: tuple[int, int, int] | None = None  # a shade of `colour`; None: its palette value

    @property
    def position(self) -> str:
        return POSITIONS[self.cell]

    @property
    def rgb(self) -> tuple[int, int, int]:
        return self.fill or COLOURS[self.colour]


@dataclass(frozen=True)
class Scene:
    shapes: tuple[Shape, ...]
    text: str | None = None  # a digit or a word, written in black
    text_cell: tuple[int, int] | None = None
    size: int = IMAGE_SIZE


@dataclass
class ImageCase:
    kind: str  # one of IMAGE_KINDS
    question: str
    answer: str
    scene: Scene
    image: Image.Image
    target: Shape  # the shape a colour, shape or position question is about

    def messages(self) -> list[dict[str, Any]]:
        topic = IMAGE_TOPICS[self.kind].format(colour=self.target.colour,
                                               shape=self.target.kind)
        reasoning = f"{describe(self.scene)} {_asks(topic)}"
        return _messages("image", self.question, reasoning, self.answer)


@dataclass
class VideoCase:
    kind: str  # one of VIDEO_KINDS
    question: str
    answer: str
    shape: str
    colour: str
    direction: str  # a key of DIRECTIONS
    frames: np.ndarray = field(compare=False)  # uint8 [T, H, W, 3]

    def messages(self) -> list[dict[str, Any]]:
        reasoning = (f"{_a(self.colour).capitalize()} {self.shape} moves {self.direction}. "
                     f"{_asks(VIDEO_TOPICS[self.kind])}")
        return _messages("video", self.question, reasoning, self.answer)


def _messages(media: str, question: str, reasoning: str, answer: str) -> list[dict[str, Any]]:
    """A user turn with the media and the question (the media alone when it is empty), and
    the answer."""
    text = [{"type": "text", "text": question}] if question else []
    return [{"role": "user", "content": [{"type": media}, *text]},
            {"role": "assistant", "reasoning_content": reasoning, "content": answer}]


def _asks(topic: str) -> str:
    return f"The question asks {topic}."


def _a(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def _where(position: str) -> str:
    if position == "center":
        return "in the center"
    if position in ("left", "right"):
        return f"on the {position}"
    return f"at the {position}"


def describe(scene: Scene) -> str:
    """The reasoning of an image answer: the shapes numbered in reading order with where
    each is, then how many that makes, then any text. Counting while listing, rather than
    saying the count first, gives a small model a count it can read off its own list."""
    shapes = sorted(scene.shapes, key=lambda shape: (shape.cell, shape.center[::-1]))
    text = " ".join(f"Shape {index} is {_a(shape.colour)} {shape.kind} {_where(shape.position)}."
                    for index, shape in enumerate(shapes, 1))
    text += f" That is {len(shapes)} shape{'s' if len(shapes) > 1 else ''}."
    if scene.text is not None and scene.text_cell is not None:
        text += f' "{scene.text}" is written {_where(POSITIONS[scene.text_cell])}.'
    return text


def _outline(kind: str, center: tuple[float, float], radius: float) -> list[tuple[float, float]]:
    """The polygon of a shape other than a circle."""
    x, y = center
    if kind == "square":
        half = radius * 0.85
        return [(x - half, y - half), (x + half, y - half), (x + half, y + half),
                (x - half, y + half)]
    corners = {"triangle": 3, "diamond": 4, "hexagon": 6, "star": 10}[kind]
    points = []
    for index in range(corners):
        angle = -math.pi / 2 + 2 * math.pi * index / corners
        reach = radius * 0.45 if kind == "star" and index % 2 else radius
        points.append((x + reach * math.cos(angle), y + reach * math.sin(angle)))
    return points


def draw_shape(draw: ImageDraw.ImageDraw, kind: str, fill: tuple[int, int, int] | int | str,
               center: tuple[float, float], radius: float) -> None:
    if kind == "circle":
        x, y = center
        draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=fill)
    else:
        draw.polygon(_outline(kind, center, radius), fill=fill)


@functools.cache
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def _draw_text(draw: ImageDraw.ImageDraw, scene: Scene, fill: tuple[int, int, int] | int
               ) -> None:
    if scene.text is None or scene.text_cell is None:
        return
    cell = scene.size / 3
    row, column = scene.text_cell
    center = ((column + 0.5) * cell, (row + 0.5) * cell)
    size = int(cell * (0.55 if scene.text.isdigit() else 0.32))
    draw.text(center, scene.text, fill=fill, font=_font(size), anchor="mm")


def draw_scene(scene: Scene) -> Image.Image:
    image = Image.new("RGB", (scene.size, scene.size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for shape in scene.shapes:
        draw_shape(draw, shape.kind, shape.rgb, shape.center, shape.radius)
    _draw_text(draw, scene, TEXT_COLOUR)
    return image


# Classes of a scene's pixels (`label_map`), for training the vision encoder on what each
# part of a picture shows: 0 the background, then each (shape, colour) pair, then each text
# (the digits, then WORDS).
BACKGROUND_CLASS = 0
TEXTS = tuple(str(digit) for digit in range(10)) + WORDS
NUM_PIXEL_CLASSES = 1 + len(SHAPES) * len(COLOURS) + len(TEXTS)


def shape_class(kind: str, colour: str) -> int:
    return 1 + SHAPES.index(kind) * len(COLOURS) + list(COLOURS).index(colour)


def text_class(text: str) -> int:
    return 1 + len(SHAPES) * len(COLOURS) + TEXTS.index(text)


def label_map(scene: Scene) -> np.ndarray:
    """uint8 [size, size]: the class of each pixel of `draw_scene(scene)` (shapes cover the
    same pixels; text, antialiased there, counts where it is drawn on a 1-bit image)."""
    labels = Image.new("L", (scene.size, scene.size), BACKGROUND_CLASS)
    draw = ImageDraw.Draw(labels)
    for shape in scene.shapes:
        draw_shape(draw, shape.kind, shape_class(shape.kind, shape.colour), shape.center,
                   shape.radius)
    result = np.asarray(labels).copy()
    if scene.text is not None:
        mask = Image.new("1", (scene.size, scene.size), 0)
        _draw_text(ImageDraw.Draw(mask), scene, 1)
        result[np.asarray(mask)] = text_class(scene.text)
    return result


# Share of training pictures of one shape (and no text) where the shape is drawn larger than
# a grid cell, up to LARGE_SHAPE_MAX_RADIUS of the picture's side: users' pictures are not
# all drawn to the grid, and a model that saw only cell-sized shapes reads a large circle as
# several squares. Held-out pictures keep the grid's sizes, so figures stay comparable.
LARGE_SHAPE_SHARE = 0.3
LARGE_SHAPE_MAX_RADIUS = 0.4
# Share of training pictures of two or more shapes (and no text) drawn anywhere rather than in
# grid cells, so that two may share a cell: a model that saw one shape a cell counted shapes
# placed freely one or two short (the shipped model: 5 shapes 4 of 8, in 400x300 pictures
# 3 of 8), its list of shapes by cell folding two into one. Held-out pictures keep the grid.
FREE_PLACEMENT_SHARE = 0.3
# Share of training position questions about a lone shape asked without naming it ("Where is
# the shape?"); every held-out one names its shape.
LONE_POSITION_SHARE = 0.5


def sample_scene(rng: random.Random, split: str, shape_count: int, with_text: bool,
                 size: int = IMAGE_SIZE) -> Scene:
    """`shape_count` shapes (1 to 8) in distinct cells, no two of the same colour and kind;
    in training, a lone shape is sometimes larger than a cell (`LARGE_SHAPE_SHARE`)."""
    if not 1 <= shape_count <= 8:
        raise ValueError(f"shape_count must be 1 to 8 (one cell is kept for text), got "
                         f"{shape_count}")
    cells = rng.sample(sorted(POSITIONS), shape_count + 1)
    pairs = rng.sample([(kind, colour) for kind in SHAPES for colour in COLOURS], shape_count)
    cell_size = size / 3
    shapes = []
    for (kind, colour), (row, column) in zip(pairs, cells):
        jitter = int(cell_size / 8)
        center = (int((column + 0.5) * cell_size) + rng.randint(-jitter, jitter),
                  int((row + 0.5) * cell_size) + rng.randint(-jitter, jitter))
        radius = rng.randint(int(cell_size * 0.22), int(cell_size * 0.3))
        shapes.append(Shape(kind, colour, (row, column), center, radius))
    if split == TRAIN and shape_count == 1 and not with_text \
            and rng.random() < LARGE_SHAPE_SHARE:
        shapes = [_large_shape(rng, shapes[0].kind, shapes[0].colour, size)]
    if split == TRAIN and shape_count > 1 and not with_text \
            and rng.random() < FREE_PLACEMENT_SHARE:
        shapes = _placed_anywhere(rng, [(shape.kind, shape.colour) for shape in shapes], size)
    if split == TRAIN:
        shapes = [replace(shape, fill=shade(rng, shape.colour))
                  if rng.random() < SHADE_SHARE else shape for shape in shapes]
    text = None
    if with_text:
        text = str(rng.randint(0, 9)) if rng.random() < 0.5 else rng.choice(
            split_items(WORDS, split))
    return Scene(tuple(shapes), text, cells[-1] if with_text else None, size)


def shade(rng: random.Random, colour: str) -> tuple[int, int, int]:
    """One of COLOUR_SHADES[colour], each channel moved by up to SHADE_JITTER."""
    base = rng.choice(COLOUR_SHADES[colour])
    return tuple(min(255, max(0, value + rng.randint(-SHADE_JITTER, SHADE_JITTER)))
                 for value in base)


def _placed_anywhere(rng: random.Random, pairs: list[tuple[str, str]], size: int
                     ) -> list[Shape]:
    """Shapes of the grid's sizes or somewhat smaller at random centers, at least a few
    pixels apart, each positioned by its center's cell (two may share one)."""
    cell_size = size / 3
    shapes: list[Shape] = []
    while len(shapes) < len(pairs):
        kind, colour = pairs[len(shapes)]
        radius = rng.randint(int(cell_size * 0.14), int(cell_size * 0.3))
        center = (rng.randint(radius, size - radius), rng.randint(radius, size - radius))
        if any(math.dist(center, other.center) < radius + other.radius + 4 for other in shapes):
            continue
        shapes.append(Shape(kind, colour, _cell_of(center, size), center, radius))
    return shapes


def _cell_of(center: tuple[int, int], size: int) -> tuple[int, int]:
    """The grid cell (row, column) a point of a `size`-pixel picture falls in."""
    cell_size = size / 3
    return min(2, int(center[1] // cell_size)), min(2, int(center[0] // cell_size))


def _large_shape(rng: random.Random, kind: str, colour: str, size: int) -> Shape:
    """A lone shape larger than a grid cell, anywhere it fits; its position is its center's
    cell."""
    cell_size = size / 3
    radius = rng.randint(int(cell_size * 0.3) + 1, int(size * LARGE_SHAPE_MAX_RADIUS))
    center = (rng.randint(radius, size - radius), rng.randint(radius, size - radius))
    return Shape(kind, colour, _cell_of(center, size), center, radius)


def sample_image_case(rng: random.Random, split: str, kind: str | None = None) -> ImageCase:
    """A picture and a question of `kind` (one of IMAGE_KINDS; random when None)."""
    kind = kind or rng.choice(IMAGE_KINDS)
    if kind not in IMAGE_KINDS:
        raise ValueError(f"kind must be one of {IMAGE_KINDS}, got {kind!r}")
    shape_count = 1 if kind in ("colour", "shape") else rng.randint(1, 5)
    with_text = kind == "read" or rng.random() < 0.3
    scene = sample_scene(rng, split, shape_count, with_text)
    template = rng.choice(_phrasings("image", IMAGE_QUESTIONS[kind], kind, split))
    if kind == "position" and shape_count == 1 and split == TRAIN \
            and rng.random() < LONE_POSITION_SHARE:
        template = rng.choice(composed_questions(
            "image", "position_lone", split_items(IMAGE_QUESTIONS["position"], HELD_OUT)))
    target = rng.choice(scene.shapes)
    question = template.format(colour=target.colour, shape=target.kind)
    answer = {"colour": target.colour, "shape": target.kind, "count": str(shape_count),
              "position": target.position, "read": scene.text or ""}[kind]
    return ImageCase(kind, question, answer, scene, draw_scene(scene), target)


def _phrasings(media: str, written: tuple[str, ...], kind: str, split: str) -> tuple[str, ...]:
    """The question phrasings of `split`: held out, those of the hand-written ones held out;
    in training, the others and the phrasings composed from parts (`question_parts`)."""
    if split != TRAIN:
        return split_items(written, split)
    return split_items(written, TRAIN) + composed_questions(
        media, kind, split_items(written, HELD_OUT))


def draw_video(shape: str, colour: str, direction: str, start: tuple[int, int], step: int,
               radius: int, frames: int = VIDEO_FRAMES, size: int = VIDEO_SIZE) -> np.ndarray:
    """Frames of one shape moving `step` pixels per frame in `direction`."""
    dx, dy = DIRECTIONS[direction]
    video = np.empty((frames, size, size, 3), dtype=np.uint8)
    for index in range(frames):
        image = Image.new("RGB", (size, size), BACKGROUND)
        center = (start[0] + dx * step * index, start[1] + dy * step * index)
        draw_shape(ImageDraw.Draw(image), shape, COLOURS[colour], center, radius)
        video[index] = np.asarray(image)
    return video


def sample_video_case(rng: random.Random, split: str, kind: str | None = None) -> VideoCase:
    """A clip of one moving shape and a question of `kind` (one of VIDEO_KINDS)."""
    kind = kind or rng.choice(VIDEO_KINDS)
    if kind not in VIDEO_KINDS:
        raise ValueError(f"kind must be one of {VIDEO_KINDS}, got {kind!r}")
    shape, colour = rng.choice(SHAPES), rng.choice(sorted(COLOURS))
    direction = rng.choice(sorted(DIRECTIONS))
    radius = rng.randint(8, 12)
    step = rng.randint(4, 8)
    travel = step * (VIDEO_FRAMES - 1)
    # Start where the whole path stays inside the frame; the other axis is free.
    margin = radius + 1
    along = rng.randint(margin, VIDEO_SIZE - margin - travel)
    across = rng.randint(margin, VIDEO_SIZE - margin)
    dx, dy = DIRECTIONS[direction]
    if dx:
        start = (along if dx > 0 else VIDEO_SIZE - along, across)
    else:
        start = (across, along if dy > 0 else VIDEO_SIZE - along)
    question = rng.choice(_phrasings("video", VIDEO_QUESTIONS[kind], kind, split))
    answer = {"direction": direction, "shape": shape, "colour": colour}[kind]
    frames = draw_video(shape, colour, direction, start, step, radius)
    return VideoCase(kind, question, answer, shape, colour, direction, frames)
