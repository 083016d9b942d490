"""MuseTokenizer: fixed special ids, lossless round trips, and parity with transformers."""

from __future__ import annotations

import inspect
import json
import json.decoder
import os
import random
from pathlib import Path

import pytest

from muse.chat_format import (
    BOS_ID,
    END_OF_TURN_ID,
    EOS_ID,
    NUM_SPECIAL_TOKENS,
    PAD_ID,
    SPECIAL_TOKENS,
    USER_ID,
)
from muse.tokenizer import (
    BASE_TOKENIZER_DIR,
    TOKENIZER_FILE,
    MuseTokenizer,
    build_untrained_tokenizer,
    train_tokenizer,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

CONVERSATIONS: list[tuple[list[dict], list[dict] | None]] = [
    ([{"role": "user", "content": "What is 17 * 23?"}], None),
    (
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "reasoning_content": "I should call the tool.",
                "content": None,
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Nîmes"}}},
                ],
            },
            {"role": "tool", "tool_call_id": "call_0", "content": '{"temperature": 21}'},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 24}'},
            {"role": "assistant", "content": "21 °C in Paris, 24 °C in Nîmes."},
        ],
        TOOLS,
    ),
    ([{"role": "user", "content": "Use a tool if needed: weather in Oslo?"}], TOOLS),
    (
        [
            {"role": "user", "content": [
                {"type": "text", "text": "Describe this image and this clip: "},
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                {"type": "video_url", "video_url": {"url": "https://example.com/cat.mp4"}},
                {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
            ]},
        ],
        None,
    ),
]


@pytest.fixture(scope="module")
def base() -> MuseTokenizer:
    return MuseTokenizer.base()


@pytest.fixture(scope="module")
def saved_dir(base: MuseTokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("saved_tokenizer")
    base.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def hf_tokenizer(saved_dir: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(saved_dir))


def test_base_tokenizer_special_ids_and_size(base: MuseTokenizer) -> None:
    assert base.vocab_size == 8192
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert base.token_to_id(token) == token_id
        assert base.id_to_token(token_id) == token
    assert (base.pad_token_id, base.bos_token_id, base.eos_token_id) == (PAD_ID, BOS_ID, EOS_ID) == (0, 1, 2)
    assert base.end_of_turn_token_id == END_OF_TURN_ID == 7
    assert base.stop_token_ids == [7, 2]


def test_special_token_strings_in_text_are_parsed(base: MuseTokenizer) -> None:
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert base.encode(token) == [token_id]
    ids = base.encode("hello<|user|>world<think>x</think><|end|>")
    assert ids.count(USER_ID) == 1 and ids.count(8) == 1 and ids.count(9) == 1 and ids[-1] == END_OF_TURN_ID
    # Strings that only resemble special tokens are ordinary text.
    for lookalike in ["<|user |>", "<| user|>", "<|USER|>", "<thinking>", "<|reserved_32|>", "|user|"]:
        ids = base.encode(lookalike)
        assert all(token_id >= NUM_SPECIAL_TOKENS for token_id in ids), lookalike
        assert base.decode(ids) == lookalike


def test_add_special_tokens_prepends_bos(base: MuseTokenizer) -> None:
    assert base.encode("hi", add_special_tokens=True) == [BOS_ID] + base.encode("hi")


def test_decode_skip_special_tokens(base: MuseTokenizer) -> None:
    ids = base.encode("<|bos|><|user|>Hi there<|end|>\n<|assistant|><think>ok</think>Yes<|end|><|eos|>")
    assert base.decode(ids) == "<|bos|><|user|>Hi there<|end|>\n<|assistant|><think>ok</think>Yes<|end|><|eos|>"
    assert base.decode(ids, skip_special_tokens=True) == "Hi there\nokYes"


def random_unicode_text(rng: random.Random, length: int) -> str:
    ranges = [
        (0x20, 0x7E), (0x09, 0x0D), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x6FF),
        (0x900, 0x97F), (0x3040, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF),
        (0x0300, 0x036F), (0x200B, 0x200F), (0xE000, 0xF8FF), (0x10000, 0x1007F), (0x0, 0x1F),
    ]
    chars = []
    for _ in range(length):
        low, high = rng.choice(ranges)
        chars.append(chr(rng.randint(low, high)))
    return "".join(chars)


