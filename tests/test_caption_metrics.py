"""BLEU and CIDEr-D against the COCO caption toolkit (pycocoevalcap) and hand-computed cases."""

from __future__ import annotations

import math
import random

import pytest

from vision_attn.caption_metrics import bleu_scores, caption_metrics, cider_d

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
    assert set(caption_metrics(hyps, refs)) == {"bleu1", "bleu2", "bleu3", "bleu4", "cider"}
    with pytest.raises(KeyError, match="image id 99"):
        cider_d({99: "a"}, refs)
    with pytest.raises(ValueError, match="empty reference list"):
        cider_d({1: "a"}, {1: []})
