"""BLEU, CIDEr-D, ROUGE-L and METEOR against the COCO caption toolkit (pycocoevalcap) and
hand-computed cases; image dependence on an image-blind and a perfect captioner."""

from __future__ import annotations

import logging
import math
import random
import shutil

import pytest

from vision_attn.metrics import caption as cm
from vision_attn.metrics.caption import (
    bleu_scores,
    caption_metrics,
    caption_metrics_per_image,
    cider_d,
    derangement,
    image_dependence,
    java_metrics,
    rouge_l,
)

WORDS = "a red blue green circle square star cross on the left right of and two three shapes there are".split()


def _fixed_set(seed: int = 0, n: int = 40):
    rng = random.Random(seed)
    refs = {i: [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 10))) for _ in range(rng.randint(1, 5))]
            for i in range(n)}
    hyps = {i: " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 10))) for i in range(n)}
    for i in range(0, n, 4):  # some good hypotheses, so scores are far from zero
        hyps[i] = refs[i][0]
    for i in range(1, n, 4):
        hyps[i] = refs[i][-1] + " " + rng.choice(WORDS)
    return hyps, refs


def test_cider_d_equals_pycocoevalcap():
    from pycocoevalcap.cider.cider import Cider

    hyps, refs = _fixed_set()
    expected, expected_per_image = Cider().compute_score(refs, {i: [h] for i, h in hyps.items()})
    score, per_image = cider_d(hyps, refs)
    assert score > 1.0  # a non-trivial case
    assert score == pytest.approx(expected, abs=1e-12)
    assert [per_image[i] for i in sorted(refs)] == pytest.approx(list(expected_per_image), abs=1e-12)


def test_bleu_matches_pycocoevalcap():
    from pycocoevalcap.bleu.bleu import Bleu

    hyps, refs = _fixed_set(1)
    expected, _ = Bleu(4).compute_score(refs, {i: [h] for i, h in hyps.items()}, verbose=0)
    ours = bleu_scores(hyps, refs)
    assert [ours[f"bleu{k}"] for k in range(1, 5)] == pytest.approx(expected, abs=1e-5)


def test_hand_computed_cases():
    # Two images, exact matches: BLEU is 1.
    hyps = {1: "a red circle", 2: "a blue star on the left"}
    refs = {1: ["a red circle"], 2: ["a blue star on the left"]}
    assert all(v == pytest.approx(1.0) for v in bleu_scores(hyps, refs).values())
    # CIDEr-D by hand: image 1 shares no n-gram with image 2's references except "a" (df = 2,
    # idf = log(2/2) = 0), so its unigram vector is {red, circle} x log 2 and matches itself:
    # cosine 1 for n = 1, 2 ("red circle"; "a red" has idf log 2 too) ... all four orders where defined.
    score, per_image = cider_d({1: "a red circle", 2: "a blue star"}, {1: ["a red circle"], 2: ["a blue star"]})
    # n = 1..3 have non-zero vectors with cosine 1; for n = 4 both vectors are empty -> 0.
    assert per_image[1] == pytest.approx(10 * 3 / 4)
    assert score == pytest.approx(7.5)
    # Length penalty: one extra bigram (delta = 1) multiplies by exp(-1/72).
    _, per = cider_d({1: "red circle", 2: "x"}, {1: ["red circle left"], 2: ["blue star"]})
    l2 = math.log(2)
    cos1 = (2 * l2 * l2) / (math.sqrt(2 * l2 * l2) * math.sqrt(3 * l2 * l2))
    cos2 = (l2 * l2) / (l2 * math.sqrt(2 * l2 * l2))
    assert per[1] == pytest.approx(10 * (cos1 + cos2) / 4 * math.exp(-1 / 72))


def test_caption_metrics_keys_and_errors():
    hyps, refs = _fixed_set(2, 8)
    assert set(caption_metrics(hyps, refs)) == {"bleu1", "bleu2", "bleu3", "bleu4", "cider", "rouge_l"}
    with pytest.raises(KeyError, match="image id 99"):
        cider_d({99: "a"}, refs)
    with pytest.raises(ValueError, match="empty reference list"):
        cider_d({1: "a"}, {1: []})


def test_per_image_scores_average_to_the_corpus_scores():
    hyps, refs = _fixed_set(3)
    corpus, per_image = caption_metrics_per_image(hyps, refs)
    assert set(per_image) == set(hyps)
    for key in ("cider", "rouge_l"):
        assert sum(p[key] for p in per_image.values()) / len(per_image) == pytest.approx(corpus[key], abs=1e-12)
    assert [per_image[i]["cider"] for i in sorted(hyps)] == [cider_d(hyps, refs)[1][i] for i in sorted(hyps)]


def test_rouge_l_equals_pycocoevalcap():
    from pycocoevalcap.rouge.rouge import Rouge

    hyps, refs = _fixed_set(4)
    expected, expected_per_image = Rouge().compute_score(refs, {i: [h] for i, h in hyps.items()})
    score, per_image = rouge_l(hyps, refs)
    assert score > 0.2
    assert score == pytest.approx(expected, abs=1e-12)
    assert [per_image[i] for i in sorted(refs)] == pytest.approx(list(expected_per_image), abs=1e-12)


def test_rouge_l_hand_computed():
    # against "a red circle": LCS 3, P = 3/6, R = 3/3; against "the left circle": LCS 2 ("the
    # left"), P = 2/6, R = 2/3. The best P (1/2) and the best R (1) are combined, beta = 1.2.
    score, per = rouge_l({1: "a red circle on the left"}, {1: ["a red circle", "the left circle"]})
    p, r, b2 = 0.5, 1.0, 1.2**2
    assert per[1] == pytest.approx((1 + b2) * p * r / (r + b2 * p))
    assert score == per[1]
    assert rouge_l({1: "x y", 2: "a b c"}, {1: ["z"], 2: ["c b a"]})[1] == pytest.approx(
        {1: 0.0, 2: (1 + b2) / 3 * (1 / 3) / (1 / 3 + b2 / 3)})  # LCS 1 of 3 each way


@pytest.mark.parametrize("n", [2, 3, 7, 50])
def test_derangement_moves_every_item(n):
    for seed in range(5):
        perm = derangement(n, seed)
        assert sorted(perm) == list(range(n)) and all(p != i for i, p in enumerate(perm))
        assert perm == derangement(n, seed)  # seeded
    with pytest.raises(ValueError, match="at least 2"):
        derangement(1)


def test_image_dependence():
    # Two images: the derangement swaps them. Own references: CIDEr-D 7.5 (test_hand_computed_cases);
    # the other image's: only "a" is shared, whose idf is log(2/2) = 0, so 0.
    hyps, refs = {1: "a red circle", 2: "a blue star"}, {1: ["a red circle"], 2: ["a blue star"]}
    assert image_dependence(hyps, refs) == pytest.approx(7.5)
    # An image-blind captioner (one caption for every image) scores exactly as well against any
    # pairing of the same reference lists: 0. Correct captions lose almost everything when moved.
    _, many = _fixed_set(5, 40)
    blind = {i: "a red circle on the left of a blue star" for i in many}
    assert cider_d(blind, many)[0] > 0.1
    assert image_dependence(blind, many) == pytest.approx(0.0, abs=1e-9)
    perfect = {i: r[0] for i, r in many.items()}
    cider = cider_d(perfect, many)[0]
    assert image_dependence(perfect, many) > 0.8 * cider > 1.0
    assert image_dependence(perfect, many, true_cider=cider) == image_dependence(perfect, many)


def test_java_metrics_equal_the_toolkit_or_are_reported_missing(monkeypatch, caplog):
    hyps, refs = _fixed_set(6, 12)
    monkeypatch.setenv("VISION_ATTN_JAVA_METRICS", "1")  # the test suite's conftest switches Java off
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger="vision_attn.metrics.caption"):
        assert java_metrics(hyps, refs) == {}
    assert "METEOR and SPICE not computed: no Java runtime on PATH" in caplog.text
    monkeypatch.undo()
    monkeypatch.setenv("VISION_ATTN_JAVA_METRICS", "0")
    assert java_metrics(hyps, refs) == {}
    monkeypatch.setenv("VISION_ATTN_JAVA_METRICS", "1")
    if shutil.which("java") is None or cm._toolkit_dir() is None:
        pytest.skip("no Java runtime or no pycocoevalcap: METEOR cannot run here")
    from pycocoevalcap.meteor.meteor import Meteor

    # one Java run: the toolkit's own score of the toolkit's input layout (references as lists,
    # one hypothesis per id), recorded as the toolkit computes it
    calls = []
    compute = Meteor.compute_score

    def recorded(self, gts, res):
        calls.append((gts, res, compute(self, gts, res)[0]))
        return calls[-1][2], None

    monkeypatch.setattr(Meteor, "compute_score", recorded)
    ours = java_metrics(hyps, refs)
    assert len(calls) == 1
    gts, res, expected = calls[0]
    assert gts == {i: list(r) for i, r in refs.items()} and res == {i: [h] for i, h in hyps.items()}
    assert ours["meteor"] == expected and 0.05 < ours["meteor"] < 1.0
