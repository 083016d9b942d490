"""The offline API as a new user meets it: chat replies split into reasoning and answer,
streamed outputs, the progress bar, and one-line errors for a wrong device or model."""

from __future__ import annotations

import functools
import io
import sys

import pytest
import torch
from tqdm import tqdm

from muse import LLM, SamplingParams
from muse.chat_format import THINK_END_ID, THINK_END_TOKEN, THINK_START_TOKEN
from muse.cli import main
from muse.presets import SHIPPED_CHECKPOINT
from muse.reasoning import split_reasoning
from muse.server.parsers.reasoning import MuseReasoningParser
from tests.engine.helpers import random_prompt, tiny_llm

needs_shipped_model = pytest.mark.skipif(not (SHIPPED_CHECKPOINT / "config.json").is_file(),
                                         reason="no shipped checkpoint in this tree")
needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
QUESTION = [{"role": "user", "content": "What is 37+45?"}]


def greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **extra)


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return tiny_llm()


@pytest.fixture(scope="module")
def shipped() -> LLM:
    return LLM(str(SHIPPED_CHECKPOINT), device="cpu")


# ---- splitting a reply ---------------------------------------------------------------------
@pytest.mark.parametrize("text, thinking, want", [
    ("<think>7+5=12</think>82", True, ("7+5=12", "82")),
    ("\n<think>a</think>b", True, ("a", "b")),
    ("<think>ran out of tokens", True, ("ran out of tokens", "")),
    ("82", True, (None, "82")),
    ("a</think>b", True, (None, "a</think>b")),  # a late tag is text when thinking is on
    ("7+5=12</think>82", False, ("7+5=12", "82")),
    ("<think>a</think>b</think>", False, ("a", "b")),
    ("<think>ran out", False, ("ran out", "")),
    ("82", False, (None, "82")),
    ("8<think>2", False, (None, "82")),
])
def test_a_reply_splits_into_reasoning_and_content(text, thinking, want):
    assert split_reasoning(text, thinking) == want


def test_the_server_parser_splits_the_same_way():
    for text in ("<think>a</think>b", " <think>a", "a</think>b", "plain"):
        assert MuseReasoningParser().parse(text) == split_reasoning(text)


# ---- chat ----------------------------------------------------------------------------------
@needs_shipped_model
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_chat_gives_the_reasoning_apart_from_the_answer(shipped, skip_special_tokens):
    reply = shipped.chat(QUESTION, greedy(64, skip_special_tokens=skip_special_tokens)
                         )[0].outputs[0]
    assert reply.text == "82"
    assert reply.reasoning_content.endswith("So 82.")
    assert THINK_START_TOKEN not in reply.reasoning_content + reply.text
    assert THINK_END_TOKEN not in reply.reasoning_content + reply.text


@needs_shipped_model
def test_chat_without_thinking_never_shows_a_think_tag(shipped):
    reply = shipped.chat(QUESTION, greedy(64), enable_thinking=False)[0].outputs[0]
    same = shipped.chat(QUESTION, greedy(64), chat_template_kwargs={"enable_thinking": False}
                        )[0].outputs[0]
    assert same == reply
    assert THINK_START_TOKEN not in reply.text and THINK_END_TOKEN not in reply.text
    # Nothing is lost: the reasoning the model wrote anyway, its closing tag and the answer.
    # Without the final <|end|> when the reply ended its turn (not when max_tokens cut it).
    ended = reply.finish_reason == "stop"
    written = shipped.tokenizer.decode(reply.token_ids[:-1] if ended else reply.token_ids)
    if reply.reasoning_content is None:
        assert written == reply.text
    else:
        assert written == reply.reasoning_content + THINK_END_TOKEN + reply.text


def test_chat_without_thinking_treats_text_before_a_closing_tag_as_reasoning(tiny):
    # The tiny model is pushed to write only closing tags, even with special tokens shown.
    params = greedy(3, ignore_eos=True, skip_special_tokens=False,
                    logit_bias={THINK_END_ID: 100.0})
    reply = tiny.chat(QUESTION, params, enable_thinking=False)[0].outputs[0]
    assert reply.token_ids == [THINK_END_ID] * 3
    assert (reply.reasoning_content, reply.text) == ("", "")
    plain = tiny.generate([[5, 6, 7]], params)[0].outputs[0]
    assert (plain.reasoning_content, plain.text) == (None, THINK_END_TOKEN * 3)


