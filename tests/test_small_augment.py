"""The one-step ``small`` augmentation equals torchvision's ops for the same random choices,
and draws them as the preset says."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchvision.transforms import v2 as T
from torchvision.transforms.v2 import functional as TF

from vision_attn.data.transforms import SmallAugment, build_train_transform

PRE = {"input_size": (3, 32, 32), "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225),
       "interpolation": "bicubic", "crop_pct": 1.0}


def _image(seed: int = 0, size: int = 32) -> torch.Tensor:
    return torch.as_tensor(np.random.default_rng(seed).integers(0, 256, (3, size, size), dtype=np.uint8))


@pytest.mark.parametrize("top,left,flip,factors,order", [
    (0, 0, False, (1.0, 1.0), (0, 1)),
    (4, 4, False, (1.2, 0.8), (0, 1)),
    (0, 8, True, (0.8, 1.2), (1, 0)),
    (7, 1, True, (1.13, 0.91), (1, 0)),
])
def test_apply_equals_torchvision(top, left, flip, factors, order):
    aug = SmallAugment((32, 32), 4, True, PRE["mean"], PRE["std"])
    x = _image()
    got = aug.apply(x, top, left, flip, factors, order)
    ref = TF.pad(x.float() / 255, [4, 4, 4, 4], padding_mode="reflect")  # torchvision's RandomCrop padding
    ref = TF.crop(ref, top, left, 32, 32)
    if flip:
        ref = TF.horizontal_flip(ref)
    for k in order:
        ref = TF.adjust_brightness(ref, factors[0]) if k == 0 else TF.adjust_contrast(ref, factors[1])
    ref = TF.normalize(ref, list(PRE["mean"]), list(PRE["std"]))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_preset_uses_it_and_resizes_other_sizes():
    tf = build_train_transform(PRE, "small", hflip=False)
    assert isinstance(tf.transforms[0], SmallAugment) and tf.transforms[0].hflip is False
    out = tf(_image(1, 48).permute(1, 2, 0).numpy())  # numpy [H, W, 3] of another size
    assert out.shape == (3, 32, 32) and out.dtype == torch.float32
    # with RandAugment asked for, the torchvision chain stays (RandAugment needs it)
    assert not isinstance(build_train_transform(PRE, "small", randaugment_ops=2).transforms[0], SmallAugment)


def test_random_choices_cover_the_preset():
    """Offsets cover 0..2*pad, flips happen about half the time only with hflip, and the
    result is a crop of the padded image (never the image shifted out of range)."""
    aug = SmallAugment((32, 32), 4, True, (0.0,) * 3, (1.0,) * 3, jitter=0.0)
    x = torch.arange(32).repeat(3, 32, 1).to(torch.uint8) * 8  # columns 0, 8, ..., 248
    torch.manual_seed(0)
    firsts = []
    for _ in range(400):
        out = aug(x)
        firsts.append(round(float(out[0, 0, 0]) * 255 / 8))
    shifts = set(firsts)
    # column index of the top-left pixel: reflect padding maps offsets 0..8 to columns 4..0 and 1..4
    assert shifts <= set(range(0, 32)) and len(shifts) >= 8
    no_flip = SmallAugment((32, 32), 0, False, (0.0,) * 3, (1.0,) * 3, jitter=0.0)
    torch.testing.assert_close(no_flip(x), x.float() / 255)  # pad 0, no flip, no jitter: the image
    torch.manual_seed(1)
    flips = sum(int(SmallAugment((32, 32), 0, True, (0.0,) * 3, (1.0,) * 3, jitter=0.0)(x)[0, 0, 0] > 0.5)
                for _ in range(400))
    assert 150 < flips < 250  # the flipped image starts with the brightest column


def _chain(jitter: float) -> T.Compose:
    """torchvision's chain that :class:`SmallAugment` replaces, on the float image (on uint8 it
    rounds down between the jitter's two blends: about 1/255 darker, the one intended difference)."""
    ops = [T.ToImage(), T.ToDtype(torch.float32, scale=True), T.RandomCrop((32, 32), padding=4, padding_mode="reflect"),
           T.RandomHorizontalFlip()]
    if jitter:
        ops.append(T.ColorJitter(brightness=jitter, contrast=jitter))
    return T.Compose([*ops, T.Normalize(mean=list(PRE["mean"]), std=list(PRE["std"]))])


