"""Run a trained model over a folder of images: predictions JSON and attention overlays.

    vision-attn predict --ckpt_path runs/x/checkpoints/last.ckpt --images photos/ --output_dir out/
    python -m vision_attn.predict --model model.onnx --images photos/ --output_dir out/

``--ckpt_path`` (or ``--model``) is a checkpoint from training (any task; overlays included) or
an ONNX file from ``vision-attn export`` (tasks whose predictions ONNX can make; ONNX holds no
attention maps, so no overlays). Everything task specific is asked of the task
(:meth:`~vision_attn.tasks.VisionTask.predict_step`), its own options included: the dataclass the
task declares (:attr:`~vision_attn.tasks.VisionTask.inference_options`: ``--topk`` of a classifier,
``--score_threshold`` of a detector, ``--generate.*`` of a captioner). The images run through
Lightning's predict loop: DataLoader workers decode them, ``--devices`` processes share them, a
progress bar shows the run; unreadable files are listed in ``skipped.json`` and never abort it.
Writes into ``--output_dir``:

- ``predictions.json``: the task's records, in file order (``file`` relative to ``--images``):
  classification ``[{"file", "pred", "score"}]``; detection ``[{"file", "detections":
  [{"label", "category_id", "bbox": [x, y, w, h] pixels, "score"}]}]``; captioning ``[{"file",
  "caption"}]``;
- ``overlays/<file>.png`` (checkpoints): the explanation maps, each detected object's query
  cross-attention, or the caption's per-word strip; ``<file>`` keeps its extension
  (``a.jpg.png`` and ``a.png.png`` never collide) and names are made safe and shortened
  deterministically (:func:`vision_attn.outputs.safe_filename`);
- ``skipped.json``: ``[{"file", "reason"}]``: unreadable images, and FIFOs, devices, sockets and
  broken links, which are listed, never opened;
- ``report.html``: one self-contained page, under 10 MB whatever the model and the number of
  images: a table of the first 50 images with what the model said of each (the top-k classes
  and their scores, the objects found, the caption) and the skipped files with the reason,
  then the overlays and interactive attention view of those images (the attention kept at
  what fits the page unless ``FolderRun.full_attention``, :mod:`vision_attn.report.budget`).

A folder that already holds any of these outputs is refused unless ``--overwrite`` is given.
Every file is written through a temporary file and a rename, inside ``--output_dir``
(:mod:`vision_attn.outputs`).

Speed: the overlays are PNG-encoded and written by one background thread
(:class:`BackgroundWriter`, a bounded queue) while the model runs the next batch; an error
there stops the run in the main process, naming the file. With ``--no_overlays`` no
explanation code runs and no hook is put on the model: the task's plain forward
(:meth:`~vision_attn.tasks.VisionTask.export_forward`) under ``torch.inference_mode``.
"""

from __future__ import annotations

import copy
import logging
import os
import queue
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.utils.data import DataLoader, Dataset

from vision_attn.data.imageio import (
    IMAGE_EXTENSIONS,
    ImageReadError,
    not_regular_reason,
    read_image,
)
from vision_attn.data.loading import link_target
from vision_attn.data.transforms import build_eval_transform
from vision_attn.distributed import check_accelerator, gather_objects
from vision_attn.errors import (
    CheckpointError,
    ConfigError,
    EncoderError,
    RunExistsError,
    VisionAttnError,
)
from vision_attn.explain.evaluate import ExplainOptions
from vision_attn.explain.methods import skip_inapplicable
from vision_attn.explain.overlay import save_png
from vision_attn.explain.progress import Progress
from vision_attn.models.merging import merge_tokens
from vision_attn.onnx_predict import OnnxPredictor
from vision_attn.outputs import display_path, safe_filename, write_json
from vision_attn.report import write_report
from vision_attn.report.folder import folder_sections, record_line
from vision_attn.tasks.base import VisionTask
from vision_attn.tasks.sources import load_model

__all__ = ["OUTPUTS", "BackgroundWriter", "FolderRun", "ModelSource", "OverlayWriteError", "check_outputs",
           "load_source", "overlay_name", "predict_folder", "scan_folder", "task_of"]

log = logging.getLogger(__name__)


OUTPUTS = ("predictions.json", "skipped.json", "report.html", "overlays")
"""What :func:`predict_folder` writes into its output folder (never over a user's files)."""


SCAN_QUIET_S = 3.0  # seconds a folder scan runs before it reports its progress (a quick scan says nothing)


