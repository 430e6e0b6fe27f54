"""The write side: every output stays inside its output folder, a planted link in the output
folder is replaced, never followed, and names built from data are made safe and short, so a long
file name cannot fail an evaluation."""

from __future__ import annotations

import json
import logging
import os
import stat
import unicodedata
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from vision_attn import create_encoder
from vision_attn.explain.overlay import save_png
from vision_attn.models.captioner import DecoderConfig, GenerationOptions
from vision_attn.outputs import (
    MAX_NAME_BYTES,
    OutputPathError,
    atomic_output,
    resolve_under,
    safe_filename,
    write_bytes,
    write_json,
    write_npy,
    write_png,
)
from vision_attn.report import write_report

from .conftest import TINY_VIT

IMG = np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3)


def _files_outside(top: Path, inside: Path) -> list[Path]:
    inside = inside.resolve()
    return [p for p in top.resolve().rglob("*") if p.is_file() and inside not in p.parents]


def test_safe_filename_flat_deterministic_distinct_and_short():
    hostile = "../../../../tmp/x"
    name = safe_filename(hostile)
    assert "/" not in name and not name.startswith(".") and name == safe_filename(hostile)
    assert safe_filename("a/b.png") != safe_filename("a_b.png")  # changed names carry a hash
    assert safe_filename("00012_cat.png") == "00012_cat.png"  # safe names are kept as they are
    assert safe_filename("").startswith("_") and safe_filename("..").startswith("_")
    assert "\x00" not in safe_filename("a\x00b\nc.png")
    for long, suffix in (("x" * 1000 + ".png", ".png"), ("é" * 300 + ".jpg.png", ".png"), ("x" * 300, "")):
        short = safe_filename(long)
        assert len(short.encode()) <= MAX_NAME_BYTES and short == safe_filename(long)
        assert Path(short).suffix == suffix and short.startswith(long[:50])
    assert safe_filename("x" * 300 + "a.png") != safe_filename("x" * 300 + "b.png")  # same prefix, other hash


def test_writers_refuse_paths_outside_the_output_folder(tmp_path):
    out = tmp_path / "out"
    escape = out / "overlays" / ".." / ".." / "escaped.json"
    deep = out / "overlays" / "00001_.." / ".." / ".." / ".." / "x.png"
    for write in (lambda: write_json(escape, {"a": 1}, root=out), lambda: write_bytes(escape, b"x", root=out),
                  lambda: write_npy(escape, np.zeros(2), root=out),
                  lambda: write_png(escape.with_suffix(".png"), IMG, root=out),
                  lambda: save_png(deep, IMG, root=out),
                  lambda: write_report(escape.with_suffix(".html"), "t", {}, {}, [], root=out)):
        with pytest.raises(OutputPathError, match="outside the output folder"):
            write()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out.mkdir(exist_ok=True)
    (out / "overlays").symlink_to(elsewhere)  # a planted folder link
    with pytest.raises(OutputPathError, match=str(out)):
        save_png(out / "overlays" / "1.png", IMG, root=out)
    assert not _files_outside(tmp_path, out) and not list(elsewhere.iterdir())
    linked = tmp_path / "link-to-out"
    linked.symlink_to(out)  # an output folder that is itself a link is fine
    assert resolve_under(linked, linked / "m.json") == out.resolve() / "m.json"


