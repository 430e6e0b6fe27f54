"""python -m vision_attn.predict: every task from a checkpoint (with overlays), classification and
detection from ONNX (the same predictions as the checkpoint)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image

from vision_attn.commands.predict import main
from vision_attn.errors import CheckpointError, RunExistsError
from vision_attn.explain.evaluate import ExplainOptions
from vision_attn.predict import FolderRun, predict_folder
from vision_attn.tasks.detection import DetectionOptions

from .conftest import save_timm_weights
from .test_export import _checkpoint, _tasks

QUIET = FolderRun(progress=False)


def _every_box(kind: str) -> DetectionOptions | None:
    """The task options that keep every detection (``score_threshold`` 0) of a ``kind`` model."""
    return DetectionOptions(score_threshold=0.0) if kind == "detection" else None


def _methods(*names: str) -> ExplainOptions:
    return ExplainOptions(methods=list(names))


@pytest.fixture
def folder(tmp_path):
    images = tmp_path / "imgs"
    (images / "sub").mkdir(parents=True)
    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((40, 56, 3)) * 255).astype(np.uint8)).save(images / "a.jpg")
    Image.fromarray((rng.random((30, 30)) * 255).astype(np.uint8), "L").save(images / "sub" / "b.png")
    (images / "broken.png").write_bytes(b"not an image")
    return images


@pytest.mark.parametrize("kind", ["classification", "detection", "captioning"])
def test_predict_from_a_checkpoint_writes_predictions_and_overlays(kind, folder, tmp_path):
    ckpt = _checkpoint(_tasks()[kind], tmp_path / "m.ckpt")
    out = tmp_path / "out"
    res = predict_folder(ckpt, folder, out, FolderRun(batch_size=1, progress=False), options=_every_box(kind))
    assert [p["file"] for p in res["predictions"]] == ["a.jpg", "sub/b.png"]
    assert [s["file"] for s in res["skipped"]] == ["broken.png"]
    keys = {"classification": {"file", "pred", "score", "topk"}, "detection": {"file", "detections"},
            "captioning": {"file", "caption"}}[kind]
    assert all(set(p) == keys for p in res["predictions"])
    if kind == "detection":
        det = res["predictions"][0]["detections"]
        assert det and set(det[0]) == {"label", "category_id", "bbox", "score"}
        x, y, w, h = det[0]["bbox"]
        assert 0 <= x <= 56 and 0 <= y <= 40 and w >= 0 and h >= 0  # pixels of the original image
    assert json.loads((out / "predictions.json").read_text()) == res["predictions"]
    assert sorted(str(p.relative_to(out / "overlays")) for p in (out / "overlays").rglob("*.png")) == ["a.jpg.png",
                                                                                                      "sub/b.png.png"]
    page = (out / "report.html").read_text()
    # per image: its panel and, for the interactive view, the picture (the same items as eval.py's report)
    # (large panels are re-encoded as JPEG to keep the page small)
    assert page.count("data:image/png;base64,") + page.count("data:image/jpeg;base64,") == 4
    view = {"classification": "patches", "detection": "boxes", "captioning": "words"}[kind]
    assert page.count(f'"kind": "{view}"') == 2
    with pytest.raises(SystemExit):  # results already there: refused, nothing overwritten
        main(["--model", str(ckpt), "--images", str(folder), "--output_dir", str(out)])


@pytest.mark.parametrize("kind", ["classification", "detection"])
def test_predict_from_onnx_equals_the_checkpoint(kind, folder, tmp_path):
    pytest.importorskip("onnxruntime")
    from vision_attn.export import export_onnx

    ckpt = _checkpoint(_tasks()[kind], tmp_path / "m.ckpt")
    onnx_path = export_onnx(ckpt, tmp_path / "m.onnx")
    a = predict_folder(ckpt, folder, tmp_path / "a", QUIET, options=_every_box(kind), overlays=False)["predictions"]
    b = predict_folder(onnx_path, folder, tmp_path / "b", QUIET, options=_every_box(kind))["predictions"]
    assert not (tmp_path / "b" / "overlays").exists()  # ONNX holds no attention maps
    if kind == "classification":
        assert [p["pred"] for p in a] == [p["pred"] for p in b]
        assert [p["score"] for p in a] == pytest.approx([p["score"] for p in b], abs=1e-4)
    else:
        for pa, pb in zip(a, b, strict=True):
            assert [d["label"] for d in pa["detections"]] == [d["label"] for d in pb["detections"]]
            assert np.allclose([d["bbox"] for d in pa["detections"]], [d["bbox"] for d in pb["detections"]], atol=1e-2)


def test_captioning_onnx_is_refused_clearly(folder, tmp_path):
    pytest.importorskip("onnxruntime")
    from vision_attn.export import export_onnx

    path = export_onnx(_checkpoint(_tasks()["captioning"], tmp_path / "m.ckpt"), tmp_path / "m.onnx")
    with pytest.raises(CheckpointError, match="captioning model whose predictions need PyTorch"):
        predict_folder(path, folder, tmp_path / "out", QUIET)


@pytest.fixture(scope="module")
def classifier_ckpt(tmp_path_factory):
    return _checkpoint(_tasks()["classification"], tmp_path_factory.mktemp("model") / "m.ckpt")


@pytest.mark.parametrize("present", ["skipped.json", "report.html", "overlays"])
def test_predict_never_overwrites_a_users_files(present, classifier_ckpt, folder, tmp_path):
    """A folder without predictions.json but with a user's skipped.json (or report.html, or
    overlays/) is refused, the file untouched; --overwrite lets the run go ahead."""
    out = tmp_path / "out"
    out.mkdir()
    mine = out / present
    if present == "overlays":
        mine.mkdir()
        mine = mine / "a.jpg.png"
    mine.write_text("the user's own notes")
    with pytest.raises(RunExistsError, match=present):
        predict_folder(classifier_ckpt, folder, out, QUIET)
    assert mine.read_text() == "the user's own notes"
    predict_folder(classifier_ckpt, folder, out, FolderRun(overwrite=True, progress=False), overlays=False)
    assert (out / "predictions.json").is_file()


def test_predict_names_fifos_devices_and_colliding_or_long_names(classifier_ckpt, tmp_path):
    images = tmp_path / "imgs"
    images.mkdir()
    rng = np.random.default_rng(1)
    long_name = "y" * 245 + ".jpeg"  # its overlay name, kept whole, would be 254 bytes + a temporary's
    for name in ("a.jpg", "a.png", long_name):
        Image.fromarray((rng.random((32, 32, 3)) * 255).astype(np.uint8)).save(images / name)
    os.mkfifo(images / "pipe.png")  # opening it would block the whole run
    (images / "null.jpg").symlink_to("/dev/null")  # a character device
    (images / "gone.png").symlink_to(images / "missing.png")  # a link to nothing
    out = tmp_path / "out"
    res = predict_folder(classifier_ckpt, images, out, QUIET, _methods("rollout"))
    assert [p["file"] for p in res["predictions"]] == ["a.jpg", "a.png", long_name]
    reasons = {s["file"]: s["reason"] for s in json.loads((out / "skipped.json").read_text())}
    assert set(reasons) == {"pipe.png", "null.jpg", "gone.png"}
    assert "FIFO" in reasons["pipe.png"] and "character device" in reasons["null.jpg"]
    overlays = sorted(p.name for p in (out / "overlays").iterdir())
    assert len(overlays) == 3 and {"a.jpg.png", "a.png.png"} <= set(overlays)  # no collision
    assert all(len(n.encode()) <= 200 and n.endswith(".png") for n in overlays)


def test_onnx_runtime_errors_are_one_line_naming_the_file(folder, tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    bad = tmp_path / "m.onnx"
    bad.write_bytes(b"not an onnx model")
    with pytest.raises(SystemExit) as info:
        main(["--model", str(bad), "--images", str(folder), "--output_dir", str(tmp_path / "out")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ONNX Runtime cannot load") and str(bad) in err and "\n" not in err


def test_images_may_be_a_file_a_folder_or_a_glob(folder, tmp_path):
    from vision_attn.errors import VisionAttnError
    from vision_attn.predict import resolve_images

    root, files, skipped = resolve_images(folder / "sub" / "b.png")  # one file: named by its name
    assert root == folder / "sub" and files == [folder / "sub" / "b.png"] and skipped == []
    root, files, skipped = resolve_images(folder)  # a folder, recursively; unreadable files come later
    assert [p.relative_to(root).as_posix() for p in files] == ["a.jpg", "broken.png", "sub/b.png"]
    root, files, _ = resolve_images(f"{folder}/**/*.png")  # a glob: rooted before the first wildcard
    assert root == folder and [p.relative_to(root).as_posix() for p in files] == ["broken.png", "sub/b.png"]
    (folder / "dir.png").mkdir()  # a folder that matches the pattern is not an image
    _, files, skipped = resolve_images(f"{folder}/*.png")
    assert [p.name for p in files] == ["broken.png"] and skipped == []
    os.mkfifo(tmp_path / "pipe.png")  # listed, never opened
    _, files, skipped = resolve_images(tmp_path / "pipe.png")
    assert files == [] and skipped[0]["file"] == "pipe.png" and "not a regular file" in skipped[0]["reason"]
    with pytest.raises(VisionAttnError, match="matches no image"):
        resolve_images(f"{folder}/*.gif")
    with pytest.raises(VisionAttnError, match="no such file or folder"):
        resolve_images(tmp_path / "absent.jpg")


@pytest.fixture(scope="module")
def timm_weights(tmp_path_factory):
    """A timm ViT made and saved by plain timm code (random weights, ImageNet-1k head)."""
    return save_timm_weights("vit_tiny_patch16_224", tmp_path_factory.mktemp("timm"))


def test_predict_any_timm_vit_by_name_contract(timm_weights, folder, tmp_path):
    import timm

    photo = folder / "a.jpg"
    out = tmp_path / "out"
    weights = timm_weights
    main(["--model", "timm:vit_tiny_patch16_224", "--weights_file", str(weights), "--images", str(photo),
          "--output_dir", str(out), "--topk", "3", "--methods", "gradcam", "tokens", "--num_workers", "0"])
    preds = json.loads((out / "predictions.json").read_text())
    assert len(preds) == 1 and preds[0]["file"] == "a.jpg"  # a single file: its name
    topk = preds[0]["topk"]
    assert len(topk) == 3 and topk[0] == {"label": preds[0]["pred"], "score": preds[0]["score"]}
    assert [t["score"] for t in topk] == sorted((t["score"] for t in topk), reverse=True)
    info = timm.data.ImageNetInfo()
    names = {info.index_to_description(i) for i in range(1000)}
    assert all(t["label"] in names for t in topk)  # ImageNet descriptions, not indices
    assert (out / "overlays" / "a.jpg.png").is_file() and (out / "report.html").is_file()
    assert json.loads((out / "skipped.json").read_text()) == []
    # --no_overlays: predictions only; a folder gives paths relative to it
    main(["--model", "timm:vit_tiny_patch16_224", "--weights_file", str(weights), "--images", str(folder),
          "--output_dir", str(tmp_path / "o2"), "--no_overlays", "--num_workers", "0"])
    assert not (tmp_path / "o2" / "overlays").exists()
    assert [p["file"] for p in json.loads((tmp_path / "o2" / "predictions.json").read_text())] == ["a.jpg",
                                                                                                   "sub/b.png"]


def test_a_pretrained_name_offline_without_weights_is_one_line_and_status_2(folder, tmp_path, capsys, monkeypatch):
    import timm.models._builder as builder

    def offline(*args, **kwargs):
        raise OSError("Name or service not known")

    monkeypatch.setattr(builder, "load_pretrained", offline)
    with pytest.raises(SystemExit) as ex:
        main(["--model", "timm:vit_tiny_patch16_224.augreg_in21k_ft_in1k", "--images", str(folder),
              "--output_dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert ex.value.code == 2 and "--weights_file" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- a predict loop as fast as the model
@pytest.fixture
def many_images(tmp_path):
    """Seven colour JPEGs / PNGs of different sizes (two batches of 4), one in a sub-folder."""
    images = tmp_path / "many"
    (images / "sub").mkdir(parents=True)
    rng = np.random.default_rng(2)
    for i in range(7):
        name = f"sub/s{i}.png" if i == 3 else f"i{i}.{'jpg' if i % 2 else 'png'}"
        Image.fromarray((rng.random((24 + 4 * i, 40 - 2 * i, 3)) * 255).astype(np.uint8)).save(images / name)
    return images


def test_background_writer_writes_byte_identical_overlays_on_its_own_thread(classifier_ckpt, many_images, tmp_path,
                                                                             monkeypatch):
    """The overlays of the background thread are the synchronous path's, byte for byte, and
    the PNGs really are written off the main thread (each a temporary file and a rename)."""
    import threading

    import vision_attn.predict as predict_module

    threads: list[str] = []
    real_save = predict_module.save_png

    def spy(path, panel, root=None):
        threads.append(threading.current_thread().name)
        return real_save(path, panel, root=root)

    monkeypatch.setattr(predict_module, "save_png", spy)
    runs = {}
    for background in (False, True):
        out = tmp_path / f"bg{int(background)}"
        threads.clear()
        res = predict_folder(classifier_ckpt, many_images, out,
                             FolderRun(batch_size=4, progress=False, background_writes=background),
                             _methods("rollout", "attention"))
        assert set(threads) == ({"vision_attn-overlay-writer"} if background else {threading.main_thread().name})
        runs[background] = (res, {p.relative_to(out).as_posix(): p.read_bytes() for p in (out / "overlays").rglob("*")
                                  if p.is_file()})
        assert not list(out.rglob("*.tmp")) and not list(out.rglob(".*"))  # no temporary left behind
    (sync, sync_files), (bg, bg_files) = runs[False], runs[True]
    assert len(sync_files) == 7 and "overlays/sub/s3.png.png" in sync_files
    assert bg_files == sync_files  # the same names, byte-identical PNGs
    assert bg == sync
    assert not [t for t in threading.enumerate() if t.name == "vision_attn-overlay-writer"]  # the thread ended


def test_an_overlay_write_error_surfaces_in_the_main_process_naming_the_file(classifier_ckpt, many_images, tmp_path,
                                                                             monkeypatch, capsys):
    import threading

    import vision_attn.predict as predict_module
    from vision_attn.predict import OverlayWriteError

    real_save = predict_module.save_png

    def failing(path, panel, root=None):
        if path.name == "i1.jpg.png":
            raise OSError(28, "No space left on device")
        return real_save(path, panel, root=root)

    monkeypatch.setattr(predict_module, "save_png", failing)
    out = tmp_path / "out"
    with pytest.raises(OverlayWriteError, match=r"i1\.jpg\.png.*No space left on device"):
        predict_folder(classifier_ckpt, many_images, out, FolderRun(batch_size=4, progress=False), _methods("rollout"))
    assert not (out / "predictions.json").exists()  # the run stopped: no results that look complete
    assert not [t for t in threading.enumerate() if t.name == "vision_attn-overlay-writer"]
    with pytest.raises(SystemExit) as info:  # the command: one line, status 2
        main(["--model", str(classifier_ckpt), "--images", str(many_images), "--output_dir", str(tmp_path / "cli"),
              "--methods", "rollout", "--num_workers", "0"])
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after any library warning
    assert info.value.code == 2 and err.startswith("error: cannot write the overlay") and "i1.jpg.png" in err


def test_background_writer_queue_is_bounded(tmp_path, monkeypatch):
    """With a stalled disk, the producer blocks once ``max_pending`` panels wait (memory stays
    bounded), and goes on when the writes do."""
    import threading

    import vision_attn.predict as predict_module
    from vision_attn.predict import BackgroundWriter

    release = threading.Event()
    written: list[str] = []

    def slow(path, panel, root=None):
        release.wait(10)
        written.append(path.name)

    monkeypatch.setattr(predict_module, "save_png", slow)
    writer = BackgroundWriter(tmp_path, max_pending=2)
    panel = np.zeros((4, 4, 3), np.uint8)
    producer = threading.Thread(target=lambda: [writer.submit(tmp_path / f"{i}.png", panel) for i in range(6)])
    producer.start()
    producer.join(0.5)
    assert producer.is_alive()  # 1 being written + 2 queued: the 4th submit waits
    assert writer._queue.qsize() == 2
    release.set()
    producer.join(10)
    writer.close()
    assert written == [f"{i}.png" for i in range(6)] and writer.written == 6


@pytest.mark.parametrize("kind", ["classification", "detection", "captioning"])
def test_predictions_only_run_no_explanation_code_and_hook_nothing(kind, folder, tmp_path, monkeypatch):
    """--no_overlays: the task's plain forward under inference_mode, no hook registered on any
    module, explain_batch never called; the records equal those of a run with overlays (whose
    capture does register hooks: the spy sees them)."""
    import torch

    ckpt = _checkpoint(_tasks()[kind], tmp_path / "m.ckpt")
    task_class = type(_tasks()[kind])
    hooks: list[str] = []
    modes: list[bool] = []
    explained: list[int] = []
    for name in ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
                 "register_full_backward_pre_hook"):
        real = getattr(torch.nn.Module, name)
        monkeypatch.setattr(torch.nn.Module, name,
                            lambda self, *a, _real=real, _name=name, **k: (hooks.append(_name),
                                                                           _real(self, *a, **k))[1])
    real_forward, real_explain = task_class.export_forward, task_class.explain_batch
    monkeypatch.setattr(task_class, "export_forward",
                        lambda self, x: (modes.append(torch.is_inference_mode_enabled()), real_forward(self, x))[1])
    monkeypatch.setattr(task_class, "explain_batch",
                        lambda self, *a, **k: (explained.append(1), real_explain(self, *a, **k))[1])
    plain = predict_folder(ckpt, folder, tmp_path / "plain", QUIET, options=_every_box(kind), overlays=False)
    assert hooks == [] and explained == [] and modes and all(modes)
    assert not (tmp_path / "plain" / "overlays").exists()
    drawn = predict_folder(ckpt, folder, tmp_path / "drawn", QUIET, _methods("relevance"), _every_box(kind))
    assert hooks and explained  # the spies do see an explanation run (relevance captures through hooks)
    files = [p["file"] for p in plain["predictions"]]
    assert files == [p["file"] for p in drawn["predictions"]] == ["a.jpg", "sub/b.png"]
    for a, b in zip(plain["predictions"], drawn["predictions"], strict=True):
        assert _close(a, b), (a, b)


def _close(a, b) -> bool:
    """Records equal up to float rounding (nested lists and dicts)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return b == pytest.approx(a, abs=1e-4)
    return a == b


