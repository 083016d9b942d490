"""Regenerate the shipped base tokenizer in muse/assets (vocab 8192).

Training text: the Python standard library's .py files (sorted, capped at ~30 MB) plus
synthetic chat-format text made from a fixed seed, so that code, English, JSON
punctuation and digits all get useful merges. The output depends only on the Python
version's stdlib and the tokenizers version.

    PYTHONPATH=. python scripts/build_base_tokenizer.py [--out-dir muse/assets]
"""

from __future__ import annotations

import argparse
import json
import random
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

from muse.tokenizer import BASE_TOKENIZER_DIR, train_tokenizer_from_texts

VOCAB_SIZE = 8192
STDLIB_BYTE_CAP = 30_000_000
NUM_SYNTHETIC_CONVERSATIONS = 4000
SEED = 0

CITIES = ["Paris", "Tokyo", "London", "New York", "Berlin", "Madrid", "Sydney", "Toronto", "Cairo", "Mumbai"]
TOPICS = ["photosynthesis", "black holes", "the French Revolution", "binary search", "climate change",
          "the immune system", "supply and demand", "neural networks", "volcanoes", "the water cycle"]
INSTRUCTIONS = [
    "Explain {topic} in simple terms.",
    "Write a short summary of {topic}.",
    "Give me three facts about {topic}.",
    "Can you describe how {topic} works?",
    "Please list the key ideas behind {topic}.",
    "Why is {topic} important? Answer in two sentences.",
]
ANSWERS = [
    "Sure. {Topic} is a topic that many people find interesting, and the main idea is easy to follow.",
    "Here is a short answer: {topic} can be understood step by step, starting from the basics.",
    "Good question! The key point about {topic} is that small causes can have large effects.",
    "In short, {topic} matters because it shapes the world around us in many ways.",
]
OPERATORS: dict[str, Callable[[int, int], int]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
}


def stdlib_texts(byte_cap: int) -> Iterator[str]:
    """Stdlib .py files in sorted order until `byte_cap` bytes; undecodable files are skipped."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        path for path in root.rglob("*.py") if "site-packages" not in path.relative_to(root).parts
    )
    total = 0
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        size = len(text.encode("utf-8"))
        if total + size > byte_cap:
            return
        total += size
        yield text


def arithmetic_turn(rng: random.Random) -> str:
    a, b = rng.randint(0, 9999), rng.randint(0, 999)
    operator = rng.choice(list(OPERATORS))
    result = OPERATORS[operator](a, b)
    return (
        f"<|user|>What is {a} {operator} {b}?<|end|>\n"
        f"<|assistant|><think>{a} {operator} {b} = {result}</think>The answer is {result}.<|end|>\n"
    )


def tool_call_turn(rng: random.Random) -> str:
    city = rng.choice(CITIES)
    unit = rng.choice(["celsius", "fahrenheit"])
    call = {"name": "get_weather", "arguments": {"city": city, "unit": unit}}
    result = {"city": city, "temperature": rng.randint(-20, 40), "unit": unit, "humidity": rng.random()}
    return (
        f"<|user|>What is the weather in {city}?<|end|>\n"
        f"<|assistant|><tool_call>{json.dumps(call)}</tool_call><|end|>\n"
        f"<|tool|>{json.dumps(result)}<|end|>\n"
        f"<|assistant|>It is {result['temperature']} degrees {unit} in {city}.<|end|>\n"
    )


def instruction_turn(rng: random.Random) -> str:
    topic = rng.choice(TOPICS)
    question = rng.choice(INSTRUCTIONS).format(topic=topic)
    answer = rng.choice(ANSWERS).format(topic=topic, Topic=topic[0].upper() + topic[1:])
    return f"<|user|>{question}<|end|>\n<|assistant|>{answer}<|end|>\n"


def synthetic_texts(count: int, seed: int) -> Iterator[str]:
    rng = random.Random(seed)
    makers = [arithmetic_turn, tool_call_turn, instruction_turn]
    for _ in range(count):
        yield "<|bos|><|system|>You are a helpful assistant.<|end|>\n" + rng.choice(makers)(rng)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=BASE_TOKENIZER_DIR)
    args = parser.parse_args()

    def texts() -> Iterator[str]:
        yield from stdlib_texts(STDLIB_BYTE_CAP)
        yield from synthetic_texts(NUM_SYNTHETIC_CONVERSATIONS, SEED)

    tokenizer = train_tokenizer_from_texts(texts(), VOCAB_SIZE, args.out_dir)
    print(f"wrote {args.out_dir} (vocab size {tokenizer.vocab_size})")


if __name__ == "__main__":
    main()
