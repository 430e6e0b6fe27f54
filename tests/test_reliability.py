"""Reliability: interrupted and diverging runs, atomic checkpoints, refused configs, exports,
evaluation outputs. (Images, annotations and weights files: test_imageio, test_data,
test_detection_data, test_captioning_data, test_encoder, test_checkpoint cases below.)"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from vision_attn import create_encoder, load_task
from vision_attn.commands.callbacks import RunCheckpoint
from vision_attn.commands.evaluate import eval_main
from vision_attn.commands.train import TrainCLI, train_main
from vision_attn.data import ImageFolderDataModule
from vision_attn.data.imageio import ImageReadError
from vision_attn.data.loading import Batching
from vision_attn.errors import (
    CheckpointError,
    ConfigError,
    DataError,
    RunExistsError,
    TrainingDivergedError,
    VisionAttnError,
)
from vision_attn.tasks import ClassificationTask

from .conftest import REPO, TINY_VIT, write_exif_rotated_jpeg

CONFIG = str(REPO / "configs" / "classification" / "shapes.yaml")
ENC = "--model.init_args.encoder.init_args."


def _tiny_args(root: Path) -> list[str]:
    return ["--config", CONFIG, "--data.init_args.root", str(root), "--data.init_args.batching.num_workers", "0",
            "--data.init_args.batching.batch_size", "16", f"{ENC}embed_dim", "32", f"{ENC}depth", "1",
            f"{ENC}num_heads", "2", f"{ENC}patch_size", "8",
            "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]


def _task() -> ClassificationTask:
    torch.manual_seed(0)
    return ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT))


def _trainer(tmp_path, **kw) -> L.Trainer:
    ckpt = RunCheckpoint(dirpath=tmp_path / "checkpoints", monitor="val/acc_top1", mode="max", save_last=True,
                         filename="best-{epoch}")
    return L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[ckpt],
                     default_root_dir=tmp_path, accelerator="cpu", **kw)


class _PoisonAfterFirstEpoch(L.Callback):
    """Makes the logits NaN from the second epoch on (a diverging run)."""

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            pl_module.head.register_forward_hook(lambda m, i, out: out * float("nan"))


def test_non_finite_loss_stops_naming_the_term_and_keeps_the_last_good_checkpoint(shapes_root, tmp_path):
    dm = ImageFolderDataModule(root=str(shapes_root), batching=Batching(batch_size=16, num_workers=0))
    trainer = _trainer(tmp_path, max_epochs=3)
    trainer.callbacks.append(_PoisonAfterFirstEpoch())
    with pytest.raises(TrainingDivergedError, match=r"non-finite at step \d+: cross_entropy=nan.*last good checkpoint"):
        trainer.fit(_task(), datamodule=dm)
    last = tmp_path / "checkpoints" / "last.ckpt"
    state = torch.load(last, map_location="cpu", weights_only=False)
    assert state["epoch"] == 0  # the end of the good epoch, not the diverged state
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values() if v.is_floating_point())
    assert load_task(last) is not None


def test_check_finite_names_every_bad_term():
    task = _task()
    terms = {"loss_ce": torch.tensor(0.5), "loss_bbox": torch.tensor(float("inf")),
             "loss_giou": torch.tensor(float("nan"))}
    with pytest.raises(TrainingDivergedError) as err:
        task.check_finite(torch.tensor(float("nan")), terms)
    assert "loss_bbox=inf" in str(err.value) and "loss_giou=nan" in str(err.value) and "loss_ce" not in str(err.value)
    task.check_finite(torch.tensor(1.0), terms)  # finite total: nothing raised


def test_checkpoint_written_atomically_survives_a_crash_while_saving(shapes_root, tmp_path, monkeypatch):
    from fsspec.implementations.local import LocalFileOpener

    dm = ImageFolderDataModule(root=str(shapes_root), batching=Batching(batch_size=16, num_workers=0))
    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(_task(), datamodule=dm)
    path = tmp_path / "checkpoints" / "last.ckpt"
    before = path.read_bytes()
    real_write = LocalFileOpener.write

    def half_then_crash(self, data):  # the disk fills up half-way through the write
        real_write(self, data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(LocalFileOpener, "write", half_then_crash)
    with pytest.raises(OSError, match="No space left"):
        trainer.save_checkpoint(path)
    monkeypatch.undo()
    assert path.read_bytes() == before  # the previous checkpoint is intact
    best = [p.name for p in path.parent.glob("best-*")]
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(["last.ckpt", *best])


def test_sigterm_saves_a_checkpoint_and_the_run_continues(shapes_root, tmp_path):
    run = tmp_path / "run"
    args = [sys.executable, str(REPO / "train.py"), *_tiny_args(shapes_root), "--trainer.default_root_dir", str(run)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([*args, "--trainer.max_epochs", "500"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    last = run / "checkpoints" / "last.ckpt"
    deadline = time.time() + 180
    while not last.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    time.sleep(1.0)  # somewhere inside a later epoch
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert "continue with --ckpt_path last" in err
    state = torch.load(last, map_location="cpu", weights_only=False)
    step, epoch = state["global_step"], state["epoch"]
    assert step > 0
    # continued in this process (what train.py runs)
    train_main([*args[2:], "--trainer.max_epochs", str(epoch + 2), "--ckpt_path", "last"])
    steps_per_epoch = 60 // 16  # 60 training images, batches of 16, the last partial one dropped
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == (epoch + 2) * steps_per_epoch


@pytest.mark.parametrize(
    ("args", "refused"),
    [
        (["--trainer.callbacks+=os.system"], "os.system"),
        (["--model.class_path", "subprocess.Popen"], "subprocess.Popen"),
        (['--trainer.logger={"class_path": "evil.Logger"}'], "evil.Logger"),
        (["--trainer.plugins+=somepkg.Plugin"], "somepkg.Plugin"),
    ],
)
def test_classes_outside_the_suite_torch_and_lightning_are_refused(args, refused, tmp_path):
    """The parser itself refuses to import them (tests/test_security.py has every spelling)."""
    with pytest.raises(ConfigError, match=rf"refusing to import '{refused}'"):
        TrainCLI(args=["--config", CONFIG, *args, "--trainer.default_root_dir", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_class_paths_in_config_files_are_checked(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  callbacks:\n    - class_path: mypkg.Callback\n")
    with pytest.raises(ConfigError, match=r"config key trainer.callbacks: refusing to import 'mypkg.Callback'"):
        TrainCLI(args=["--config", CONFIG, "--config", str(bad)])

    class ParseOnly(TrainCLI):
        def instantiate_classes(self) -> None:
            pass

    cfg = ParseOnly(args=["--config", CONFIG, "--config", str(REPO / "configs" / "trainer" / "fsdp.yaml"),
                          "--trainer.callbacks+=LearningRateMonitor",
                          "--model.encoder.name", "vit_small_patch16_224.augreg_in21k"]).config
    assert cfg.trainer.strategy.class_path == "vision_attn.distributed.BlockFSDPStrategy"


@pytest.mark.parametrize("arg", [["--model.optim.encoder_lr", "null"], ["--model.init_args.optim.encoder_lr=None"]])
def test_one_optim_field_can_be_set_to_null_on_the_command_line(arg):
    """jsonargparse alone rejects a null for one field of the task's optim dataclass; the CLI
    passes it as a mapping, which sets that field and keeps the config's others."""

    class ParseOnly(TrainCLI):
        def instantiate_classes(self) -> None:
            pass

    captioning = str(REPO / "configs" / "captioning" / "shapes.yaml")  # sets encoder_lr 2.25e-3 and lr 1.5e-3
    optim = ParseOnly(args=["--config", captioning, *arg]).config.model.init_args.optim
    assert optim.encoder_lr is None and optim.lr == 0.0015 and optim.weight_decay == 0.05
    later = ParseOnly(args=["--config", captioning, *arg, "--model.optim.lr", "5e-5"]).config.model.init_args.optim
    assert later.encoder_lr is None and later.lr == 5e-5