@pytest.mark.parametrize("overlays", [False, True])
def test_worker_decoding_gives_the_main_process_predictions(overlays, classifier_ckpt, many_images, tmp_path):
    """Two DataLoader workers decoding give exactly the records (and overlays) of decoding in
    the main process, in file order, the unreadable file skipped alike."""
    (many_images / "broken.jpg").write_bytes(b"not a jpeg")
    runs = []
    for workers in (0, 2):
        out = tmp_path / f"w{workers}"
        res = predict_folder(classifier_ckpt, many_images, out, FolderRun(batch_size=3, progress=False,
                             num_workers=workers), _methods("rollout"), overlays=overlays)
        pngs = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*.png")}
        runs.append((res, pngs))
    (main_res, main_pngs), (worker_res, worker_pngs) = runs
    assert len(main_res["predictions"]) == 7 and [s["file"] for s in main_res["skipped"]] == ["broken.jpg"]
    assert worker_res["predictions"] == main_res["predictions"]  # bitwise: the same tensors, the same records
    assert [s["file"] for s in worker_res["skipped"]] == ["broken.jpg"]
    assert worker_pngs == main_pngs and len(main_pngs) == (7 if overlays else 0)


def test_images_past_the_report_are_explained_without_report_items(classifier_ckpt, many_images, tmp_path,
                                                                    monkeypatch):
    """report.html shows ``report_images`` images: the batches after them are explained with
    ``ExplainOptions.report`` off (no per-patch attention rows to build); every overlay is written."""
    from vision_attn.tasks.classification import ClassificationTask

    reports: list[bool] = []
    real = ClassificationTask.explain_batch
    monkeypatch.setattr(ClassificationTask, "explain_batch",
                        lambda self, images, pictures, options, truths=None: (reports.append(options.report),
                                                                              real(self, images, pictures, options))[1])
    out = tmp_path / "out"
    res = predict_folder(classifier_ckpt, many_images, out, FolderRun(batch_size=2, progress=False, report_images=3),
                         _methods("rollout"))
    assert reports == [True, True, False, False]  # images 0-1, 2-3 (the 3rd is reported), 4-5, 6
    assert len(res["predictions"]) == 7 and len(list((out / "overlays").rglob("*.png"))) == 7
    assert (out / "report.html").read_text().count('"kind": "patches"') == 3


