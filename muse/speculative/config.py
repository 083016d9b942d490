"""`--speculative-config` / `LLM(speculative_config=...)`: vLLM's names and meanings.

    {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_min": 2,
     "prompt_lookup_max": 5, "rejection_sample_method": "token"}

Methods: `ngram` (prompt lookup: drafts copied from where the latest tokens occurred before in
the prompt or the output), `suffix` (suffix decoding over the request and earlier requests'
outputs), and the block-diffusion drafters `dflash` and `dspark` (`model`: the drafter's
folder; `dspark` without one takes the target checkpoint's `drafter/`). Drafts of model-free
methods and greedy drafts are one-hot, so token-wise and block verification accept the same
tokens there; `draft_sample_method: "probabilistic"` samples a drafter's block at the
request's temperature and verifies it against that q.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from muse.json_options import json_object

METHODS = ("ngram", "dflash", "dspark", "suffix")
ENGINE_METHODS = METHODS
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
REJECTION_SAMPLE_METHODS = ("token", "block")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 7
    model: str | None = None  # a drafter checkpoint (drafter methods)
    draft_sample_method: str = "greedy"
    rejection_sample_method: str = "token"
    enable_adaptive_verification: bool = False
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # Suffix decoding (vLLM's names): the longest suffix matched, drafts up to this factor of
    # the match length, stop below this probability, outputs of finished requests kept.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cached_requests: int = 1000

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str | None
              ) -> SpeculativeConfig | None:
        """From a dict, its JSON text (the CLI flag) or an instance; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object(value, "speculative_config")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"`speculative_config` has unknown keys {unknown}; known: "
                             f"{sorted(known)}")
        if "method" not in value:
            raise ValueError("`speculative_config.method` is required, one of "
                             f"{list(METHODS)}")
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        def check(name: str, ok: bool, wanted: str) -> None:
            if not ok:
                raise ValueError(f"`speculative_config.{name}` must be {wanted}, got "
                                 f"{getattr(self, name)!r}")

        check("method", self.method in METHODS, f"one of {list(METHODS)}")
        check("num_speculative_tokens", _positive_int(self.num_speculative_tokens),
              "a positive integer")
        check("draft_sample_method", self.draft_sample_method in DRAFT_SAMPLE_METHODS,
              f"one of {list(DRAFT_SAMPLE_METHODS)}")
        check("rejection_sample_method",
              self.rejection_sample_method in REJECTION_SAMPLE_METHODS,
              f"one of {list(REJECTION_SAMPLE_METHODS)}")
        check("enable_adaptive_verification",
              isinstance(self.enable_adaptive_verification, bool), "true or false")
        check("prompt_lookup_min", _positive_int(self.prompt_lookup_min), "a positive integer")
        check("prompt_lookup_max", _positive_int(self.prompt_lookup_max)
              and self.prompt_lookup_max >= self.prompt_lookup_min,
              "a positive integer >= prompt_lookup_min")
        check("suffix_decoding_max_tree_depth",
              _positive_int(self.suffix_decoding_max_tree_depth), "a positive integer")
        check("suffix_decoding_max_spec_factor",
              isinstance(self.suffix_decoding_max_spec_factor, (int, float))
              and self.suffix_decoding_max_spec_factor > 0, "a positive number")
        check("suffix_decoding_min_token_prob",
              isinstance(self.suffix_decoding_min_token_prob, (int, float))
              and 0 <= self.suffix_decoding_min_token_prob <= 1, "a number in [0, 1]")
        check("suffix_decoding_max_cached_requests",
              isinstance(self.suffix_decoding_max_cached_requests, int)
              and self.suffix_decoding_max_cached_requests >= 0, "a non-negative integer")
        if self.method not in ENGINE_METHODS:
            raise ValueError(f"`speculative_config.method` {self.method!r} is not run by the "
                             f"engine yet; it runs {list(ENGINE_METHODS)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
