"""Content of captions checked against their references alone (no boxes needed).

BLEU and CIDEr reward a caption for the template it shares with the references: "the digit six
is above the digit seven" scores well on every image of a dataset whose captions follow that
template. A split without an instances file still says what each image holds: in its references.
These scores compare the *content words* of a caption with those of its image's references.

**Vocabulary** (:class:`ContentVocabulary`): the object words are given (a text file, one word per
line, ``--explain.content_words``) or found in the references (:meth:`ContentVocabulary.from_references`):
the words that vary between images (in the references of at most ``max_share`` of the images)
and that an image's references agree on (on average in at least ``min_agreement`` of the
references of an image that has them). Template words (in every image's references) and
paraphrase words (in one reference of five) are left out; a word that is both (``two`` in "two
digits side by side" and as a digit's name) may be missed: give the words in a file then.
Relation words are spatial words (:data:`RELATIONS`), each mapped to a canonical relation;
``below`` is ``above`` read the other way round, ``right`` is ``left`` the other way round.

**Scores** (:func:`reference_content`), over the images with references, each caption against
the best-matching reference of its image:

- ``objects_exact``: share of captions whose object words equal, as a multiset, those of at
  least one reference ("two sevens" counts seven twice);
- ``relations_exact``: share whose object words *and* relations equal those of one reference. A
  relation is read between the object words before and after a relation word ("a six above a
  seven", "a seven below a six" and "a six on the left and a seven on the right" each give one
  relation); ``X below Y`` is the same relation as ``Y above X``;
- ``hallucination_rate`` (CHAIR-i, Rohrbach et al. 2018): object words of the captions that no
  reference of the image contains, over all object words of the captions;
- ``hallucinated_captions`` (CHAIR-s): share of captions with at least one such word;
- ``content_vocabulary``: how many object words were checked.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["RELATIONS", "ContentVocabulary", "content_signature", "reference_checks", "reference_content", "words"]

RELATIONS: dict[str, str] = {
    # word -> canonical relation of the object before it to the object after it
    "above": "above", "over": "above", "atop": "above", "top": "above",
    "below": "below", "under": "below", "beneath": "below", "underneath": "below", "bottom": "below",
    "left": "left", "right": "right",
    "beside": "beside", "next": "beside", "near": "beside", "by": "beside",
}
INVERSE = {"above": "below", "below": "above", "left": "right", "right": "left"}
SYMMETRIC = {"beside"}
NUMBERS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "several": 2, "pair": 2}
"""Count words: ``two sevens`` counts ``seven`` twice (a count word that is also an object word,
such as ``six`` among digit names, counts only when the next word is an object word)."""

_WORD = re.compile(r"[a-z0-9]+")

Triple = tuple[str, str, str]


def words(caption: str) -> list[str]:
    """The lower-case words of ``caption`` (letters and digits; punctuation dropped)."""
    return _WORD.findall(caption.lower())


@dataclass(frozen=True)
class ContentVocabulary:
    """The object words checked, and the relation words (word -> canonical relation)."""

    objects: frozenset[str]
    relations: Mapping[str, str] = field(default_factory=lambda: dict(RELATIONS))

    def object_of(self, word: str) -> str | None:
        """The object word ``word`` names (itself, or its singular), ``None`` if none."""
        if word in self.objects:
            return word
        for singular in (word[:-2], word[:-1]) if word.endswith("es") else (word[:-1],) if word.endswith("s") else ():
            if singular in self.objects:
                return singular
        return None

    @classmethod
    def from_file(cls, path: str | Path) -> ContentVocabulary:
        """One object word per line; empty lines and ``#`` comments skipped.

        Raises:
            ValueError: the file cannot be read or names no word.
        """
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"content words {path}: cannot be read ({err}); give a text file, one word per line") \
                from err
        found = {w for line in text.splitlines() for w in words(line.split("#", 1)[0])}
        if not found:
            raise ValueError(f"content words {path}: no word in the file; give one object word per line")
        return cls(frozenset(found))

    @classmethod
    def from_references(cls, references: Mapping[Hashable, Sequence[str]], max_share: float = 0.5,
                        min_agreement: float = 0.5) -> ContentVocabulary:
        """The words that vary between images and that an image's references agree on (see the
        module docstring); relation words are never object words (count words may be: digit names)."""
        images = [refs for refs in references.values() if refs]
        in_images: Counter = Counter()
        agreement: Counter = Counter()
        for refs in images:
            per_ref = [set(words(r)) for r in refs]
            seen = set().union(*per_ref)
            in_images.update(seen)
            for w in seen:
                agreement[w] += sum(w in s for s in per_ref) / len(per_ref)
        n = len(images)
        objects = {w for w, k in in_images.items()
                   if k <= max_share * n and agreement[w] / k >= min_agreement
                   and w not in RELATIONS}
        # a plural form of another object word is that word
        objects = {w for w in objects if not any(s in objects for s in (w[:-1], w[:-2]) if w.endswith("s"))}
        return cls(frozenset(objects))


def _objects(tokens: Sequence[str], vocab: ContentVocabulary) -> list[tuple[int, str, int]]:
    """``(position, object word, count)`` of each object mention."""
    out = []
    for i, token in enumerate(tokens):
        name = vocab.object_of(token)
        if name is None:
            continue
        if i and tokens[i - 1] in NUMBERS and (tokens[i - 1] not in vocab.objects or token != tokens[i - 1]):
            count = NUMBERS[tokens[i - 1]]
            if out and out[-1][0] == i - 1:  # "six sevens": "six" counted, not named
                out.pop()
        else:
            count = 1
        out.append((i, name, count))
    return out


def _canonical(a: str, relation: str, b: str) -> Triple:
    if relation in SYMMETRIC:
        return (min(a, b), relation, max(a, b))
    flipped = (b, INVERSE[relation], a) if relation in INVERSE else None
    return min((a, relation, b), flipped) if flipped else (a, relation, b)


def content_signature(caption: str, vocab: ContentVocabulary) -> tuple[Counter, Counter]:
    """``(object words as a multiset, relations as a multiset of canonical triples)`` of
    ``caption``: a relation word between two object mentions relates them (the nearest on each
    side)."""
    tokens = words(caption)
    mentions = _objects(tokens, vocab)
    objects: Counter = Counter()
    for _, name, count in mentions:
        objects[name] += count
    triples: Counter = Counter()
    for i, token in enumerate(tokens):
        relation = vocab.relations.get(token)
        if relation is None:
            continue
        before = [name for pos, name, _ in mentions if pos < i]
        after = [name for pos, name, _ in mentions if pos > i]
        if before and after:
            triples[_canonical(before[-1], relation, after[0])] += 1
    return objects, triples


def reference_checks(caption: str, references: Sequence[str], vocab: ContentVocabulary) -> dict[str, Any]:
    """One caption's content against its references: ``objects_exact`` (the object words, with
    their counts, equal those of a reference), ``relations_exact`` (and the relations too, of the
    same reference), ``hallucinated`` (object words no reference of the image uses, one entry per
    mention), ``named`` (the object words it says, with repeats) and ``referenced`` (those the
    references use)."""
    said, said_triples = content_signature(caption, vocab)
    signatures = [content_signature(r, vocab) for r in references]
    same_objects = [t for o, t in signatures if o == said]
    known = set().union(*(o.keys() for o, _ in signatures))
    return {"objects_exact": bool(same_objects), "relations_exact": any(t == said_triples for t in same_objects),
            "hallucinated": [name for name, k in said.items() if name not in known for _ in range(k)],
            "named": list(said.elements()), "referenced": sorted(known)}


def reference_content(captions: Mapping[Hashable, str], references: Mapping[Hashable, Sequence[str]],
                      vocab: ContentVocabulary | None = None) -> dict[str, float]:
    """``objects_exact``, ``relations_exact``, ``hallucination_rate``, ``hallucinated_captions``
    and ``content_vocabulary`` of ``{image id: caption}`` against ``{image id: references}`` (see
    the module docstring); the vocabulary is found in ``references`` when not given. ``{}`` when
    no captioned image has references or the vocabulary is empty."""
    vocab = vocab or ContentVocabulary.from_references(references)
    scored = [i for i in captions if references.get(i)]
    if not scored or not vocab.objects:
        return {}
    checks = [reference_checks(captions[i], references[i], vocab) for i in scored]
    hallucinated = sum(len(c["hallucinated"]) for c in checks)
    said_total = sum(len(c["named"]) for c in checks)
    n = float(len(scored))
    return {
        "objects_exact": sum(c["objects_exact"] for c in checks) / n,
        "relations_exact": sum(c["relations_exact"] for c in checks) / n,
        "hallucination_rate": hallucinated / said_total if said_total else 0.0,
        "hallucinated_captions": sum(bool(c["hallucinated"]) for c in checks) / n,
        "content_vocabulary": float(len(vocab.objects)),
    }
