"""Word tokenizer: normalisation shared by training and metrics, stable ids, special tokens."""

from __future__ import annotations

import pytest

from vision_attn.data.tokenizer import SPECIAL_TOKENS, WordTokenizer, normalize_caption
from vision_attn.errors import CheckpointError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("A red Circle.", "a red circle"),
        ("two shapes: a red star, and a blue cross!", "two shapes a red star and a blue cross"),
        ("  Tabs\tand\nnewlines  ", "tabs and newlines"),
        ("The dog\u2019s ball", "the dog's ball"),
        ("'quoted' words -- dashes", "quoted words dashes"),
        ("\uff21 full-width", "a full width"),  # NFKC
        ("...", ""),
    ],
)
def test_normalize_caption(text, expected):
    assert normalize_caption(text) == expected


def test_train_orders_by_frequency_then_alphabetically_and_is_deterministic():
    caps = ["a red circle", "A blue circle.", "a red star", "zebra"]
    tok = WordTokenizer.train(caps)
    assert tok.vocab[:4] == list(SPECIAL_TOKENS)
    assert tok.vocab[4:] == ["a", "circle", "red", "blue", "star", "zebra"]
    assert WordTokenizer.train(reversed(caps)).vocab == tok.vocab
    assert WordTokenizer.train(caps, min_freq=2).vocab[4:] == ["a", "circle", "red"]
    assert WordTokenizer.train(caps, max_size=2).vocab[4:] == ["a", "circle"]


def test_encode_decode_round_trip_unknown_words_and_truncation():
    tok = WordTokenizer.train(["a red circle", "a blue star"])
    ids = tok.encode("A red, circle!")
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == "a red circle"
    assert tok.encode("a green circle")[2] == tok.unk_id
    assert tok.encode("a red circle a blue star", max_length=4) == [tok.bos_id, tok.index["a"], tok.index["red"], tok.eos_id]
    # decoding stops at <eos>, skips <bos>/<pad>
    assert tok.decode([tok.bos_id, tok.index["star"], tok.eos_id, tok.index["red"], tok.pad_id]) == "star"
    assert tok.pad_id == 0


def test_bad_vocabulary_is_a_clear_error():
    with pytest.raises(CheckpointError, match="must start with the special tokens"):
        WordTokenizer(["a", "b"])
    with pytest.raises(CheckpointError, match="'a' twice"):
        WordTokenizer([*SPECIAL_TOKENS, "a", "a"])