def test_round_trip_unicode(base: MuseTokenizer) -> None:
    rng = random.Random(1234)
    samples = [random_unicode_text(rng, rng.randint(1, 300)) for _ in range(200)]
    samples += ["", " ", "  \n\n\t  ", "\r\n", "naïve café — “quotes” 🙂👍🏽 日本語のテキスト 한국어 العربية", "\x00\x7f\ufeff"]
    for text in samples:
        assert base.decode(base.encode(text)) == text


def test_round_trip_code(base: MuseTokenizer) -> None:
    for module in (json.decoder, inspect, random):
        source = inspect.getsource(module)
        ids = base.encode(source)
        assert base.decode(ids) == source
        # Trained on the stdlib: code must compress well, not fall back to bytes.
        assert len(ids) < len(source.encode("utf-8")) / 3


def test_digits_are_single_tokens(base: MuseTokenizer) -> None:
    for digit in "0123456789":
        assert len(base.encode(digit)) == 1
    digit_ids = {base.encode(digit)[0] for digit in "0123456789"}
    for text in ["1234567890", "x=2024;", "3.14159", "Call 555-0199 at 10:30", "  007", "[1,22,333]"]:
        ids = base.encode(text)
        digits_in_text = [character for character in text if character.isdigit()]
        assert [token_id for token_id in ids if token_id in digit_ids] == [base.encode(d)[0] for d in digits_in_text]
    assert_no_multi_character_digit_tokens(base)


def assert_no_multi_character_digit_tokens(tokenizer: MuseTokenizer) -> None:
    for token in tokenizer.tokenizer.get_vocab(with_added_tokens=False):
        if token not in SPECIAL_TOKENS and any(character in "0123456789" for character in token):
            assert len(token) == 1, token


