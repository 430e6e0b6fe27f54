"""Content accuracy of captions: do the objects a caption names match the image's annotated objects?

BLEU and CIDEr reward the template; they barely notice a "blue circle" where the image has a
red square. Each caption is parsed into object mentions ``(colour, kind)``
(:func:`~vision_attn.data.caption_objects.parse_mentions`) and compared, as a multiset, with the
annotated objects (:class:`~vision_attn.data.caption_objects.AnnotatedObjects`).

**Scores** (:func:`content_accuracy`), over the images that have annotations:
``content_exact`` share of images whose multiset of ``(colour, kind)`` mentions equals the
annotated one; ``kinds_exact`` the same on kinds alone; ``content_precision`` /
``content_recall`` matched mentions (multiset intersection) over all mentions / all
annotated objects, summed over the images; ``count_acc`` share of images with as many
mentions as objects; ``content_images`` how many images were scored.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Mapping

from vision_attn.data.caption_objects import AnnotatedObjects, Mention, parse_mentions

__all__ = ["content_accuracy"]


def _kinds(mentions: Iterable[Mention]) -> Counter:
    return Counter(kind for _, kind in mentions)


def content_accuracy(captions: Mapping[Hashable, str], annotated: AnnotatedObjects) -> dict[str, float]:
    """``content_exact``, ``kinds_exact``, ``content_precision``, ``content_recall``,
    ``count_acc`` and ``content_images`` of ``{image id: caption}`` against the annotated
    objects (see the module docstring); ``{}`` when no captioned image has annotations.
    Precision is 0 when the captions mention nothing, recall 1 when nothing is annotated."""
    vocab = annotated.vocabulary()
    scored = [i for i in captions if i in annotated.objects]
    if not scored:
        return {}
    exact = kinds = counts = matched = mentioned = objects = 0
    for i in scored:
        said = Counter(parse_mentions(captions[i], vocab))
        truth = Counter(annotated.objects[i])
        exact += said == truth
        kinds += _kinds(said.elements()) == _kinds(truth.elements())
        counts += said.total() == truth.total()
        matched += (said & truth).total()
        mentioned += said.total()
        objects += truth.total()
    n = float(len(scored))
    return {
        "content_exact": exact / n,
        "kinds_exact": kinds / n,
        "content_precision": matched / mentioned if mentioned else 0.0,
        "content_recall": matched / objects if objects else 1.0,
        "count_acc": counts / n,
        "content_images": n,
    }
