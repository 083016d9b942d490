"""Encoder disaggregation (`encoder_workers`): the same outputs as in-process encoders (tokens
exactly, floats within float32 rounding: a worker packs fewer items, and a pack's size can
change how a CPU matmul splits its sums), with the encoder cache still in the engine; a dead worker is a clear error, not a hang;
the workers end with the engine."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from muse.engine.args import EngineArgs
from muse.multimodal.encoder_workers import EncoderWorkerPool, deal
from muse.server.launch import engine_args_from
from muse.init_checkpoint import init_random_checkpoint
from muse.presets import get_preset
from tests.engine.helpers import tiny_llm
from tests.live_server import SHUTDOWN_TIMEOUT_S, start_server, stop_server
from tests.multimodal.test_checkpoint_encoders import INIT_STD, PRESET, checkpoint_llm, without
from tests.multimodal.test_engine_media import clip, greedy, image, media_prompt
from tests.server.helpers import wait_until
from tests.server.test_media_parts import IMAGE_PROMPT_TOKENS, ask, data_url, png_bytes
from tests.server.test_serve_flags import serve_parser


def media_requests(seed: int) -> list[dict]:
    """Three requests of an image and a clip each, of different sizes: one step packs six
    items, dealt over the workers."""
    return [{"prompt_token_ids": media_prompt(seed + i),
             "multi_modal_data": {"image": [image(seed + i, (56 * (i + 1), 112))],
                                  "audio": [clip(seed + i, 0.3 + 0.4 * i)]}}
            for i in range(3)]


# How far logprobs may move when items are packed differently (float32, tiny preset).
LOGPROB_TOLERANCE = 1e-4


def assert_same_logprobs(got: list, want: list) -> None:
    """The same tokens, ranks and alternatives, their logprobs within LOGPROB_TOLERANCE."""
    assert len(got) == len(want)
    for mine, theirs in zip(got, want):
        assert (mine.token_id, mine.rank) == (theirs.token_id, theirs.rank)
        assert mine.logprob == pytest.approx(theirs.logprob, abs=LOGPROB_TOLERANCE)
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
        assert [v for _, v in mine.top] == pytest.approx([v for _, v in theirs.top],
                                                         abs=LOGPROB_TOLERANCE)


def with_logprobs():
    params = greedy()
    params.logprobs = 3
    return params


@pytest.fixture(scope="module")
def in_process():
    llm = tiny_llm()
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """The tiny preset's seed-0 weights in float32, as `tiny_llm()` draws them."""
    return init_random_checkpoint(get_preset(PRESET), tmp_path_factory.mktemp("tiny"), seed=0,
                                  dtype="float32", std=INIT_STD)


@pytest.fixture(scope="module")
def pooled():
    llm = tiny_llm(encoder_workers=2)
    yield llm
    llm.shutdown()


def test_outputs_equal_the_in_process_encoders(in_process, pooled):
    assert isinstance(pooled.engine.encoders, EncoderWorkerPool)
    requests = media_requests(20)
    expected = in_process.generate(requests, with_logprobs(), use_tqdm=False)
    got = pooled.generate(requests, with_logprobs(), use_tqdm=False)
    for want, out in zip(expected, got):
        assert out.prompt_token_ids == want.prompt_token_ids
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert want.outputs[0].logprobs
        assert_same_logprobs(out.outputs[0].logprobs, want.outputs[0].logprobs)


def test_the_workers_return_the_in_process_embeddings(in_process, pooled):
    processor = in_process.engine._processor
    items = [item for request in media_requests(40)
             for item in processor(request["prompt_token_ids"],
                                   images=request["multi_modal_data"]["image"],
                                   audios=request["multi_modal_data"]["audio"]).media]
    expected = in_process.engine.encoders.encode(items)
    got = pooled.engine.encoders.encode(items)
    assert len(got) == len(items) == 6
    for want, out in zip(expected, got):
        assert out.dtype == want.dtype and out.device == want.device
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


