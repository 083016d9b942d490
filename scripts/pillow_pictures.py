"""A model on pictures drawn as a user draws them with Pillow: the colour named the way
Pillow names it (`fill="brown"` is (165, 42, 42), not the training palette's brown), other
picture sizes, a light grey background, a small shape. The model is asked the colour and
the kind of one shape in the middle, and how many shapes a picture of one to five placed
anywhere (not on the training grid) holds, greedily; a reply is right when its content is
the answer as `muse eval` compares them (`media_tasks.is_right`).

    python scripts/pillow_pictures.py MODEL [--json OUT] [--variants NAME,...] [--counts 8]

Prints right / asked per variant and question, then every miss (variant, question, answer,
reply, the other attribute of the shape).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from muse import LLM, SamplingParams  # noqa: E402
from muse.eval.media_tasks import is_right  # noqa: E402
from muse.eval.replies import read_reply  # noqa: E402
from muse.train.data import vision_tasks  # noqa: E402


class Variant(NamedTuple):
    size: tuple[int, int]
    background: str | tuple[int, int, int]
    pillow_names: bool  # fill with Pillow's colour of the name, else the training palette's
    radius: float = 0.2  # of the picture's shorter side


VARIANTS = {
    "training palette": Variant((224, 224), "white", False),
    "Pillow names": Variant((224, 224), "white", True),
    "Pillow names 400x300": Variant((400, 300), "white", True),
    "Pillow names on light grey": Variant((224, 224), (235, 235, 235), True),
    "Pillow names small shape": Variant((224, 224), "white", True, 0.1),
}
QUESTIONS = {"colour": "What color is the shape?", "shape": "What shape is this?",
             "count": "How many shapes are there?"}
MOST_SHAPES = 5


def _fill(variant: Variant, colour: str) -> str | tuple[int, int, int]:
    return colour if variant.pillow_names else vision_tasks.COLOURS[colour]


def picture(variant: Variant, kind: str, colour: str) -> Image.Image:
    """One shape in the middle."""
    image = Image.new("RGB", variant.size, variant.background)
    width, height = variant.size
    vision_tasks.draw_shape(ImageDraw.Draw(image), kind, _fill(variant, colour),
                            (width / 2, height / 2), variant.radius * min(width, height))
    return image


def scattered(variant: Variant, count: int, rng: random.Random) -> Image.Image:
    """`count` shapes of random kinds and colours anywhere, none touching, each about half
    the variant's radius."""
    image = Image.new("RGB", variant.size, variant.background)
    draw = ImageDraw.Draw(image)
    width, height = variant.size
    placed: list[tuple[float, float, float]] = []
    while len(placed) < count:
        radius = rng.uniform(0.3, 0.6) * variant.radius * min(width, height)
        x, y = rng.uniform(radius, width - radius), rng.uniform(radius, height - radius)
        if all(math.dist((x, y), (a, b)) > radius + r + 6 for a, b, r in placed):
            placed.append((x, y, radius))
            vision_tasks.draw_shape(draw, rng.choice(vision_tasks.SHAPES),
                                    _fill(variant, rng.choice(list(vision_tasks.COLOURS))),
                                    (x, y), radius)
    return image


def probe(llm: LLM, variants: list[str], colours: list[str], kinds: list[str],
          counts: int = 8) -> dict[str, Any]:
    """Each variant's colour and shape questions on one shape of each colour and kind, and
    `counts` pictures of each number of shapes, 1 to MOST_SHAPES, placed anywhere."""
    rng = random.Random(0)
    cases = []  # (variant, question, answer, picture, what else it shows)
    for name in variants:
        variant = VARIANTS[name]
        for colour in colours:
            for kind in kinds:
                image = picture(variant, kind, colour)
                cases += [(name, "colour", colour, image, kind),
                          (name, "shape", kind, image, colour)]
        cases += [(name, "count", str(count), scattered(variant, count, rng), "")
                  for count in range(1, MOST_SHAPES + 1) for _ in range(counts)]
    prompts = [{"prompt_token_ids": llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"},
                                      {"type": "text", "text": QUESTIONS[question]}]}],
        add_generation_prompt=True, tokenize=True),
        "multi_modal_data": {"image": [image]}} for _, question, _, image, _ in cases]
    params = SamplingParams(temperature=0.0, max_tokens=200, skip_special_tokens=False)
    outputs = llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
    right: Counter[tuple[str, str]] = Counter()
    asked: Counter[tuple[str, str]] = Counter()
    misses = []
    for (name, question, answer, _, other), output in zip(cases, outputs):
        reply = read_reply(output.outputs[0], llm.tokenizer).content
        asked[name, question] += 1
        if is_right(reply, answer):
            right[name, question] += 1
        else:
            misses.append({"variant": name, "question": question, "answer": answer,
                           "reply": reply, "other": other})
    return {"results": {f"{name} / {question}": {"right": right[name, question],
                                                 "asked": asked[name, question]}
                        for name, question in asked},
            "misses": misses}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--colours", default=",".join(vision_tasks.COLOURS))
    parser.add_argument("--shapes", default=",".join(vision_tasks.SHAPES))
    parser.add_argument("--counts", type=int, default=8,
                        help="pictures of each number of shapes (1 to 5) a variant")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [name for name in variants if name not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {list(VARIANTS)}")
    report = probe(LLM(args.model), variants, args.colours.split(","), args.shapes.split(","),
                   args.counts)
    report["model"] = args.model
    for label, cell in report["results"].items():
        print(f"{label}: {cell['right']}/{cell['asked']}")
    for miss in report["misses"]:
        print("miss:", miss)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
