"""The random workload: independent requests with input and output lengths drawn from ranges.

For plain throughput: each prompt starts with its own random header, so no two requests share
more than the chat template's first tokens and the prefix cache has nothing to reuse.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from muse.bench.text import TextSource, prose, python_source
from muse.bench.tokens import Sizer
from muse.bench.trace import Session, Trace, Turn

TEMPLATE_ALLOWANCE_TOKENS = 64
SOURCES: tuple[TextSource, ...] = (prose, python_source)


@dataclass
class RandomSettings:
    num_requests: int = 256
    input_tokens: tuple[int, int] = (256, 4096)
    output_tokens: tuple[int, int] = (64, 512)

    @classmethod
    def for_context(cls, max_model_len: int | None) -> RandomSettings:
        """Input lengths capped so the longest request still fits the server's context."""
        settings = cls()
        if max_model_len is None:
            return settings
        output_low, output_high = settings.output_tokens
        if output_high > max_model_len // 4:
            output_high = max(1, max_model_len // 4)
            settings.output_tokens = (min(output_low, output_high), output_high)
        cap = max(1, max_model_len - settings.output_tokens[1] - TEMPLATE_ALLOWANCE_TOKENS)
        low, high = settings.input_tokens
        settings.input_tokens = (min(low, cap), min(high, cap))
        return settings

    def validate(self, max_model_len: int | None = None) -> None:
        if self.num_requests < 1:
            raise ValueError("--num-requests must be at least 1")
        for name in ("input_tokens", "output_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise ValueError(f"--{name.replace('_', '-')} must be N or MIN:MAX with "
                                 f"1 <= MIN <= MAX, got {low}:{high}")
        longest = self.input_tokens[1] + self.output_tokens[1] + TEMPLATE_ALLOWANCE_TOKENS
        if max_model_len is not None and longest > max_model_len:
            raise ValueError(f"--input-tokens up to {self.input_tokens[1]} + --output-tokens "
                             f"up to {self.output_tokens[1]} (+{TEMPLATE_ALLOWANCE_TOKENS} for "
                             f"the template) exceed the server's context of {max_model_len}")


def generate_random(settings: RandomSettings, sizer: Sizer, seed: int) -> Trace:
    settings.validate()
    rng = random.Random(f"{seed}:random")
    sessions = []
    for index in range(settings.num_requests):
        input_tokens = rng.randint(*settings.input_tokens)
        output_tokens = rng.randint(*settings.output_tokens)
        head = f"{rng.getrandbits(64):016x} request {index}:\n"
        text = sizer.fit(rng.choice(SOURCES), f"{seed}:random:{index}", input_tokens, head=head)
        turn = Turn([{"role": "user", "content": text}], output_tokens,
                    intended_input_tokens=input_tokens)
        sessions.append(Session(f"r{index:05}", [turn]))
    return Trace("random", sessions, seed, asdict(settings), sizer.counter.description)
