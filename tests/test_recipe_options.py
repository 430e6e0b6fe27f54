"""Small-data recipe options: the batch size sized from the data, repeated augmentation,
RandAugment for ``small``, and timm's mixup / CutMix in the classification task."""

from __future__ import annotations

import json
import logging
import math
from collections import Counter

import lightning as L
import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.utils.data import DistributedSampler
from torchvision.transforms import v2 as T

from vision_attn import create_encoder, load_task
from vision_attn.data.classification import ImageAugment, ImageFolderDataModule
from vision_attn.data.loading import (
    Batching,
    RepeatedAugmentationSampler,
    auto_batch_size,
    make_loader,
)
from vision_attn.data.transforms import DEFAULT_PREPROCESS, build_train_transform
from vision_attn.errors import DataError
from vision_attn.tasks import ClassificationTask
from vision_attn.tasks.classification import MixConfig

from .conftest import REPO, TINY_VIT

PRE32 = {**DEFAULT_PREPROCESS, "input_size": (3, 32, 32), "crop_pct": 1.0}
NO_TRAINER_LOG = "ignore:You are trying to `self.log"


# ------------------------------------------------------------------ batch size from the data
@pytest.mark.parametrize(("images", "processes", "accumulate", "expected"), [
    (1300, 1, 1, 32),    # 1300 / 40 = 32.5 -> 32 (40 batches per epoch)
    (500, 1, 1, 8),      # 12.5 -> 8
    (2000, 1, 1, 32),    # 50 -> 32
    (5000, 1, 1, 64),    # 125 -> 64
    (10000, 1, 1, 128),  # 250 -> 128
    (10240, 1, 1, 256),  # exactly 256
    (10239, 1, 1, 128),  # just below: 255.97 -> 128
    (10**6, 1, 1, 256),  # clamped to max_batch_size
    (60, 1, 1, 8),       # 1.5 -> 1, clamped to min_batch_size
    (1300, 2, 1, 16),    # per process: 650 / 40 = 16.25 -> 16
    (1301, 2, 1, 16),    # ceil(1301 / 2) = 651 per process
    (1300, 1, 2, 16),    # two batches per optimizer step: 1300 / 80 = 16.25
])
def test_auto_batch_size_hand_cases(images, processes, accumulate, expected):
    assert auto_batch_size(images, 40, 8, 256, processes, accumulate) == expected


def test_auto_batch_size_is_the_largest_power_of_two_that_keeps_the_steps():
    for images in range(1, 3000, 7):
        for processes in (1, 3):
            b = auto_batch_size(images, 10, 1, 10**6, processes)
            per_process = math.ceil(images / processes)
            assert b & (b - 1) == 0  # a power of two
            if per_process >= 10:
                assert per_process // b >= 10 > per_process // (2 * b)
            else:
                assert b == 1


def test_datamodule_auto_batch_is_resolved_logged_once_and_recorded(shapes_root, caplog):
    dm = ImageFolderDataModule(root=str(shapes_root), batching=Batching(batch_size="auto", min_steps_per_epoch=4,
                                                                        min_batch_size=2, max_batch_size=64,
                                                                        num_workers=0))
    dm.preprocess = PRE32
    assert dm.evaluation_batch_size() == 64  # auto without eval_batch_size: max_batch_size
    with caplog.at_level(logging.INFO, logger="vision_attn.data.loading"):
        dm.setup("fit")
        loader = dm.train_dataloader()
        dm.train_dataloader()
    # 60 images / 4 steps = 15 -> 8; 60 // 8 = 7 batches (the last partial one dropped)
    assert dm.resolved_batch_size == 8 and loader.batch_size == 8 and len(loader) == 7
    assert dict(dm.hparams) == {"batch_size": 8, "batch_size_rule": "auto", "train_images": 60,
                                "batches_per_epoch": 7}
    logged = [r.getMessage() for r in caplog.records if "training batch size" in r.getMessage()]
    assert len(logged) == 1 and "training batch size 8 per process" in logged[0] and "60 training images" in logged[0]
    assert dm.val_dataloader().batch_size == 64

    fixed = ImageFolderDataModule(root=str(shapes_root), batching=Batching(batch_size=16, num_workers=0))
    fixed.preprocess = PRE32
    fixed.setup("fit")
    assert fixed.train_dataloader().batch_size == 16 and fixed.val_dataloader().batch_size == 16
    assert fixed.hparams["batch_size"] == 16 and fixed.hparams["batch_size_rule"] == "16"


