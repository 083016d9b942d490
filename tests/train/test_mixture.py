"""Training rows: fixed length, deterministic per step, loss only where it belongs."""

from __future__ import annotations

import random
import pytest
import torch

from muse.chat_format import (ASSISTANT_ID, AUDIO_ID, BOS_ID, END_OF_TURN_ID, IMAGE_ID, USER_ID,
                              VIDEO_ID)
from muse.multimodal.processor import MuseSparkProcessor, ProcessorConfig
from muse.presets import PROCESSOR_SETTINGS, get_preset
from muse.tokenizer import MuseTokenizer
from muse.train.data.conversations import (Conversation, answered_directly, conversation_tasks,
                                           unseen_tool_conversation)
from muse.train.data.mixture import (
    NO_LOSS,
    PYTHON_SOURCE,
    TASK_SOURCE,
    MixtureConfig,
    TrainingBatches,
    assistant_mask,
    emphasis_mask,
    encode_conversation,
)
from muse.train.data.python_source import PythonCorpus, SourceFile
from muse.train.data.split import TRAIN
from tests.train.helpers import NoiseSpeechPool


@pytest.fixture(scope="module")
def tokenizer() -> MuseTokenizer:
    return MuseTokenizer.base()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> PythonCorpus:
    folder = tmp_path_factory.mktemp("source")
    files = []
    for index in range(40):
        path = folder / f"module_{index}.py"
        path.write_text("".join(f"def function_{index}_{n}(x):\n    return x * {n}\n\n"
                                for n in range(30)))
        files.append(SourceFile(f"test/module_{index}.py", path))
    return PythonCorpus(files, TRAIN)


def test_assistant_mask_covers_assistant_turns_through_their_end(
        tokenizer: MuseTokenizer) -> None:
    conversation = Conversation("arithmetic", [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "reasoning_content": "2+2=4, write 4. So 4.", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "reasoning_content": "3+3=6, write 6. So 6.", "content": "6"}])
    ids, sources, media = encode_conversation(conversation, tokenizer)
    assert media == []
    trained = [token for token, source in zip(ids, sources) if source != NO_LOSS]
    expected = tokenizer.encode("<think>2+2=4, write 4. So 4.</think>4<|end|>"
                                "<think>3+3=6, write 6. So 6.</think>6<|end|>")
    assert trained == expected
    assert set(sources) == {NO_LOSS, TASK_SOURCE["arithmetic"]}
    assert assistant_mask([USER_ID, 40, ASSISTANT_ID, 41, END_OF_TURN_ID, 42]) == \
        [False, False, False, True, True, False]


def test_an_empty_reasoning_block_opening_a_reply_is_context(tokenizer: MuseTokenizer) -> None:
    """With thinking off the generation prompt writes `<think></think>`: the model learns
    the answer after it, not to write one (which would skip its reasoning when thinking)."""
    conversation = Conversation("instructions", [
        {"role": "user", "content": "Copy: abc"},
        {"role": "assistant", "reasoning_content": "", "content": "abc"},
        {"role": "user", "content": "Copy: de"},
        {"role": "assistant", "reasoning_content": "Copy it.", "content": "de"}])
    ids, sources, _ = encode_conversation(conversation, tokenizer)
    trained = [token for token, source in zip(ids, sources) if source != NO_LOSS]
    assert trained == tokenizer.encode("abc<|end|><think>Copy it.</think>de<|end|>")


def test_batches_are_fixed_length_and_deterministic(tokenizer: MuseTokenizer,
                                                    corpus: PythonCorpus) -> None:
    config = MixtureConfig(seq_len=256, batch_size=3, seed=5)
    batches = TrainingBatches(config, tokenizer, corpus)
    first = batches[4]
    assert first["input_ids"].shape == first["labels"].shape == first["sources"].shape == (3, 256)
    assert torch.equal(first["labels"][:, :-1], first["input_ids"][:, 1:])
    again = TrainingBatches(config, tokenizer, corpus)[4]
    assert first["media"] == again["media"] == []
    assert all(torch.equal(first[k], again[k]) for k in ("input_ids", "labels", "sources"))
    assert not torch.equal(first["input_ids"], batches[5]["input_ids"])
    other_seed = TrainingBatches(MixtureConfig(seq_len=256, batch_size=3, seed=6), tokenizer,
                                 corpus)[4]
    assert not torch.equal(first["input_ids"], other_seed["input_ids"])


def test_loss_is_on_assistant_turns_and_python_only(tokenizer: MuseTokenizer) -> None:
    batches = TrainingBatches(MixtureConfig(seq_len=512, batch_size=4), tokenizer, None)
    for step in range(3):
        batch = batches[step]
        for ids, labels, sources in zip(batch["input_ids"], batch["labels"], batch["sources"]):
            row = [int(ids[0])] + labels.tolist()
            expected = assistant_mask(row)[1:]
            assert [bool(s) for s in sources.tolist()] == expected
            assert PYTHON_SOURCE not in sources.tolist()