def test_report_items_are_built_only_for_the_report_s_images(classifier_ckpt, many_images, tmp_path, monkeypatch):
    """Past ``report_images`` (here 2, batches of 4) no report entry is built (each costs an
    encoded panel and the patch view's maps): only the first batch's; the overlays and the
    report's two entries are unchanged."""
    import vision_attn.explain.evaluate as evaluate

    calls = []
    real = evaluate.attention_report_item
    monkeypatch.setattr(evaluate, "attention_report_item", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = tmp_path / "out"
    predict_folder(classifier_ckpt, many_images, out, FolderRun(batch_size=4, progress=False, report_images=2),
                   _methods("rollout"))
    assert len(calls) == 4  # the first batch only (7 images in two batches)
    assert len(list((out / "overlays").rglob("*.png"))) == 7
    html = (out / "report.html").read_text()
    assert html.count('"kind": "patches"') + html.count('"kind":"patches"') == 2



@pytest.fixture(scope="module")
def exported_onnx(tmp_path_factory):
    """A tiny classifier exported once: its metadata dresses the hostile files below."""
    pytest.importorskip("onnxruntime")
    from vision_attn.export import export_onnx

    tmp = tmp_path_factory.mktemp("onnx")
    return export_onnx(_checkpoint(_tasks()["classification"], tmp / "m.ckpt"), tmp / "m.onnx")


def _with_graph(exported, path, nodes, initializers):
    """An ONNX file with ``exported``'s vision_attn metadata around another graph: images
    [b, 3, H, W] -> logits."""
    import onnx
    from onnx import TensorProto, helper

    props = {p.key: p.value for p in exported.metadata_props}
    size = list(json.loads(props["data_config"])["input_size"])
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["b", *size])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    for key, value in props.items():
        model.metadata_props.add(key=key, value=value)
    onnx.save(model, path)
    return path


