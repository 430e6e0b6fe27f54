"""Content checks of captions against their references alone: hand-made cases, and that a
template-only or image-blind captioner scores near chance while a reading one scores 1."""

from __future__ import annotations

import random

import pytest

from vision_attn.metrics.reference_content import ContentVocabulary, content_signature, reference_content

DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TEMPLATES = [  # (a, b): a is above (vertical) or left of (horizontal) b
    ("vertical", "the digit {a} is above the digit {b}"),
    ("vertical", "a {b} below a {a}"),
    ("vertical", "a {a} on top and a {b} at the bottom"),
    ("vertical", "there is a {a} over a {b}"),
    ("horizontal", "a {a} on the left and a {b} on the right"),
    ("horizontal", "the digit {a} is left of the digit {b}"),
    ("horizontal", "a {b} to the right of a {a}"),
    ("horizontal", "digits side by side: {a} and then {b}, the {a} left of the {b}"),
]


def scenes(n: int, seed: int = 0) -> tuple[dict[int, tuple[str, str, str]], dict[int, list[str]]]:
    """``{id: (layout, a, b)}`` and five references per image, each from a random template of its layout."""
    rng = random.Random(seed)
    truth, refs = {}, {}
    for i in range(n):
        layout = rng.choice(["vertical", "horizontal"])
        a, b = rng.sample(DIGITS, 2)
        truth[i] = (layout, a, b)
        kinds = [t for k, t in TEMPLATES if k == layout]
        refs[i] = [rng.choice(kinds).format(a=a, b=b) for _ in range(5)]
    return truth, refs


def test_the_vocabulary_found_in_the_references_is_the_digit_names():
    _, refs = scenes(300)
    vocab = ContentVocabulary.from_references(refs)
    assert vocab.objects == frozenset(DIGITS)


def test_hand_made_cases():
    vocab = ContentVocabulary(frozenset(DIGITS))
    refs = {1: ["the digit six is above the digit seven", "a seven below a six"]}
    assert reference_content({1: "a six over a seven"}, refs, vocab)["relations_exact"] == 1.0
    assert reference_content({1: "a seven under a six"}, refs, vocab)["relations_exact"] == 1.0
    swapped = reference_content({1: "a seven above a six"}, refs, vocab)
    assert swapped["objects_exact"] == 1.0 and swapped["relations_exact"] == 0.0
    assert swapped["hallucination_rate"] == 0.0
    wrong = reference_content({1: "a six above a nine"}, refs, vocab)
    assert wrong == {"objects_exact": 0.0, "relations_exact": 0.0, "hallucination_rate": 0.5,
                     "hallucinated_captions": 1.0, "content_vocabulary": 10.0}
    # a missing object is not a hallucination, but the objects differ
    missing = reference_content({1: "a six"}, refs, vocab)
    assert missing["objects_exact"] == 0.0 and missing["hallucination_rate"] == 0.0
    # counts: "two sevens" is seven twice (and "two" is not named)
    objects, _ = content_signature("two sevens side by side", vocab)
    assert objects == {"seven": 2}
    twins = {2: ["a seven next to a seven", "two sevens"]}
    assert reference_content({2: "two sevens"}, twins, vocab)["objects_exact"] == 1.0
    assert reference_content({2: "a seven"}, twins, vocab)["objects_exact"] == 0.0
    # left / right: the relation read between the two mentions, either way round
    horizontal = {3: ["a two on the left and a five on the right"]}
    assert reference_content({3: "a five to the right of a two"}, horizontal, vocab)["relations_exact"] == 1.0
    assert reference_content({3: "a two to the right of a five"}, horizontal, vocab)["relations_exact"] == 0.0
    # images without references are not scored
    assert reference_content({9: "a six"}, refs, vocab) == {}


def test_a_reading_captioner_scores_one_and_template_or_blind_ones_near_chance():
    truth, refs = scenes(400, seed=1)
    rng = random.Random(2)
    reading = {i: f"a {a} above a {b}" if layout == "vertical" else f"a {a} left of a {b}"
               for i, (layout, a, b) in truth.items()}
    template = dict.fromkeys(truth, "the digit six is above the digit seven")
    blind = {i: "a {} above a {}".format(*rng.sample(DIGITS, 2)) for i in truth}
    layout_only = {i: "a six above a seven" if layout == "vertical" else "a six left of a seven"
                   for i, (layout, _, _) in truth.items()}
    good = reference_content(reading, refs)
    assert good["objects_exact"] == 1.0 and good["relations_exact"] == 1.0 and good["hallucination_rate"] == 0.0
    chance = 2 / (10 * 9)  # one unordered pair of digits out of 45
    for captions in (template, blind, layout_only):
        scores = reference_content(captions, refs)
        assert scores["objects_exact"] < 4 * chance + 0.02
        assert scores["relations_exact"] <= scores["objects_exact"]
        assert scores["hallucination_rate"] > 0.6


def test_a_content_words_file(tmp_path):
    path = tmp_path / "words.txt"
    path.write_text("# digits\nsix\nseven  # and more\n\n")
    assert ContentVocabulary.from_file(path).objects == {"six", "seven"}
    (tmp_path / "empty.txt").write_text("# nothing\n")
    with pytest.raises(ValueError, match="empty.txt: no word"):
        ContentVocabulary.from_file(tmp_path / "empty.txt")
    with pytest.raises(ValueError, match="missing.txt: cannot be read"):
        ContentVocabulary.from_file(tmp_path / "missing.txt")