def test_hostile_caption_image_id_writes_inside_the_output_folder(tmp_path):
    """A captioning image id ends up in an overlay name: ``../../../../x`` must stay inside."""
    from vision_attn.data.tokenizer import SPECIAL_TOKENS
    from vision_attn.explain.captioning import write_caption_overlays
    from vision_attn.explain.evaluate import ExplainOptions
    from vision_attn.tasks import CaptioningTask

    torch.manual_seed(0)
    task = CaptioningTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), vocab=[*SPECIAL_TOKENS, "a", "red"],
                          decoder=DecoderConfig(hidden_dim=32, num_layers=1, num_heads=2, max_length=4),
                          generate=GenerationOptions(beam_size=1)).eval()
    image_file = tmp_path / "img.png"
    Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(image_file)

    class _Data:  # just what write_caption_overlays reads; the id comes from an annotation file
        images, root, split = [{"id": "../../../../x"}], tmp_path, "val"

        def __len__(self):
            return 1

        def __getitem__(self, i):
            return torch.zeros(3, 32, 32), None

        def image_path(self, i):
            return image_file

    out = tmp_path / "a" / "b" / "out"
    options = ExplainOptions(num_overlays=1, faithfulness=False, batch_size=1)
    write_caption_overlays(task, _Data(), options, out)
    written = list((out / "overlays").iterdir())
    assert len(written) == 1 and written[0].suffix == ".png" and "/" not in written[0].name
    assert _files_outside(tmp_path, out) == [image_file.resolve()]


@pytest.mark.parametrize("planted", ["final", "temporary"])
def test_planted_links_are_replaced_never_followed(tmp_path, planted):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    (out / "overlays").mkdir(parents=True)
    names = ["report.html", "overlays/1.png", "predictions.json", "maps.npy"]
    for name in names:  # the final names, or the predictable temporaries older code used
        (out / (name if planted == "final" else name + ".tmp")).symlink_to(victim)
    write_report(out / "report.html", "t", {"acc": 1.0}, {}, [])
    save_png(out / "overlays" / "1.png", IMG)  # safe without root= as well
    write_json(out / "predictions.json", [1, 2], root=out)
    write_npy(out / "maps.npy", np.ones(3, np.float32), root=out)
    assert victim.read_text() == "precious"
    for name in names:
        assert not (out / name).is_symlink() and (out / name).is_file()
    assert np.array_equal(cv2.cvtColor(cv2.imread(str(out / "overlays" / "1.png")), cv2.COLOR_BGR2RGB), IMG)
    assert json.loads((out / "predictions.json").read_text()) == [1, 2]
    assert np.load(out / "maps.npy").tolist() == [1.0, 1.0, 1.0]


