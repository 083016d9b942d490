"""The shared-prefix workload: G groups of R requests with long prefixes shared in a group.

Each request has about N input tokens: a P-token prefix (the system message) that every
request of its group repeats, then N - P tokens of its own (the user message). Groups start
with a distinct random header, so they share nothing but the chat template's first tokens. Requests
go out round by round (request r of every group, then r + 1): at a concurrency up to G, the
first round computes each group's prefix and later rounds can reuse it.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from muse.bench.text import python_source, task_description
from muse.bench.tokens import Sizer
from muse.bench.trace import Session, Trace, Turn

# The seeds' setting: 8 groups of 8, 80K input tokens with a 73,360-token shared prefix, 20
# output tokens, swept over 7 concurrency levels.
SEED_INPUT_TOKENS = 80_000
SEED_PREFIX_TOKENS = 73_360
SEED_OUTPUT_TOKENS = 20
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)
# Room left in the context for the chat template and the run's salt.
TEMPLATE_ALLOWANCE_TOKENS = 64


@dataclass
class SharedPrefixSettings:
    num_groups: int = 8
    requests_per_group: int = 8
    input_tokens: int = SEED_INPUT_TOKENS
    prefix_tokens: int = SEED_PREFIX_TOKENS
    output_tokens: int = SEED_OUTPUT_TOKENS

    @classmethod
    def for_context(cls, max_model_len: int | None) -> SharedPrefixSettings:
        """The seeds' setting, shrunk in proportion where the server's context is shorter."""
        settings = cls()
        budget = None if max_model_len is None else \
            max_model_len - settings.output_tokens - TEMPLATE_ALLOWANCE_TOKENS
        if budget is not None and settings.input_tokens > budget:
            scale = max(budget, 2) / settings.input_tokens
            settings.input_tokens = max(2, int(settings.input_tokens * scale))
            settings.prefix_tokens = max(1, int(settings.prefix_tokens * scale))
        return settings

    def validate(self, max_model_len: int | None = None) -> None:
        for name in ("num_groups", "requests_per_group", "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if not 0 < self.prefix_tokens < self.input_tokens:
            raise ValueError(f"--prefix-tokens must be between 1 and --input-tokens - 1 "
                             f"({self.input_tokens - 1}), got {self.prefix_tokens}")
        total = self.input_tokens + self.output_tokens + TEMPLATE_ALLOWANCE_TOKENS
        if max_model_len is not None and total > max_model_len:
            raise ValueError(f"--input-tokens {self.input_tokens} + --output-tokens "
                             f"{self.output_tokens} (+{TEMPLATE_ALLOWANCE_TOKENS} for the "
                             f"template) exceed the server's context of {max_model_len}")


def generate_shared_prefix(settings: SharedPrefixSettings, sizer: Sizer, seed: int) -> Trace:
    settings.validate()
    rng = random.Random(f"{seed}:shared-prefix")
    prefixes = []
    for group in range(settings.num_groups):
        head = f"{rng.getrandbits(64):016x} context group {group}\n"
        prefixes.append(sizer.fit(python_source, f"{seed}:group:{group}",
                                  settings.prefix_tokens, head=head))
    suffix_tokens = settings.input_tokens - settings.prefix_tokens
    sessions = []
    for round_index in range(settings.requests_per_group):
        for group in range(settings.num_groups):
            head = f"{rng.getrandbits(64):016x} request {group}.{round_index}: "
            question = sizer.fit(task_description, f"{seed}:group:{group}:{round_index}",
                                 suffix_tokens, head=head)
            messages = [{"role": "system", "content": prefixes[group]},
                        {"role": "user", "content": question}]
            turn = Turn(messages, settings.output_tokens,
                        intended_input_tokens=settings.input_tokens)
            sessions.append(Session(f"g{group:03}r{round_index:03}", [turn], f"g{group:03}"))
    return Trace("shared-prefix", sessions, seed, asdict(settings), sizer.counter.description)