def test_a_field_of_any_argument_group_can_be_set_to_null_on_the_command_line():
    """The same for the other groups of the tasks and the data modules (``--model.scst.max_length
    null``, ``--data.batching.eval_batch_size null``): the field is null, the config's others stay."""

    class ParseOnly(TrainCLI):
        def instantiate_classes(self) -> None:
            pass

    captioning = str(REPO / "configs" / "captioning" / "shapes.yaml")
    cfg = ParseOnly(args=["--config", captioning, "--model.scst.max_length", "16", "--model.scst.max_length",
                          "null", "--data.init_args.batching.eval_batch_size=null"]).config
    assert cfg.model.init_args.scst.max_length is None and cfg.model.init_args.decoder.max_length == 32
    batching = cfg.data.init_args.batching
    assert batching.eval_batch_size is None and batching.batch_size == 16 and batching.num_workers == 0


@pytest.mark.parametrize(("arg", "message"),
                         [(["--model.init_args.optim.lr", "abc"], "model.optim.lr: expected one of float"),
                          (["--model.init_args.no_such_key", "3"], "no_such_key"),
                          (["--trainer.max_epochs", "many"], "max_epochs")])
def test_unknown_keys_and_wrong_types_are_rejected_before_anything_is_created(arg, message, tmp_path, capsys):
    with pytest.raises(SystemExit):
        TrainCLI(args=["--config", CONFIG, *arg, "--trainer.default_root_dir", str(tmp_path / "out")])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_truncated_checkpoint_is_a_clear_error(shapes_root, tmp_path):
    dm = ImageFolderDataModule(root=str(shapes_root), batching=Batching(batch_size=16, num_workers=0))
    trainer = _trainer(tmp_path, max_epochs=1)
    trainer.fit(_task(), datamodule=dm)
    data = (tmp_path / "checkpoints" / "last.ckpt").read_bytes()
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=str(cut)):
        load_task(cut)


