"""scripts/unseen_tool_pieces.py: rare name tokens counted, replies scored teacher-forced."""

from __future__ import annotations

import json
import math
import sys

import pytest

from muse.presets import SHIPPED_CHECKPOINT
from muse.tokenizer import MuseTokenizer
from muse.train.data import unseen_tools
from muse.train.data.split import HELD_OUT, TRAIN
from tests.train.helpers import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("unseen_tool_pieces")


def test_counts_see_the_pieces_only_when_names_are_pieced(script, monkeypatch) -> None:
    tokenizer = MuseTokenizer.base()
    ailer = tokenizer.encode('"tr' + 'ailer"')[2]
    assert tokenizer.decode([ailer]) == "ailer"
    held_out = script.name_token_counts(tokenizer, HELD_OUT, 200, seed=0)
    assert held_out[ailer] > 0
    pieced = script.name_token_counts(tokenizer, TRAIN, 3000, seed=0)
    monkeypatch.setattr(script.unseen_tools, "PIECE_WORD_SHARE", 0.0)
    unpieced = script.name_token_counts(tokenizer, TRAIN, 3000, seed=0)
    assert len(pieced) > len(unpieced) + 300
    assert unpieced[ailer] == 0


def test_every_piece_of_a_held_out_name_is_written_in_training_names(script) -> None:
    # A model copies a name token by token and does not write a token it never wrote in a
    # name ("trailer" is "tr" + "ailer"; without "ailer" in training it copies "trggle").
    # Only tokens that are a whole held-out word ("Ġverify") may stay out of training names.
    tokenizer = MuseTokenizer.base()
    whole_words = {tokens[0] for word in unseen_tools._held_out_words()
                   if len(tokens := tokenizer.encode(f" {word}")) == 1}
    held_out = set(script.name_token_counts(tokenizer, HELD_OUT, 300, seed=3)) - whole_words
    trained = script.name_token_counts(tokenizer, TRAIN, 20000, seed=4)
    assert not {tokenizer.decode([token]) for token in held_out if not trained[token]}


@pytest.mark.skipif(not (SHIPPED_CHECKPOINT / "config.json").is_file(),
                    reason="needs the shipped checkpoint")
def test_the_script_scores_a_model_and_writes_json(script, monkeypatch, tmp_path) -> None:
    out = tmp_path / "pieces.json"
    for share in ("MADE_UP_SHARE", "PIECE_WORD_SHARE", "COMMON_WORD_SHARE"):  # --shares sets
        monkeypatch.setattr(script.unseen_tools, share, getattr(script.unseen_tools, share))
    monkeypatch.setattr(sys, "argv", ["unseen_tool_pieces.py", str(SHIPPED_CHECKPOINT),
                                      "--num", "3", "--train-cases", "500",
                                      "--shares", "0.3,0,0.3", "--json", str(out)])
    script.main()
    result = json.loads(out.read_text())
    assert result["shares"] == [0.3, 0.0, 0.3] and "ailer" in result["rare_tokens"]
    scored, = result["models"]
    assert scored["reply_tokens"] > 50 and scored["rare_tokens"] > 0
    assert 0 < scored["reply_nll"] and 0 < scored["rare_nll"] and math.isfinite(scored["rare_nll"])
    assert math.isclose(scored["rare_probability"], math.exp(-scored["rare_nll"]))
