"""Run a trained model over a folder of images: predictions JSON and attention overlays.

    python -m vision_attn.predict --model runs/x/checkpoints/last.ckpt --images photos/ --output_dir out/
    python -m vision_attn.predict --model model.onnx --images photos/ --output_dir out/

``--model`` is a checkpoint from ``train.py`` (any task; overlays included) or an ONNX file from
``python -m vision_attn.export`` (classification and detection; ONNX holds no attention maps, so
no overlays). The folder is walked recursively with a progress bar; unreadable files are listed
in ``skipped.json`` and never abort the run. Writes into ``--output_dir``:

- ``predictions.json``: classification ``[{"file", "pred", "score"}]``; detection ``[{"file",
  "detections": [{"label", "category_id", "bbox": [x, y, w, h] pixels, "score"}]}]``;
  captioning ``[{"file", "caption"}]`` (``file`` relative to ``--images``);
- ``overlays/<file>.png`` (checkpoints): the explanation maps, each detected object's query
  cross-attention, or the caption's per-word strip; ``<file>`` keeps its extension
  (``a.jpg.png`` and ``a.png.png`` never collide) and names are made safe and shortened
  deterministically (:func:`vision_attn.outputs.safe_filename`);
- ``skipped.json``: ``[{"file", "reason"}]``: unreadable images, and FIFOs, devices, sockets and
  broken links, which are listed, never opened;
- ``report.html``: the predictions and overlays of the first 50 images in one self-contained page.

A folder that already holds any of these outputs is refused unless ``--overwrite`` is given.
Every file is written through a temporary file and a rename, inside ``--output_dir``
(:mod:`vision_attn.outputs`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import stat
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.progress import Progress

from vision_attn.boxes import box_xyxy_to_xywh
from vision_attn.data.imageio import (
    IMAGE_EXTENSIONS,
    ImageReadError,
    not_regular_reason,
    read_image,
)
from vision_attn.data.transforms import build_display_transform, build_eval_transform
from vision_attn.errors import CheckpointError, RunExistsError, VisionAttnError
from vision_attn.explain.overlay import draw_box, image_grid, overlay_saliency, save_png
from vision_attn.explain.report import Report, png_data_uri, write_report
from vision_attn.models.detr import post_process
from vision_attn.outputs import safe_filename, write_json

__all__ = ["OUTPUTS", "main", "overlay_name", "predict_folder", "run_cli", "scan_folder"]

log = logging.getLogger(__name__)


OUTPUTS = ("predictions.json", "skipped.json", "report.html", "overlays")
"""What :func:`predict_folder` writes into its output folder (never over a user's files)."""


def scan_folder(folder: Path) -> tuple[list[Path], list[dict[str, str]]]:
    """The image files under ``folder`` (recursively, sorted) and the entries that are not read.

    Entries are classified from ``stat`` alone, never opened (opening a FIFO blocks): FIFOs,
    devices and sockets, and links to nothing with an image extension, come back as
    ``[{"file", "reason"}]`` (``file`` relative to ``folder``); other files are ignored.
    """
    images: list[Path] = []
    skipped: list[dict[str, str]] = []
    for p in sorted(folder.rglob("*")):
        is_image = p.suffix.lower() in IMAGE_EXTENSIONS
        try:
            mode = p.stat().st_mode
        except OSError as err:
            if is_image:
                skipped.append({"file": str(p.relative_to(folder)), "reason": f"cannot access it ({err.strerror or err})"})
            continue
        if stat.S_ISDIR(mode):
            continue
        reason = not_regular_reason(mode)
        if reason:
            log.warning("skipping %s: %s", p, reason)
            skipped.append({"file": str(p.relative_to(folder)), "reason": reason})
        elif is_image:
            images.append(p)
    return images, skipped


def list_images(folder: Path) -> list[Path]:
    """The image files under ``folder`` (see :func:`scan_folder`)."""
    return scan_folder(folder)[0]


def overlay_name(rel: Path) -> Path:
    """The overlay of the image ``rel`` (relative to the image folder), relative to
    ``overlays/``: its name with the extension kept and ``.png`` added (``a.jpg`` ->
    ``a.jpg.png``, so ``a.jpg`` and ``a.png`` never share one), every part made safe and at most
    :data:`~vision_attn.outputs.MAX_NAME_BYTES` bytes (:func:`~vision_attn.outputs.safe_filename`)."""
    return Path(*(safe_filename(part) for part in rel.parts[:-1]), safe_filename(rel.name + ".png"))


class _OnnxModel:
    """An exported model run by ONNX Runtime, with what its metadata says (task, preprocessing, labels)."""

    def __init__(self, path: Path) -> None:
        try:
            import onnxruntime as ort
        except ImportError as err:  # pragma: no cover - depends on the install
            raise VisionAttnError("running .onnx models needs onnxruntime: pip install onnxruntime") from err
        self.path = path
        try:  # ONNX Runtime's errors derive from Exception only: make them one clear line
            self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            meta = self.session.get_modelmeta().custom_metadata_map
        except Exception as err:  # noqa: BLE001
            raise CheckpointError(f"ONNX Runtime cannot load {path}: {_first_line(err)}; "
                                  "export it again with python -m vision_attn.export") from err
        if meta.get("format") != "vision_attn":
            raise CheckpointError(f"{path} was not exported by vision_attn (no metadata); use python -m vision_attn.export")
        self.task_name = meta.get("task")
        if self.task_name == "captioning":
            raise CheckpointError(f"{path} holds a captioning encoder only (beam search runs in PyTorch); "
                                  "predict with the checkpoint instead")
        try:
            self.data_config = {k: tuple(v) if isinstance(v, list) else v
                                for k, v in json.loads(meta["data_config"]).items()}
            self.init_args = json.loads(meta["model"])["init_args"]
            self.class_names = self.init_args.get("class_names")
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise CheckpointError(f"{path} has broken vision_attn metadata ({type(err).__name__}: {err}); "
                                  "export it again with python -m vision_attn.export") from err
        if self.task_name not in ("classification", "detection"):
            raise CheckpointError(f"{path} holds an unknown task {self.task_name!r}; export it again")

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        try:
            outputs = self.session.run(None, {"images": x.numpy()})
        except Exception as err:  # noqa: BLE001 - ONNX Runtime's errors derive from Exception only
            raise CheckpointError(f"ONNX Runtime failed running {self.path} on a batch of shape {tuple(x.shape)}: "
                                  f"{_first_line(err)}") from err
        return [torch.from_numpy(o) for o in outputs]


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return lines[0] if lines else type(err).__name__


def _enlarge(rgb: np.ndarray, side: int = 160) -> np.ndarray:
    import cv2

    s = max(rgb.shape[:2])
    if s >= side:
        return rgb
    f = int(np.ceil(side / s))
    return cv2.resize(rgb, (rgb.shape[1] * f, rgb.shape[0] * f), interpolation=cv2.INTER_NEAREST)


def _classify(model, x, originals, methods, alpha, want_overlays):
    from vision_attn.explain.evaluate import explanation_panel
    from vision_attn.explain.methods import explain_classifier

    names = model.class_names or []
    if isinstance(model, _OnnxModel):
        probs = model(x)[0].float().softmax(-1)
        preds, maps = probs.argmax(-1), None
    else:
        expl = explain_classifier(model, x, methods)
        probs, preds, maps = expl.logits.float().softmax(-1), expl.target, expl.maps
    display = build_display_transform(model.data_config)
    results = []
    for j, img in enumerate(originals):
        pred, score = int(preds[j]), float(probs[j, preds[j]])
        panel = explanation_panel(display(img), maps, j, f"{names[pred]} {score:.2f}", alpha) if want_overlays and maps else None
        results.append(({"pred": names[pred], "score": score}, panel))
    return results


def _detect(model, x, originals, threshold, alpha, want_overlays):
    from vision_attn.explain.detection import query_attention_maps

    sizes = torch.tensor([img.shape[:2] for img in originals])
    if isinstance(model, _OnnxModel):
        logits, boxes = model(x)
        out, grid = {"pred_logits": logits, "pred_boxes": boxes}, None
        args = model.init_args
        focal, top_k, names, cat_ids = args.get("focal", False), args.get("top_k", 100), args["class_names"], args["category_ids"]
        dets = post_process(out, sizes, top_k, focal)
    else:
        with torch.no_grad():
            enc = model.encoder(x)
            out = model.head(enc, need_weights=want_overlays)
        grid, names, cat_ids = enc.grid, model.class_names, model.category_ids
        dets = model.detect(out, sizes)
    results = []
    for j, (img, det) in enumerate(zip(originals, dets, strict=True)):
        keep = (det["scores"] >= threshold).nonzero().flatten()
        found = [{"label": names[int(det["labels"][k])], "category_id": int(cat_ids[int(det["labels"][k])]),
                  "bbox": box_xyxy_to_xywh(det["boxes"][k]).tolist(), "score": float(det["scores"][k])} for k in keep.tolist()]
        panel = None
        if want_overlays and grid is not None:
            rgb = _enlarge(img)
            scale = rgb.shape[1] / img.shape[1]
            shown = keep[:6]
            maps = query_attention_maps([a[j : j + 1] for a in out["cross_attn"]], det["queries"][shown].cpu(), grid)
            boxed, tiles, titles = rgb, [], []
            for m, k in zip(maps, shown.tolist(), strict=True):
                label = f"{names[int(det['labels'][k])]} {float(det['scores'][k]):.2f}"
                box = (det["boxes"][k] * scale).tolist()
                boxed = draw_box(boxed, box, label=label)
                tiles.append(draw_box(overlay_saliency(rgb, m, alpha=alpha), box, label=label))
                titles.append(f"query {int(det['queries'][k])}")
            panel = image_grid([boxed, *tiles], ["detections", *titles])
        results.append(({"detections": found}, panel))
    return results


def _caption(model, x, originals, alpha, want_overlays):
    from vision_attn.explain.captioning import caption_strip, word_attention_maps

    with torch.no_grad():
        gen = model.generate(x, return_attention=want_overlays)
    grid = model.encoder.grid_for(*x.shape[-2:])
    results = []
    for j, img in enumerate(originals):
        words = model.tokenizer.decode_words(gen.tokens[j].tolist())
        panel = None
        if want_overlays:
            maps = word_attention_maps(gen.attention[j].cpu(), len(words), grid, "mean")
            panel = caption_strip(img, words, maps, alpha)
        results.append(({"caption": " ".join(words)}, panel))
    return results


def predict_folder(
    model_path: str | Path,
    images: str | Path,
    output_dir: str | Path,
    batch_size: int = 16,
    overlays: bool = True,
    methods: tuple[str, ...] = ("rollout", "relevance"),
    score_threshold: float = 0.3,
    alpha: float = 0.5,
    device: str = "cpu",
    overwrite: bool = False,
    progress: bool = True,
    expected_task: str | None = None,
    report_images: int = 50,
) -> dict[str, list]:
    """Predictions (and overlays) for every image under ``images``; returns
    ``{"predictions": [...], "skipped": [{"file", "reason"}]}`` as written."""
    from vision_attn.tasks.base import load_task

    images, out, model_path = Path(images), Path(output_dir), Path(model_path)
    if not images.is_dir():
        raise VisionAttnError(f"--images {images} is not a folder")
    existing = [name for name in OUTPUTS if os.path.lexists(out / name)]
    if existing and not overwrite:
        raise RunExistsError(f"{out} already holds {', '.join(existing)}, which predict would overwrite; "
                             "pass another --output_dir or --overwrite")
    if model_path.suffix == ".onnx":
        model, overlays, device = _OnnxModel(model_path), False, "cpu"
    else:
        model = load_task(model_path, expected_task=expected_task, map_location=device)
    kind = model.task_name
    if expected_task is not None and kind != expected_task:
        raise CheckpointError(f"{model_path} holds a {kind!r} model, not a {expected_task!r} one")
    pre = model.data_config if kind == "classification" else {**model.data_config, "crop_pct": 1.0}
    tf = build_eval_transform(pre)
    predictions: list[dict[str, Any]] = []
    report = Report()

    def flush(batch: list[tuple[Path, np.ndarray]]) -> None:
        x = torch.stack([tf(img) for _, img in batch]).to(device)
        originals = [img for _, img in batch]
        if kind == "classification":
            results = _classify(model, x, originals, methods, alpha, overlays)
        elif kind == "detection":
            results = _detect(model, x, originals, score_threshold, alpha, overlays)
        else:
            results = _caption(model, x, originals, alpha, overlays)
        for (path, _), (record, panel) in zip(batch, results, strict=True):
            rel = path.relative_to(images)
            predictions.append({"file": str(rel), **record})
            if panel is not None:
                save_png(out / "overlays" / overlay_name(rel), panel, root=out)
            if len(report.items) < report_images:
                text = json.dumps(record)[:300]
                report.items.append({"name": str(rel), "text": text, "panels": [png_data_uri(panel)] if panel is not None else []})

    files, skipped = scan_folder(images)
    with Progress(disable=not progress, transient=True) as bar:
        job = bar.add_task(f"{kind}: predicting", total=len(files))
        batch: list[tuple[Path, np.ndarray]] = []
        for path in files:
            try:
                batch.append((path, read_image(path)))
            except ImageReadError as err:
                log.warning("skipping %s: %s", path, err.reason)
                skipped.append({"file": str(path.relative_to(images)), "reason": err.reason or str(err)})
            if len(batch) == batch_size:
                flush(batch)
                batch = []
            bar.advance(job)
        if batch:
            flush(batch)
    skipped.sort(key=lambda s: s["file"])
    write_json(out / "predictions.json", predictions, root=out)
    write_json(out / "skipped.json", skipped, root=out)
    write_report(out / "report.html", f"vision_attn {kind} predictions", {"images": float(len(predictions)),
                 "skipped": float(len(skipped))}, {"model": str(model_path), "images": str(images)}, report.items,
                 root=out)
    log.info("%s: %d images into %s (%d skipped)", kind, len(predictions), out, len(skipped))
    return {"predictions": predictions, "skipped": skipped}


def run_cli(argv: list[str] | None, prog: str, description: str, model_flag: str = "--model",
            expected_task: str | None = None) -> None:
    """The command line of :func:`predict_folder` (shared by ``vision_attn.predict`` and ``vision_attn.overlay``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(model_flag, dest="model", required=True,
                        help="a .ckpt from train.py" + ("" if expected_task else " or a .onnx from vision_attn.export"))
    parser.add_argument("--images", required=True, help="folder of images (searched recursively)")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--no_overlays", action="store_true", help="predictions only")
    parser.add_argument("--methods", nargs="+", default=["rollout", "relevance"], choices=["rollout", "relevance", "attention"],
                        help="classification: explanation methods drawn")
    parser.add_argument("--score_threshold", type=float, default=0.3, help="detection: keep boxes scoring at least this")
    parser.add_argument("--alpha", type=float, default=0.5, help="heat-map opacity")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the outputs of an earlier run (predictions.json, skipped.json, report.html, "
                             "overlays/) in --output_dir")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        result = predict_folder(args.model, args.images, args.output_dir, args.batch_size, not args.no_overlays,
                                tuple(args.methods), args.score_threshold, args.alpha, args.device, args.overwrite,
                                expected_task=expected_task)
    except VisionAttnError as err:
        sys.stderr.write(f"error: {err}\n")
        raise SystemExit(2) from None
    print(f"{len(result['predictions'])} images, {len(result['skipped'])} skipped -> {args.output_dir}")


def main(argv: list[str] | None = None) -> None:
    run_cli(argv, "python -m vision_attn.predict", __doc__)


if __name__ == "__main__":
    main()