@pytest.mark.parametrize(("group", "kwargs", "key"), [
    (Batching, {"batch_size": "big"}, "batching.batch_size"),
    (Batching, {"batch_size": 0}, "batching.batch_size"),
    (Batching, {"batch_size": "auto", "min_steps_per_epoch": 0}, "batching.min_steps_per_epoch"),
    (Batching, {"batch_size": "auto", "min_batch_size": 64, "max_batch_size": 32}, "batching.max_batch_size"),
    (ImageAugment, {"repeated_augmentation": 0}, "augment.repeated_augmentation"),
])
def test_bad_sizing_settings_name_the_key(shapes_root, group, kwargs, key):
    with pytest.raises(DataError, match=f"--data.{key}"):
        name = "batching" if group is Batching else "augment"
        ImageFolderDataModule(root=str(shapes_root), **{name: group(**kwargs)})


# ------------------------------------------------------------------ repeated augmentation
def _runs(order: list[int]) -> list[tuple[int, int]]:
    """``[(value, run length)]`` of consecutive equal values."""
    runs: list[tuple[int, int]] = []
    for v in order:
        if runs and runs[-1][0] == v:
            runs[-1] = (v, runs[-1][1] + 1)
        else:
            runs.append((v, 1))
    return runs


def test_repeated_augmentation_sampler_one_process():
    data = list(range(10))
    sampler = RepeatedAugmentationSampler(data, 3)
    assert isinstance(sampler, DistributedSampler)  # Lightning keeps it under DDP
    assert (sampler.num_replicas, sampler.rank) == (1, 0)  # no process group
    order = list(sampler)
    assert len(order) == len(sampler) == 10  # the epoch keeps the dataset's length
    # 10 = 3 + 3 + 3 + 1: four distinct images, each repeated in a row
    assert [n for _, n in _runs(order)] == [3, 3, 3, 1]
    assert len(set(order)) == 4 and set(order) <= set(data)
    assert order == list(RepeatedAugmentationSampler(data, 3))  # deterministic given seed + epoch
    sampler.set_epoch(1)
    other = list(sampler)
    assert other != order and [n for _, n in _runs(other)] == [3, 3, 3, 1]
    assert list(RepeatedAugmentationSampler(data, 3, seed=5)) != order
    seen: set[int] = set()  # over epochs every image is shown
    for epoch in range(30):
        sampler.set_epoch(epoch)
        seen |= set(sampler)
    assert seen == set(data)
    # k = 1: a plain permutation of the dataset
    assert sorted(RepeatedAugmentationSampler(data, 1)) == data
    with pytest.raises(DataError, match="repeated_augmentation"):
        RepeatedAugmentationSampler(data, 0)


@pytest.mark.parametrize(("n", "repeats", "world"), [(12, 3, 2), (13, 3, 2), (20, 2, 4), (11, 1, 3)])
def test_repeated_augmentation_sampler_across_processes(n, repeats, world):
    data = list(range(n))
    samplers = [RepeatedAugmentationSampler(data, repeats, num_replicas=world, rank=r, seed=7) for r in range(world)]
    for s in samplers:
        s.set_epoch(3)
    parts = [list(s) for s in samplers]
    per_process = math.ceil(n / world)
    assert all(len(p) == len(s) == per_process for p, s in zip(parts, samplers, strict=True))
    # the processes deal the same epoch order out in turn: position j of rank r is global j * world + r
    merged = [parts[r][j] for j in range(per_process) for r in range(world)]
    assert merged == samplers[0].epoch_order().tolist()
    runs = _runs(merged)
    assert all(length == repeats for _, length in runs[:-1]) and runs[-1][1] <= repeats
    if math.ceil(world * per_process / repeats) <= n:  # no padding beyond the dataset
        assert len({v for v, _ in runs}) == len(runs)  # each image in one run only
        counts = Counter(merged)
        assert all(c == repeats for c in list(counts.values())[:-1])
    if repeats == 1:  # plain sharding: disjoint except the padding to equal lengths
        overlap = set(parts[0]).intersection(*map(set, parts[1:]))
        assert sum(len(p) for p in parts) - n == world * per_process - n >= len(overlap)
        assert set().union(*map(set, parts)) == set(data)


