"""Deletion / insertion curves on a model whose answer we know."""

from __future__ import annotations

import pytest
import torch

from vision_attn.explain.faithfulness import auc, deletion_insertion_curve


def _model(x):
    # "Class 0" probability = mean brightness of the top-left 8x8 patch of a 16x16 image.
    p0 = x[:, :, :8, :8].mean(dim=(1, 2, 3)).clamp(0, 1)
    return torch.stack([p0, 1 - p0], dim=1)


def test_right_saliency_beats_wrong_saliency():
    x = torch.zeros(2, 3, 16, 16)
    x[:, :, :8, :8] = 1.0
    right = torch.tensor([[1.0, 0.0], [0.0, 0.0]]).expand(2, 2, 2)
    wrong = torch.tensor([[0.1, 0.5], [0.7, 1.0]]).expand(2, 2, 2)  # decisive patch last
    target = torch.zeros(2, dtype=torch.long)
    d_right = deletion_insertion_curve(_model, x, right, target, "deletion", steps=4)
    d_wrong = deletion_insertion_curve(_model, x, wrong, target, "deletion", steps=4)
    assert d_right.shape == (2, 5)
    assert d_right[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]  # the decisive patch goes first
    assert d_wrong[0].tolist() == [1.0, 1.0, 1.0, 1.0, 0.0]  # ...or last
    assert torch.all(auc(d_right) < auc(d_wrong))
    i_right = deletion_insertion_curve(_model, x, right, target, "insertion", steps=4, baseline="zero")
    i_wrong = deletion_insertion_curve(_model, x, wrong, target, "insertion", steps=4, baseline="zero")
    assert i_right[0].tolist() == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert torch.all(auc(i_right) > auc(i_wrong))


def test_auc_trapezoid():
    assert torch.allclose(auc(torch.tensor([[1.0, 0.0]])), torch.tensor([0.5]))
    assert torch.allclose(auc(torch.tensor([[1.0, 1.0, 1.0]])), torch.tensor([1.0]))


def test_sample_spreads_over_a_class_sorted_split():
    from vision_attn.explain.evaluate import select_images

    labels = [i // 100 for i in range(500)]  # 5 classes of 100, sorted by class (ImageFolder)
    sample = select_images(500, 256)
    assert len(sample) == len(set(sample)) == 256 and sample == sorted(sample) and 0 <= sample[0] <= sample[-1] < 500
    assert {labels[i] for i in sample} == set(range(5))
    assert {labels[i] for i in select_images(500, 256, "first")} == {0, 1, 2}  # what "first" covered
    assert select_images(500, 256) == sample and select_images(500, 256, seed=1) != sample  # seeded
    assert select_images(7, 20) == list(range(7))
    assert select_images(10, 3, "spread") == [0, 4, 9]  # round(4.5) == 4
    # one image per stratum: any class with 2 * ceil(N / n) - 1 consecutive images is hit, whatever the seed
    for seed in range(20):
        picked = select_images(60, 6, seed=seed)
        assert [i // 10 for i in picked] == list(range(6))


def test_eval_faithfulness_covers_every_class_and_reports_it(shapes_root, tmp_path):
    from vision_attn import create_encoder
    from vision_attn.data.classification import ImageFolderDataset
    from vision_attn.data.transforms import build_eval_transform
    from vision_attn.explain.evaluate import ExplainOptions, explain_eval_split
    from vision_attn.tasks import ClassificationTask

    from .conftest import TINY_VIT

    torch.manual_seed(0)
    names = ["circle", "cross", "square", "star", "triangle"]
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=names).eval()
    ds = ImageFolderDataset(shapes_root, "val", names, build_eval_transform(task.data_config))
    assert [ds.samples[i][1] for i in range(len(ds))] == sorted(ds.samples[i][1] for i in range(len(ds)))  # by class
    options = ExplainOptions(methods=["attention"], num_overlays=0, faithfulness_images=5, steps=2, batch_size=5,
                             report=False)
    metrics = explain_eval_split(task, ds, options, tmp_path)
    assert metrics["explain_images"] == 5.0 and metrics["explain_classes"] == 5.0
    assert {"deletion_auc", "insertion_auc", "deletion_auc_random", "saco_attention", "saco_random"} <= set(metrics)
    assert not any(k.startswith("road") for k in metrics)  # ROAD when asked
    options.road = True
    with_road = explain_eval_split(task, ds, options, tmp_path)
    assert {f"{k}_{m}" for k in ("road", "road_morf", "road_lerf") for m in ("attention", "random")} <= set(with_road)
    for m in ("attention", "random"):  # ROAD's combined score is its two orders' half difference
        assert with_road[f"road_{m}"] == pytest.approx((with_road[f"road_lerf_{m}"] - with_road[f"road_morf_{m}"]) / 2)
        assert -1 <= with_road[f"saco_{m}"] <= 1 and with_road[f"saco_{m}"] == metrics[f"saco_{m}"]


def test_shared_curve_ends_give_the_same_curves_with_fewer_model_calls():
    from vision_attn.explain.faithfulness import curve_ends, end_probabilities

    gen = torch.Generator().manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(2),
                              torch.nn.Flatten(), torch.nn.Linear(16, 5))
    seen = []

    def proba(x):
        seen.append(x.shape[0])
        return net(x).softmax(-1)

    images = torch.randn(3, 3, 16, 16, generator=gen)
    rows = torch.tensor([0, 0, 1, 2, 2])  # several explained targets per image, as detections are
    target = torch.tensor([1, 4, 0, 2, 3])
    sal = torch.rand(5, 4, 4, generator=gen)
    shared = end_probabilities(proba, images)
    assert sum(seen) == 3 + 1 + 3  # the images, one zero image, the blurred images
    for mode in ("deletion", "insertion"):
        for baseline in ("zero", "blur"):
            seen.clear()
            full = deletion_insertion_curve(proba, images[rows], sal, target, mode, 4, baseline)
            assert sum(seen) == 5 * 5
            seen.clear()
            ends = curve_ends(shared, rows, target, mode, baseline)
            inner = deletion_insertion_curve(proba, images[rows], sal, target, mode, 4, baseline, ends=ends)
            assert sum(seen) == 5 * 3  # only the points in between
            torch.testing.assert_close(inner, full, atol=1e-6, rtol=0)
    # deletion starts at the image's own probability; insertion ends there
    mine = proba(images)[rows].gather(1, target[:, None]).squeeze(1)
    torch.testing.assert_close(curve_ends(shared, rows, target, "deletion")[0], mine)
    torch.testing.assert_close(curve_ends(shared, rows, target, "insertion")[1], mine)
    # nothing to explain: no model call, empty curves
    seen.clear()
    none = end_probabilities(proba, images[:0])
    empty = deletion_insertion_curve(proba, images[:0], sal[:0], target[:0], "deletion", 4,
                                     ends=curve_ends(none, rows[:0], target[:0], "deletion"))
    assert seen == [] and empty.shape == (0, 5)