def _outside_reason(path: Path, root: Path, follow_symlinks: bool) -> str | None:
    """Why an image ``path`` found under ``root`` is not read: a symbolic link that leads out of
    ``root`` (unless ``follow_symlinks``); else ``None``."""
    if follow_symlinks or not path.is_symlink():
        return None
    target = link_target(path)
    if target is None:
        return "a loop of symbolic links"
    if target.is_relative_to(root.resolve()):
        return None
    return "a symbolic link out of the images folder (--follow_symlinks follows links you trust)"


def scan_folder(folder: Path, follow_symlinks: bool = False) -> tuple[list[Path], list[dict[str, str]]]:
    """The image files under ``folder`` (recursively, sorted) and the entries that are not read.

    Entries are classified from ``stat`` alone, never opened (opening a FIFO blocks): FIFOs,
    devices and sockets, links to nothing, and (unless ``follow_symlinks``) links out of
    ``folder``, with an image extension, come back as ``[{"file", "reason"}]`` (``file``
    relative to ``folder``); other files are ignored.
    A scan that takes more than a few seconds (a large or remote folder) reports its progress
    (:class:`~vision_attn.explain.progress.Progress`): the paths found, then those checked.
    """
    images, skipped, entries = [], [], []
    with Progress(f"scanning {folder}", None, "path", log_every=10.0, delay=SCAN_QUIET_S) as found:
        for p in folder.rglob("*"):
            entries.append(p)
            found.update()
    checking = Progress(f"checking the entries of {folder}", len(entries), "path", log_every=10.0,
                        delay=SCAN_QUIET_S, start=found.start)
    for p in sorted(entries):
        checking.update()
        is_image = p.suffix.lower() in IMAGE_EXTENSIONS
        try:
            mode = p.stat().st_mode
        except OSError as err:
            if is_image:
                reason = f"cannot access it ({err.strerror or err})"
                skipped.append({"file": str(p.relative_to(folder)), "reason": reason})
            continue
        if stat.S_ISDIR(mode):
            continue
        reason = not_regular_reason(mode) or (_outside_reason(p, folder, follow_symlinks) if is_image else None)
        if reason:
            log.warning("skipping %r: %s", str(p), reason)
            skipped.append({"file": str(p.relative_to(folder)), "reason": reason})
        elif is_image:
            images.append(p)
    checking.close()
    return images, skipped


GLOB_CHARS = frozenset("*?[")


def resolve_images(spec: str | Path, follow_symlinks: bool = False) -> tuple[Path, list[Path], list[dict[str, str]]]:
    """``(root, image files, skipped)`` of ``--images``: a single file (its folder is the root,
    so its record's ``file`` is its name), a folder searched recursively (:func:`scan_folder`),
    or a glob such as ``photos/**/*.jpg`` (the root is the folder before the first wildcard;
    ``**`` matches any depth). A folder's or a glob's links out of the root are skipped unless
    ``follow_symlinks``; a file named alone is read wherever it lies.

    Raises:
        VisionAttnError: when nothing is there or nothing matches.
    """
    text = str(spec)
    path = Path(text)
    if path.is_dir():
        return (path, *scan_folder(path, follow_symlinks))
    if path.is_file() or (os.path.lexists(path) and not any(c in text for c in GLOB_CHARS)):
        root = path.parent
        mode = os.stat(path, follow_symlinks=True).st_mode if path.exists() else None
        reason = not_regular_reason(mode) if mode is not None else "a link to nothing"
        return (root, [], [{"file": path.name, "reason": reason}]) if reason else (root, [path], [])
    if not any(c in text for c in GLOB_CHARS):
        raise VisionAttnError(f"--images {text}: no such file or folder; give an image, a folder or a glob "
                              "such as 'photos/*.jpg' (quoted)")
    parts = path.parts
    first = next(i for i, part in enumerate(parts) if any(c in part for c in GLOB_CHARS))
    root = Path(*parts[:first]) if first else Path(".")
    matches = sorted(p for p in root.glob(str(Path(*parts[first:]))) if p.suffix.lower() in IMAGE_EXTENSIONS)
    files, skipped = [], []
    for p in matches:
        if p.is_dir():
            continue
        try:
            reason = not_regular_reason(p.stat().st_mode) or _outside_reason(p, root, follow_symlinks)
        except OSError as err:
            reason = f"cannot access it ({err.strerror or err})"
        (skipped.append({"file": str(p.relative_to(root)), "reason": reason}) if reason else files.append(p))
    if not files and not skipped:
        raise VisionAttnError(f"--images {text}: the pattern matches no image file")
    return root, files, skipped


