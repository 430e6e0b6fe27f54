"""How high can CIDEr-D go on a caption set? The references scored as if they were captions.

    python -m benchmarks.caption_ceiling [RUN_OR_PREDICTIONS ...] [--root ROOT] [--split val]
        [--json benchmarks/results/caption_ceiling.json]

Template captions leave a captioner little room above its references, and a relative goal
("SCST: +10 % CIDEr-D") can ask for more than the metric gives. Rows, each CIDEr-D with the
document frequencies of ``eval.py`` (the references of the scored images, normalised as
``eval.py`` normalises them):

- ``reference``: reference ``j`` of every image used as its caption, scored against all of the
  image's references (itself included, as a prediction would be), averaged over ``j``: what
  writing one of the references verbatim scores;
- ``best reference``: per image, the best of those (an oracle that knows which of its
  references is the most consensual): about the top a captioner can reach by picking among the
  phrasings the references use;
- ``held-out reference``: reference ``j`` against the *other* references (the COCO protocol's
  human score), averaged over ``j``;
- one row per run (``RUN/eval/predictions.json``, or a predictions file): its corpus CIDEr-D
  against all references, and against the same held-out sets as the row above.

``--root`` defaults to the embedded scenes of ``--config``'s ``synthetic`` settings
(``configs/captioning/shapes.yaml``: its image ids are those of that recipe's runs).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path

import numpy as np

from benchmarks.common import write_result
from vision_attn.caption_metrics import cider_d
from vision_attn.data.tokenizer import normalize_caption

log = logging.getLogger("benchmarks.caption_ceiling")


def reference_rows(references: Mapping[Hashable, Sequence[str]]) -> dict[str, float]:
    """``{"reference", "best reference", "held-out reference"}`` CIDEr-D of normalised
    ``{image: [references]}`` (every image needs at least two references, the same number)."""
    counts = {len(r) for r in references.values()}
    if len(counts) != 1 or min(counts) < 2:
        raise ValueError(f"every image needs the same number (>= 2) of references, got {sorted(counts)}")
    k = counts.pop()
    ids = list(references)
    per_image = [cider_d({i: references[i][j] for i in ids}, references)[1] for j in range(k)]
    per_reference = np.array([[scores[i] for i in ids] for scores in per_image])  # [k, images]
    held = [cider_d({i: references[i][j] for i in ids}, _without(references, j))[0] for j in range(k)]
    return {"reference": float(per_reference.mean()), "best reference": float(per_reference.max(0).mean()),
            "held-out reference": float(np.mean(held))}


def prediction_row(predictions: Mapping[Hashable, str], references: Mapping[Hashable, Sequence[str]]) -> dict[str, float]:
    """``{"all references", "held-out"}``: CIDEr-D of ``{image: caption}`` against all
    references, and averaged over ``j`` against the references without the ``j``-th."""
    k = len(next(iter(references.values())))
    return {"all references": cider_d(predictions, references)[0],
            "held-out": float(np.mean([cider_d(predictions, _without(references, j))[0] for j in range(k)]))}


def _without(references: Mapping[Hashable, Sequence[str]], j: int) -> dict[Hashable, list[str]]:
    return {i: [c for n, c in enumerate(refs) if n != j] for i, refs in references.items()}


def read_predictions(path: Path, references: Mapping[Hashable, Sequence[str]]) -> dict[Hashable, str]:
    """``{image_id: normalised caption}`` of an ``eval.py`` ``predictions.json`` (or a run folder
    holding ``eval/predictions.json``), checked against the reference images."""
    file = path / "eval" / "predictions.json" if path.is_dir() else path
    try:
        rows = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"{file}: cannot read the predictions ({err}); pass eval.py's predictions.json or its run folder") from err
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("caption"), str) for r in rows):
        raise SystemExit(f"{file}: expected eval.py's list of {{\"image_id\", \"caption\"}}")
    out = {r.get("image_id"): normalize_caption(r["caption"]) for r in rows}
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
    return CaptioningDataModule(root=None, synthetic=synthetic, num_workers=0).root


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
    rows: dict[str, dict[str, float]] = {"references": reference_rows(references)}
    for run in args.runs:
        rows[run] = prediction_row(read_predictions(Path(run), references), references)
    write_result(args.json, {"root": str(root), "split": args.split, "images": len(references), "rows": rows})
    ref = rows["references"]
    print(f"| {len(references)} images of {root.name}/{args.split} | CIDEr-D, all references | held-out reference's sets |")
    print("| --- | --- | --- |")
    print(f"| a reference, verbatim | {ref['reference']:.3f} | {ref['held-out reference']:.3f} |")
    print(f"| the best reference of each image (oracle) | {ref['best reference']:.3f} | - |")
    for run in args.runs:
        print(f"| {run} | {rows[run]['all references']:.3f} | {rows[run]['held-out']:.3f} |")


if __name__ == "__main__":
    main()
