"""Caption metrics: BLEU-1..4 (torchmetrics), CIDEr-D (the consensus metric COCO reports),
ROUGE-L, image dependence, and METEOR / SPICE through the COCO toolkit when Java is there.

All take captions that are already normalised (:func:`vision_attn.data.tokenizer.normalize_caption`:
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

ROUGE-L (Lin 2004) as the COCO toolkit computes it: per reference the longest common
subsequence ``LCS`` of words, precision ``LCS / len(hypothesis)`` and recall
``LCS / len(reference)``; the best precision and the best recall over the references (each
maximised on its own) give ``F = (1 + β²) P R / (R + β² P)`` with ``β = 1.2``; the corpus
score is the mean over images. (torchmetrics' ``ROUGEScore`` differs: β = 1 and the
reference with the best F, so it is not used: the numbers would not compare with papers.)

Image dependence (:func:`image_dependence`): CIDEr-D of the captions against their own images'
references minus CIDEr-D of the same captions against the references of other images (a
fixed, seeded derangement). An image-blind captioner scores about 0; a model whose captions
describe their images scores about its CIDEr-D.

METEOR and SPICE (:func:`java_metrics`) run the COCO toolkit's Java programs
(``pip install pycocoevalcap`` and a Java runtime, e.g. ``apt install default-jre-headless``).
SPICE also needs Stanford CoreNLP 3.6.0's two jars in ``pycocoevalcap/spice/lib`` (the toolkit
downloads them on first use; here nothing is downloaded). What is missing is logged and the
metric left out of the results; ``VISION_ATTN_JAVA_METRICS=0`` skips both (about 8 s of Java
start-up per evaluation).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path

import numpy as np

__all__ = ["CiderD", "bleu_scores", "caption_metrics", "caption_metrics_per_image", "cider_d", "derangement",
           "image_dependence", "java_metrics", "rouge_l"]

log = logging.getLogger(__name__)


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


class CiderD:
    """CIDEr-D with document frequencies fixed once, from a set of references (module docstring).

    :func:`cider_d` builds one from the evaluated set's references (the COCO toolkit's rule);
    self-critical training (:mod:`vision_attn.losses.scst`) builds one from the *training* set's
    references, once, and scores every sampled caption against its image's references with
    it (the statistics of ruotianluo's and later SCST implementations, "coco-train-idxs").

    Args:
        references: each image's normalised reference captions (one list per image); ``df``
            counts, per n-gram, the images whose references contain it, and the IDF's
            ``#images`` is ``len(references)``.
        n: longest n-gram.
        sigma: the Gaussian length penalty's standard deviation (in bigrams).

    Attributes:
        df: ``{n-gram tuple: number of images}``.
        log_images: ``log(len(references))``.
    """

    def __init__(self, references: Sequence[Sequence[str]], n: int = 4, sigma: float = 6.0) -> None:
        if not references:
            raise ValueError("CIDEr-D needs the references of at least one image for its document frequencies")
        self.n, self.sigma = n, sigma
        self.df: Counter = Counter()
        for refs in references:
            self.df.update({g for r in refs for g in _ngrams(r.split(), n)})
        self.log_images = math.log(float(len(references)))

    def _vectorise(self, counts: Counter) -> tuple[list[dict], np.ndarray, int]:
        """``(TF-IDF per n-gram order, their norms, number of bigrams)`` of an n-gram count."""
        vec: list[dict] = [{} for _ in range(self.n)]
        for gram, tf in counts.items():
            vec[len(gram) - 1][gram] = tf * (self.log_images - math.log(max(1.0, self.df[gram])))
        norms = np.array([math.sqrt(sum(v * v for v in d.values())) for d in vec])
        bigrams = sum(tf for gram, tf in counts.items() if len(gram) == 2)
        return vec, norms, bigrams

    def scores(self, hypotheses: Sequence[str], references: Sequence[str]) -> list[float]:
        """CIDEr-D of each of several captions of one image against that image's ``references``
        (vectorised once for all of them: SCST scores its samples and greedy caption so)."""
        if not references:
            raise ValueError("CIDEr-D needs at least one reference caption of the image")
        refs = [self._vectorise(_ngrams(r.split(), self.n)) for r in references]
        out = []
        for hyp in hypotheses:
            hv, hn, hl = self._vectorise(_ngrams(hyp.split(), self.n))
            total = np.zeros(self.n)
            for rv, rn, rl in refs:
                penalty = math.exp(-((hl - rl) ** 2) / (2 * self.sigma**2))
                for k in range(self.n):
                    dot = sum(min(w, rv[k].get(g, 0.0)) * rv[k].get(g, 0.0) for g, w in hv[k].items())
                    if hn[k] != 0 and rn[k] != 0:
                        dot /= hn[k] * rn[k]
                    total[k] += dot * penalty
            out.append(float(total.mean() / len(refs) * 10.0))
        return out

    def score(self, hypothesis: str, references: Sequence[str]) -> float:
        """CIDEr-D of one caption against its image's ``references``."""
        return self.scores([hypothesis], references)[0]


def cider_d(hypotheses: Mapping[Hashable, str], references: Mapping[Hashable, Sequence[str]], n: int = 4,
            sigma: float = 6.0) -> tuple[float, dict[Hashable, float]]:
    """``(corpus CIDEr-D, per-image scores)`` of ``{id: hypothesis}`` against ``{id: [references]}``
    (document frequencies from the references of the hypotheses' images)."""
    ids = _check(hypotheses, references)
    if not ids:
        return 0.0, {}
    scorer = CiderD([references[i] for i in ids], n, sigma)
    per_image: dict[Hashable, float] = {i: scorer.score(hypotheses[i], references[i]) for i in ids}
    return float(np.mean(list(per_image.values()))), per_image


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


def _lcs(a: Sequence[str], b: Sequence[str]) -> int:
    """Length of the longest common subsequence of two word lists (dynamic programming, one row)."""
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0  # row[j - 1] of the previous row
        for j, y in enumerate(b, start=1):
            above = row[j]
            row[j] = diagonal + 1 if x == y else max(row[j], row[j - 1])
            diagonal = above
    return row[-1]


def rouge_l(hypotheses: Mapping[Hashable, str], references: Mapping[Hashable, Sequence[str]],
            beta: float = 1.2) -> tuple[float, dict[Hashable, float]]:
    """``(corpus ROUGE-L, per-image scores)``, the COCO toolkit's definition (module docstring)."""
    ids = _check(hypotheses, references)
    per_image: dict[Hashable, float] = {}
    for i in ids:
        hyp = hypotheses[i].split()
        best_p = best_r = 0.0
        for ref in references[i]:
            words = ref.split()
            common = _lcs(hyp, words)
            best_p = max(best_p, common / len(hyp) if hyp else 0.0)
            best_r = max(best_r, common / len(words) if words else 0.0)
        per_image[i] = (1 + beta**2) * best_p * best_r / (best_r + beta**2 * best_p) if best_p and best_r else 0.0
    return float(np.mean(list(per_image.values()))) if per_image else 0.0, per_image


def derangement(n: int, seed: int = 0) -> list[int]:
    """A seeded random permutation of ``range(n)`` without fixed points (Sattolo's algorithm: a
    uniformly random ``n``-cycle), ``n >= 2``."""
    if n < 2:
        raise ValueError(f"a derangement needs at least 2 items, got {n}")
    perm = list(range(n))
    rng = np.random.default_rng(seed)
    for i in range(n - 1, 0, -1):
        j = int(rng.integers(0, i))  # j < i: every element moves
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def image_dependence(hypotheses: Mapping[Hashable, str], references: Mapping[Hashable, Sequence[str]],
                     seed: int = 0, true_cider: float | None = None) -> float:
    """CIDEr-D of the captions on their own images minus CIDEr-D of the same captions scored
    against the references of other images (image ``ids[k]``'s caption against image
    ``ids[derangement[k]]``'s references, ids in the order given). The set of references is
    the same, so CIDEr-D's document frequencies are too: only the pairing changes. Pass
    ``true_cider`` when it is already computed. Needs at least two images."""
    ids = _check(hypotheses, references)
    perm = derangement(len(ids), seed)
    shuffled = {i: references[ids[perm[k]]] for k, i in enumerate(ids)}
    own = cider_d(hypotheses, references)[0] if true_cider is None else true_cider
    return own - cider_d(hypotheses, shuffled)[0]


def _toolkit_dir() -> Path | None:
    try:
        import pycocoevalcap
    except ImportError:
        return None
    return Path(next(iter(pycocoevalcap.__path__)))


def java_metrics(hypotheses: Mapping[Hashable, str], references: Mapping[Hashable, Sequence[str]]
                 ) -> dict[str, float]:
    """``meteor`` and ``spice`` from the COCO toolkit where it can run them (module docstring);
    each one that cannot run is logged with the reason and left out."""
    if os.environ.get("VISION_ATTN_JAVA_METRICS", "1").strip().lower() in ("0", "false", "no", "off"):
        log.info("METEOR and SPICE skipped (VISION_ATTN_JAVA_METRICS=0)")
        return {}
    toolkit = _toolkit_dir()
    missing = ("the COCO caption toolkit is not installed (pip install pycocoevalcap)" if toolkit is None else
               "no Java runtime on PATH (install one, e.g. apt install default-jre-headless)"
               if shutil.which("java") is None else None)
    if missing is not None:
        log.warning("METEOR and SPICE not computed: %s", missing)
        return {}
    ids = _check(hypotheses, references)
    gts = {i: list(references[i]) for i in ids}
    res = {i: [hypotheses[i]] for i in ids}
    out: dict[str, float] = {}
    try:
        from pycocoevalcap.meteor.meteor import Meteor

        meteor = Meteor()
        try:
            out["meteor"] = float(meteor.compute_score(gts, res)[0])
        finally:
            del meteor  # stops the Java process
    except Exception as err:  # a Java or toolkit failure costs the metric, not the evaluation
        log.warning("METEOR not computed: the COCO toolkit failed (%s: %s)", type(err).__name__, err)
    corenlp = toolkit / "spice" / "lib" / "stanford-corenlp-3.6.0.jar"
    if not (corenlp.is_file() and corenlp.with_name("stanford-corenlp-3.6.0-models.jar").is_file()):
        log.warning("SPICE not computed: Stanford CoreNLP 3.6.0 is missing from %s (run "
                    "pycocoevalcap.spice.get_stanford_models once with network access)", corenlp.parent)
        return out
    try:
        from pycocoevalcap.spice.spice import Spice

        out["spice"] = float(Spice().compute_score(gts, res)[0])
    except Exception as err:
        log.warning("SPICE not computed: the COCO toolkit failed (%s: %s)", type(err).__name__, err)
    return out


def caption_metrics_per_image(hypotheses: Mapping[Hashable, str], references: Mapping[Hashable, Sequence[str]]
                              ) -> tuple[dict[str, float], dict[Hashable, dict[str, float]]]:
    """``(corpus metrics, {id: {"cider", "rouge_l"}})``: :func:`caption_metrics` and the per-image
    scores whose means they are."""
    out = bleu_scores(hypotheses, references)
    out["cider"], cider = cider_d(hypotheses, references)
    out["rouge_l"], rouge = rouge_l(hypotheses, references)
    return out, {i: {"cider": cider[i], "rouge_l": rouge[i]} for i in cider}


def caption_metrics(hypotheses: Mapping[Hashable, str],
                    references: Mapping[Hashable, Sequence[str]]) -> dict[str, float]:
    """``bleu1``..``bleu4``, ``cider`` (CIDEr-D) and ``rouge_l``: what every captioning evaluation
    reports (``eval.py`` adds :func:`image_dependence`, :func:`java_metrics` and content accuracy)."""
    return caption_metrics_per_image(hypotheses, references)[0]
