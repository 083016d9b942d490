"""Synthetic pictures and clips: deterministic, split apart, answers that match the pixels."""

from __future__ import annotations

import itertools
import math
import random
import re

import numpy as np
import pytest
from scipy import ndimage

from muse.tokenizer import MuseTokenizer
from muse.train.data import vision_tasks
from muse.train.data.question_parts import NEAR_DUPLICATE_SHARE, composed_questions
from muse.train.data.split import HELD_OUT, TRAIN, split_items
from muse.train.data.vision_tasks import (COLOURS, IMAGE_KINDS, IMAGE_QUESTIONS, POSITIONS,
                                          VIDEO_KINDS, VIDEO_QUESTIONS, Shape, describe,
                                          sample_image_case, sample_scene, sample_video_case)


def _colour_masks(pixels: np.ndarray, shapes: tuple[Shape, ...] = ()) -> dict[str, np.ndarray]:
    """Where each palette colour, or the shade `shapes` give its name, is, exactly (shapes are
    drawn without antialiasing)."""
    fills = [*COLOURS.items(), *((shape.colour, shape.rgb) for shape in shapes)]
    masks: dict[str, np.ndarray] = {}
    for name, rgb in fills:
        masks[name] = masks.get(name, False) | np.all(pixels == rgb, axis=-1)
    return {name: mask for name, mask in masks.items() if mask.any()}