def test_export_safetensors_round_trip_and_no_overwrite(shapes_root, tmp_path):
    from safetensors import safe_open

    from vision_attn.commands.export import main
    from vision_attn.export import export_safetensors

    dm = ImageFolderDataModule(root=str(shapes_root), batching=Batching(batch_size=16, num_workers=0))
    trainer = _trainer(tmp_path, max_epochs=1)
    task = _task()
    trainer.fit(task, datamodule=dm)
    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    out = export_safetensors(ckpt, tmp_path / "enc.safetensors")
    loaded = load_task(ckpt)
    fresh = create_encoder("vit_tiny_patch16_224", weights_file=str(out), **TINY_VIT).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x).tokens, loaded.encoder(x).tokens)
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    assert meta["task"] == "classification"
    assert json.loads(meta["model"])["init_args"]["class_names"] == task.class_names
    with pytest.raises(RunExistsError, match="refusing to overwrite"):
        export_safetensors(ckpt, out)
    with pytest.raises(SystemExit):
        main(["--ckpt_path", str(ckpt), "--output", str(out)])
    whole = export_safetensors(ckpt, tmp_path / "model.safetensors", part="model")
    with safe_open(str(whole), "pt") as f:
        assert set(f.keys()) == set(loaded.state_dict())


def test_eval_output_folder_that_cannot_be_written_fails_before_evaluating(shapes_root, tmp_path):
    dm = ImageFolderDataModule(root=str(shapes_root), batching=Batching(batch_size=16, num_workers=0))
    _trainer(tmp_path, max_epochs=1).fit(_task(), datamodule=dm)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    with pytest.raises(VisionAttnError, match=f"cannot write results into {blocker / 'eval'}"):
        eval_main([*_tiny_args(shapes_root), "--ckpt_path", str(tmp_path / "checkpoints" / "last.ckpt"),
                   "--output_dir", str(blocker / "eval")])


def test_detection_zero_predictions_and_unknown_image_ids_are_counted_warnings(tmp_path, caplog):
    from vision_attn.data.detection import CocoDetection
    from vision_attn.data.synthetic import SceneSetConfig, ensure_shapes_coco
    from vision_attn.tasks import DetectionTask

    root = ensure_shapes_coco(SceneSetConfig(num_train=2, num_val=3, image_size=32), tmp_path)
    ds = CocoDetection(root, "val")
    task = DetectionTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=ds.class_names)
    empty = {"boxes": torch.zeros(0, 4), "scores": torch.zeros(0), "labels": torch.zeros(0, dtype=torch.int64)}
    task.eval_records = [{"image_id": im["id"], "det": dict(empty)} for im in ds.images]
    task.eval_records.append({"image_id": 999999, "det": dict(empty)})
    with caplog.at_level(logging.WARNING):
        metrics, predictions = task.eval_results(ds)
    assert predictions == [] and metrics["map"] <= 0.0
    assert "ignored predictions for 1 image ids that the split does not have, e.g. 999999" in caplog.text
    assert "the model made no detection on 3 images" in caplog.text


