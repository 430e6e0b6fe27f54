"""The objects a caption names, and the objects a split annotates: what content accuracy compares.

BLEU and CIDEr reward the template; they barely notice a "blue circle" where the image has a
red square. When a split has instance annotations (the embedded scenes always do; COCO has
``instances_<split>.json`` next to the captions), each caption is parsed into object
*mentions* ``(colour, kind)`` and compared, as a multiset, with the annotated objects.

**Vocabulary.** Kind words are the category names (``"circle"``, ``"traffic light"``), for
COCO also the synonyms in :data:`COCO_SYNONYMS` ("man", "woman", "people" name a person);
colour words are the colour values found in the annotations (an object's ``"colour"`` key, as
the embedded scenes write it). When no annotated object has a colour, colours are ignored and
mentions are ``(None, kind)``.

**Parsing** (:func:`parse_mentions`), on the normalised words (:func:`normalize_caption`):

- a kind is the longest category phrase starting at a word; its last word may be a plural
  ("circles", "crosses", "ponies", "knives", "men", "people");
- a colour word belongs to the next kind word when that comes at most three words later
  ("a red circle", "red small shiny circle"); farther away ("a red thing next to a circle") or
  after another kind, it names nothing;
- a number word ("one" ... "ten", digits, "pair", "couple", "no" = 0) at most three words
  before the next kind word counts that many objects ("two red circles" = two red circles); without one a kind
  counts once, plural or not ("circles" = one mention: the number it stands for is unknown);
- a generic noun (:data:`GENERIC_NOUNS`: "shapes", "objects", ...) ends a pending colour or
  number ("two shapes: a circle and a square" is one circle and one square);
- a word that is both a category and a number (a "two" in a dataset of digits) is a category;
- every other word is ignored.

Limitations (documented, measured on the embedded captions: they parse exactly): a caption
that names an object twice ("two circles: a red circle and a blue circle") counts it twice;
negation beyond "no", relative clauses and coreference are not understood.

The scores are :func:`vision_attn.metrics.caption_content.content_accuracy`.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from vision_attn.data.tokenizer import normalize_caption

__all__ = [
    "COCO_SYNONYMS",
    "GENERIC_NOUNS",
    "NUMBER_WORDS",
    "AnnotatedObjects",
    "Mention",
    "ObjectVocabulary",
    "parse_mentions",
]

Mention = tuple[str | None, str]  # (colour or None, kind = category name)

NUMBER_WORDS: dict[str, int] = {
    "no": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
    "ten": 10, "pair": 2, "couple": 2, **{str(n): n for n in range(11)},
}
GENERIC_NOUNS: frozenset[str] = frozenset(
    {"shape", "shapes", "object", "objects", "thing", "things", "item", "items", "figure", "figures"})
WINDOW = 3  # a colour / number word reaches the kind word at most this many words after it

# COCO category name -> other words that name it (a small, hand-made list: the frequent ones).
COCO_SYNONYMS: dict[str, tuple[str, ...]] = {
    "person": ("man", "woman", "people", "boy", "girl", "child", "kid", "guy", "lady", "player", "skier", "surfer",
               "skateboarder", "snowboarder", "baby", "adult", "rider"),
    "bicycle": ("bike", "cycle"),
    "motorcycle": ("motorbike", "motor bike", "scooter"),
    "airplane": ("plane", "jet", "aeroplane", "airliner", "aircraft"),
    "car": ("taxi", "sedan"),
    "dog": ("puppy", "pup"),
    "cat": ("kitten", "kitty"),
    "horse": ("pony", "foal"),
    "sheep": ("lamb",),
    "cow": ("cattle", "calf", "bull", "ox"),
    "couch": ("sofa",),
    "tv": ("television", "tv set"),
    "dining table": ("table",),
    "cell phone": ("phone", "cellphone", "mobile phone", "smartphone"),
    "laptop": ("computer", "notebook"),
    "sports ball": ("ball", "soccer ball", "football", "baseball", "tennis ball"),
    "hair drier": ("hair dryer", "blow dryer"),
    "donut": ("doughnut",),
    "skis": ("ski",),
    "potted plant": ("plant", "houseplant"),
    "teddy bear": ("teddy", "stuffed bear"),
    "cup": ("mug",),
}

_IRREGULAR_SINGULAR = {"men": "man", "women": "woman", "people": "person", "children": "child", "mice": "mouse",
                       "feet": "foot", "teeth": "tooth", "geese": "goose", "oxen": "ox", "calves": "calf",
                       "knives": "knife", "leaves": "leaf", "wolves": "wolf", "shelves": "shelf"}


def _singular_forms(word: str) -> set[str]:
    """The word and every singular it could be the plural of (checked against the vocabulary)."""
    forms = {word}
    if word in _IRREGULAR_SINGULAR:
        forms.add(_IRREGULAR_SINGULAR[word])
    if word.endswith("ies") and len(word) > 4:
        forms.add(word[:-3] + "y")
    if word.endswith("ves") and len(word) > 4:
        forms.update({word[:-3] + "f", word[:-3] + "fe"})
    if word.endswith("es") and len(word) > 3:
        forms.add(word[:-2])
    if word.endswith("s") and not word.endswith("ss") and len(word) > 2:
        forms.add(word[:-1])
    return forms


@dataclass
class ObjectVocabulary:
    """Which word sequences name which category, and which words are colours.

    Args:
        categories: category names (normalised: lower case, single spaces).
        colours: colour words (empty: colours are ignored).
        synonyms: per category name, more phrases naming it (default :data:`COCO_SYNONYMS`;
            only the entries of ``categories`` are used).
    """

    categories: Sequence[str]
    colours: frozenset[str] = frozenset()
    synonyms: Mapping[str, Sequence[str]] = field(default_factory=lambda: COCO_SYNONYMS)

    def __post_init__(self) -> None:
        self.colours = frozenset(self.colours)
        self.phrases: dict[tuple[str, ...], str] = {}
        for name in self.categories:
            for phrase in (name, *self.synonyms.get(name, ())):
                words = tuple(normalize_caption(phrase).split())
                if words:
                    self.phrases.setdefault(words, name)  # a category's own name wins over a synonym
        for name in self.categories:  # ... and over another category's synonym
            self.phrases[tuple(normalize_caption(name).split())] = name
        self.longest = max((len(p) for p in self.phrases), default=0)

    def match(self, words: Sequence[str], i: int) -> tuple[str, int] | None:
        """``(category, number of words)`` of the longest kind phrase starting at ``words[i]``
        (its last word possibly plural), or ``None``."""
        for n in range(min(self.longest, len(words) - i), 0, -1):
            head = tuple(words[i : i + n - 1])
            for last in _singular_forms(words[i + n - 1]):
                name = self.phrases.get((*head, last))
                if name is not None:
                    return name, n
        return None


def parse_mentions(caption: str, vocab: ObjectVocabulary) -> list[Mention]:
    """The object mentions ``[(colour or None, category)]`` of one caption, in caption order
    (the rules are in the module docstring)."""
    words = normalize_caption(caption).split()
    mentions: list[Mention] = []
    colour: tuple[int, str] | None = None  # (position, word) waiting for its kind word
    number: tuple[int, int] | None = None  # (position, count)
    i = 0
    while i < len(words):
        found = vocab.match(words, i)
        if found is not None:
            kind, span = found
            named = colour[1] if colour is not None and i - colour[0] <= WINDOW else None
            count = number[1] if number is not None and i - number[0] <= WINDOW else 1
            mentions.extend([(named, kind)] * count)
            colour = number = None
            i += span
            continue
        word = words[i]
        if word in vocab.colours:
            colour = (i, word)
        elif word in NUMBER_WORDS:
            number = (i, NUMBER_WORDS[word])
        elif word in GENERIC_NOUNS:
            colour = number = None
        i += 1
    return mentions


@dataclass
class AnnotatedObjects:
    """The annotated objects of a split, as content accuracy reads them.

    Attributes:
        categories: category names (normalised).
        colours: the colour words that occur in the annotations (empty: none annotated).
        objects: per image id, its objects ``[(colour or None, category)]`` (colour ``None``
            everywhere when ``colours`` is empty). Images absent here are not scored.
        synonyms: more phrases per category (:data:`COCO_SYNONYMS` by default).
    """

    categories: list[str]
    colours: list[str]
    objects: dict[Hashable, list[Mention]]
    synonyms: Mapping[str, Sequence[str]] = field(default_factory=lambda: COCO_SYNONYMS)

    def vocabulary(self) -> ObjectVocabulary:
        return ObjectVocabulary(self.categories, frozenset(self.colours), self.synonyms)
