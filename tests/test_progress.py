"""Progress of long work: explanation measures and ONNX export say what they do and the time left."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from vision_attn.explain.evaluate import select_images
from vision_attn.explain.measures import Localisation, Perturbation, Sanity
from vision_attn.explain.progress import Progress

from .test_caption_explain_eval import captioner  # noqa: F401 (the tiny captioner fixture)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def informed():
    """The vision_attn logger at INFO (the commands' level), restored after."""
    logger = logging.getLogger("vision_attn")
    before = logger.level
    logger.setLevel(logging.INFO)
    yield
    logger.setLevel(before)


def test_a_terminal_gets_a_bar_with_the_time_left(informed):
    term = _Terminal()
    with Progress("explanation measures: deletion / insertion curves", 4, "image", stream=term) as p:
        for _ in range(3):
            p.update()
        p.bar.refresh()  # tqdm redraws at most every 0.1 s
    out = term.getvalue()
    assert "explanation measures: deletion / insertion curves" in out and "3/4" in out and "<" in out  # tqdm's ETA


def test_without_a_terminal_log_lines_say_how_far_and_how_long(informed, caplog):
    caplog.set_level(logging.INFO, logger="vision_attn.progress")
    p = Progress("explanation measures: sanity check", 8, "image", stream=io.StringIO(), log_every=0.0)
    p.update(2)
    p.update(6)
    lines = [r.getMessage() for r in caplog.records if r.name == "vision_attn.progress"]
    assert lines[0].startswith("explanation measures: sanity check: 2/8 images,") and "left" in lines[0]
    assert lines[-1].startswith("explanation measures: sanity check: 8/8 images,") and "left" not in lines[-1]


def test_quiet_means_no_progress(caplog):
    logging.getLogger("vision_attn").setLevel(logging.WARNING)
    try:
        term = _Terminal()
        p = Progress("x", 2, stream=term, log_every=0.0)
        p.update(2)
        p.close()
        assert term.getvalue() == "" and not p.enabled
    finally:
        logging.getLogger("vision_attn").setLevel(logging.NOTSET)


def test_measures_report_their_items(informed, monkeypatch):
    seen: list[tuple[str, int | None, int]] = []
    real = Progress.update

    def spy(self, n=1):
        seen.append((self.desc, self.total, n))
        real(self, n)

    monkeypatch.setattr(Progress, "update", spy)
    curve = torch.linspace(1, 0, 5).repeat(3, 1)
    perturbation = Perturbation(first="rollout", total=6)
    for _ in range(2):
        perturbation.update({"rollout": {"deletion": curve, "insertion": curve.flip(-1)}})
    assert perturbation.compute() and perturbation._progress is None  # closed by compute
    sanity = Sanity(total=3)
    sanity.update({"rollout": {"all": torch.ones(3)}})
    loc = Localisation()
    loc.update({"rollout": torch.ones(4, 4).numpy()}, [[0, 0, 2, 2]])
    assert seen == [("explanation measures: deletion / insertion curves", 6, 3)] * 2 + [
        ("explanation measures: sanity check", 3, 3), ("explanation measures: localisation", None, 1)]
    assert Perturbation(progress=False).progress_enabled is False


def test_onnx_export_reports_its_steps(informed, caplog, tmp_path):
    pytest.importorskip("onnx")
    from vision_attn.export import export_onnx

    from .test_export import _checkpoint, _tasks

    caplog.set_level(logging.INFO, logger="vision_attn.progress")
    ckpt = _checkpoint(_tasks()["classification"], tmp_path / "m.ckpt")
    export_onnx(ckpt, tmp_path / "out" / "model.onnx")
    lines = [r.getMessage() for r in caplog.records if r.name == "vision_attn.progress"]
    assert [ln.split(":")[1].strip() for ln in lines] == [
        "tracing the classification model", "adding the metadata", "writing model.onnx", "wrote model.onnx"]
    assert lines[0].endswith("left") and "4/4 steps" in lines[-1]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.onnx"]


@pytest.fixture
def reports(monkeypatch):
    """Every progress report made, as ``{"desc", "total", "enabled", "done"}`` (``done``: the
    units counted, read at the end)."""
    made: list[Progress] = []
    real = Progress.__init__

    def spy(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(Progress, "__init__", spy)

    def read() -> list[dict]:
        return [{"desc": p.desc, "total": p.total, "enabled": p.enabled, "done": p.n} for p in made]

    return read


def _shown(reports) -> dict[str, tuple[int | None, int]]:
    """``{desc: (total, units done)}`` of the reports that are shown."""
    return {r["desc"]: (r["total"], r["done"]) for r in reports() if r["enabled"]}


def test_a_classification_evaluation_reports_every_measure_with_its_total(informed, reports, shapes_root,
                                                                           tmp_path):
    from vision_attn import create_encoder
    from vision_attn.data.classification import ImageFolderDataset
    from vision_attn.data.transforms import build_eval_transform
    from vision_attn.explain.evaluate import ExplainOptions, explain_eval_split
    from vision_attn.tasks import ClassificationTask

    from .conftest import TINY_VIT

    names = ["circle", "cross", "square", "star", "triangle"]
    torch.manual_seed(0)
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=names).eval()
    ds = ImageFolderDataset(shapes_root, "val", names, build_eval_transform(task.data_config))
    options = ExplainOptions(methods=["rollout"], num_overlays=2, faithfulness_images=5, steps=2, batch_size=3,
                             sanity=True, report=False)
    explain_eval_split(task, ds, options, tmp_path)
    shown = _shown(reports)
    assert shown == {"explanation overlays": (2, 2),
                     "explanation measures: deletion / insertion curves": (5, 5),
                     "explanation measures: ROAD and SaCo": (5, 5),
                     "explanation measures: sanity check": (5, 5)}, shown  # localisation: the sanity's report
    assert all(r["total"] == 5 for r in reports() if r["desc"].startswith("explanation measures"))


def test_a_detection_evaluation_reports_its_images_with_their_total(informed, reports, tmp_path, tiny_encoder,
                                                                    monkeypatch):
    from vision_attn.data.detection import CocoDetection, build_detection_transform
    from vision_attn.explain.detection import detection_explain_metrics
    from vision_attn.explain.evaluate import ExplainOptions

    from .test_detection_explain_eval import _split, _tiny_task

    dets = _split(tmp_path / "data", n_images=4)
    task = _tiny_task(tiny_encoder)
    ds = CocoDetection(tmp_path / "data", "val", build_detection_transform(task.data_config, train=False))
    monkeypatch.setattr(task, "detect", lambda outputs, sizes: [dets.pop(0) for _ in range(len(sizes))])
    options = ExplainOptions(methods=["attention"], faithfulness_images=4, steps=2, sanity=True, batch_size=3)
    metrics = detection_explain_metrics(task, ds, options, tmp_path / "out", max_objects=2)
    assert "sanity_attention" in metrics and "deletion_auc" in metrics
    # the detections are known only once detected: one report over the images (sanity check included)
    assert _shown(reports) == {"explanation measures: detections": (4, 4)}


def test_a_captioning_evaluation_reports_its_images_with_their_total(informed, reports, captioner, tmp_path):  # noqa: F811
    from vision_attn.explain.captioning import write_caption_overlays
    from vision_attn.explain.evaluate import ExplainOptions

    task, val, _ = captioner
    options = ExplainOptions(methods=["attention"], num_overlays=1, faithfulness_images=3, steps=2, batch_size=2,
                             sanity=True, report=False)
    metrics = write_caption_overlays(task, val, options, tmp_path)
    assert "sanity_attention" in metrics
    todo = len(set(select_images(len(val), 1, "sample", 0)) | set(select_images(len(val), 3, "sample", 0)))
    assert _shown(reports) == {"caption overlays and explanation measures": (todo, todo)}


def test_a_measure_counts_the_time_since_it_was_created(informed, caplog):
    caplog.set_level(logging.INFO, logger="vision_attn.progress")
    sanity = Sanity(total=4)
    sanity._began -= 120.0  # created two minutes before its first items were done
    sanity.update({"rollout": {"all": torch.ones(2)}})
    lines = [r.getMessage() for r in caplog.records if r.name == "vision_attn.progress"]
    assert lines == ["explanation measures: sanity check: 2/4 items, 2:00 elapsed, about 2:00 left"]


def test_a_delayed_report_says_nothing_of_quick_work(informed, caplog):
    caplog.set_level(logging.INFO, logger="vision_attn.progress")
    quick = Progress("scanning photos", 3, "path", stream=io.StringIO(), log_every=0.0, delay=60.0)
    quick.update(3)
    term = _Terminal()
    with Progress("scanning photos", 3, "path", stream=term, delay=60.0) as bar:
        bar.update(3)
    assert not [r for r in caplog.records if r.name == "vision_attn.progress"] and term.getvalue() == ""


def test_a_folder_scan_reports_progress_once_it_takes_long(informed, caplog, tmp_path, monkeypatch):
    import vision_attn.predict as predict

    for name in ("a.png", "b.jpg", "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    caplog.set_level(logging.INFO, logger="vision_attn.progress")
    images, _ = predict.scan_folder(tmp_path)
    assert [p.name for p in images] == ["a.png", "b.jpg"]
    assert not [r for r in caplog.records if r.name == "vision_attn.progress"]  # a quick scan says nothing
    monkeypatch.setattr(predict, "SCAN_QUIET_S", 0.0)
    assert predict.scan_folder(tmp_path)[0] == images
    lines = [r.getMessage() for r in caplog.records if r.name == "vision_attn.progress"]
    assert lines and lines[-1].startswith(f"checking the entries of {tmp_path}: 3/3 paths")


def test_an_image_folder_scan_logs_its_classes_once_it_takes_long(informed, caplog, tmp_path):
    from vision_attn.data.classification import _ScanReport

    caplog.set_level(logging.INFO, logger="vision_attn.data.classification")
    _ScanReport(tmp_path, 4).update(1, 10)  # quick: nothing
    assert not caplog.records
    _ScanReport(tmp_path, 4, quiet=0.0, every=0.0).update(1, 10)
    assert caplog.records[-1].getMessage().startswith(f"scanning {tmp_path}: 1/4 classes, 10 images,")
