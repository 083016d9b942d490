"""Training-only phrasings of the media questions, composed from parts.

Twelve hand-written phrasings a question kind, a quarter of them held out, are too few for a
small model: it learns the training sentences and misreads a held-out one as another kind
of question ("Say which way the shape travels." answered with the shape). Here each kind
gets forms whose subject and place vary ("Which way does {thing} head{where}?" with "the
figure", "it", "in the clip", ...), a few hundred sentences a kind, so that what decides the
kind is the words that ask it ("which way", "hue", "how many"), not the sentence around them.

The evaluation's held-out phrasings stay the hand-written ones, and no composed phrasing
comes close to them: one that shares `NEAR_DUPLICATE_SHARE` or more of its words (Jaccard)
with a held-out phrasing of its kind is dropped, so held-out questions keep their wording
unseen.
"""

from __future__ import annotations

import functools
import re
from itertools import product

NEAR_DUPLICATE_SHARE = 0.5

_IMAGE_THINGS = ("the shape", "the object", "the figure", "the item", "the only shape",
                 "the single shape", "that shape")
_IMAGE_PLACES = ("", " in the picture", " in this image", " here", " in the drawing",
                 " on the canvas")
_VIDEO_THINGS = ("the shape", "the object", "it", "the figure", "the moving shape",
                 "the moving object", "the thing")
_VIDEO_PLACES = ("", " in the clip", " in this video", " across the frames", " on screen")

# Per question kind: forms with {thing} (and {where}) slots. Image "position" questions name
# their target with {colour} and {shape}, filled in per case like the hand-written ones.
IMAGE_FORMS: dict[str, tuple[str, ...]] = {
    "colour": ("What colour is {thing}{where}?", "What color is {thing}{where}?",
               "Which colour does {thing} have{where}?", "Tell me the colour of {thing}.",
               "Which hue is {thing}{where}?", "What shade is {thing}{where}?",
               "Say what colour {thing} is.", "Identify the color of {thing}{where}.",
               "What is the colour of {thing}{where}?", "Name the color of {thing}."),
    "shape": ("What shape is {thing}{where}?", "Which kind of shape is {thing}?",
              "What form does {thing} have{where}?", "Name the kind of {thing}{where}.",
              "What sort of shape is {thing}{where}?", "Tell me what shape {thing} is.",
              "Is {thing} a circle, a square or another shape?",
              "Which geometric figure is {thing}{where}?", "Identify {thing}'s shape.",
              # "What is" asks what the thing is: a question that names a place is not
              # always asking where (that is "where is").
              "What is {thing}{where}?", "What exactly is {thing}{where}?"),
    "count": ("How many shapes are there{where}?", "How many objects do you count{where}?",
              "Count the figures{where}.", "What is the number of items{where}?",
              "Give me the number of shapes{where}.", "How many things are drawn{where}?",
              "Tell me how many figures you see{where}.", "How many shapes appear{where}?",
              "What's the total number of objects{where}?",
              "Count how many shapes there are{where}.",
              # The count as a noun after another noun: a question that names the shapes
              # first is not always asking which shape.
              "What is the object count{where}?", "Give the figure count{where}.",
              "Tell me the item count{where}.", "What count of figures is drawn{where}?",
              "How large is the object tally{where}?"),
    "position": ("Where is the {colour} {shape}{where}?", "In which spot is the {colour} "
                 "{shape}{where}?", "Which part of the picture holds the {colour} {shape}?",
                 "Tell me where the {colour} {shape} is placed.",
                 "Give the location of the {colour} {shape}{where}.",
                 "Where does the {colour} {shape} sit{where}?",
                 "Point out where the {colour} {shape} is{where}."),
    # Where the only shape is, asked without naming it (training only: the held-out
    # position questions name the shape they ask about).
    "position_lone": ("Where is {thing}{where}?", "In which part of the picture is {thing}?",
                      "Tell me where {thing} is.", "Where does {thing} sit{where}?",
                      "Give the location of {thing}{where}.", "Which region holds {thing}?",
                      "Where can you see {thing}{where}?", "In what spot is {thing}{where}?",
                      "Point to where {thing} is{where}."),
    "read": ("What is written{where}?", "What text do you see{where}?",
             "Read the writing{where}.", "Which word or digit is printed{where}?",
             "What do the characters say{where}?", "Tell me the written text{where}.",
             "What does the writing say{where}?", "Read out the text{where}."),
}
VIDEO_FORMS: dict[str, tuple[str, ...]] = {
    "direction": ("Which way does {thing} move{where}?", "Which way does {thing} go{where}?",
                  "In which direction does {thing} travel{where}?",
                  "What direction is {thing} heading{where}?", "Where is {thing} heading{where}?",
                  "Which direction does {thing} drift{where}?",
                  "Tell me the direction {thing} moves in{where}.",
                  "Does {thing} go left, right, up or down{where}?",
                  # The directions offered decide the kind, whatever the sentence names.
                  "Is {thing} moving left, right, up or down{where}?",
                  "Does {thing} move up, down, left or right{where}?",
                  "Left, right, up or down: which way does {thing} move{where}?",
                  "Does {thing} move to the left, to the right, up or down{where}?",
                  "Say which way {thing} is going{where}.",
                  "Name the direction in which {thing} moves{where}."),
    "shape": ("What shape is {thing}{where}?", "Which kind of shape is {thing}{where}?",
              "What form does {thing} have{where}?", "Name the shape of {thing}{where}.",
              "Tell me what shape {thing} is.", "Which geometric figure is {thing}{where}?",
              "What sort of shape is {thing}{where}?", "Identify the shape of {thing}."),
    "colour": ("What colour is {thing}{where}?", "What color is {thing}{where}?",
               "Which colour does {thing} have{where}?", "Which hue is {thing}{where}?",
               "Tell me the colour of {thing}{where}.", "What shade is {thing}{where}?",
               "Say what color {thing} is{where}.", "Name the colour of {thing}."),
}


def _words(text: str) -> frozenset[str]:
    return frozenset(re.findall(r"[a-z']+", text.lower()))


def _near(phrasing: str, others: tuple[str, ...]) -> bool:
    words = _words(phrasing)
    return any(len(words & _words(o)) / len(words | _words(o)) >= NEAR_DUPLICATE_SHARE
               for o in others)


def _compose(forms: tuple[str, ...], things: tuple[str, ...], places: tuple[str, ...]
             ) -> list[str]:
    """Every form with every subject and place, in order, without repeats."""
    sentences = []
    for form, thing, where in product(forms, things, places):
        text = form.replace("{thing}", thing).replace("{where}", where)
        sentences.append(text[0].upper() + text[1:])
    return list(dict.fromkeys(sentences))


@functools.cache
def composed_questions(media: str, kind: str, held_out: tuple[str, ...]) -> tuple[str, ...]:
    """Training phrasings of question `kind` about an "image" or a "video", none of them
    equal or near (`NEAR_DUPLICATE_SHARE`) to one of `held_out` (that kind's held-out
    phrasings)."""
    forms, things, places = (IMAGE_FORMS, _IMAGE_THINGS, _IMAGE_PLACES) if media == "image" \
        else (VIDEO_FORMS, _VIDEO_THINGS, _VIDEO_PLACES)
    if kind not in forms:
        raise ValueError(f"no {media} question kind {kind!r}: one of {sorted(forms)}")
    if kind == "shape":  # not "What shape is the shape?"
        things = tuple(thing for thing in things if "shape" not in thing)
    return tuple(q for q in _compose(forms[kind], things, places) if not _near(q, held_out))
