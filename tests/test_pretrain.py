"""Masked image modelling (vision_attn.tasks.pretrain) and unlabelled images (vision_attn.data.images):
what is hidden, what is scored, that no hidden pixel reaches the encoder, and that a pretrained
encoder starts another task."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from vision_attn.data.images import ImagesDataModule, UnlabeledImages
from vision_attn.data.layout import FolderLayout
from vision_attn.errors import ConfigError, DataError
from vision_attn.models import ViTEncoder
from vision_attn.tasks import MaskingConfig, PixelDecoderConfig, PretrainTask
from vision_attn.tasks.pretrain import block_mask, patch_pixels

from .conftest import REPO

CONFIG = str(REPO / "configs" / "pretrain" / "mae.yaml")
SMALL_ENCODER = dict(name="vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                     mlp_ratio=2.0)
MAE_STEM = dict(stem="cnn", stem_channels=32, stem_norm="instance")  # configs/pretrain/mae.yaml's


def _task(stem: str = "conv", **kwargs) -> PretrainTask:
    torch.manual_seed(0)
    return PretrainTask(ViTEncoder(**SMALL_ENCODER, stem=stem), **kwargs)


def test_block_mask_hides_the_share_in_blocks():
    gen = torch.Generator().manual_seed(0)
    mask = block_mask(16, (8, 8), 0.6, 2, gen)
    assert mask.shape == (16, 8, 8) and mask.dtype == torch.bool
    assert (mask.sum((1, 2)) == round(0.6 * 64)).all()  # exactly the share, every image
    # in whole 2 x 2 blocks, except at most one block hidden in part
    blocks = mask.reshape(16, 4, 2, 4, 2).sum((2, 4))
    assert ((blocks == 0) | (blocks == 4)).sum((1, 2)).min() >= 15
    assert len({tuple(m.flatten().tolist()) for m in mask}) == 16  # another choice per image
    again = block_mask(16, (8, 8), 0.6, 2, torch.Generator().manual_seed(0))
    assert torch.equal(mask, again)
    # a grid that is no multiple of the block: border blocks are cut, the count still holds
    odd = block_mask(4, (5, 7), 0.5, 3, gen)
    assert (odd.sum((1, 2)) == round(0.5 * 35)).all()
    assert (block_mask(2, (4, 4), 0.99, 1, gen).sum((1, 2)) == 15).all()  # never every patch


def test_patch_pixels_are_the_patches():
    images = torch.arange(2 * 3 * 4 * 6, dtype=torch.float32).reshape(2, 3, 4, 6)
    pix = patch_pixels(images, (2, 3))  # patches of 2 x 2
    assert pix.shape == (2, 6, 12)
    # patch (row 1, column 2) of image 1: channel first, then row-major within the patch
    expected = images[1, :, 2:4, 4:6].reshape(-1)
    assert torch.equal(pix[1, 1 * 3 + 2], expected)


def test_hidden_pixels_never_reach_the_prediction():
    for stem in ("conv", "cnn", "patch"):
        task = _task(stem).eval()
        images = torch.randn(2, 3, 32, 32)
        mask = block_mask(2, (4, 4), 0.5, 1, torch.Generator().manual_seed(1))
        changed = images.clone()
        pixel_mask = mask.repeat_interleave(8, 1).repeat_interleave(8, 2)[:, None].expand_as(images)
        changed[pixel_mask] = torch.randn(int(pixel_mask.sum()))
        with torch.no_grad():
            a, b = task.masked_forward(images, mask), task.masked_forward(changed, mask)
            c = task.masked_forward(changed, ~mask)  # the same change, now visible
        assert torch.equal(a, b), stem
        assert not torch.allclose(a, c), stem


def test_reconstruction_loss_is_the_hidden_patches_error():
    task = _task(masking=MaskingConfig(ratio=0.5, block=1, norm_pix_loss=True))
    images = torch.randn(2, 3, 32, 32)
    mask = block_mask(2, (4, 4), 0.5, 1, torch.Generator().manual_seed(2))
    predicted = torch.randn(2, 16, 3 * 8 * 8)
    # by hand: every hidden patch's pixels normalised by their mean and (unbiased) std
    errors = []
    for i in range(2):
        for r in range(4):
            for c in range(4):
                if mask[i, r, c]:
                    target = images[i, :, 8 * r:8 * r + 8, 8 * c:8 * c + 8].reshape(-1)
                    target = (target - target.mean()) / (target.var() + 1e-6).sqrt()
                    errors.append(((predicted[i, r * 4 + c] - target) ** 2).mean())
    loss = task.reconstruction_loss(images, mask, predicted)
    assert loss.item() == pytest.approx(torch.stack(errors).mean().item(), rel=1e-5)
    visible = predicted.clone()
    visible[~mask.reshape(2, 16)] = 1e3  # what is predicted for visible patches does not count
    assert task.reconstruction_loss(images, mask, visible).item() == pytest.approx(loss.item(), rel=1e-6)
    raw = _task(masking=MaskingConfig(ratio=0.5, block=1, norm_pix_loss=False))
    target = patch_pixels(images, (4, 4))
    hand = ((predicted - target) ** 2).mean(-1)[mask.reshape(2, 16)].mean()
    assert raw.reconstruction_loss(images, mask, predicted).item() == pytest.approx(hand.item(), rel=1e-5)


def test_settings_are_checked():
    for bad in (dict(ratio=0.0), dict(ratio=1.0), dict(block=0), dict(block=True)):
        with pytest.raises(ConfigError, match="masking"):
            MaskingConfig(**bad)
    with pytest.raises(ConfigError, match="multiple of num_heads"):
        PixelDecoderConfig(dim=10, num_heads=4)
    with pytest.raises(ConfigError, match="decoder.depth"):
        PixelDecoderConfig(depth=-1)
    assert isinstance(_task(decoder=PixelDecoderConfig(depth=0)).head.blocks, torch.nn.Identity)


def _write(path: Path, seed: int) -> None:
    import cv2

    path.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(path), np.random.default_rng(seed).integers(0, 255, (32, 32, 3), dtype=np.uint8))


def test_images_of_any_layout(tmp_path):
    coco = tmp_path / "coco"
    for i in range(5):
        _write(coco / "train" / f"{i:03d}.png", i)
    (coco / "annotations").mkdir()
    folder = tmp_path / "folder"
    for i in range(4):
        _write(folder / "train" / ("cat" if i % 2 else "dog") / f"{i}.png", i)
        _write(folder / "val" / "cat" / f"{i}.png", 10 + i)
    ds = UnlabeledImages(folder, "train")
    assert ds.files == ["train/cat/1.png", "train/cat/3.png", "train/dog/0.png", "train/dog/2.png"]
    img, index = ds[2]
    assert index == 2 and img.shape == (32, 32, 3)
    dm = ImagesDataModule(str(folder))
    assert dm.val_fraction is None  # val/ exists: it is the validation split
    dm.preprocess = ViTEncoder(**SMALL_ENCODER, stem="conv").data_config
    assert len(dm.dataset("val")) == 4
    # no val/: a seeded share of train/ is held out, the same every time, apart from training
    dm = ImagesDataModule(str(coco), layout=FolderLayout(val_fraction=0.4))
    dm.preprocess = ViTEncoder(**SMALL_ENCODER, stem="conv").data_config
    train, val = dm.dataset("train", train=True), dm.dataset("val")
    assert len(train) == 3 and len(val) == 2 and not set(train.files) & set(val.files)
    assert ImagesDataModule(str(coco), layout=FolderLayout(val_fraction=0.4)).holdout() == dm.holdout()
    assert ImagesDataModule(str(coco)).val_fraction == 0.05
    with pytest.raises(DataError, match="val_fraction"):
        ImagesDataModule(str(folder), layout=FolderLayout(val_fraction=0.2))
    with pytest.raises(DataError, match="directly under the data root"):
        ImagesDataModule(str(coco), layout=FolderLayout(train_split=".."))
    with pytest.raises(DataError, match="holds no images"):
        UnlabeledImages(coco, "annotations")
    with pytest.raises(DataError, match="does not exist"):
        ImagesDataModule(str(tmp_path / "absent"))
    with pytest.raises(DataError, match="--data.root"):
        ImagesDataModule(None)


def test_links_out_of_the_split_are_refused(tmp_path):
    outside = tmp_path / "secret.png"
    _write(outside, 0)
    _write(tmp_path / "root" / "train" / "a.png", 1)
    os.symlink(outside, tmp_path / "root" / "train" / "b.png")
    assert UnlabeledImages(tmp_path / "root", "train", skip_unreadable=True).files == ["train/a.png"]
    with pytest.raises(DataError, match="b.png"):
        UnlabeledImages(tmp_path / "root", "train")
    assert len(UnlabeledImages(tmp_path / "root", "train", follow_symlinks=True)) == 2


@pytest.fixture(scope="module")
def pretrained_run(tmp_path_factory, shapes_root):
    from vision_attn.commands.train import train_main

    out = tmp_path_factory.mktemp("pretrain") / "mae"
    enc = "--model.init_args.encoder.init_args."
    cli = train_main(["--config", CONFIG, "--data.init_args.root", str(shapes_root),
                      "--data.init_args.batching.num_workers", "0", "--data.init_args.batching.batch_size", "16",
                      f"{enc}patch_size", "8", f"{enc}embed_dim", "32", f"{enc}depth", "2", f"{enc}num_heads", "2",
                      "--model.init_args.masking.norm_pix_loss", "false",
                      "--model.init_args.decoder.dim", "32", "--model.init_args.decoder.num_heads", "2",
                      "--trainer.max_epochs", "12", "--trainer.check_val_every_n_epoch", "12",
                      "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                      "--trainer.default_root_dir", str(out)])
    return out, cli


def test_pretraining_learns_to_fill_in_the_hidden_patches(pretrained_run):
    out, cli = pretrained_run
    task = cli.model.eval()
    val = cli.datamodule.datasets["val"]
    images = torch.stack([val[i][0] for i in range(len(val))])
    mask = block_mask(len(images), task.encoder.grid_for(32, 32), 0.6, 2, torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = task.reconstruction_loss(images, mask, task.masked_forward(images, mask)).item()
        # the image-blind guess: every hidden pixel at the normalisation's mean (0)
        blind = task.reconstruction_loss(images, mask, torch.zeros(len(images), 16, 3 * 8 * 8)).item()
    assert trained < 0.7 * blind, (trained, blind)  # trained: 0.55 of it
    assert (out / "checkpoints" / "last.ckpt").is_file()


def test_a_pretrained_encoder_starts_another_task(pretrained_run, shapes_root, tmp_path, caplog):
    from vision_attn.commands.train import train_main

    out, cli = pretrained_run
    ckpt = out / "checkpoints" / "last.ckpt"
    pretrained = cli.model.encoder.model.state_dict()
    # the checkpoint as a weights file: its encoder's tensors, the decoder and mask token left out
    encoder = ViTEncoder(**{**SMALL_ENCODER, "drop_path_rate": 0.1}, **MAE_STEM, weights_file=str(ckpt))
    assert all(torch.equal(v, pretrained[k]) for k, v in encoder.model.state_dict().items())
    fresh = ViTEncoder(**SMALL_ENCODER, **MAE_STEM)
    assert not all(torch.equal(v, pretrained[k]) for k, v in fresh.model.state_dict().items())
    with pytest.raises(Exception, match="does not fit"):  # another architecture: a clear error
        ViTEncoder(**{**SMALL_ENCODER, "embed_dim": 64}, **MAE_STEM, weights_file=str(ckpt))
    # and from the command line: the classification recipe starts from it
    enc = "--model.init_args.encoder.init_args."
    with caplog.at_level("INFO", logger="vision_attn.models.encoder"):
        fine = train_main(["--config", str(REPO / "configs" / "classification" / "small.yaml"),
                           "--data.init_args.root", str(shapes_root), "--data.init_args.batching.num_workers", "0",
                           "--data.init_args.batching.batch_size", "16", f"{enc}patch_size", "8",
                           f"{enc}embed_dim", "32", f"{enc}depth", "2", f"{enc}num_heads", "2",
                           f"{enc}weights_file", str(ckpt), "--trainer.max_epochs", "1",
                           "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
                           "--trainer.default_root_dir", str(tmp_path / "cls")])
    assert f"loaded encoder weights from {ckpt}" in caplog.text
    assert "the other" in caplog.text  # the decoder's tensors are named as left out
    assert fine.trainer.global_step > 0 and (tmp_path / "cls" / "checkpoints" / "last.ckpt").is_file()
    # a classifier's checkpoint starts another task the same way (its head is left out)
    again = ViTEncoder(**SMALL_ENCODER, **MAE_STEM,
                       weights_file=str(tmp_path / "cls" / "checkpoints" / "last.ckpt"))
    tuned = fine.model.encoder.model.state_dict()
    assert all(torch.equal(v, tuned[k]) for k, v in again.model.state_dict().items())
    assert not all(torch.equal(v, pretrained[k]) for k, v in again.model.state_dict().items())


def test_a_pretraining_checkpoint_predicts_nothing_and_says_what_to_do(pretrained_run, shapes_root, tmp_path,
                                                                      capsys):
    from vision_attn.commands.predict import main as predict_main
    from vision_attn.export import export_onnx, export_safetensors
    from vision_attn.tasks import load_task

    out, cli = pretrained_run
    ckpt = out / "checkpoints" / "last.ckpt"
    assert isinstance(load_task(ckpt), PretrainTask)
    with pytest.raises(SystemExit) as exit_info:
        predict_main(["--ckpt_path", str(ckpt), "--images", str(shapes_root / "val"), "--num_workers", "0",
                      "--output_dir", str(tmp_path / "pred")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "predicts nothing" in err and "weights_file" in err, err
    assert not (tmp_path / "pred" / "predictions.json").exists()
    with pytest.raises(ConfigError, match="predicts nothing"):
        export_onnx(ckpt, tmp_path / "model.onnx")
    # the encoder's weights export as timm names them, and load back
    written = export_safetensors(ckpt, tmp_path / "encoder.safetensors")
    encoder = ViTEncoder(**SMALL_ENCODER, **MAE_STEM, weights_file=str(written))
    pretrained = cli.model.encoder.model.state_dict()
    assert all(torch.equal(v, pretrained[k]) for k, v in encoder.model.state_dict().items())