def test_same_distribution_as_the_torchvision_chain():
    """Same distribution as the torchvision chain it replaces, on a smooth image: without jitter
    the mean image over many draws (crops and flips averaged) agrees pixel by pixel; with it the
    mean and the spread of each draw's mean brightness agree."""
    rows, cols = np.mgrid[0:32, 0:32]
    x = np.stack([rows * 6 + 20, cols * 7, 255 - rows * 4 - cols * 3], -1).clip(0, 255).astype(np.uint8)
    torch.manual_seed(0)
    geometry = SmallAugment((32, 32), 4, True, PRE["mean"], PRE["std"], jitter=0.0)
    a = torch.stack([geometry(x) for _ in range(800)]).mean(0)
    b = torch.stack([_chain(0.0)(x) for _ in range(800)]).mean(0)
    assert (a - b).abs().mean() < 0.03
    new = build_train_transform(PRE, "small", hflip=True)
    a = torch.stack([new(x).mean() for _ in range(1500)])
    b = torch.stack([_chain(0.2)(x).mean() for _ in range(1500)])
    assert abs(float(a.mean() - b.mean())) < 3 * float(b.std()) / 1500 ** 0.5 * 2 ** 0.5
    assert 0.85 < float(a.std() / b.std()) < 1.15
    assert float(a.std()) > 0.05  # the jitter is there


@pytest.mark.parametrize("top,left,flip", [(0, 0, False), (4, 4, False), (8, 0, True), (1, 7, True)])
def test_boxes_move_with_the_crop_and_flip(top, left, flip):
    """A drawn rectangle's pixels after :meth:`SmallAugment.apply` are where ``move_boxes`` puts its box."""
    aug = SmallAugment((32, 32), 4, True, (0.0,) * 3, (1.0,) * 3, jitter=0.0)
    x = torch.zeros(3, 32, 32, dtype=torch.uint8)
    x[:, 10:18, 6:20] = 255  # rows 10..17, columns 6..19: the box (6, 10, 20, 18) in pixels
    out = aug.apply(x, top, left, flip, (1.0, 1.0), (0, 1))
    rows, cols = (out[0] > 0.5).nonzero(as_tuple=True)
    drawn = torch.tensor([cols.min(), rows.min(), cols.max() + 1, rows.max() + 1], dtype=torch.float32) / 32
    box = torch.tensor([[6, 10, 20, 18]], dtype=torch.float32) / 32
    torch.testing.assert_close(aug.move_boxes(box, top, left, flip)[0], drawn)


def test_boxes_clip_to_the_crop_and_come_with_forward():
    aug = SmallAugment((32, 32), 4, False, (0.0,) * 3, (1.0,) * 3)
    corner = torch.tensor([[0.0, 0.0, 0.25, 0.25]])
    # cropped at (8, 8) of the padded image: the view moves 4 px right/down, the box's left/top leave it
    torch.testing.assert_close(aug.move_boxes(corner, 8, 8, False), torch.tensor([[0.0, 0.0, 4 / 32, 4 / 32]]))
    image, boxes = aug(_image(), corner)
    assert image.shape == (3, 32, 32) and boxes.shape == (1, 4)
    assert torch.isclose(boxes[0, 2] - boxes[0, 0], torch.tensor(0.25), atol=4 / 32 + 1e-6)


def test_colour_jitter_option_sets_the_factor_range():
    """``colour_jitter`` reaches the one-step augmentation and the torchvision chain; 0 leaves
    the pixels' values alone; out-of-range values are refused with the option's name."""
    assert build_train_transform(PRE, "small", hflip=False).transforms[0].jitter == 0.2  # the default
    tf = build_train_transform(PRE, "small", hflip=False, colour_jitter=0.5)
    assert tf.transforms[0].jitter == 0.5
    chain = build_train_transform(PRE, "small", randaugment_ops=1, colour_jitter=0.4)
    jitter = [t for t in chain.transforms if isinstance(t, T.ColorJitter)][0]
    assert jitter.brightness == (0.6, 1.4) and jitter.contrast == (0.6, 1.4)
    flat = torch.full((3, 32, 32), 100, dtype=torch.uint8)
    still = build_train_transform({**PRE, "mean": (0.0,) * 3, "std": (1.0,) * 3}, "small", hflip=False,
                                  colour_jitter=0.0)
    torch.manual_seed(0)
    torch.testing.assert_close(still(flat), flat.float() / 255)  # a flat image: crops and flips change nothing
    torch.manual_seed(0)
    moved = build_train_transform({**PRE, "mean": (0.0,) * 3, "std": (1.0,) * 3}, "small", hflip=False,
                                  colour_jitter=0.5)
    assert any(abs(float(moved(flat).mean()) - 100 / 255) > 0.01 for _ in range(5))
    with pytest.raises(ValueError, match="colour_jitter"):
        build_train_transform(PRE, "small", colour_jitter=1.5)