def list_images(folder: Path) -> list[Path]:
    """The image files under ``folder`` (see :func:`scan_folder`)."""
    return scan_folder(folder)[0]


def overlay_name(rel: Path) -> Path:
    """The overlay of the image ``rel`` (relative to the image folder), relative to
    ``overlays/``: its name with the extension kept and ``.png`` added (``a.jpg`` ->
    ``a.jpg.png``, so ``a.jpg`` and ``a.png`` never share one), every part made safe and at most
    :data:`~vision_attn.outputs.MAX_NAME_BYTES` bytes (:func:`~vision_attn.outputs.safe_filename`)."""
    return Path(*(safe_filename(part) for part in rel.parts[:-1]), safe_filename(rel.name + ".png"))


class FolderImages(Dataset):
    """The images of a folder for Lightning's predict loop: each item is ``{"file", "image",
    "picture", "size", "reason"}`` — the preprocessed tensor, the original RGB picture (only when
    ``keep_pictures``: overlays are drawn on it; a predictions-only run does not ship it from the
    workers) and its ``(height, width)``, or, for a file that cannot be read, ``None`` and the
    reason (the run goes on; ``skipped.json`` lists it). Decoding happens in the DataLoader's
    workers."""

    def __init__(self, root: Path, files: list[Path], transform, keep_pictures: bool = True) -> None:
        self.root, self.files, self.transform, self.keep_pictures = root, files, transform, keep_pictures

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict[str, Any]:
        path = self.files[i]
        rel = str(path.relative_to(self.root))
        try:
            picture = read_image(path)
        except ImageReadError as err:
            log.warning("skipping %s: %s", path, err.reason)
            return {"file": rel, "image": None, "picture": None, "size": None, "reason": err.reason or str(err)}
        return {"file": rel, "image": self.transform(picture), "picture": picture if self.keep_pictures else None,
                "size": tuple(picture.shape[:2]), "reason": None}