def test_shipped_assets_match_code(base: MuseTokenizer) -> None:
    config = json.loads((BASE_TOKENIZER_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config == base.tokenizer_config()
    shipped = json.loads((BASE_TOKENIZER_DIR / TOKENIZER_FILE).read_text(encoding="utf-8"))
    fresh = json.loads(build_untrained_tokenizer().to_str())
    for part in ("pre_tokenizer", "decoder", "post_processor", "normalizer"):
        assert shipped[part] == fresh[part], part


def test_from_pretrained_rejects_wrong_special_ids(tmp_path: Path) -> None:
    tokenizer = build_untrained_tokenizer()
    tokenizer.add_special_tokens(list(reversed(SPECIAL_TOKENS)))
    tokenizer.save(str(tmp_path / TOKENIZER_FILE))
    with pytest.raises(ValueError, match="requires id 0"):
        MuseTokenizer.from_pretrained(tmp_path)


def test_save_and_reload_round_trip(base: MuseTokenizer, saved_dir: Path) -> None:
    reloaded = MuseTokenizer.from_pretrained(saved_dir)
    assert reloaded.vocab_size == base.vocab_size
    assert reloaded.chat_template == base.chat_template
    text = "def f(x):\n    return {'a': 1}  # ok"
    assert reloaded.encode(text) == base.encode(text)


def test_from_pretrained_reads_chat_template_file(saved_dir: Path, tmp_path: Path) -> None:
    # Folders saved by recent transformers keep the template in chat_template.jinja.
    config = json.loads((saved_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = config.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (tmp_path / TOKENIZER_FILE).write_bytes((saved_dir / TOKENIZER_FILE).read_bytes())
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}!", encoding="utf-8")
    tokenizer = MuseTokenizer.from_pretrained(tmp_path)
    assert tokenizer.chat_template != template
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"


def test_from_pretrained_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        MuseTokenizer.from_pretrained(tmp_path / "nowhere")


def test_train_tokenizer_small_corpus(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    files = []
    for index, module in enumerate((json.decoder, inspect, random)):
        path = corpus / f"part{index}.txt"
        chat = "<|user|>What is 1234 + 5678?<|end|>\n<|assistant|>6912<|end|>\n" * 200
        path.write_text(inspect.getsource(module) + chat, encoding="utf-8")
        files.append(path)

    out_dir = tmp_path / "trained"
    tokenizer = train_tokenizer(files, vocab_size=400, out_dir=out_dir)

    assert tokenizer.vocab_size == 400
    assert {path.name for path in out_dir.iterdir()} == {"tokenizer.json", "tokenizer_config.json"}
    reloaded = MuseTokenizer.from_pretrained(out_dir)
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert reloaded.token_to_id(token) == token_id
    # Frequent words were merged into whole tokens.
    assert len(reloaded.encode(" return")) == 1
    # Special strings in the corpus were kept out of the merges.
    assert all("|>" not in token for token in reloaded.tokenizer.get_vocab(with_added_tokens=False)
               if token not in SPECIAL_TOKENS)
    text = "def f(self): return 12345 <|user|>x"
    assert reloaded.decode(reloaded.encode(text)) == text
    assert len(reloaded.encode("12345")) == 5
    assert_no_multi_character_digit_tokens(reloaded)


def test_train_tokenizer_rejects_tiny_vocab(tmp_path: Path) -> None:
    path = tmp_path / "a.txt"
    path.write_text("hello", encoding="utf-8")
    with pytest.raises(ValueError, match="vocab_size must be greater than 288"):
        train_tokenizer([path], vocab_size=100, out_dir=tmp_path / "out")


def test_transformers_loads_same_ids(base: MuseTokenizer, hf_tokenizer) -> None:
    assert hf_tokenizer.bos_token_id == BOS_ID
    assert hf_tokenizer.eos_token_id == EOS_ID
    assert hf_tokenizer.pad_token_id == PAD_ID
    assert len(hf_tokenizer) == base.vocab_size
    texts = [
        "Hello, world! What is 1234 + 5678?",
        "naïve café 🙂 日本語",
        "<|user|>hi<|end|>\n<|assistant|><think>hm</think>ok<|end|>",
        "    for i in range(10):\n        print(f'{i:>3}')\n",
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    ]
    for text in texts:
        assert hf_tokenizer.encode(text, add_special_tokens=False) == base.encode(text)
        assert hf_tokenizer.encode(text) == base.encode(text, add_special_tokens=True)
        ids = base.encode(text)
        assert hf_tokenizer.decode(ids) == base.decode(ids)
        assert hf_tokenizer.decode(ids, skip_special_tokens=True) == base.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("conversation_index", range(len(CONVERSATIONS)))
@pytest.mark.parametrize(
    "template_kwargs",
    [
        {"add_generation_prompt": False},
        {"add_generation_prompt": True},
        {"add_generation_prompt": True, "enable_thinking": False},
    ],
)
def test_chat_template_matches_transformers(
    base: MuseTokenizer, hf_tokenizer, conversation_index: int, template_kwargs: dict
) -> None:
    messages, tools = CONVERSATIONS[conversation_index]
    expected_text = hf_tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **template_kwargs)
    expected_ids = hf_tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=False, **template_kwargs
    )
    text = base.apply_chat_template(messages, tools=tools, **template_kwargs)
    ids = base.apply_chat_template(messages, tools=tools, tokenize=True, **template_kwargs)
    assert text == expected_text
    assert ids == list(expected_ids)
    assert text.startswith("<|bos|>") and ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    if template_kwargs.get("enable_thinking") is False:
        assert text.endswith("<|assistant|><think></think>")
    elif template_kwargs["add_generation_prompt"]:
        assert text.endswith("<|assistant|>")


def test_unknown_role_raises_in_both(base: MuseTokenizer, hf_tokenizer) -> None:
    import jinja2

    messages = [{"role": "critic", "content": "meh"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="Unknown message role: critic"):
        base.apply_chat_template(messages)
    with pytest.raises(jinja2.exceptions.TemplateError, match="Unknown message role: critic"):
        hf_tokenizer.apply_chat_template(messages, tokenize=False)
