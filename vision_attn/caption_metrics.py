"""Caption metrics: BLEU-1..4 (torchmetrics) and CIDEr-D (the consensus metric COCO reports).

Both take captions that are already normalised (:func:`vision_attn.data.tokenizer.normalize_caption`:
lower case, no punctuation, words separated by single spaces), a hypothesis per image and
several references per image.

CIDEr-D (Vedantam et al., 2015) for one image: for ``n = 1..4`` the hypothesis and each reference
become TF-IDF vectors of their n-grams — term frequency times ``log(#images / df)``, where
``df`` is the number of images whose references contain the n-gram (the statistics come from
the evaluated set's references, as in the COCO toolkit). The score per reference is the cosine
similarity with the hypothesis counts clipped at the reference's (``min(h, r) · r``), times a
Gaussian length penalty ``exp(-(l_h - l_r)^2 / (2 σ^2))``, ``σ = 6``. It is averaged over
references and over ``n`` and scaled by 10; the corpus score is the mean over images. As in the
COCO toolkit, lengths are counted in bigrams.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence

import numpy as np

__all__ = ["bleu_scores", "caption_metrics", "cider_d"]


def _ngrams(words: Sequence[str], max_n: int) -> Counter:
    return Counter(tuple(words[i : i + n]) for n in range(1, max_n + 1) for i in range(len(words) - n + 1))


def _check(hypotheses: Mapping[Hashable, str], references: Mapping[Hashable, Sequence[str]]) -> list[Hashable]:
    missing = [k for k in hypotheses if k not in references]
    if missing:
        raise KeyError(f"no references for image id {missing[0]!r} ({len(missing)} hypotheses without references)")
    empty = [k for k in hypotheses if not references[k]]
    if empty:
        raise ValueError(f"image id {empty[0]!r} has an empty reference list")
    return list(hypotheses)


def cider_d(hypotheses: Mapping[Hashable, str], references: Mapping[Hashable, Sequence[str]], n: int = 4,
            sigma: float = 6.0) -> tuple[float, dict[Hashable, float]]:
    """``(corpus CIDEr-D, per-image scores)`` of ``{id: hypothesis}`` against ``{id: [references]}``."""
    ids = _check(hypotheses, references)
    refs = {i: [_ngrams(r.split(), n) for r in references[i]] for i in ids}
    df: Counter = Counter()
    for i in ids:
        df.update({g for r in refs[i] for g in r})
    log_images = math.log(float(len(ids)))

    def vectorise(counts: Counter) -> tuple[list[dict], np.ndarray, int]:
        vec: list[dict] = [{} for _ in range(n)]
        for gram, tf in counts.items():
            vec[len(gram) - 1][gram] = tf * (log_images - math.log(max(1.0, df[gram])))
        norms = np.array([math.sqrt(sum(v * v for v in d.values())) for d in vec])
        bigrams = sum(tf for gram, tf in counts.items() if len(gram) == 2)
        return vec, norms, bigrams

    per_image: dict[Hashable, float] = {}
    for i in ids:
        hv, hn, hl = vectorise(_ngrams(hypotheses[i].split(), n))
        total = np.zeros(n)
        for r in refs[i]:
            rv, rn, rl = vectorise(r)
            penalty = math.exp(-((hl - rl) ** 2) / (2 * sigma**2))
            for k in range(n):
                dot = sum(min(w, rv[k].get(g, 0.0)) * rv[k].get(g, 0.0) for g, w in hv[k].items())
                if hn[k] != 0 and rn[k] != 0:
                    dot /= hn[k] * rn[k]
                total[k] += dot * penalty
        per_image[i] = float(total.mean() / len(refs[i]) * 10.0)
    return float(np.mean(list(per_image.values()))) if per_image else 0.0, per_image


def bleu_scores(hypotheses: Mapping[Hashable, str], references: Mapping[Hashable, Sequence[str]],
                max_n: int = 4) -> dict[str, float]:
    """Corpus BLEU-1..``max_n`` (torchmetrics' ``BLEUScore``, uniform weights, no smoothing).

    The brevity penalty uses the reference length closest to each hypothesis; on a tie the
    shorter one (as BLEU's definition and the COCO toolkit do; torchmetrics takes the first
    listed, so the references are passed shortest first).
    """
    from torchmetrics.text import BLEUScore

    ids = _check(hypotheses, references)
    preds = [hypotheses[i] for i in ids]
    targets = [sorted(references[i], key=lambda r: len(r.split())) for i in ids]
    return {f"bleu{k}": float(BLEUScore(n_gram=k)(preds, targets)) for k in range(1, max_n + 1)}


def caption_metrics(hypotheses: Mapping[Hashable, str], references: Mapping[Hashable, Sequence[str]]) -> dict[str, float]:
    """``bleu1``..``bleu4`` and ``cider`` (CIDEr-D): what ``eval.py`` writes for captioning."""
    out = bleu_scores(hypotheses, references)
    out["cider"] = cider_d(hypotheses, references)[0]
    return out