def test_repeated_augmentation_sampler_takes_its_rank_from_the_process_group(monkeypatch):
    # an initialised 2-process group, as torch.distributed reports it inside rank 1
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    sampler = RepeatedAugmentationSampler(list(range(12)), 3, seed=4)
    assert (sampler.num_replicas, sampler.rank, len(sampler)) == (2, 1, 6)
    explicit = RepeatedAugmentationSampler(list(range(12)), 3, num_replicas=2, rank=1, seed=4)
    for s in (sampler, explicit):
        s.set_epoch(2)
    assert list(sampler) == list(explicit) == sampler.epoch_order()[1::2].tolist()


def test_make_loader_drops_the_last_partial_batch_by_the_samplers_length():
    data = list(range(10))
    sampler = RepeatedAugmentationSampler(data, 2, num_replicas=2, rank=0)  # 5 per process
    loader = make_loader(data, 4, True, 0, sampler=sampler)
    assert loader.sampler is sampler and loader.drop_last and len(loader) == 1
    assert not make_loader(data, 8, True, 0, sampler=sampler).drop_last  # one partial batch is kept


# ------------------------------------------------------------------ RandAugment for `small`
def test_randaugment_option_of_the_presets():
    def rand_augments(tf):
        return [(op.num_ops, op.magnitude) for op in tf.transforms if isinstance(op, T.RandAugment)]

    assert rand_augments(build_train_transform(PRE32, "small")) == []
    assert rand_augments(build_train_transform(PRE32, "small", randaugment_ops=2)) == [(2, 9)]
    assert rand_augments(build_train_transform(PRE32, "small", randaugment_ops=1, randaugment_magnitude=5)) == [(1, 5)]
    assert rand_augments(build_train_transform(PRE32, "finetune")) == [(2, 9)]
    assert rand_augments(build_train_transform(PRE32, "finetune", randaugment_ops=0)) == []
    with pytest.raises(ValueError, match="randaugment_ops"):
        build_train_transform(PRE32, "none", randaugment_ops=2)
    with pytest.raises(ValueError, match="randaugment_magnitude"):
        build_train_transform(PRE32, "small", randaugment_ops=2, randaugment_magnitude=31)
    image = np.random.default_rng(0).integers(0, 256, (40, 48, 3), dtype=np.uint8)
    out = build_train_transform(PRE32, "small", randaugment_ops=2)(image)
    assert out.shape == (3, 32, 32) and out.dtype == torch.float32


# ------------------------------------------------------------------ mixup / CutMix
def _task(**kw) -> ClassificationTask:
    torch.manual_seed(0)
    return ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), num_classes=5, **kw).eval()


def _batch(n: int = 4):
    torch.manual_seed(1)
    return torch.randn(n, 3, 32, 32), torch.tensor([0, 1, 2, 3, 4, 0, 1][:n]), torch.arange(n)


def _soft_ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return -(target * logits.log_softmax(-1)).sum(-1).mean()


@pytest.mark.filterwarnings(NO_TRAINER_LOG)
def test_without_mixing_the_training_loss_is_the_label_smoothed_cross_entropy():
    images, labels, index = _batch()
    plain = _task(label_smoothing=0.1)
    assert plain.mixer is None
    with torch.no_grad():
        expected = F.cross_entropy(plain(images), labels, label_smoothing=0.1)
        assert torch.equal(plain.training_step((images.clone(), labels, index), 0), expected)
        # mixing switched on but never applied (mix_prob 0): the soft-target loss is the same number
        never = _task(label_smoothing=0.1, mix=MixConfig(mixup=0.8, cutmix=1.0, prob=0.0))
        torch.testing.assert_close(never.training_step((images.clone(), labels, index), 0), expected)


@pytest.mark.filterwarnings(NO_TRAINER_LOG)
def test_mixup_with_a_fixed_lambda_gives_the_hand_computed_target_and_loss():
    images, labels, index = _batch()
    task = _task(label_smoothing=0.1, mix=MixConfig(mixup=0.8))
    task.mixer._params_per_batch = lambda: (0.7, False)  # lam = 0.7, mixup (not CutMix)
    mixed, target = task.mix(images.clone(), labels)
    torch.testing.assert_close(mixed, 0.7 * images + 0.3 * images.flip(0))
    # smoothing 0.1 over 5 classes: 0.92 on the label, 0.02 elsewhere; image i is mixed with 3 - i
    on, off = 0.92, 0.02
    expected = torch.full((4, 5), off)
    for i, (a, b) in enumerate([(0, 3), (1, 2), (2, 1), (3, 0)]):
        expected[i, a] = 0.7 * on + 0.3 * off
        expected[i, b] = 0.3 * on + 0.7 * off
    torch.testing.assert_close(target, expected)
    assert torch.allclose(target.sum(-1), torch.ones(4))
    with torch.no_grad():
        loss = task.training_step((images.clone(), labels, index), 0)
        torch.testing.assert_close(loss, _soft_ce(task(mixed), expected))
    # the training accuracy is counted against the dominant class (argmax) of each target
    with torch.no_grad():
        hits = (task(mixed).argmax(-1) == expected.argmax(-1)).float().mean()
    torch.testing.assert_close(task.metrics["train_metrics"]["acc_top1"].compute(), hits)


