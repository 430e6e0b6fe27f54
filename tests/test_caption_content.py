"""Content accuracy: the caption parser on hand-made captions (plurals, numbers, colours out of
reach, unknown words, COCO synonyms), the scores on a hand-computed set, the instances reader,
and the embedded scenes' own reference captions (they must parse into exactly their objects)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from vision_attn.data.caption_objects import AnnotatedObjects, ObjectVocabulary, parse_mentions
from vision_attn.data.captioning import instances_file_for, read_annotated_objects, read_captions
from vision_attn.data.synthetic import COLOURS, SHAPES, SceneSetConfig, ensure_shapes_coco
from vision_attn.metrics.caption_content import content_accuracy

SHAPE_VOCAB = ObjectVocabulary(list(SHAPES), frozenset(COLOURS))
COCO_VOCAB = ObjectVocabulary(["person", "dog", "dining table", "teddy bear", "bear", "knife", "bus", "sheep"])


@pytest.mark.parametrize(("caption", "expected"), [
    ("a red circle and a blue square", [("red", "circle"), ("blue", "square")]),
    ("A Red Circle, and a BLUE square.", [("red", "circle"), ("blue", "square")]),  # normalised first
    ("red circles", [("red", "circle")]),  # a plural without a number counts once
    ("two red circles", [("red", "circle")] * 2),
    ("three crosses and two yellow stars", [(None, "cross")] * 3 + [("yellow", "star")] * 2),
    ("two large red circles", [("red", "circle")] * 2),  # the number three words before the kind
    ("two of the large red circles", [("red", "circle")]),  # five words before: out of reach
    ("red small shiny circle", [("red", "circle")]),  # the colour three words before
    ("a red thing next to a circle", [(None, "circle")]),  # the colour too far from the kind
    ("red and a small circle", [(None, "circle")]),  # four words: too far
    ("a red circle and square", [("red", "circle"), (None, "square")]),  # a colour names one kind only
    ("a red blue circle", [("blue", "circle")]),  # the nearer colour
    ("a purple hexagon next to a green circle", [("green", "circle")]),  # unknown words name nothing
    ("a black circle", [(None, "circle")]),  # not an annotated colour
    ("two shapes a red circle and a blue star", [("red", "circle"), ("blue", "star")]),  # "shapes" ends "two"
    ("two shapes a circle", [(None, "circle")]),
    ("no circles", []),
    ("an empty picture", []),
    ("", []),
])
def test_parse_shapes_captions(caption, expected):
    assert parse_mentions(caption, SHAPE_VOCAB) == expected


@pytest.mark.parametrize(("caption", "expected"), [
    ("two men and a dog at a dining table", [(None, "person")] * 2 + [(None, "dog"), (None, "dining table")]),
    ("a teddy bear next to a bear", [(None, "teddy bear"), (None, "bear")]),  # the longest phrase first
    ("three knives on a table", [(None, "knife")] * 3 + [(None, "dining table")]),  # synonym, -ves plural
    ("people walking past two buses", [(None, "person"), (None, "bus"), (None, "bus")]),
    ("a woman with her puppies", [(None, "person"), (None, "dog")]),
    ("a flock of sheep", [(None, "sheep")]),
    ("a red dog", [(None, "dog")]),  # no annotated colours: colour words are ordinary words
])
def test_parse_coco_captions(caption, expected):
    assert parse_mentions(caption, COCO_VOCAB) == expected


def test_category_words_that_are_numbers_are_categories():
    digits = ObjectVocabulary(["zero", "one", "two", "three", "seven"])
    assert parse_mentions("a two above a zero", digits) == [(None, "two"), (None, "zero")]
    assert parse_mentions("two sevens", digits) == [(None, "two"), (None, "seven")]


def test_content_accuracy_hand_computed():
    annotated = AnnotatedObjects(
        categories=list(SHAPES), colours=sorted(COLOURS),
        objects={1: [("red", "circle"), ("blue", "square")], 2: [("red", "circle"), ("red", "circle")],
                 3: [("green", "star")], 4: [("red", "cross"), ("blue", "circle")]})
    captions = {1: "a blue square to the right of a red circle",  # exact (order does not matter)
                2: "two red circles",  # exact
                3: "a blue star",  # the kind right, the colour wrong
                4: "a red cross",  # one object missing
                5: "a red circle"}  # no annotations: not scored
    scores = content_accuracy(captions, annotated)
    assert scores == pytest.approx({
        "content_exact": 2 / 4, "kinds_exact": 3 / 4, "count_acc": 3 / 4,
        "content_precision": (2 + 2 + 0 + 1) / (2 + 2 + 1 + 1), "content_recall": (2 + 2 + 0 + 1) / (2 + 2 + 1 + 2),
        "content_images": 4.0})
    assert content_accuracy({9: "a red circle"}, annotated) == {}
    nothing = content_accuracy({1: "an empty picture", 3: "nothing"}, annotated)
    assert nothing["content_precision"] == 0.0 and nothing["content_recall"] == 0.0


def test_instances_reader(tmp_path):
    ann = tmp_path / "annotations"
    ann.mkdir()
    cats = [{"id": 1, "name": "person"}, {"id": 18, "name": "Dog"}, {"id": 67, "name": "dining table"}]
    anns = [{"id": 1, "image_id": 5, "category_id": 1}, {"id": 2, "image_id": 5, "category_id": 1},
            {"id": 3, "image_id": 5, "category_id": 18}, {"id": 4, "image_id": 5, "category_id": 1, "iscrowd": 1},
            {"id": 5, "image_id": 6, "category_id": 67}, {"id": 6, "image_id": 6, "category_id": 99},
            {"id": 7, "image_id": 77, "category_id": 1}]
    (ann / "instances_val2017.json").write_text(json.dumps({
        "images": [{"id": 5, "file_name": "a.jpg"}, {"id": 6, "file_name": "b.jpg"}, {"id": 8, "file_name": "c.jpg"}],
        "annotations": anns, "categories": cats}))
    assert instances_file_for(ann / "captions_val2017.json") == ann / "instances_val2017.json"
    objects = read_annotated_objects(ann / "instances_val2017.json")
    assert objects.categories == ["person", "dog", "dining table"] and objects.colours == []
    assert Counter(objects.objects[5]) == Counter({(None, "person"): 2, (None, "dog"): 1})  # the crowd left out
    assert objects.objects[6] == [(None, "dining table")] and objects.objects[8] == []
    scores = content_accuracy({5: "two men and a dog", 6: "a table", 8: "a dog"}, objects)
    assert scores["content_exact"] == pytest.approx(2 / 3) and scores["content_recall"] == 1.0


def test_embedded_reference_captions_parse_into_their_objects(tmp_path):
    """Every reference caption of the embedded scenes names each object's colour and kind; the
    parser must recover exactly the annotated multiset from each of them, and the captions of
    other images must mostly not match (the score measures the image, not the template)."""
    root = ensure_shapes_coco(SceneSetConfig(image_size=32, num_train=2, num_val=40, max_objects=4), tmp_path)
    images, captions = read_captions(root, "val")
    objects = read_annotated_objects(instances_file_for(root / "annotations" / "captions_val.json"))
    assert objects.colours and set(objects.colours) <= set(COLOURS)
    ids = [im["id"] for im in images]
    for k in range(5):  # every phrasing of every image
        scores = content_accuracy({i: captions[i][k] for i in ids}, objects)
        assert scores["content_exact"] == 1.0 and scores["content_precision"] == 1.0, k
    shifted = content_accuracy({i: captions[ids[(n + 1) % len(ids)]][0] for n, i in enumerate(ids)}, objects)
    assert shifted["content_exact"] < 0.2