def test_only_cache_misses_reach_the_workers(pooled):
    pool = pooled.engine.encoders
    requests = media_requests(60)
    first = pooled.generate(requests, greedy(), use_tqdm=False)
    sent = pool.items_encoded
    again = pooled.generate(requests, greedy(), use_tqdm=False)
    assert pool.items_encoded == sent  # every item came from the engine's cache
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]


def test_media_kinds_come_from_the_config(pooled):
    assert pooled.engine.media_kinds() == ["image", "video", "audio"]


def test_a_killed_worker_is_a_clear_error_and_shutdown_ends_the_rest():
    llm = tiny_llm(encoder_workers=2)
    try:
        processes = llm.engine.encoders.processes
        os.kill(processes[1].pid, signal.SIGKILL)
        processes[1].join(timeout=30)
        # The engine's idle health check sees it before any media arrives.
        with pytest.raises(RuntimeError, match="encoder worker 1"):
            llm.engine.check_health()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"encoder worker 1 \(pid \d+\) exited with "
                                               r"code -9"):
            llm.generate(media_requests(80), greedy(), use_tqdm=False)
        assert time.monotonic() - started < 30  # noticed, not waited out
        with pytest.raises(RuntimeError, match="encoder worker 1"):  # and it stays failed
            llm.engine.encoders.encode([])  # nothing to encode still reports it
    finally:
        llm.shutdown()
    assert not any(process.is_alive() for process in processes)


def test_a_checkpoints_encoders_load_in_the_workers(checkpoint, pooled):
    llm = checkpoint_llm(checkpoint, encoder_workers=1)
    try:
        requests = media_requests(100)
        got = llm.generate(requests, with_logprobs(), use_tqdm=False)
    finally:
        llm.shutdown()
    expected = pooled.generate(requests, with_logprobs(), use_tqdm=False)
    for out, want in zip(got, expected):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert_same_logprobs(out.outputs[0].logprobs, want.outputs[0].logprobs)


def test_a_worker_that_cannot_load_fails_the_start(checkpoint, tmp_path):
    name = "vision_tower.merger.fc2.weight"
    broken = without(checkpoint, tmp_path / "broken", name)
    with pytest.raises(RuntimeError, match=rf"(?s)encoder worker 0 .* failed to build the "
                                           rf"encoders.*CheckpointError.*{name}"):
        checkpoint_llm(broken, encoder_workers=1)


def test_encoder_workers_must_be_a_non_negative_integer():
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="encoder_workers"):
            EngineArgs(encoder_workers=bad).validate()
    EngineArgs(encoder_workers=0).validate()


def test_the_serve_flag_reaches_the_engine_args():
    args = serve_parser().parse_args(["muse-spark-tiny", "--encoder-workers", "2"])
    assert engine_args_from(args).encoder_workers == 2
    assert engine_args_from(serve_parser().parse_args([])).encoder_workers == 0


def test_deal_spreads_the_tokens():
    assert deal([5, 1, 4, 2], 2) == [[0, 1], [2, 3]]  # 5 + 1 against 4 + 2
    assert deal([3], 2) == [[0], []]
    assert deal([1, 1, 1], 3) == [[0], [1], [2]]


def session_gone(session: int) -> bool:
    try:
        os.killpg(session, 0)
    except ProcessLookupError:
        return True
    return False


def test_muse_serve_with_encoder_workers(tmp_path):
    server = start_server(tmp_path, "--max-model-len", "1024", "--encoder-workers", "2")
    try:
        with server.client() as client:
            text_only = ask(client).usage.prompt_tokens
            image_part = {"type": "image_url",
                          "image_url": {"url": data_url(png_bytes(3), "image/png")}}
            reply = ask(client, image_part)
        assert reply.usage.prompt_tokens == text_only + IMAGE_PROMPT_TOKENS
        assert "encoders running in 2 worker process(es)" in server.log_path.read_text()
    finally:
        session = server.process.pid
        stop_server(server)
    # The server, its engine core and the encoder workers (all in the server's session) end.
    wait_until(lambda: session_gone(session), SHUTDOWN_TIMEOUT_S, "the session's exit")