def test_cutmix_pastes_a_box_and_weighs_the_targets_by_its_area():
    images, labels, _ = _batch()
    task = _task(label_smoothing=0.0, mix=MixConfig(cutmix=1.0))
    task.mixer._params_per_batch = lambda: (0.6, True)
    np.random.seed(0)
    mixed, target = task.mix(images.clone(), labels)
    pasted = (mixed != images).any(1)  # (B, H, W): where the image came from the flipped batch
    assert torch.equal(pasted[0], pasted[1]) and torch.equal(pasted, pasted[:1].expand(4, -1, -1))
    rows, cols = pasted[0].any(1).nonzero().flatten(), pasted[0].any(0).nonzero().flatten()
    box = (slice(int(rows[0]), int(rows[-1]) + 1), slice(int(cols[0]), int(cols[-1]) + 1))
    assert bool(pasted[0][box].all()) and int(pasted[0].sum()) == pasted[0][box].numel()  # a rectangle
    torch.testing.assert_close(mixed[:, :, box[0], box[1]], images.flip(0)[:, :, box[0], box[1]])
    lam = 1 - pasted[0][box].numel() / (32 * 32)  # the area actually kept
    expected = lam * F.one_hot(labels, 5).float() + (1 - lam) * F.one_hot(labels.flip(0), 5).float()
    torch.testing.assert_close(target, expected)


@pytest.mark.parametrize("n", [5, 1])
def test_an_odd_batch_mixes_all_but_its_last_image(n):
    images, labels, _ = _batch(n)
    task = _task(label_smoothing=0.1, mix=MixConfig(mixup=0.8))
    task.mixer._params_per_batch = lambda: (0.7, False)
    mixed, target = task.mix(images.clone(), labels)
    assert mixed.shape == images.shape and target.shape == (n, 5)
    even = n - 1
    torch.testing.assert_close(mixed[:even], 0.7 * images[:even] + 0.3 * images[:even].flip(0))
    assert torch.equal(mixed[even:], images[even:])
    last = torch.full((5,), 0.02)
    last[labels[-1]] = 0.92
    torch.testing.assert_close(target[-1], last)


@pytest.mark.parametrize(("key", "value"), [("mixup", -0.1), ("cutmix", -1.0), ("prob", 1.5),
                                            ("switch_prob", -0.5)])
def test_bad_mixing_settings_name_the_key(key, value):
    with pytest.raises(ValueError, match=f"--model.mix.{key}"):
        _task(mix=MixConfig(**{key: value}))


class _RecordIndices(L.Callback):
    def __init__(self) -> None:
        self.epochs: list[list[list[int]]] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self.epochs.append([])

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.epochs[-1].append(batch[2].tolist())