def collate_folder(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A batch for :meth:`~vision_attn.tasks.VisionTask.predict_step`: ``{"images", "pictures",
    "sizes", "files", "skipped"}`` (``pictures``: ``None`` each when not kept; ``sizes``:
    ``(height, width)`` of the originals; unreadable files go to ``skipped``)."""
    good = [it for it in items if it["image"] is not None]
    return {
        "images": torch.stack([it["image"] for it in good]) if good else torch.empty(0),
        "pictures": [it["picture"] for it in good],
        "sizes": [it["size"] for it in good],
        "files": [it["file"] for it in good],
        "skipped": [{"file": it["file"], "reason": it["reason"]} for it in items if it["image"] is None],
    }


class OverlayWriteError(VisionAttnError):
    """An overlay could not be written (raised in the main process; the message names the file)."""


class BackgroundWriter:
    """Writes overlay PNGs on one background thread, so that encoding and writing them overlaps
    the model's next batch.

    :meth:`submit` hands over an already drawn panel; at most ``max_pending`` wait in the queue
    (:meth:`submit` blocks when it is full), so memory stays bounded whatever the speed of the
    disk. Every file goes through :func:`~vision_attn.explain.overlay.save_png` (a temporary
    file and a rename inside ``root``), exactly as a synchronous write would, so the files are
    byte-identical. The first error in the thread is kept (later panels are dropped, not
    written) and raised in the caller's thread as an :class:`OverlayWriteError` naming the
    file, at the next :meth:`submit` or at :meth:`close`. The thread starts with the first
    panel: a run without overlays never starts one.
    """

    def __init__(self, root: Path, max_pending: int = 8) -> None:
        self.root = root
        self._queue: queue.Queue[tuple[Path, Any] | None] = queue.Queue(maxsize=max(1, max_pending))
        self._thread: threading.Thread | None = None
        self._error: tuple[Path, BaseException] | None = None
        self.written = 0

    def submit(self, path: Path, panel: Any) -> None:
        """Queue ``panel`` (uint8 RGB) for ``path`` (under :attr:`root`); raises an earlier write's error."""
        self.check()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="vision_attn-overlay-writer", daemon=True)
            self._thread.start()
        self._queue.put((path, panel))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue  # a write failed: drain the queue so the producer never blocks, write nothing
            path, panel = item
            try:
                save_png(path, panel, root=self.root)
                self.written += 1
            except BaseException as err:  # noqa: BLE001 - handed to the main thread by check()
                self._error = (path, err)

    def check(self) -> None:
        """Raise the error of a failed write, if any (:class:`OverlayWriteError`, naming the file)."""
        if self._error is not None:
            path, err = self._error
            raise OverlayWriteError(f"cannot write the overlay {path}: {type(err).__name__}: {err}") from err

    def close(self, raise_errors: bool = True) -> None:
        """Wait until every queued panel is written and stop the thread; then raise the first
        error (unless ``raise_errors`` is false: the run is already failing for another reason)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if raise_errors:
            self.check()


class PredictionWriter(BasePredictionWriter):
    """Writes what the predict loop returns: overlays after every batch (each process its own
    images; on a :class:`BackgroundWriter` thread unless ``background`` is false), then
    ``predictions.json``, ``skipped.json`` and ``report.html`` from every process's records, in
    file order, on the main process."""

    def __init__(self, out: Path, skipped: list[dict[str, str]], title: str, summary: dict[str, str],
                 report_images: int = 50, background: bool = True, max_pending: int = 8,
                 full_attention: bool = False) -> None:
        super().__init__(write_interval="batch")
        self.out, self.title, self.summary, self.report_images = out, title, summary, report_images
        self.full_attention = full_attention
        self.skipped = list(skipped)  # found while scanning the folder (main process)
        self.records: list[dict[str, Any]] = []
        self.items: list[dict[str, Any]] = []
        self.failed: list[dict[str, str]] = []
        self.overlay_writer = BackgroundWriter(out, max_pending) if background else None

    def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch, batch_idx,
                           dataloader_idx=0) -> None:
        self.failed.extend(prediction["skipped"])
        for file, record, panel, item in zip(prediction["files"], prediction["records"], prediction["panels"],
                                             prediction["report_items"], strict=True):
            self.records.append({"file": file, **record})
            if panel is not None:
                path = self.out / "overlays" / overlay_name(Path(file))
                if self.overlay_writer is not None:
                    self.overlay_writer.submit(path, panel)
                else:
                    save_png(path, panel, root=self.out)
            if len(self.items) < self.report_images:
                panels = item.get("panels", []) if item else []
                self.items.append({**(item or {}), "name": file, "text": record_line(record), "panels": panels})

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self.overlay_writer is not None:  # stop the thread; the run's own error is the one raised
            self.overlay_writer.close(raise_errors=False)

    def on_predict_epoch_end(self, trainer, pl_module) -> None:
        if self.overlay_writer is not None:  # every overlay on disk (or its error raised) before the JSON
            self.overlay_writer.close()
        by_file = {r["file"]: r for r in gather_objects(self.records)}  # a padded sampler repeats none here
        predictions = [by_file[f] for f in sorted(by_file, key=Path)]
        failed = {s["file"]: s for s in gather_objects(self.failed)}
        items = sorted(gather_objects(self.items), key=lambda it: Path(it["name"]))[: self.report_images]
        self.result = {"predictions": predictions,
                       "skipped": sorted([*self.skipped, *failed.values()], key=lambda s: s["file"])}
        if not trainer.is_global_zero:
            return
        write_json(self.out / "predictions.json", self.result["predictions"], root=self.out)
        write_json(self.out / "skipped.json", self.result["skipped"], root=self.out)
        task = getattr(pl_module, "task", pl_module)  # an ONNX model's task describes it
        write_report(self.out / "report.html", self.title, {"images": len(predictions),
                     "skipped": len(self.result["skipped"])}, self.summary, items, root=self.out,
                     task=task.task_name, headline=task.headline_metric, mistakes=task.mistake_cards(items, None),
                     sections=folder_sections(predictions, self.result["skipped"], self.report_images),
                     full_attention=self.full_attention)


@dataclass
class ModelSource:
    """Where the model of :func:`predict_folder` comes from, and how it is built (:func:`load_source`).

    Attributes:
        path: a checkpoint from training (any task), ``timm:NAME`` (any timm ViT by name) or an
            ONNX file from ``vision-attn export`` (``.onnx``: predictions only, no overlays).
        weights_file: ``timm:NAME`` only: a local weights file (else timm's hub).
        class_names: ``timm:NAME`` only, for a head that is not an ImageNet one: the names (a list,
            or a text file with one per line).
        allow_import: module prefixes whose task classes the checkpoint may name (``--allow_import``).
        expected_task: refuse a model of another task (``None``: any task).
        merge_r: token merging (:func:`vision_attn.merge_tokens`, ToMe): merge this many tokens in
            every encoder block (``0``: off, exactly the model as trained). Faster, slightly less
            accurate; the encoder still returns tokens on the patch grid, so overlays keep their shape.
    """

    path: str | Path
    weights_file: str | Path | None = None
    class_names: str | Path | list[str] | None = None
    allow_import: tuple[str, ...] = ()
    expected_task: str | None = None
    merge_r: int = 0


@dataclass
class FolderRun:
    """How :func:`predict_folder` runs: batches, processes, device, and what it may replace.

    Attributes:
        batch_size: images per batch.
        num_workers: DataLoader processes decoding the images (``0``: the main process).
        device: ``cpu``, ``cuda`` or ``auto`` (``None``: a GPU when there is one).
        devices: processes / GPUs sharing the images (Lightning's ``Trainer(devices=...)``).
        overwrite: replace the outputs of an earlier run (:data:`OUTPUTS`) in the output folder.
        progress: show a progress bar.
        report_images: how many images ``report.html`` shows (later ones get no report item).
        background_writes: encode and write the overlay PNGs on a background thread while the
            model runs the next batch (:class:`BackgroundWriter`; the same files as writing them
            in the loop, ``False``).
        follow_symlinks: read images that symbolic links in the folder lead to outside it
            (``--follow_symlinks``; default: skipped, listed in ``skipped.json``).
        full_attention: ``report.html`` keeps every layer and head of the per-patch attention
            view (``--report.full_attention``; the page then grows with the model and the number
            of images: about 7.4 MB per image on ViT-B/16); default: each image's attention is
            fitted to its share of a 10 MB page (:mod:`vision_attn.report.budget`).
    """

    batch_size: int = 16
    num_workers: int = 0
    device: str | None = None
    devices: int | str = 1
    overwrite: bool = False
    progress: bool = True
    report_images: int = 50
    background_writes: bool = True
    full_attention: bool = False
    follow_symlinks: bool = False


def check_outputs(out: Path, overwrite: bool = False) -> None:
    """Refuse an output folder that holds any of :data:`OUTPUTS` (a user's file of the same name
    included), unless ``overwrite``.

    Raises:
        RunExistsError: naming what is there.
    """
    existing = [name for name in OUTPUTS if os.path.lexists(Path(out) / name)]
    if existing and not overwrite:
        raise RunExistsError(f"{out} already holds {', '.join(existing)}, which predict would overwrite; "
                             "pass another --output_dir or --overwrite")


def task_of(model: VisionTask | OnnxPredictor) -> VisionTask:
    """The task that describes ``model``: an :class:`OnnxPredictor`'s, or the model itself."""
    return model.task if isinstance(model, OnnxPredictor) else model


def load_source(source: ModelSource | str | Path) -> VisionTask | OnnxPredictor:
    """The model ``source`` describes, ready to predict: the task of a checkpoint or a timm model
    (eval mode; its tokens merged when ``source.merge_r`` asks), or an :class:`OnnxPredictor`.

    Raises:
        CheckpointError: a model of another task than ``source.expected_task``, or one that cannot
            be read.
        ConfigError: token merging asked of an ONNX model, or of an encoder that cannot merge.
    """
    source = source if isinstance(source, ModelSource) else ModelSource(source)
    path = Path(str(source.path))
    if path.suffix == ".onnx":
        model: VisionTask | OnnxPredictor = OnnxPredictor(path, source.allow_import)
        if source.merge_r:
            raise ConfigError(f"--merge_r {source.merge_r}: token merging changes the PyTorch model; an ONNX model "
                              "cannot merge tokens (export a merged model, or predict with the checkpoint)")
    else:  # a checkpoint, or timm:NAME
        model = load_model(str(source.path), weights_file=source.weights_file, class_names=source.class_names,
                           allow_import=source.allow_import)
        if source.merge_r:
            try:
                merge_tokens(model, source.merge_r)
            except EncoderError as err:
                raise ConfigError(f"--merge_r {source.merge_r}: {err}") from err
    if source.expected_task is not None and model.task_name != source.expected_task:
        raise CheckpointError(f"{path} holds a {model.task_name!r} model, not a {source.expected_task!r} one")
    return model


def _drawn(task: VisionTask, explain: ExplainOptions, what: str) -> ExplainOptions:
    """``explain`` with only the methods that apply to ``task`` (the others skipped with a warning,
    :func:`~vision_attn.explain.methods.skip_inapplicable`)."""
    kept = copy.copy(explain)
    kept.methods = skip_inapplicable(task, explain.methods, what)
    return kept


def predict_folder(
    source: ModelSource | str | Path,
    images: str | Path,
    output_dir: str | Path,
    run: FolderRun | None = None,
    explain: ExplainOptions | None = None,
    options: Any = None,
    overlays: bool = True,
    model: VisionTask | OnnxPredictor | None = None,
) -> dict[str, list]:
    """Predictions (and overlays) for every image under ``images``, through Lightning's predict
    loop (DataLoader workers decode; ``run.devices`` processes share the images); returns
    ``{"predictions": [...], "skipped": [{"file", "reason"}]}`` as written.

    Args:
        source: the model: a checkpoint, ``timm:NAME`` or ``.onnx`` path, or a :class:`ModelSource`
            (timm weights and class names, allowed imports, the task expected, token merging).
        images: an image file, a folder (searched recursively) or a glob (:func:`resolve_images`).
        output_dir: where ``predictions.json``, ``overlays/``, ``skipped.json`` and ``report.html`` go.
        run: batches, processes, device, overwriting, progress (:class:`FolderRun`).
        explain: the explanation methods drawn side by side and the overlays' opacity
            (:class:`~vision_attn.explain.evaluate.ExplainOptions`; default: each head's methods);
            a method that does not apply to the model is skipped with a warning.
        options: the task's inference options: an instance of the dataclass the model's task
            declares (:attr:`~vision_attn.tasks.VisionTask.inference_options`; ``None``: the task's
            defaults), handed to it by :meth:`~vision_attn.tasks.VisionTask.set_inference_options`.
        overlays: draw the explanations (``False``: predictions only; no explanation code runs).
        model: the model ``source`` describes, already loaded (:func:`load_source`), or ``None``.
    """
    run = run or FolderRun()
    source = source if isinstance(source, ModelSource) else ModelSource(source)
    out = Path(output_dir)
    images, files, skipped = resolve_images(images, run.follow_symlinks)
    check_outputs(out, run.overwrite)
    accelerator = {"cuda": "gpu", "gpu": "gpu", "cpu": "cpu"}.get(run.device or "auto", "auto")
    check_accelerator(accelerator, run.devices, flag="--device")
    model = load_source(source) if model is None else model
    task = task_of(model)
    if task.no_inference:
        raise ConfigError(f"{display_path(source.path)}: {task.no_inference}")
    if isinstance(model, OnnxPredictor):  # ONNX holds no attention maps
        overlays, accelerator = False, "cpu"
    if options is not None:
        task.set_inference_options(options)
    model.predict_options = task.explain_options(explain if explain is not None else ExplainOptions())
    if overlays:
        model.predict_options = _drawn(task, model.predict_options, display_path(source.path))
        if not model.predict_options.methods:
            log.warning("no explanation method applies to %s: predictions only", display_path(source.path))
            overlays = False
    model.predict_overlays = overlays
    model.predict_report_images = run.report_images
    loader = DataLoader(FolderImages(images, files, build_eval_transform(model.inference_data_config()), overlays),
                        batch_size=run.batch_size, num_workers=run.num_workers, collate_fn=collate_folder,
                        persistent_workers=False,  # one pass: workers end with it
                        pin_memory=accelerator != "cpu" and torch.cuda.is_available())  # faster copies to a GPU
    writer = PredictionWriter(out, skipped, f"vision_attn {model.task_name} predictions",
                              {"model": display_path(source.path), "images": display_path(images)}, run.report_images,
                              background=run.background_writes, full_attention=run.full_attention)
    # explanations (relevance, Grad-CAM) need gradients; predictions alone run under inference_mode
    trainer = L.Trainer(accelerator=accelerator, devices=run.devices, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, enable_progress_bar=run.progress, callbacks=[writer],
                        default_root_dir=str(out), inference_mode=not overlays)
    if files:
        trainer.predict(model, dataloaders=loader, return_predictions=False)
    else:
        writer.on_predict_epoch_end(trainer, model)
    log.info("%s: %d images into %s (%d skipped)", model.task_name, len(writer.result["predictions"]), out,
             len(writer.result["skipped"]))
    return writer.result


if __name__ == "__main__":
    from vision_attn.commands.predict import main

    main()
