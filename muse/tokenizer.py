"""Byte-level BPE tokenizer with Muse's fixed special tokens and chat template.

The files written here (tokenizer.json + tokenizer_config.json) load unchanged in
`transformers.AutoTokenizer`, and `MuseTokenizer.apply_chat_template` renders the same
string as transformers does, so prompts built by muse and by other tools agree token
for token.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from muse.chat_format import (
    BOS_ID,
    BOS_TOKEN,
    CHAT_TEMPLATE,
    END_OF_TURN_ID,
    EOS_ID,
    EOS_TOKEN,
    NUM_SPECIAL_TOKENS,
    PAD_ID,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    STOP_TOKEN_IDS,
)
from muse.literal_specials import LiteralSpecials

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# transformers >= 4.47 saves the template here instead of in tokenizer_config.json.
CHAT_TEMPLATE_FILE = "chat_template.jinja"
BASE_TOKENIZER_DIR = Path(__file__).parent / "assets"
DEFAULT_MODEL_MAX_LENGTH = 32768

# GPT-4 style split, except that every digit is its own pre-token: numbers then
# tokenize the same way wherever they appear, which arithmetic needs.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

_SPECIAL_TOKEN_SPLIT = re.compile("|".join(re.escape(token) for token in SPECIAL_TOKENS))


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """The byte-level alphabet read backwards: printable stand-in character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    mapping, shift = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[chr(byte)] = byte
        else:
            mapping[chr(256 + shift)] = byte
            shift += 1
    return mapping


@lru_cache(maxsize=8)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile a chat template with the same environment transformers uses."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    # Jinja's own tojson escapes HTML characters; transformers replaces it with plain
    # json.dumps, and so must we for byte-identical prompts.
    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(date_format: str) -> str:
        return datetime.now().strftime(date_format)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    return environment.from_string(template)