def test_fit_with_auto_batch_repeated_augmentation_and_mixing(shapes_root, tmp_path):
    """Two epochs on the tiny shapes data: the schedule is planned over the auto-sized loader, the
    sampler reshuffles every epoch, mixing trains, and the checkpoint reloads with the settings."""
    dm = ImageFolderDataModule(root=str(shapes_root), batching=Batching(batch_size="auto",
                                                                        min_steps_per_epoch=3,
                                                                        min_batch_size=2,
                                                                        max_batch_size=64,
                                                                        num_workers=0),
                               augment=ImageAugment(repeated_augmentation=2))
    torch.manual_seed(0)
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), mix=MixConfig(mixup=0.8, cutmix=1.0,
                                                                                                prob=0.9,
                                                                                                switch_prob=0.4))
    record = _RecordIndices()
    L.seed_everything(0)
    trainer = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[record])
    trainer.fit(task, datamodule=dm)
    # 60 images / 3 steps = 20 -> 16 per batch, 60 // 16 = 3 batches per epoch
    assert dm.resolved_batch_size == 16 and trainer.global_step == 6
    assert trainer.lr_scheduler_configs[0].scheduler.end_step == 6  # the schedule saw the auto-sized loader
    assert isinstance(trainer.train_dataloader.sampler, RepeatedAugmentationSampler)
    for epoch in record.epochs:
        assert len(epoch) == 3 and all(len(b) == 16 for b in epoch)
        assert all(b[0::2] == b[1::2] for b in epoch)  # each image twice, side by side in its batch
    assert record.epochs[0] != record.epochs[1]  # set_epoch reshuffled
    assert task.mixer is not None and bool(torch.isfinite(trainer.callback_metrics["train/loss"]))

    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)  # plain data only: the safe loader reads it
    assert ckpt["datamodule_hyper_parameters"]["batch_size"] == 16
    loaded = load_task(path, expected_task="classification")
    assert (loaded.mixup, loaded.cutmix, loaded.mix_prob, loaded.mix_switch_prob) == (0.8, 1.0, 0.9, 0.4)
    assert loaded.mixer is not None and loaded.mixer.num_classes == len(dm.class_names)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(x), task.eval()(x))


def _cli_args(root, out) -> list[str]:
    enc = "--model.init_args.encoder.init_args."
    return ["--config", str(REPO / "configs" / "classification" / "shapes.yaml"),
            "--data.root", str(root), "--data.batching.num_workers", "0",
            "--data.batching.batch_size", "auto", "--data.batching.min_steps_per_epoch", "3",
            "--data.batching.min_batch_size", "2",
            "--data.augment.repeated_augmentation", "2", "--data.augment.randaugment_ops", "1",
            "--model.mix.mixup", "0.8", "--model.mix.cutmix", "1.0",
            f"{enc}embed_dim", "32", f"{enc}depth", "2", f"{enc}num_heads", "2", f"{enc}patch_size", "8",
            "--trainer.max_epochs", "1", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.default_root_dir", str(out)]


def test_print_config_shows_the_rule_and_the_options(shapes_root, tmp_path, capsys):
    from vision_attn.commands.train import train_main

    with pytest.raises(SystemExit) as exit_info:
        train_main([*_cli_args(shapes_root, tmp_path / "out"), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    data, model = printed["data"]["init_args"], printed["model"]["init_args"]
    batching, augment, mix = data["batching"], data["augment"], model["mix"]
    assert batching["batch_size"] == "auto"
    assert (batching["min_steps_per_epoch"], batching["min_batch_size"], batching["max_batch_size"]) == (3, 2, 256)
    assert (augment["repeated_augmentation"], augment["randaugment_ops"], augment["randaugment_magnitude"]) == (2, 1, 9)
    assert (mix["mixup"], mix["cutmix"], mix["prob"], mix["switch_prob"]) == (0.8, 1.0, 1.0, 0.5)


def test_train_and_eval_from_the_checkpoint_alone_with_the_options(shapes_root, tmp_path):
    from vision_attn.commands.evaluate import eval_main
    from vision_attn.commands.train import train_main

    out = tmp_path / "run"
    cli = train_main(_cli_args(shapes_root, out))
    assert cli.datamodule.resolved_batch_size == 16 and cli.trainer.global_step == 3
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["data"]["init_args"]["batching"]["batch_size"] == "auto"
    assert saved["model"]["init_args"]["mix"]["mixup"] == 0.8
    hparams = yaml.safe_load(next((out / "csv").rglob("hparams.yaml")).read_text())
    assert hparams["batch_size"] == 16 and hparams["mix"]["mixup"] == 0.8  # what the loggers record
    ckpt = out / "checkpoints" / "last.ckpt"
    meta = torch.load(ckpt, weights_only=True)["vision_attn"]
    assert meta["model"]["init_args"]["mix"]["cutmix"] == 1.0
    assert meta["data"]["init_args"]["batching"]["batch_size"] == "auto"
    metrics = eval_main(["--ckpt_path", str(ckpt), "--output_dir", str(tmp_path / "eval"),
                         "--explain.num_overlays", "0", "--explain.faithfulness", "false",
                         "--explain.report", "false"])
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text()) == metrics
    assert 0.0 <= metrics["acc_top1"] <= 1.0
    assert len(json.loads((tmp_path / "eval" / "predictions.json").read_text())) == 25