def _cell(mask: np.ndarray) -> tuple[int, int]:
    rows, columns = np.nonzero(mask)
    third = mask.shape[0] / 3
    return int(rows.mean() // third), int(columns.mean() // third)


def test_cases_are_deterministic_per_seed() -> None:
    def draw(seed: int):
        rng = random.Random(seed)
        return ([sample_image_case(rng, TRAIN) for _ in range(30)],
                [sample_video_case(rng, TRAIN) for _ in range(10)])

    (images, videos), (images_again, videos_again) = draw(4), draw(4)
    assert images == images_again and videos == videos_again
    assert all(np.array_equal(a.frames, b.frames) for a, b in zip(videos, videos_again))
    assert draw(5)[0] != images


@pytest.mark.parametrize("templates", [*IMAGE_QUESTIONS.values(), *VIDEO_QUESTIONS.values()])
def test_each_kind_has_ten_phrasings_split_apart(templates: tuple[str, ...]) -> None:
    train, held_out = split_items(templates, TRAIN), split_items(templates, HELD_OUT)
    assert len(templates) >= 10 and train and held_out and not set(train) & set(held_out)


def test_questions_come_from_their_split() -> None:
    """Held-out cases are asked in the held-out hand-written phrasings; training ones in the
    others and in phrasings composed from parts, most often the composed ones."""
    rng = random.Random(6)
    composed = 0
    for split in (TRAIN, HELD_OUT):
        for kind in IMAGE_KINDS:
            for _ in range(20):
                case = sample_image_case(rng, split, kind)
                written = split_items(IMAGE_QUESTIONS[kind], split)
                if split == TRAIN:
                    written += composed_questions("image", kind,
                                                  split_items(IMAGE_QUESTIONS[kind], HELD_OUT))
                if split == TRAIN and kind == "position" and len(case.scene.shapes) == 1:
                    written += composed_questions("image", "position_lone",
                                                  split_items(IMAGE_QUESTIONS[kind], HELD_OUT))
                allowed = {template.format(colour=shape.colour, shape=shape.kind)
                           for template in written for shape in case.scene.shapes}
                assert case.question in allowed
                composed += split == TRAIN and case.question not in {
                    t.format(colour=s.colour, shape=s.kind) for s in case.scene.shapes
                    for t in IMAGE_QUESTIONS[kind]}
                if kind == "read" and not case.answer.isdigit():
                    assert case.answer in split_items(vision_tasks.WORDS, split)
        for kind in VIDEO_KINDS:
            case = sample_video_case(rng, split, kind)
            allowed = split_items(VIDEO_QUESTIONS[kind], split)
            if split == TRAIN:
                allowed += composed_questions("video", kind,
                                              split_items(VIDEO_QUESTIONS[kind], HELD_OUT))
            assert case.question in allowed
    assert composed > 50  # of 100 training image cases


@pytest.mark.parametrize("media,questions", [("image", IMAGE_QUESTIONS),
                                             ("video", VIDEO_QUESTIONS)])
def test_composed_phrasings_are_many_and_none_is_near_a_held_out_one(media, questions) -> None:
    for kind, written in questions.items():
        held_out = split_items(written, HELD_OUT)
        composed = composed_questions(media, kind, held_out)
        assert len(composed) >= 20 and len(set(composed)) == len(composed)
        for phrasing in composed:
            words = set(re.findall(r"[a-z']+", phrasing.lower()))
            for other in held_out:
                theirs = set(re.findall(r"[a-z']+", other.lower()))
                assert len(words & theirs) / len(words | theirs) < NEAR_DUPLICATE_SHARE, \
                    (phrasing, other)
        # Each kind's own words, never another kind's question (which the reasoning restates).
        for other_kind, other_written in questions.items():
            if other_kind != kind:
                assert not set(composed) & set(other_written)


@pytest.mark.parametrize("kind", ["colour", "shape"])
def test_a_lone_shape_has_the_answered_colour(kind: str) -> None:
    rng = random.Random(7)
    for _ in range(40):
        case = sample_image_case(rng, TRAIN, kind)
        masks = _colour_masks(np.asarray(case.image), case.scene.shapes)
        (shape,) = case.scene.shapes
        assert list(masks) == [shape.colour]
        assert case.answer == (shape.colour if kind == "colour" else shape.kind)


def test_counts_and_positions_match_the_pixels() -> None:
    rng = random.Random(8)
    for kind in ("count", "position"):
        for _ in range(40):
            case = sample_image_case(rng, TRAIN, kind)
            masks = _colour_masks(np.asarray(case.image), case.scene.shapes)
            blobs = sum(ndimage.label(mask)[1] for mask in masks.values())
            assert blobs == len(case.scene.shapes)
            if kind == "count":
                assert case.answer == str(blobs)
                continue
            # The shape named, or the only one ("Where is the shape?").
            colour, shape = next(((s.colour, s.kind) for s in case.scene.shapes
                                  if f"{s.colour} {s.kind}" in case.question),
                                 (case.target.colour, case.target.kind))
            labels, _ = ndimage.label(masks[colour])
            found = {POSITIONS[_cell(labels == index)] for index in range(1, labels.max() + 1)}
            # The shape asked about is the only one of its colour and kind.
            target = next(s for s in case.scene.shapes if (s.colour, s.kind) == (colour, shape))
            assert case.answer == target.position and case.answer in found


def test_written_text_is_drawn_in_its_cell() -> None:
    rng = random.Random(9)
    for _ in range(30):
        case = sample_image_case(rng, TRAIN, "read")
        pixels = np.asarray(case.image)
        dark = np.all(pixels < 100, axis=-1)
        assert case.answer == case.scene.text and dark.any()
        assert POSITIONS[_cell(dark)] == POSITIONS[case.scene.text_cell]


def test_motion_matches_the_frames() -> None:
    rng = random.Random(10)
    for _ in range(40):
        case = sample_video_case(rng, TRAIN)
        frames = case.frames
        assert frames.dtype == np.uint8 and frames.shape == (vision_tasks.VIDEO_FRAMES,
                                                              vision_tasks.VIDEO_SIZE,
                                                              vision_tasks.VIDEO_SIZE, 3)
        centroids = []
        for frame in frames:
            (colour,) = _colour_masks(frame)
            assert colour == case.colour
            rows, columns = np.nonzero(np.all(frame == COLOURS[colour], axis=-1))
            centroids.append((columns.mean(), rows.mean()))
        dx, dy = np.subtract(centroids[-1], centroids[0])
        moved = ("right" if dx > 0 else "left") if abs(dx) > abs(dy) else \
            ("down" if dy > 0 else "up")
        assert moved == case.direction
        assert case.answer == {"direction": case.direction, "shape": case.shape,
                               "colour": case.colour}[case.kind]


def test_rendered_chat_has_the_media_placeholder() -> None:
    tokenizer = MuseTokenizer.base()
    rng = random.Random(11)
    image_case, video_case = sample_image_case(rng, TRAIN), sample_video_case(rng, TRAIN)
    image_text = tokenizer.apply_chat_template(image_case.messages())
    assert f"<|image_start|><|image|><|image_end|>{image_case.question}<|end|>" in image_text
    assert image_text.endswith(f"</think>{image_case.answer}<|end|>\n")
    video_text = tokenizer.apply_chat_template(video_case.messages())
    assert f"<|video_start|><|video|><|video_end|>{video_case.question}" in video_text
    assert video_text.endswith(f"</think>{video_case.answer}<|end|>\n")


def test_the_reasoning_numbers_the_shapes_in_reading_order_then_counts_them() -> None:
    rng = random.Random(11)
    for count in range(1, 6):
        scene = sample_scene(rng, TRAIN, count, with_text=False)
        reasoning = describe(scene)
        listed = re.findall(r"Shape (\d) is an? (\w+) (\w+) (?:in|on|at) the ([\w ]+?)\.",
                            reasoning)
        assert [int(number) for number, *_ in listed] == list(range(1, count + 1))
        cells = {(shape.colour, shape.kind): shape.cell for shape in scene.shapes}
        order = [cells[(colour, kind)] for _, colour, kind, _ in listed]
        assert order == sorted(order)
        assert reasoning.endswith(f"That is {count} shape{'s' if count > 1 else ''}.")


def test_the_reasoning_ends_with_what_the_question_asks_and_the_answer_is_in_it() -> None:
    rng = random.Random(12)
    for kind in IMAGE_KINDS:
        case = vision_tasks.sample_image_case(rng, TRAIN, kind)
        reasoning = case.messages()[1]["reasoning_content"]
        topic = vision_tasks.IMAGE_TOPICS[kind].format(colour=case.target.colour,
                                                       shape=case.target.kind)
        assert reasoning == f"{vision_tasks.describe(case.scene)} The question asks {topic}."
        assert case.answer in reasoning
    for kind in vision_tasks.VIDEO_KINDS:
        case = vision_tasks.sample_video_case(rng, TRAIN, kind)
        reasoning = case.messages()[1]["reasoning_content"]
        assert reasoning.endswith(f"The question asks {vision_tasks.VIDEO_TOPICS[kind]}.")
        assert case.answer in reasoning


def test_training_draws_some_lone_shapes_larger_than_a_cell_and_held_out_none() -> None:
    cell = vision_tasks.IMAGE_SIZE / 3
    for split, rng in ((TRAIN, random.Random(21)), (HELD_OUT, random.Random(22))):
        scenes = [sample_scene(rng, split, 1, with_text=False) for _ in range(200)]
        large = [s.shapes[0] for s in scenes if s.shapes[0].radius > cell * 0.3]
        if split == HELD_OUT:
            assert not large
            continue
        assert 30 <= len(large) <= 90, len(large)  # LARGE_SHAPE_SHARE of 200
        for shape in large:
            x, y = shape.center
            size = vision_tasks.IMAGE_SIZE
            assert shape.radius <= x <= size - shape.radius
            assert shape.radius <= y <= size - shape.radius
            assert shape.cell == (min(2, int(y // cell)), min(2, int(x // cell)))
    # Scenes with text or several shapes keep the grid's sizes.
    crowded = sample_scene(random.Random(23), TRAIN, 3, with_text=True)
    assert all(shape.radius <= cell * 0.3 for shape in crowded.shapes)


def test_lone_shapes_are_sometimes_located_without_being_named() -> None:
    rng = random.Random(24)
    cases = [vision_tasks.sample_image_case(rng, TRAIN, "position") for _ in range(300)]
    unnamed = [case for case in cases if case.target.colour not in case.question]
    assert unnamed and all(len(case.scene.shapes) == 1 for case in unnamed)
    assert all(case.answer == case.scene.shapes[0].position for case in unnamed)
    rng = random.Random(25)
    held_out = [vision_tasks.sample_image_case(rng, HELD_OUT, "position") for _ in range(100)]
    assert all(case.target.colour in case.question for case in held_out)


def test_training_fills_half_its_shapes_with_other_shades_of_their_colour() -> None:
    """Users' pictures use Pillow's named colours; training draws half its shapes in one of
    COLOUR_SHADES (jittered), held-out pictures keep the palette."""
    rng = random.Random(12)
    shapes = [shape for _ in range(300)
              for shape in sample_scene(rng, TRAIN, rng.randint(1, 5), False).shapes]
    shaded = [shape for shape in shapes if shape.fill is not None]
    assert 0.4 < len(shaded) / len(shapes) < 0.6
    for shape in shaded:
        assert any(max(abs(a - b) for a, b in zip(shape.rgb, base)) <= vision_tasks.SHADE_JITTER
                   for base in vision_tasks.COLOUR_SHADES[shape.colour])
    assert {shape.colour for shape in shaded} == set(COLOURS)
    held_out = [shape for _ in range(100)
                for shape in sample_scene(rng, HELD_OUT, rng.randint(1, 5), False).shapes]
    assert all(shape.rgb == COLOURS[shape.colour] for shape in held_out)


def test_the_shades_of_two_colours_never_meet_even_jittered() -> None:
    jitter_reach = 2 * math.sqrt(3) * vision_tasks.SHADE_JITTER
    shades = {name: [COLOURS[name], *vision_tasks.COLOUR_SHADES[name]] for name in COLOURS}
    for first, second in itertools.combinations(shades, 2):
        closest = min(math.dist(a, b) for a in shades[first] for b in shades[second])
        assert closest > jitter_reach, (first, second)


def test_training_places_some_shapes_anywhere_two_to_a_cell_and_held_out_none() -> None:
    """Users do not draw to a grid: some training pictures place their shapes freely, two
    may then share a cell, and the reasoning still lists each one; held-out pictures keep
    one shape a cell."""
    rng = random.Random(14)
    scenes = [sample_scene(rng, TRAIN, rng.randint(2, 5), False) for _ in range(300)]
    shared = [scene for scene in scenes
              if len({shape.cell for shape in scene.shapes}) < len(scene.shapes)]
    assert 10 < len(shared) < 120
    for scene in shared:
        assert describe(scene).count("Shape ") == len(scene.shapes)
        assert f"That is {len(scene.shapes)} shapes." in describe(scene)
        pixels = np.asarray(vision_tasks.draw_scene(scene))
        masks = _colour_masks(pixels, scene.shapes)
        touching = np.ones((3, 3))  # a small triangle's apex may touch it at a corner only
        assert sum(ndimage.label(mask, touching)[1] for mask in masks.values()) \
            == len(scene.shapes)
    held_out = [sample_scene(rng, HELD_OUT, rng.randint(2, 5), False) for _ in range(100)]
    assert all(len({shape.cell for shape in scene.shapes}) == len(scene.shapes)
               for scene in held_out)