@needs_shipped_model
def test_muse_chat_prints_the_reasoning_then_the_answer(capsys):
    main(["chat", "--message", "What is 37+45?", "--device", "cpu"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("thinking: ") and lines[0].endswith("So 82.")
    assert lines[-1] == "82"


@needs_shipped_model
def test_muse_chat_keeps_the_reasoning_out_of_the_history(monkeypatch, capsys):
    conversations: list[list[dict]] = []
    chat = LLM.chat

    def recording_chat(self, messages, *args, **kwargs):
        conversations.append([dict(m) for m in messages])
        return chat(self, messages, *args, **kwargs)

    monkeypatch.setattr(LLM, "chat", recording_chat)
    main(["chat", "--message", "What is 37+45?", "--message", "What is 12+30?",
          "--device", "cpu"])
    assistant = conversations[1][1]
    assert assistant["role"] == "assistant" and assistant["content"] == "82"
    assert assistant["reasoning_content"].endswith("So 82.")
    assert capsys.readouterr().out.splitlines()[-1] == "42"


# ---- streaming -----------------------------------------------------------------------------
def test_delta_stream_pieces_add_up_to_the_final_output(tiny):
    prompts = [random_prompt(9, 300), random_prompt(14, 301)]
    params = greedy(12, n=2, ignore_eos=True)
    final = tiny.generate(prompts, params, use_tqdm=False)
    texts: dict[tuple[str, int], str] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    for piece in tiny.stream(prompts, params, delta=True):
        for sample in piece.outputs:
            key = (piece.request_id, sample.index)
            texts[key] = texts.get(key, "") + sample.text
            tokens[key] = tokens.get(key, []) + sample.token_ids
    request_ids = sorted({request_id for request_id, _ in texts}, key=int)
    for request_id, want in zip(request_ids, final):
        for sample in want.outputs:
            assert texts[request_id, sample.index] == sample.text
            assert tokens[request_id, sample.index] == sample.token_ids


def test_cumulative_stream_outputs_are_prefixes_of_the_final_text(tiny):
    # A stop string made of two generated tokens: after the first of them, that token's text
    # may start the stop string, so it must not be shown yet.
    prompt = random_prompt(10, 310)
    token_ids = tiny.generate([prompt], greedy(12, ignore_eos=True))[0].outputs[0].token_ids
    pieces = [tiny.tokenizer.decode([t]) for t in token_ids]
    full = "".join(pieces)
    index = next(i for i in range(2, len(pieces) - 1)
                 if pieces[i].strip() and "\ufffd" not in pieces[i] + pieces[i + 1]
                 and full.find(pieces[i] + pieces[i + 1]) == len("".join(pieces[:i])))
    params = greedy(12, ignore_eos=True, stop=[pieces[index] + pieces[index + 1]])
    partials = [o.outputs[0].text for o in tiny.stream([prompt], params)]
    assert partials[-1] == "".join(pieces[:index])
    assert all(partials[-1].startswith(text) for text in partials)


# ---- progress bar --------------------------------------------------------------------------
class TerminalStderr(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_generate_shows_a_progress_bar_on_a_terminal_only(tiny, monkeypatch, capsys):
    prompts = [random_prompt(6, 320), random_prompt(7, 321)]
    tiny.generate(prompts, greedy(3))
    assert "Processed prompts" not in capsys.readouterr().err  # not a terminal
    terminal = TerminalStderr()
    monkeypatch.setattr(sys, "stderr", terminal)
    tiny.generate(prompts, greedy(3))
    assert "Processed prompts" in terminal.getvalue() and "2/2" in terminal.getvalue()
    quiet = TerminalStderr()
    monkeypatch.setattr(sys, "stderr", quiet)
    tiny.generate(prompts, greedy(3), use_tqdm=False)
    tiny.chat(QUESTION, greedy(3), use_tqdm=False)
    assert quiet.getvalue() == ""


def test_a_progress_bar_factory_always_shows_its_bar(tiny):
    log = io.StringIO()  # not a terminal
    tiny.generate([random_prompt(6, 330)], greedy(3), use_tqdm=functools.partial(tqdm, file=log))
    assert "Processed prompts" in log.getvalue() and "1/1" in log.getvalue()


# ---- engine arguments ----------------------------------------------------------------------
def test_an_unknown_model_is_named_as_a_missing_folder_and_not_a_preset(capsys):
    with pytest.raises(ValueError, match=r"checkpoint folder 'no/such/model' does not exist "
                                         r"\(and it is not a preset: one of .*muse-spark-tiny"):
        LLM("no/such/model")
    with pytest.raises(SystemExit) as exit_info:
        main(["chat", "no/such/model", "--message", "hi"])
    assert exit_info.value.code == 2
    error, = capsys.readouterr().err.strip().splitlines()
    assert error.startswith("muse chat: error: checkpoint folder 'no/such/model' does not exist")


@needs_no_gpu
def test_cuda_without_a_gpu_is_a_one_line_error(capsys):
    with pytest.raises(ValueError, match="CUDA is not available on this machine; use --device "
                                         "cpu"):
        LLM("muse-spark-tiny", device="cuda")
    for command in (["generate", "muse-spark-tiny", "--prompt", "x"],
                    ["chat", "muse-spark-tiny", "--message", "x"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*command, "--device", "cuda"])
        assert exit_info.value.code == 2
        error, = capsys.readouterr().err.strip().splitlines()
        assert error.startswith(f"muse {command[0]}: error: ")
        assert error.endswith("CUDA is not available on this machine; use --device cpu")


def test_a_device_that_is_not_one_names_the_choices():
    with pytest.raises(ValueError, match="`device` must be 'auto', 'cpu', 'cuda'"):
        LLM("muse-spark-tiny", device="gpu")
