"""Every mistake of a classifier's or a captioner's evaluation with its map, for ``mistakes.html``
(the page: :mod:`vision_attn.report.mistakes`; a detector's cards:
:mod:`~vision_attn.explain.detection_mistakes`).

- **Classification**: every misclassified image, filterable by its true class (the page's class)
  and by what it was taken for (``confused``), with the map of the first explanation method for
  the *predicted* class (what the model saw of the class it chose): the two filters together
  show one cell of the confusion matrix.
- **Captioning**: every object word of a caption that none of the image's references uses (the
  ``hallucinated`` words of ``results_per_image.json``), each with the first decoder method's map
  of that word (teacher-forced, at its first place in the caption).
"""

from __future__ import annotations

from typing import Any

import torch

from vision_attn.explain.captioning import CAPTION_DEFAULTS, CAPTION_RULE, teacher_forced_word_maps
from vision_attn.explain.detection import decoder_methods, relevance_rule
from vision_attn.explain.detection_mistakes import MistakesBrowser, map_fields
from vision_attn.explain.images import dataset_picture
from vision_attn.explain.methods import explain_classifier
from vision_attn.explain.progress import Progress

__all__ = ["caption_mistakes", "classification_mistakes"]


def classification_mistakes(task, dataset, records: list[dict[str, Any]], options) -> MistakesBrowser:
    """The browser of the evaluation's misclassified images (``records``: the task's evaluation
    records ``{"index", "label", "probs"}``) with ``options.methods[0]``'s map of the prediction."""
    names = list(task.class_names or [])
    wrong = [(r["index"], int(r["label"]), int(r["probs"].argmax()), float(r["probs"].max())) for r in records
             if int(r["probs"].argmax()) != int(r["label"])]
    method = options.methods[0]
    device = next(task.parameters()).device
    cards, pictures = [], {}
    progress = Progress(f"mistakes browser: {method} maps", len(wrong), "image")
    for start in range(0, len(wrong), options.batch_size):
        chunk = wrong[start : start + options.batch_size]
        images = torch.stack([dataset[i][0] for i, _, _, _ in chunk]).to(device)
        maps = explain_classifier(task, images, [method], target=torch.tensor([p for _, _, p, _ in chunk],
                                                                               device=device)).maps[method]
        for (i, truth, pred, score), grid_map in zip(chunk, maps, strict=True):
            name = str(dataset.relative_file(i))
            pictures[name] = dataset_picture(dataset, i)
            cards.append({"image_id": name, "kind": "misclassified", "category": names[truth],
                          "confused": names[pred], "note": f"taken for {names[pred]}", "score": score, "size": None,
                          "box": None, "object": None, "looked": None, **map_fields(grid_map)})
        progress.update(len(chunk))
    progress.close()
    return MistakesBrowser(cards, pictures, method, "vision_attn classification mistakes",
                           intro="Every misclassified image, by its true class, with the map of the class it was "
                                 "taken for.")


def caption_mistakes(task, dataset, per_image: list[dict[str, Any]], options) -> MistakesBrowser:
    """The browser of the object words no reference of their image uses (``per_image``:
    ``results_per_image.json``), each with the first decoder method's map of the word."""
    method = decoder_methods(options, CAPTION_DEFAULTS, task)[0]
    index = {im["id"]: i for i, im in enumerate(dataset.images)}
    wanted = [e for e in per_image if e.get("hallucinated")]
    device = next(task.parameters()).device
    cards, pictures = [], {}
    progress = Progress(f"mistakes browser: {method} maps", len(wanted), "image")
    for start in range(0, len(wanted), options.batch_size):
        chunk = wanted[start : start + options.batch_size]
        idx = [index[e["image_id"]] for e in chunk]
        images = torch.stack([dataset[i][0] for i in idx]).to(device)
        tokens = [torch.tensor(task.tokenizer.encode(e["caption"])[1:-1], dtype=torch.long) for e in chunk]
        maps = teacher_forced_word_maps(task, images, tokens, [method], options.query_layers,
                                        relevance_rule(options, CAPTION_RULE))[method]
        for e, i, word_maps in zip(chunk, idx, maps, strict=True):
            words = e["caption"].split()
            pictures[e["image_id"]] = dataset_picture(dataset, i)
            for word in dict.fromkeys(e["hallucinated"]):
                at = words.index(word) if word in words else None
                if at is None or at >= len(word_maps):
                    continue
                cards.append({"image_id": e["image_id"], "kind": "hallucinated", "category": word,
                              "note": f"in \u201c{e['caption']}\u201d", "score": None, "size": None, "box": None,
                              "object": None, "looked": None, **map_fields(word_maps[at])})
        progress.update(len(chunk))
    progress.close()
    return MistakesBrowser(cards, pictures, method, "vision_attn captioning mistakes",
                           intro="Every object word of a caption that none of the image's references uses, with the "
                                 "map of the word.")