def test_failed_writes_leave_no_temporary_and_keep_the_old_file(tmp_path, monkeypatch):
    out = tmp_path / "out"
    write_json(out / "metrics.json", {"old": 1}, root=out)
    mode = stat.S_IMODE((out / "metrics.json").stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask  # not mkstemp's 0600

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_json(out / "metrics.json", {"new": 2}, root=out)
    with pytest.raises(KeyboardInterrupt), atomic_output(out / "model.onnx", root=out) as tmp:
        tmp.write_bytes(b"partial")
    monkeypatch.undo()
    with pytest.raises(OSError, match="could not write"):
        write_png(out / "x.unknownext", IMG, root=out)
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json"]
    assert json.loads((out / "metrics.json").read_text()) == {"old": 1}


def test_long_file_name_does_not_fail_the_evaluation(tmp_path):
    """evaluate.py names overlays ``<index>_<class>_<file stem>.png``: a 240-byte stem once made
    OpenCV fail after all the work, with no metrics written. save_png now shortens the name."""
    from vision_attn.data.classification import ImageFolderDataset
    from vision_attn.data.transforms import build_eval_transform
    from vision_attn.explain.evaluate import ExplainOptions, explain_eval_split
    from vision_attn.tasks import ClassificationTask

    root = tmp_path / "data"
    long_stem = "y" * 240
    for cls, stem in (("circle", long_stem), ("square", "b")):
        (root / "val" / cls).mkdir(parents=True)
        Image.fromarray(np.full((32, 32, 3), 40, np.uint8)).save(root / "val" / cls / f"{stem}.png")
    torch.manual_seed(0)
    encoder = create_encoder("vit_tiny_patch16_224", **TINY_VIT)
    task = ClassificationTask(encoder, class_names=["circle", "square"]).eval()
    ds = ImageFolderDataset(root, "val", task.class_names, build_eval_transform(task.data_config))
    out = tmp_path / "out"
    options = ExplainOptions(num_overlays=2, faithfulness=False, batch_size=2, methods=["rollout"])
    explain_eval_split(task, ds, options, out)
    names = sorted(p.name for p in (out / "overlays").iterdir())
    assert len(names) == 2 and all(len(n.encode()) <= MAX_NAME_BYTES and n.endswith(".png") for n in names)
    assert any(n.startswith("00000_circle_yyyy") for n in names)


# --- non-finite numbers and control characters in output files ----------------------------------


def _strict_json(text: str):
    """``json.loads`` that refuses ``NaN``, ``Infinity`` and ``-Infinity`` (not JSON)."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_write_json_writes_non_finite_numbers_as_null_with_one_warning(tmp_path, caplog):
    nan, inf = float("nan"), float("inf")
    obj = [{"file": "a.png", "score": nan, "topk": [{"label": "x", "score": np.float32("nan")}]},
           {"file": "b.png", "score": 0.5, "box": (1.0, -inf, np.float64(inf)), "s": torch.tensor(nan),
            "ok": np.float32(0.25), "n": np.int64(3), "arr": np.array([1.0, nan])},
           {"per_class": {"red circle": torch.tensor([inf, 2.0])}}]
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="vision_attn.outputs"):
        write_json(out / "predictions.json", obj, root=out)
    back = _strict_json((out / "predictions.json").read_text())
    assert back == [{"file": "a.png", "score": None, "topk": [{"label": "x", "score": None}]},
                    {"file": "b.png", "score": 0.5, "box": [1.0, None, None], "s": None, "ok": 0.25, "n": 3,
                     "arr": [1.0, None]},
                    {"per_class": {"red circle": [None, 2.0]}}]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "predictions.json: 7 non-finite values written as null (first at [0].score)" in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vision_attn.outputs"):
        write_json(out / "metrics.json", {"acc": 1.0, "map": 0.5}, root=out)
        write_json(out / "one.json", {"per_class": {"a b": {"ap": -inf}}}, root=out)
    assert [r.getMessage().rsplit("/", 1)[-1] for r in caplog.records] == [
        'one.json: 1 non-finite values written as null (first at per_class["a b"].ap)']
    assert _strict_json((out / "one.json").read_text()) == {"per_class": {"a b": {"ap": None}}}


def test_a_model_with_nan_weights_writes_valid_predictions_json(tmp_path, caplog):
    from vision_attn.predict import FolderRun, predict_folder
    from vision_attn.tasks import ClassificationTask
    from vision_attn.tasks.classification import ClassificationOptions

    from .test_export import _checkpoint

    torch.manual_seed(0)
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=["a", "b", "c"])
    with torch.no_grad():
        for p in task.parameters():
            p.fill_(float("nan"))
    ckpt = _checkpoint(task, tmp_path / "m.ckpt")
    images = tmp_path / "imgs"
    images.mkdir()
    for name in ("a.png", "b.png"):
        Image.fromarray(np.full((32, 32, 3), 90, np.uint8)).save(images / name)
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="vision_attn.outputs"):
        predict_folder(ckpt, images, out, FolderRun(progress=False, report_images=0),
                       options=ClassificationOptions(topk=2), overlays=False)
    records = _strict_json((out / "predictions.json").read_text())
    assert [r["file"] for r in records] == ["a.png", "b.png"]
    assert all(r["score"] is None and all(t["score"] is None for t in r["topk"]) for r in records)
    assert "predictions.json: 6 non-finite values written as null (first at [0].score)" in caplog.text


_INVISIBLE = ["\u202e", "\u202a", "\u2066", "\u2069", "\u200b", "\u200d", "\u200f", "\ufeff", "\u2060", "\x85",
              "\x9b", "\u00ad", "\u2028"]


@pytest.mark.parametrize("char", _INVISIBLE, ids=[f"U+{ord(c):04X}" for c in _INVISIBLE])
def test_safe_filename_replaces_control_and_format_characters(char):
    name = safe_filename(f"photo{char}gnp.exe.png")
    assert char not in name and name == safe_filename(f"photo{char}gnp.exe.png")
    assert name.endswith(".png") and name.startswith("photo_gnp.exe-")
    assert name != safe_filename("photognp.exe.png") and name != safe_filename("photo_gnp.exe.png")


def test_overlay_names_carry_no_bidi_override_or_zero_width_character(tmp_path):
    from vision_attn.predict import overlay_name

    spoof, hidden = "photo\u202egnp.exe.png", "pho\u200bto.png"
    names = {overlay_name(Path(n)).name for n in (spoof, hidden, "photo.png", "photo_gnp.exe.png")}
    assert len(names) == 4
    for name in names:
        assert not any(unicodedata.category(c) in ("Cc", "Cf") for c in name)
    out = tmp_path / "out"
    written = save_png(out / "overlays" / f"00001_{spoof}", IMG, root=out)
    assert written.name.startswith("00001_photo_gnp.exe-") and "\u202e" not in written.name
    assert [p.name for p in (out / "overlays").iterdir()] == [written.name]


def test_names_and_ids_from_files_cannot_forge_a_log_line_or_move_the_cursor(tmp_path, capsys):
    """The console's log lines and one-line errors escape control and format characters, and a
    line break inside a message starts an indented line; annotation ids in warnings are shown as
    short JSON."""
    from vision_attn.commands.args import console_logging
    from vision_attn.data.coco import shown_value
    from vision_attn.outputs import ConsoleText, console_text

    hostile = "a.png\nERROR vision_attn: checkpoint verified OK\x1b[1A\x1b[2K\u202egnp.exe\u2028"
    clean = console_text(hostile)
    assert "\x1b" not in clean and "\u202e" not in clean and "\u2028" not in clean
    assert "\\x1b[1A" in clean and "\\u202e" in clean
    assert all(line.startswith("    ") for line in clean.split("\n")[1:])  # no line of its own
    assert console_text("photos/ünïcode café\tok.png") == "photos/ünïcode café\tok.png"  # ordinary text unchanged
    assert shown_value("x\n" + "A" * 1000) == '"x\\nAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA...'
    assert len(shown_value(["\x1b"] * 100)) == 60 and "\x1b" not in shown_value(["\x1b"] * 100)

    root = logging.getLogger()
    saved = list(root.handlers)
    try:
        for handler in saved:
            root.removeHandler(handler)
        console_logging()
        console_logging()  # idempotent: one filter per handler
        assert [sum(isinstance(f, ConsoleText) for f in h.filters) for h in root.handlers] == [1]
        logging.getLogger("vision_attn.data").warning("dropped 1 annotation, e.g. %s", hostile)
        err = capsys.readouterr().err
        assert "\x1b" not in err and "\nERROR" not in err and "\n    ERROR vision_attn: checkpoint" in err
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved:
            root.addHandler(handler)


def test_a_dropped_annotations_id_is_shown_escaped_and_short(tmp_path, caplog):
    from PIL import Image

    from vision_attn.data.detection import CocoDetection

    (tmp_path / "val").mkdir()
    (tmp_path / "annotations").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "val" / "a.png")
    forged = "x\nERROR vision_attn: forged\x1b[2K" + "A" * 200_000
    (tmp_path / "annotations" / "instances_val.json").write_text(json.dumps({
        "images": [{"id": 1, "file_name": "a.png"}], "categories": [{"id": 1, "name": "c"}],
        "annotations": [{"id": forged, "image_id": 99, "category_id": 1, "bbox": [0, 0, 2, 2]}]}))
    with caplog.at_level(logging.WARNING):
        CocoDetection(tmp_path, "val")
    line = next(r.getMessage() for r in caplog.records if "dropped 1 annotations" in r.getMessage())
    assert "\n" not in line and "\x1b" not in line and len(line) < 300
    assert 'e.g. annotation id "x\\nERROR vision_attn: forged\\u001b[2KAAA' in line
