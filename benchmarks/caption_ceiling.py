"""How high can CIDEr-D go on a caption set? The references scored as if they were captions.

    python -m benchmarks.caption_ceiling [RUN_OR_PREDICTIONS ...] [--root ROOT] [--split val]
        [--json benchmarks/results/caption_ceiling.json]

Template captions leave a captioner little room above its references, and a relative goal
("SCST: +10 % CIDEr-D") can ask for more than the metric gives. Rows (captions normalised as
``eval.py`` normalises them):

- ``reference``: each reference of an image used as its caption, scored against all of the
  image's references (itself included, as a prediction would be), with ``eval.py``'s document
  frequencies (every reference of the scored images); the mean over an image's references, then
  over the images: what writing one of the references verbatim scores;
- ``best reference``: per image, the best of those (an oracle that knows which of its
  references is the most consensual). Not an upper bound of the metric (a caption spliced from
  pieces of the references can score a little higher), but the top of what picking among the
  references' own phrasings reaches;
- ``held-out reference``: the COCO protocol's human score: in round ``j`` every image's
  reference ``j`` (``j`` modulo its number of references) against its other references, the
  document frequencies from those other references; the mean over the rounds;
- one row per run (``RUN/eval/predictions.json``, or a predictions file): its corpus CIDEr-D
  against all references, and against the same held-out sets as the row above.

Images may have different numbers of references (COCO: 5-7); each needs at least two.

``--root`` defaults to the embedded scenes of ``--config``'s ``synthetic`` settings
(``configs/captioning/shapes.yaml``: its image ids are those of that recipe's runs).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks.common import write_result
from vision_attn.data.captioning import CAPTIONING_BATCHING
from vision_attn.data.tokenizer import normalize_caption
from vision_attn.metrics.caption import CiderD, cider_d

log = logging.getLogger("benchmarks.caption_ceiling")


def reference_rows(references: Mapping[Hashable, Sequence[str]]) -> dict[str, float]:
    """``{"reference", "best reference", "held-out reference"}`` CIDEr-D of normalised
    ``{image: [references]}`` (see the module docstring; at least two references per image)."""
    _check_references(references)
    ids = list(references)
    scorer = CiderD([references[i] for i in ids])  # eval.py's document frequencies
    per_image = [scorer.scores(list(references[i]), references[i]) for i in ids]  # each reference as the caption
    rounds = [cider_d(held, rest)[0] for held, rest in _held_out_rounds(references)]
    return {"reference": float(np.mean([np.mean(s) for s in per_image])),
            "best reference": float(np.mean([max(s) for s in per_image])),
            "held-out reference": float(np.mean(rounds))}


def prediction_row(predictions: Mapping[Hashable, str],
                   references: Mapping[Hashable, Sequence[str]]) -> dict[str, float]:
    """``{"all references", "held-out"}``: CIDEr-D of ``{image: caption}`` against all
    references, and in the held-out rounds of :func:`reference_rows` against each image's
    references without the held-out one."""
    _check_references(references)
    return {"all references": cider_d(predictions, references)[0],
            "held-out": float(np.mean([cider_d(predictions, rest)[0] for _, rest in _held_out_rounds(references)]))}


def _check_references(references: Mapping[Hashable, Sequence[str]]) -> None:
    few = [i for i, refs in references.items() if len(refs) < 2]
    if not references or few:
        raise ValueError(f"every image needs at least two reference captions (image id {few[0] if few else None} "
                         "has fewer): the held-out rows compare one with the others")


def _held_out_rounds(references: Mapping[Hashable, Sequence[str]]):
    """``(held-out caption per image, the other references per image)`` for ``j`` in ``0 ..
    most references - 1`` (image ``i`` holds out its reference ``j mod len``)."""
    for j in range(max(len(r) for r in references.values())):
        held, rest = {}, {}
        for i, refs in references.items():
            k = j % len(refs)
            held[i], rest[i] = refs[k], [c for n, c in enumerate(refs) if n != k]
        yield held, rest


def read_predictions(path: Path, references: Mapping[Hashable, Sequence[str]]) -> dict[Hashable, str]:
    """``{image_id: normalised caption}`` of an ``eval.py`` ``predictions.json`` (or a run folder
    holding ``eval/predictions.json``), checked against the reference images."""
    file = path / "eval" / "predictions.json" if path.is_dir() else path
    try:
        rows = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"{file}: cannot read the predictions ({err}); "
                         "pass eval.py's predictions.json or its run folder") from err
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("caption"), str) for r in rows):
        raise SystemExit(f"{file}: expected eval.py's list of {{\"image_id\", \"caption\"}}")
    ids = [r.get("image_id") for r in rows]
    bad = next((i for i in ids if not isinstance(i, (int, str)) or isinstance(i, bool)), None)
    if bad is not None or len(set(ids)) != len(ids):
        what = f"image id {bad!r} is not a number or text" if bad is not None else "an image id appears twice"
        raise SystemExit(f"{file}: {what}; expected one caption per image, as eval.py writes")
    out = {r["image_id"]: normalize_caption(r["caption"]) for r in rows}
    missing = [i for i in references if i not in out]
    if missing:
        raise SystemExit(f"{file}: no caption for {len(missing)} of the {len(references)} images (e.g. image id "
                         f"{missing[0]}): evaluate the same split")
    return {i: out[i] for i in references}


def embedded_root(config: Path) -> Path:
    """The root of the embedded scenes a captioning config trains on (generated if absent)."""
    import yaml

    from vision_attn.data import CaptioningDataModule
    from vision_attn.data.synthetic import SceneSetConfig

    try:
        data = yaml.safe_load(config.read_text())["data"]["init_args"]
    except (OSError, yaml.YAMLError, KeyError, TypeError) as err:
        raise SystemExit(f"{config}: cannot read its data.init_args ({err}); pass --root") from err
    if data.get("root"):
        return Path(data["root"])
    synthetic = SceneSetConfig(**(data.get("synthetic") or {}))
    batching = replace(CAPTIONING_BATCHING, num_workers=0)
    return CaptioningDataModule(root=None, synthetic=synthetic, batching=batching).root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="*", help="run folders (RUN/eval/predictions.json) or predictions files")
    parser.add_argument("--root", default=None, help="COCO-captions root (default: the embedded scenes of --config)")
    parser.add_argument("--config", default="configs/captioning/shapes.yaml",
                        help="without --root: the config whose embedded scenes to read")
    parser.add_argument("--split", default="val")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from vision_attn.data.captioning import read_captions

    root = Path(args.root) if args.root else embedded_root(Path(args.config))
    images, captions = read_captions(root, args.split)
    references = {im["id"]: [normalize_caption(c) for c in captions[im["id"]]] for im in images}
    try:
        rows: dict[str, dict[str, float]] = {"references": reference_rows(references)}
    except ValueError as err:
        raise SystemExit(f"{root}/annotations/captions_{args.split}.json: {err}") from err
    for run in args.runs:
        rows[run] = prediction_row(read_predictions(Path(run), references), references)
    write_result(args.json, {"root": str(root), "split": args.split, "images": len(references), "rows": rows})
    ref = rows["references"]
    print(f"| {len(references)} images of {root.name}/{args.split} "
          "| CIDEr-D, all references | held-out reference's sets |")
    print("| --- | --- | --- |")
    print(f"| a reference, verbatim | {ref['reference']:.3f} | {ref['held-out reference']:.3f} |")
    print(f"| the best reference of each image (oracle) | {ref['best reference']:.3f} | - |")
    for run in args.runs:
        print(f"| {run} | {rows[run]['all references']:.3f} | {rows[run]['held-out']:.3f} |")


if __name__ == "__main__":
    main()