def test_python_fills_the_rest_of_each_row(tokenizer: MuseTokenizer,
                                           corpus: PythonCorpus) -> None:
    config = MixtureConfig(seq_len=1024, batch_size=8, conversation_share=0.6)
    batch = TrainingBatches(config, tokenizer, corpus)[0]
    sources = batch["sources"]
    python = (sources == PYTHON_SOURCE).float().mean().item()
    assert 0.15 < python < 0.6
    # <|bos|> starts a document: it is never a training target.
    assert not ((batch["labels"] == BOS_ID) & (sources != NO_LOSS)).any()


def test_python_chunks_have_the_requested_length(tokenizer: MuseTokenizer,
                                                 corpus: PythonCorpus) -> None:
    for seed in range(5):
        rng = random.Random(seed)
        tokens = corpus.sample_tokens(rng, 700, tokenizer)
        assert len(tokens) == 700
        assert tokens == corpus.sample_tokens(random.Random(seed), 700, tokenizer)


def test_conversation_share_is_validated() -> None:
    with pytest.raises(ValueError, match="conversation_share"):
        MixtureConfig(conversation_share=1.5)


def test_media_rows_put_each_items_spans_on_its_placeholder_tokens(
        tokenizer: MuseTokenizer) -> None:
    config = get_preset("muse-spark-default")
    processor = MuseSparkProcessor(config, ProcessorConfig(**PROCESSOR_SETTINGS[
        "muse-spark-default"]), tokenizer)
    tasks = conversation_tasks(vision=True, speech_pool=NoiseSpeechPool())
    batches = TrainingBatches(MixtureConfig(seq_len=1024, batch_size=4, seed=2), tokenizer,
                              None, tasks, processor)
    token_of = {"image": IMAGE_ID, "video": VIDEO_ID, "audio": AUDIO_ID}
    kinds = set()
    for step in range(2):
        batch = batches[step]
        ids, sources = batch["input_ids"], batch["sources"]
        covered = torch.zeros_like(ids, dtype=torch.bool)
        for item in batch["media"]:
            kinds.add(item.kind)
            for start, length in item.spans:
                assert (ids[item.row, start:start + length] == token_of[item.kind]).all()
                covered[item.row, start:start + length] = True
        placeholders = (ids == IMAGE_ID) | (ids == VIDEO_ID) | (ids == AUDIO_ID)
        assert torch.equal(covered, placeholders)
        # Media tokens are context: never a training target.
        assert not (placeholders[:, 1:] & (sources[:, :-1] != NO_LOSS)).any()
    assert kinds == {"image", "video", "audio"}


def test_the_unseen_tool_verdict_is_emphasized(tokenizer: MuseTokenizer) -> None:
    """The emphasis mask covers exactly the verdict's tokens ("I should call ..." or the
    decline) inside the assistant's reasoning; a reply without reasoning has none."""
    rng = random.Random(3)
    for _ in range(40):
        conversation = unseen_tool_conversation(rng, TRAIN)
        ids, sources, _ = encode_conversation(conversation, tokenizer)
        mask = emphasis_mask(ids, sources, conversation, tokenizer)
        marked = [token for token, flag in zip(ids, mask) if flag]
        assert tokenizer.decode(marked) == " " + conversation.emphasized[0]
        assert conversation.emphasized[0].startswith(("I should call", "It cannot", "None of"))
        assert all(source for source, flag in zip(sources, mask) if flag)
        direct = answered_directly(conversation)
        assert direct.emphasized == ()
    tasks = [task for task in conversation_tasks(vision=False) if task.name == "unseen_tools"]
    batch = TrainingBatches(MixtureConfig(seq_len=512, batch_size=3), tokenizer, None,
                            tasks)[0]
    assert batch["emphasis"].shape == batch["labels"].shape
    assert batch["emphasis"].any()
    assert (batch["sources"][batch["emphasis"]] > 0).all()


def test_an_emphasized_text_the_reply_lacks_is_an_error(tokenizer: MuseTokenizer) -> None:
    conversation = Conversation("unseen_tools", [
        {"role": "user", "content": "Scan the locker."},
        {"role": "assistant", "reasoning_content": "The tool is \"scan_locker\".",
         "content": "I scan it."}], emphasized=('I should call "scan_locker".',))
    ids, sources, _ = encode_conversation(conversation, tokenizer)
    with pytest.raises(ValueError, match="not among the assistant's tokens"):
        emphasis_mask(ids, sources, conversation, tokenizer)