def test_an_onnx_graph_that_asks_for_gigabytes_fails_clearly_within_the_cap(exported_onnx, folder, tmp_path):
    """A file of under 2 KB whose graph fills an 8 GiB tensor (ConstantOfShape): ONNX Runtime's
    arena is capped (VISION_ATTN_MAX_ONNX_BYTES, 4 GiB by default), so the run fails with one line
    naming the file and the variable instead of taking the memory."""
    import resource

    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("ReduceMean", ["images", "axes"], ["m"], keepdims=0),
             helper.make_node("ConstantOfShape", ["shape"], ["big"],
                              value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
             helper.make_node("ReduceSum", ["big"], ["s"], keepdims=0),
             helper.make_node("Add", ["m", "s"], ["logits"])]
    inits = [numpy_helper.from_array(np.array([2048, 1024, 1024], np.int64), "shape"),
             numpy_helper.from_array(np.array([2, 3], np.int64), "axes")]
    bomb = _with_graph(onnx.load(exported_onnx), tmp_path / "bomb.onnx", nodes, inits)
    assert bomb.stat().st_size < 2000
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CheckpointError, match=r"bomb.onnx .*needs more memory than VISION_ATTN_MAX_ONNX_BYTES"):
        predict_folder(bomb, folder, tmp_path / "out", QUIET)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 2_000_000  # KiB: not the 8 GiB