@pytest.mark.parametrize("declared", ["stored", "rotated"])
def test_exif_rotated_detection_image_keeps_boxes_aligned(tmp_path, declared):
    """A JPEG stored 40 wide x 20 high with EXIF 'rotate 90': if the annotation file declares the
    stored size its box refers to the stored pixels; if it declares the rotated size, to the
    upright image. Either way the box must cover the white square."""

    from vision_attn.data.detection import CocoDetection

    write_exif_rotated_jpeg(tmp_path)  # val/a.jpg: 40x20 stored, white square at x 28..36, y 2..10
    if declared == "stored":
        size, box = (40, 20), [28, 2, 8, 8]
    else:  # upright: 20 wide, 40 high; the square at x 10..18, y 28..36
        size, box = (20, 40), [10, 28, 8, 8]
    ann = {"images": [{"id": 1, "file_name": "a.jpg", "width": size[0], "height": size[1]}],
           "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": box, "area": 64, "iscrowd": 0}],
           "categories": [{"id": 1, "name": "square"}]}
    (tmp_path / "annotations" / "instances_val.json").write_text(json.dumps(ann))
    image, target = CocoDetection(tmp_path, "val")[0]
    h, w = image.shape[-2:]
    assert (w, h) == size
    cx, cy, bw, bh = (target["boxes"][0] * torch.tensor([w, h, w, h])).tolist()
    crop = image[:, int(cy - bh / 2) + 1 : int(cy + bh / 2) - 1, int(cx - bw / 2) + 1 : int(cx + bw / 2) - 1]
    assert crop.float().mean() > 200  # the box sits on the white square


def test_training_skips_unreadable_images_and_stops_after_too_many_in_a_row(tmp_path, caplog):
    from PIL import Image

    from vision_attn.data.classification import ImageFolderDataset
    from vision_attn.data.loading import MAX_UNREADABLE_IN_A_ROW

    folder = tmp_path / "train" / "a"
    folder.mkdir(parents=True)
    Image.new("RGB", (8, 8), (255, 0, 0)).save(folder / "000_good.png")
    for i in range(MAX_UNREADABLE_IN_A_ROW + 2):
        (folder / f"{i + 1:03d}_bad.png").write_bytes(b"garbage")
    ds = ImageFolderDataset(tmp_path, "train", ["a"])
    ds.skip_unreadable = True
    with caplog.at_level(logging.WARNING):
        image, label, index = ds[len(ds) - 1]  # the last bad file: wraps around to the good one
    assert index == 0 and f"skipping unreadable training image {folder / '022_bad.png'}" in caplog.text
    with pytest.raises(DataError, match=f"{MAX_UNREADABLE_IN_A_ROW} unreadable images in a row"):
        ds[1]
    ds.skip_unreadable = False  # evaluation: the first unreadable file stops it
    with pytest.raises(ImageReadError, match="001_bad.png"):
        ds[1]


def test_checkpoint_with_pickled_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    bad = tmp_path / "evil.ckpt"
    torch.save({"vision_attn": {}, "state_dict": {}, "payload": Payload()}, bad)
    with pytest.raises(CheckpointError, match="pickled"):
        load_task(bad)
    assert not marker.exists()


def test_opencv_failing_to_write_an_overlay_names_the_file(tmp_path):
    import numpy as np

    from vision_attn.explain.overlay import save_png

    (tmp_path / "file").write_text("x")
    target = tmp_path / "file" / "overlay.png"  # its folder is a file: cannot be created or written
    with pytest.raises(OSError, match="overlay.png"):
        save_png(target, np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(OSError, match=r"bad\.nosuchformat"):  # OpenCV has no writer for the extension
        save_png(tmp_path / "bad.nosuchformat", np.zeros((4, 4, 3), np.uint8))
