"""Vocabulary-parallel embedding and LM head: at world size 1 they are nn.Embedding and a
bias-free nn.Linear over the checkpoint's table; for TP ranks (simulated in one process) each
holds, reads and looks up only its rows. The collectives at TP=2 run in `test_parallel.py`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from muse.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tests.layers.common import FakeGroup, RecordingSlice, randn, write_safetensors

EXACT = {"rtol": 0.0, "atol": 0.0}
VOCAB, DIM = 100, 16


class SharesGroup(FakeGroup):
    """A TP group whose collectives hand back this rank's part, to combine parts by hand."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x


def as_rank(monkeypatch: pytest.MonkeyPatch, world_size: int, rank: int) -> None:
    monkeypatch.setattr("muse.layers.embedding.get_tp_group",
                        lambda: SharesGroup(world_size, rank))


def load(param: nn.Parameter, loaded) -> None:
    param.weight_loader(param, loaded)


def test_embedding_equals_nn_embedding() -> None:
    reference = nn.Embedding(VOCAB, DIM)
    with torch.no_grad():
        reference.weight.copy_(randn(VOCAB, DIM, seed=0))
    layer = VocabParallelEmbedding(VOCAB, DIM)
    assert layer.weight.shape == (128, DIM)  # padded to a multiple of 64 rows
    load(layer.weight, reference.weight)
    assert (layer.weight[VOCAB:] == 0).all()
    ids = torch.tensor([[0, 1, 99], [50, 63, 64]])
    torch.testing.assert_close(layer(ids), reference(ids), **EXACT)


def test_lm_head_equals_linear_and_ties() -> None:
    reference = nn.Linear(DIM, VOCAB, bias=False)
    with torch.no_grad():
        reference.weight.copy_(randn(VOCAB, DIM, seed=1))
    head = ParallelLMHead(VOCAB, DIM)
    load(head.weight, reference.weight)
    hidden = randn(2, 3, DIM, seed=2)
    logits = head(hidden)
    assert logits.shape == (2, 3, VOCAB)  # padding columns cut off
    torch.testing.assert_close(logits, reference(hidden), **EXACT)

    embedding = VocabParallelEmbedding(VOCAB, DIM)
    load(embedding.weight, reference.weight)
    tied = ParallelLMHead(VOCAB, DIM).tie_weights(embedding)
    assert tied.weight is embedding.weight
    assert [name for name, _ in tied.named_parameters()] == ["weight"]
    torch.testing.assert_close(tied(hidden), reference(hidden), **EXACT)
    with pytest.raises(ValueError, match="same vocabulary, width and padding"):
        ParallelLMHead(VOCAB + 64, DIM).tie_weights(embedding)


@pytest.mark.parametrize(("tp", "padding"), [(2, 64), (4, 8), (3, 16)])
def test_ranks_hold_and_look_up_their_rows(monkeypatch: pytest.MonkeyPatch, tp: int,
                                           padding: int) -> None:
    table = randn(VOCAB, DIM, seed=3)
    ids = torch.arange(VOCAB).flip(0).view(4, 25)
    hidden = randn(5, DIM, seed=4)
    looked_up = torch.zeros(4, 25, DIM)
    logits = []
    for rank in range(tp):
        as_rank(monkeypatch, tp, rank)
        embedding = VocabParallelEmbedding(VOCAB, DIM, padding_size=padding)
        rows = embedding.num_embeddings_per_partition
        assert rows % padding == 0 and rows * tp >= VOCAB
        load(embedding.weight, table)
        start = rank * rows
        real = max(0, min(VOCAB - start, rows))
        torch.testing.assert_close(embedding.weight[:real], table[start:start + real], **EXACT)
        assert (embedding.weight[real:] == 0).all()
        looked_up += embedding(ids)  # this rank's rows only; the rest zero

        head = ParallelLMHead(VOCAB, DIM, padding_size=padding).tie_weights(embedding)
        logits.append(F.linear(hidden, head.weight))
    torch.testing.assert_close(looked_up, F.embedding(ids, table), **EXACT)
    torch.testing.assert_close(torch.cat(logits, -1)[:, :VOCAB], hidden @ table.t(),
                               rtol=1e-5, atol=1e-5)


def test_reads_only_its_rows(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    table = randn(VOCAB, DIM, seed=5)
    path = write_safetensors(tmp_path / "embed.safetensors", {"embed": table})
    as_rank(monkeypatch, 2, 1)  # rows 64..127 of the padded table: 36 real ones
    embedding = VocabParallelEmbedding(VOCAB, DIM)
    with safe_open(str(path), framework="pt") as checkpoint:
        source = RecordingSlice(checkpoint.get_slice("embed"))
        load(embedding.weight, source)
    assert source.elements_read == 36 * DIM
    torch.testing.assert_close(embedding.weight[:36], table[64:], **EXACT)


def test_wrong_vocabulary_is_named() -> None:
    embedding = VocabParallelEmbedding(VOCAB, DIM, prefix="model.embed_tokens")
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight: the checkpoint has 90 "
                                         r"rows where the vocabulary has 100"):
        load(embedding.weight, torch.zeros(90, DIM))