@pytest.mark.parametrize(("data_config", "match"), [
    ('{"input_size": [3, 40000, 40000]}', "VISION_ATTN_MAX_INPUT_SIZE"),
    ('{"input_size": "abc"}', "data_config"),
    ('{"mean": "xyz"}', "data_config"),
    ('{"interpolation": "evil", "input_size": [3, 32, 32]}', "data_config"),
    ('{"mean": [0.5, 0.5, 0.5]}', "no input_size"),
    ("[" * 100_000, "broken vision_attn metadata"),
])
def test_an_onnx_files_preprocessing_is_checked_as_a_checkpoints(data_config, match, exported_onnx, tmp_path):
    import onnx

    from vision_attn.onnx_predict import OnnxPredictor

    model = onnx.load(exported_onnx)
    for prop in model.metadata_props:
        if prop.key == "data_config":
            prop.value = data_config
    onnx.save(model, tmp_path / "m.onnx")
    with pytest.raises(CheckpointError, match=match):
        OnnxPredictor(tmp_path / "m.onnx")


def test_links_out_of_the_images_folder_are_skipped_unless_followed(tmp_path):
    from vision_attn.predict import resolve_images

    secret = tmp_path / "secret"
    secret.mkdir()
    Image.new("RGB", (8, 6)).save(secret / "private.png")
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (8, 6)).save(images / "a.png")
    os.symlink(secret / "private.png", images / "innocent.png")
    os.symlink(images / "a.png", images / "inside.png")  # a link that stays inside is read
    for spec in (images, f"{images}/*.png"):
        _, files, skipped = resolve_images(spec)
        assert sorted(p.name for p in files) == ["a.png", "inside.png"]
        assert [s["file"] for s in skipped] == ["innocent.png"] and "--follow_symlinks" in skipped[0]["reason"]
        _, files, skipped = resolve_images(spec, follow_symlinks=True)
        assert len(files) == 3 and skipped == []
    assert resolve_images(images / "innocent.png")[1] == [images / "innocent.png"]  # named alone: read