class MuseTokenizer:
    """A `tokenizers.Tokenizer` plus the chat template and the special-token ids."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str = CHAT_TEMPLATE,
        model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
    ) -> None:
        for token_id, token in enumerate(SPECIAL_TOKENS):
            if tokenizer.token_to_id(token) != token_id:
                raise ValueError(
                    f"tokenizer maps special token {token!r} to id {tokenizer.token_to_id(token)}, "
                    f"but muse requires id {token_id} (special tokens must be ids 0..{NUM_SPECIAL_TOKENS - 1})"
                )
        self.tokenizer = tokenizer
        self._text_tokenizer: Tokenizer | None = None
        self._max_token_bytes: int | None = None
        self.chat_template = chat_template
        self.model_max_length = model_max_length

    @classmethod
    def from_pretrained(cls, directory: str | Path) -> MuseTokenizer:
        directory = Path(directory)
        tokenizer_path = directory / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in tokenizer directory {directory}")
        config_path = directory / TOKENIZER_CONFIG_FILE
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        chat_template = config.get("chat_template")
        template_path = directory / CHAT_TEMPLATE_FILE
        if chat_template is None and template_path.is_file():
            chat_template = template_path.read_text(encoding="utf-8")
        return cls(
            Tokenizer.from_file(str(tokenizer_path)),
            chat_template=CHAT_TEMPLATE if chat_template is None else chat_template,
            model_max_length=config.get("model_max_length", DEFAULT_MODEL_MAX_LENGTH),
        )

    @classmethod
    def base(cls) -> MuseTokenizer:
        """The tokenizer shipped with muse (vocab 8192)."""
        return cls.from_pretrained(BASE_TOKENIZER_DIR)

    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        # Pretty-printed so that a regenerated tokenizer diffs line by line in git.
        self.tokenizer.save(str(directory / TOKENIZER_FILE), pretty=True)
        config_text = json.dumps(self.tokenizer_config(), indent=2, ensure_ascii=False) + "\n"
        (directory / TOKENIZER_CONFIG_FILE).write_text(config_text, encoding="utf-8")

    def tokenizer_config(self) -> dict[str, Any]:
        """The tokenizer_config.json that lets transformers load this tokenizer offline."""
        return {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS_TOKEN,
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            # Matches the tokenizer.json post-processor, so transformers keeps it as is.
            "add_bos_token": True,
            "add_eos_token": False,
            "extra_special_tokens": [
                token for token in SPECIAL_TOKENS if token not in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
            ],
            "model_max_length": self.model_max_length,
            "clean_up_tokenization_spaces": False,
            "model_input_names": ["input_ids", "attention_mask"],
            "chat_template": self.chat_template,
        }

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included: the model's embedding rows."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def pad_token_id(self) -> int:
        return PAD_ID

    @property
    def bos_token_id(self) -> int:
        return BOS_ID

    @property
    def eos_token_id(self) -> int:
        return EOS_ID

    @property
    def end_of_turn_token_id(self) -> int:
        return END_OF_TURN_ID

    @property
    def stop_token_ids(self) -> list[int]:
        return list(STOP_TOKEN_IDS)

    def token_to_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tokenizer.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (a byte-level token may be part of a character)."""
        token = self.tokenizer.id_to_token(token_id) or ""
        if token_id < NUM_SPECIAL_TOKENS:
            return token.encode()
        decoder = _byte_level_decoder()
        return bytes(decoder[char] for char in token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it become their ids.

        `add_special_tokens=True` prepends `<|bos|>`, as transformers does for this tokenizer.
        """
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` (OpenAI chat shape) with the chat template.

        Extra keyword arguments become template variables, e.g. `enable_thinking=False`.
        With `tokenize=True` the ids are returned; the template already writes `<|bos|>`,
        so no special tokens are added on top.
        """
        if tools is not None:
            for tool in tools:
                if not isinstance(tool, dict):
                    raise ValueError(f"each tool must be a JSON schema dict, got {type(tool).__name__}")
        # transformers passes the named special tokens as template variables; kwargs win.
        variables = {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, **kwargs}
        # Token ids are made from a rendering in which the conversation's own special-token
        # strings are marked, so that they are encoded as text (see muse.literal_specials).
        literals = LiteralSpecials() if tokenize else None
        if literals is not None:
            messages, tools = literals.wrap(messages), literals.wrap(tools)
        text = compile_chat_template(self.chat_template).render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        if literals is None:
            return text
        ids: list[int] = []
        for piece, literal in literals.split(text):
            ids += self.encode_as_text(piece) if literal else self.encode(piece)
        return ids

    @property
    def max_token_bytes(self) -> int:
        """Bytes of the longest token: a text of N bytes has at least N / this many tokens."""
        if self._max_token_bytes is None:
            self._max_token_bytes = max(len(self.token_bytes(i)) for i in range(self.vocab_size))
        return self._max_token_bytes

    def encode_as_text(self, text: str) -> list[int]:
        """Token ids of `text` with special-token strings spelled out as ordinary text."""
        if self._text_tokenizer is None:
            self._text_tokenizer = Tokenizer.from_str(self.tokenizer.to_str())
            self._text_tokenizer.encode_special_tokens = True
        return self._text_tokenizer.encode(text, add_special_tokens=False).ids


def build_untrained_tokenizer() -> Tokenizer:
    """An empty byte-level BPE with muse's pre-tokenizer, decoder and post-processor."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # Same template transformers builds from add_bos_token=True, add_eos_token=False.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    return tokenizer


def _split_out_special_tokens(texts: Iterable[str]) -> Iterator[str]:
    # Chat-formatted training text contains the special strings; they must not feed
    # merges like "<|" + "user", which would waste vocabulary on pieces never used.
    for text in texts:
        for piece in _SPECIAL_TOKEN_SPLIT.split(text):
            if piece:
                yield piece


def train_tokenizer_from_texts(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: Path,
    model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
) -> MuseTokenizer:
    """Train a byte-level BPE on `texts`, save it to `out_dir` and return it."""
    minimum_vocab_size = NUM_SPECIAL_TOKENS + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size <= minimum_vocab_size:
        raise ValueError(
            f"vocab_size must be greater than {minimum_vocab_size} "
            f"({NUM_SPECIAL_TOKENS} special tokens + 256 byte tokens), got {vocab_size}"
        )
    tokenizer = build_untrained_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        # Listed first, so the trainer gives them ids 0..31 in this order.
        special_tokens=[AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_split_out_special_tokens(texts), trainer=trainer)
    muse_tokenizer = MuseTokenizer(tokenizer, model_max_length=model_max_length)
    muse_tokenizer.save_pretrained(out_dir)
    return muse_tokenizer


def train_tokenizer(
    files: list[Path],
    vocab_size: int,
    out_dir: Path,
    model_max_length: int = DEFAULT_MODEL_MAX_LENGTH,
) -> MuseTokenizer:
    """Train on UTF-8 text files (each file one document), save to `out_dir` and return it."""
    texts = (Path(path).read_text(encoding="utf-8") for path in files)
    return train_tokenizer_from_texts(texts, vocab_size, out_dir, model_max_length)
