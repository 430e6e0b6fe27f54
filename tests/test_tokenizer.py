"""Word tokenizer: normalisation shared by training and metrics, stable ids, special tokens."""

from __future__ import annotations

import json
import pickle
import re
import unicodedata

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
    assert tok.encode("a red circle a blue star", max_length=4) == [tok.bos_id, tok.index["a"], tok.index["red"],
                                                                    tok.eos_id]
    # decoding stops at <eos>, skips <bos>/<pad>
    assert tok.decode([tok.bos_id, tok.index["star"], tok.eos_id, tok.index["red"], tok.pad_id]) == "star"
    assert tok.pad_id == 0


def test_bad_vocabulary_is_a_clear_error():
    with pytest.raises(CheckpointError, match="must start with the special tokens"):
        WordTokenizer(["a", "b"])
    with pytest.raises(CheckpointError, match="'a' twice"):
        WordTokenizer([*SPECIAL_TOKENS, "a", "a"])


# --- the pipeline is a tokenizers WordLevel model, saved as its JSON ------------------------------

_REF_NOT_WORD = re.compile(r"[^\w']+|_")
_REF_LONE_APOSTROPHE = re.compile(r"(^|\s)'+|'+(\s|$)")


def _reference_normalize(text: str) -> str:
    """The rules as written before the tokenizers pipeline (Python's re and str.lower)."""
    text = unicodedata.normalize("NFKC", text).lower().replace("\u2019", "'")
    return " ".join(_REF_LONE_APOSTROPHE.sub(" ", _REF_NOT_WORD.sub(" ", text)).split())


def test_normalisation_equals_the_reference_rules_on_common_scripts():
    ranges = [(0x0, 0x530), (0x1E00, 0x2070), (0x2100, 0x2200), (0x3000, 0x3040), (0xFF00, 0xFFF0)]
    chars = [chr(c) for lo, hi in ranges for c in range(lo, hi)
             if unicodedata.category(chr(c)) not in ("Cn", "Cs")]  # assigned in Python's tables
    for c in chars:
        for text in (f"a{c}b", c, f"A{c}{c}", f"'{c}' x"):
            assert normalize_caption(text) == _reference_normalize(text), (hex(ord(c)), text)
    for text in ("ΟΔΟΣ ΚΑΛΟΣ.", "ΣΑΣ", "Don\u2019t 'stop' it's", "caf\u0065\u0301 na\u00efve"):
        assert normalize_caption(text) == _reference_normalize(text)
    assert normalize_caption("ΟΔΟΣ") == "οδος"  # a final capital sigma lower-cases to ς, as str.lower does


def test_the_pipeline_is_a_tokenizers_wordlevel_model_saved_as_json():
    from tokenizers import Tokenizer

    tok = WordTokenizer.train(["a red circle", "A blue circle.", "a red star"], min_freq=1)
    text = tok.to_json()
    spec = json.loads(text)
    assert spec["model"]["type"] == "WordLevel" and spec["model"]["unk_token"] == "<unk>"
    # the JSON alone encodes as the tokenizer does: normalisation, words, <bos>/<eos>
    assert Tokenizer.from_str(text).encode("A red, circle!").ids == tok.encode("A red, circle!")
    back = WordTokenizer.from_json(text)
    assert back.vocab == tok.vocab and back.encode("a blue star circle", max_length=4) == tok.encode(
        "a blue star circle", max_length=4)
    # the special tokens are words of the vocabulary, not markers matched in raw text
    assert tok.encode("<unk> <bos>") == [tok.bos_id, tok.unk_id, tok.unk_id, tok.eos_id]
    assert pickle.loads(pickle.dumps(tok)).encode("a red star") == tok.encode("a red star")  # loader workers


def test_old_checkpoints_vocabulary_lists_and_new_json_both_restore():
    vocab = [*SPECIAL_TOKENS, "a", "red", "circle"]  # what checkpoints stored before the JSON
    old = WordTokenizer.restore(vocab)
    new = WordTokenizer.restore(old.to_json())
    assert old.vocab == new.vocab == vocab
    assert old.encode("a red square") == new.encode("a red square") == [1, 4, 5, 3, 2]
    with pytest.raises(CheckpointError, match="not a tokenizers JSON"):
        WordTokenizer.restore("{not json")
    bpe = json.loads(old.to_json())
    bpe["model"] = {"type": "BPE", "vocab": {}, "merges": []}
    with pytest.raises(CheckpointError, match="not a WordLevel model"):
        WordTokenizer.restore(json.dumps(bpe))
    shuffled = json.loads(old.to_json())
    shuffled["model"]["vocab"] = {"a": 0, "<pad>": 1, "<bos>": 2, "<eos>": 3, "<unk>": 4}
    with pytest.raises(CheckpointError, match="must start with the special tokens"):
        WordTokenizer.restore(json.dumps(shuffled))


def test_a_stored_text_pipeline_runs_none_of_its_own_rules(caplog, monkeypatch):
    """Only the stored vocabulary is read: a normaliser that doubles every letter 25 times (2 KB of
    JSON, gigabytes per caption) or a regex that panics the Rust engine is never compiled or run;
    a differing pipeline is named in a warning. Vocabularies over the limit are refused."""
    import logging

    good = WordTokenizer([*SPECIAL_TOKENS, "a", "cat"])
    spec = json.loads(good.to_json())
    doubling = {"type": "Replace", "pattern": {"String": "a"}, "content": "aa"}
    for normalizer in ({"type": "Sequence", "normalizers": [doubling] * 25},
                       {"type": "Replace", "pattern": {"Regex": "(a|a)+$"}, "content": "x"}):
        spec["normalizer"] = normalizer
        with caplog.at_level(logging.WARNING):
            tok = WordTokenizer.restore(json.dumps(spec))
        assert tok.encode("a cat") == good.encode("a cat") == [1, 4, 5, 2]
        assert "text pipeline differs" in caplog.text
        caplog.clear()
    with caplog.at_level(logging.WARNING):
        WordTokenizer.restore(good.to_json())
    assert "differs" not in caplog.text  # its own JSON: no warning
    for bad, match in (({"a": "0"}, "mapping of words to ids"), ([], "mapping of words to ids")):
        spec["model"]["vocab"] = bad
        with pytest.raises(CheckpointError, match=match):
            WordTokenizer.restore(json.dumps(spec))
    monkeypatch.setenv("VISION_ATTN_MAX_VOCAB", "5")
    with pytest.raises(CheckpointError, match="6 words, over the limit of 5"):
        WordTokenizer.restore(good.to_json())


def test_a_real_sized_vocabulary_is_stored_and_checked_as_a_checkpoint_argument():
    """A captioner trained on COCO-sized captions stores a tokenizer JSON far longer than other
    strings a checkpoint may hold; it passes the argument check, and an oversized one does not."""
    from vision_attn.schema import check_value

    tok = WordTokenizer([*SPECIAL_TOKENS, *(f"word{i}" for i in range(20_000))])
    text = tok.to_json()
    assert len(text) > 1 << 18
    check_value(text, list[str] | str | None, "model.init_args.vocab", "checkpoint x")
    with pytest.raises(CheckpointError, match="model.init_args.name"):
        check_value(text, str, "model.init_args.name", "checkpoint x")
