"""SamplingParams refuses bad values where it is built, as vLLM's does, and still travels to
the engine process intact."""

from __future__ import annotations

import msgspec
import pytest

from muse.engine.errors import InvalidRequestError
from muse.engine.sampling_params import SamplingParams
from muse.server.messages import AddRequest, ToEngine


@pytest.mark.parametrize("fields, param", [
    (dict(temperature=-1), "temperature"),
    (dict(temperature=None), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(n=0), "n"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=3), "min_tokens"),
    (dict(logprobs=21), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(seed=1.5), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
])
def test_the_constructor_refuses_bad_values_naming_the_field(fields, param):
    with pytest.raises(ValueError) as error:  # what vLLM users catch
        SamplingParams(**fields)
    assert isinstance(error.value, InvalidRequestError)
    assert error.value.param == param
    assert f"`{param}`" in str(error.value)


def test_vocabulary_checks_wait_for_the_model():
    params = SamplingParams(stop_token_ids=[9000], logit_bias={9000: 1.0})
    params.validate(vocab_size=10_000)
    with pytest.raises(InvalidRequestError, match=r"\[0, 8192\)") as error:
        params.validate(vocab_size=8192)
    assert error.value.param == "stop_token_ids"
    with pytest.raises(InvalidRequestError, match="8192") as error:
        SamplingParams(logit_bias={9000: 1.0}).validate(vocab_size=8192)
    assert error.value.param == "logit_bias"


def test_validate_also_catches_a_field_assigned_after_construction():
    params = SamplingParams()
    params.top_p = 0.0
    with pytest.raises(InvalidRequestError, match="`top_p`"):
        params.validate(vocab_size=8192)


def test_vllm_spellings_are_accepted():
    params = SamplingParams(stop="\n", top_k=-1)
    assert (params.stop, params.top_k) == (["\n"], 0)
    params = SamplingParams(stop=None, stop_token_ids=None)
    assert (params.stop, params.stop_token_ids) == ([], [])


def test_params_survive_the_trip_to_the_engine_process():
    params = SamplingParams(temperature=0.5, top_k=-1, stop="x", logit_bias={3: 1.5}, seed=7,
                            max_tokens=None)
    decoded = msgspec.msgpack.Decoder(ToEngine).decode(
        msgspec.msgpack.encode(AddRequest("a", [1, 2], params)))
    assert decoded.params == params


def test_decoding_runs_the_same_checks():
    # msgspec calls __post_init__ on decode: a bad value cannot slip into the engine process.
    params = SamplingParams()
    params.temperature = -1.0
    payload = msgspec.msgpack.encode(AddRequest("a", [1, 2], params))
    with pytest.raises(msgspec.ValidationError, match="`temperature`"):
        msgspec.msgpack.Decoder(ToEngine).decode(payload)
