"""The `NixlConnector` (where the `nixl` package is installed): a decode instance pulls a
prefill instance's prompt blocks with the bytes moved by NIXL agents (UCX, host memory
here) and answers as one instance does; the bytes really come through NIXL (a read that
brings zeros changes the answer)."""

from __future__ import annotations

import pytest
import torch

from muse import SamplingParams
from muse.disagg.nixl_plane import NixlPlane, nixl_available
from tests.engine.helpers import random_prompt, tiny_llm
from tests.live_server import free_port

pytestmark = pytest.mark.skipif(not nixl_available(), reason="needs the nixl package")
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def disaggregated(prompt: list[int], request_id: str) -> tuple[list[int], int]:
    """(decode instance's output tokens, its cached prompt tokens) for `prompt`."""
    port = free_port()
    prefill = tiny_llm(kv_transfer_config={"kv_role": "kv_producer", "kv_port": port,
                                           "kv_connector": "NixlConnector"})
    decode = tiny_llm(kv_transfer_config={"kv_role": "kv_consumer",
                                          "kv_connector": "NixlConnector"})
    prefill.engine.add_request(request_id, prompt, SamplingParams(max_tokens=1),
                               kv_transfer_params={"do_remote_decode": True})
    while prefill.engine.has_unfinished():
        prefill.engine.step()
    where = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port,
             "remote_request_id": request_id}
    (request,) = decode.engine.add_request("d", prompt, PARAMS, kv_transfer_params=where)
    while decode.engine.has_unfinished():
        prefill.engine.serve_kv_pulls()
        decode.engine.step()
    assert not prefill.engine.kv_cache.holds  # let go once pulled
    for llm in (prefill, decode):
        llm.shutdown()
    return request.output_token_ids, request.num_cached_tokens


def test_a_pull_through_nixl_answers_as_one_instance_does():
    prompt = random_prompt(70, 3)
    want = tiny_llm().generate([{"prompt_token_ids": prompt}], PARAMS, use_tqdm=False)
    got, cached = disaggregated(prompt, "p")
    assert cached == 64
    assert got == want[0].outputs[0].token_ids


def test_the_blocks_come_through_nixl(monkeypatch):
    receive = NixlPlane.receive

    def zeroed(self, group, peer, shapes):
        return [torch.zeros_like(t) for t in receive(self, group, peer, shapes)]

    monkeypatch.setattr(NixlPlane, "receive", zeroed)
    prompt = random_prompt(70, 3)
    want = tiny_llm().generate([{"prompt_token_ids": prompt}], PARAMS, use_tqdm=False)
    got, cached = disaggregated(prompt, "q")
    assert cached == 64
    assert got != want[0].outputs[0].token_ids
