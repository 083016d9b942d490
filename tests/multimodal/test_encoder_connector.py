"""Encoder disaggregation through an EC connector (`--ec-transfer-config`): an encoder
instance (ec_producer) answers without tokens after saving its requests' encoder outputs;
a consumer reads them instead of encoding (the same tokens as an instance that encodes, and
different ones when the stored outputs are altered: it really reads them), and encodes
itself what the storage lacks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from muse.disagg.encoder_connector import ConnectedEncoders, ECTransferConfig
from tests.engine.helpers import tiny_llm
from tests.multimodal.test_engine_media import clip, greedy, image, media_prompt


def config(role: str, path: Path) -> dict:
    return {"ec_role": role, "ec_connector": "ECSharedStorageConnector",
            "ec_connector_extra_config": {"shared_storage_path": str(path)}}


def request(seed: int) -> dict:
    return {"prompt_token_ids": media_prompt(seed),
            "multi_modal_data": {"image": [image(seed)], "audio": [clip(seed)]}}


def tokens(llm, prompts: list[dict]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(prompts, greedy(), use_tqdm=False)]


@pytest.fixture(scope="module")
def plain():
    llm = tiny_llm()
    yield llm
    llm.shutdown()


def test_the_consumer_reads_what_the_encoder_instance_wrote(plain, tmp_path):
    encoder = tiny_llm(ec_transfer_config=config("ec_producer", tmp_path))
    answered = encoder.generate([request(1), request(2)], greedy(), use_tqdm=False)
    assert [(out.outputs[0].token_ids, out.outputs[0].finish_reason) for out in answered] \
        == [([], "length")] * 2
    files = sorted(tmp_path.rglob("*.safetensors"))
    assert len(files) == 4  # an image and a clip a request
    assert not encoder.engine.has_unfinished()
    encoder.shutdown()

    consumer = tiny_llm(ec_transfer_config=config("ec_consumer", tmp_path))
    want = tokens(plain, [request(1), request(2), request(3)])
    assert tokens(consumer, [request(1), request(2), request(3)]) == want
    encoders = consumer.engine.worker_encoders
    assert isinstance(encoders, ConnectedEncoders)
    assert encoders.items_loaded == 4  # request 3's items were encoded here
    consumer.shutdown()

    # Negative control: altered stored outputs change the answer.
    for path in files:
        stored = load_file(path)["embeddings"]
        save_file({"embeddings": torch.flip(stored, dims=[0]).contiguous()}, path)
    altered = tiny_llm(ec_transfer_config=config("ec_consumer", tmp_path))
    assert tokens(altered, [request(1), request(2)]) != want[:2]
    altered.shutdown()


def test_a_damaged_or_misshapen_output_is_encoded_instead(plain, tmp_path):
    tiny_llm(ec_transfer_config=config("ec_producer", tmp_path)).generate(
        [request(4)], greedy(), use_tqdm=False)
    damaged, short = sorted(tmp_path.rglob("*.safetensors"))  # the image's and the clip's
    damaged.write_bytes(b"not a safetensors file")
    stored = load_file(short)["embeddings"]
    save_file({"embeddings": stored[:-1].contiguous()}, short)  # a row short
    consumer = tiny_llm(ec_transfer_config=config("ec_consumer", tmp_path))
    assert tokens(consumer, [request(4)]) == tokens(plain, [request(4)])
    assert consumer.engine.worker_encoders.items_loaded == 0
    consumer.shutdown()


def test_another_models_outputs_are_not_read(tmp_path):
    tiny_llm(ec_transfer_config=config("ec_producer", tmp_path)).generate(
        [request(1)], greedy(), use_tqdm=False)
    other = tiny_llm(seed=7, ec_transfer_config=config("ec_consumer", tmp_path))
    other.generate([request(1)], greedy(), use_tqdm=False)
    assert other.engine.worker_encoders.items_loaded == 0
    assert len(list(tmp_path.iterdir())) == 2  # a folder per model id


@pytest.mark.parametrize(("value", "message"), [
    ({"ec_role": "ec_sender"}, "ec_role"),
    ({"ec_role": "ec_producer"}, "shared_storage_path"),
    ({"ec_role": "ec_consumer", "ec_connector": "Mooncake",
      "ec_connector_extra_config": {"shared_storage_path": "/tmp"}}, "ec_connector"),
    ({"ec_role": "ec_consumer", "colour": 1}, "unknown fields"),
    ('{"ec_role": ', "not valid JSON"),
])
def test_bad_ec_transfer_configs_are_refused(value, message):
    with pytest.raises(ValueError, match=message):
        ECTransferConfig.parse(value)


def test_vllms_example_connector_name_is_accepted(tmp_path):
    parsed = ECTransferConfig.parse(
        {"ec_role": "ec_both", "ec_connector": "ECExampleConnector",
         "ec_connector_extra_config": {"shared_storage_path": str(tmp_path)}})
    assert parsed.is_producer and parsed.is_consumer and not parsed.encodes_only
