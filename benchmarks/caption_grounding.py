"""Does a captioner read its object words from the image? Teacher-forced accuracy of the words
naming objects, on the training and on the validation split.

    python -m benchmarks.caption_grounding CKPT [--root ROOT] [--images 400]
        [--json docs/results/captioning_grounding.json]

For each split, every image's first reference caption is fed to the decoder (teacher forcing)
and each position whose next word names an object — a category name, or a colour the
instances file gives its objects (``colour``), as :mod:`vision_attn.metrics.caption_content` reads
them — counts as right when the decoder's most likely next word is that word. The rows are
``kind`` (category words), ``colour`` and ``all`` (every word of the caption).

Which failure a model has shows in the two splits side by side: kinds near chance on both
(1 / number of categories when the language prior is uniform) mean the encoder does not yet
tell the kinds apart; high on training and low on validation mean it memorised the images.
``--root`` defaults to the embedded scenes of 2000 training images: the first 2000 of
``configs/captioning/shapes.yaml``'s 5500 (the scenes are drawn in order) and the same validation scenes.
``--json`` writes a row per split as a results file of the documentation's captioning page
(:mod:`benchmarks.results_json`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.common import command_line, finite, machine
from benchmarks.results_json import write_results
from vision_attn.data.captioning import caption_collate
from vision_attn.data.loading import Batching

log = logging.getLogger("benchmarks.caption_grounding")

COLUMNS = ["split", "images", {"name": "kind", "format": ".3f"}, {"name": "colour", "format": ".3f"},
           {"name": "all words", "format": ".3f"}, "kind words", "colour words"]
"""The columns of the results file (``docs/results/captioning_grounding.json``)."""


def object_word_ids(dataset, tokenizer) -> dict[str, set[int]]:
    """``{"kind": ids, "colour": ids}`` of the tokenizer's words that name the split's objects."""
    objects = dataset.annotated_objects()
    if objects is None:
        raise SystemExit(f"{dataset.instances_file} does not exist: the object words come from the split's instances")
    known = tokenizer.index
    return {"kind": {known[w] for w in objects.categories if w in known},
            "colour": {known[w] for w in objects.colours if w in known}}


def word_accuracy(logits: torch.Tensor, targets: torch.Tensor, groups: dict[str, set[int]], pad_id: int) -> Counter:
    """Counts ``<group>_n`` / ``<group>_ok`` (and ``all_*`` over every non-pad target) of
    teacher-forced ``logits [B, T, V]`` against ``targets [B, T]``."""
    pred = logits.argmax(-1)
    out: Counter = Counter()
    for name, ids in groups.items():
        mask = torch.isin(targets, torch.tensor(sorted(ids), dtype=targets.dtype)) if ids else \
            torch.zeros_like(targets, dtype=torch.bool)
        out[f"{name}_n"] += int(mask.sum())
        out[f"{name}_ok"] += int((pred[mask] == targets[mask]).sum())
    mask = targets != pad_id
    out["all_n"] += int(mask.sum())
    out["all_ok"] += int((pred[mask] == targets[mask]).sum())
    return out


def split_accuracy(task, dataset, images: int, batch_size: int = 50) -> dict[str, float | int]:
    """Teacher-forced object-word accuracy of ``task`` on the first ``images`` of ``dataset``."""
    tok = task.tokenizer
    groups = object_word_ids(dataset, tok)
    dataset.sample = "first"
    n = min(len(dataset), images)
    counts: Counter = Counter()
    with torch.no_grad():
        for start in range(0, n, batch_size):
            pics, tokens, _ = caption_collate([dataset[i] for i in range(start, min(n, start + batch_size))],
                                              tok.pad_id)
            counts += word_accuracy(task(pics, tokens[:, :-1]), tokens[:, 1:], groups, tok.pad_id)
    row: dict[str, float | int] = {"images": n}
    for name in (*groups, "all"):
        row[name] = counts[f"{name}_ok"] / counts[f"{name}_n"] if counts[f"{name}_n"] else float("nan")
        row[f"{name}_words"] = counts[f"{name}_n"]
    return row


def write_json(path: str | Path, rows: dict[str, dict[str, float | int]], ckpt: str | Path, command: str) -> Path:
    """The ``{split: row}`` of :func:`split_accuracy` as a results file (:data:`COLUMNS`; a group
    with no word is an empty cell); ``command``: the command line that reproduces it."""
    table = [[split, r["images"], finite(r["kind"]), finite(r["colour"]), finite(r["all"]), r["kind_words"],
              r["colour_words"]] for split, r in rows.items()]
    return write_results(
        path, page="captioning", title="Are the object words read from the image? Teacher-forced accuracy",
        command=command, columns=COLUMNS, rows=table,
        description="Each image's first reference caption fed to the decoder (teacher forcing); a position whose "
                    "next word names an object (kind: a category name; colour: a colour of the split's objects) "
                    "counts as right when the decoder's most likely next word is that word; all words: every "
                    "word of the caption. Kinds near chance on both splits: the encoder does not tell the kinds "
                    "apart; high on training and low on validation: the images were memorised.",
        notes=[f"Checkpoint `{ckpt}`."])


def main(argv: Sequence[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ckpt", help="a captioning checkpoint written by train.py")
    parser.add_argument("--root", default=None, help="COCO-captions root with instances files (default: embedded)")
    parser.add_argument("--images", type=int, default=400, help="images per split")
    parser.add_argument("--json", default=None, help="also write the rows here as a results file "
                                                     "(make bench: docs/results/captioning_grounding.json)")
    args = parser.parse_args(argv)
    from vision_attn.data import CaptioningDataModule
    from vision_attn.tasks.base import load_task

    logging.basicConfig(level=logging.WARNING)
    task = load_task(args.ckpt, "captioning")
    dm = CaptioningDataModule(root=args.root, batching=Batching(batch_size=50, num_workers=0))
    task.configure_datamodule(dm)
    rows = {split: split_accuracy(task, dm.dataset(split), args.images) for split in (dm.train_split, dm.val_split)}
    print(f"teacher-forced accuracy of the object words, {Path(args.ckpt).name}")
    print("| split | images | kind | colour | all words |")
    print("| --- | --- | --- | --- | --- |")
    for split, r in rows.items():
        print(f"| {split} | {r['images']} | {r['kind']:.3f} | {r['colour']:.3f} | {r['all']:.3f} |")
    result = {"machine": machine(), "ckpt": str(args.ckpt), "rows": rows}
    if args.json:
        write_json(args.json, rows, args.ckpt, command_line("benchmarks.caption_grounding", argv))
    return result


if __name__ == "__main__":
    main()
