"""Explanation measures as update / compute objects: hand-made maps, boxes, curves and
correlations with known answers, and the classifier's explanation evaluation pinned to its
numbers on a tiny fixture."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vision_attn.explain.measures import Localisation, MapWriter, Perturbation, Sanity


def explanation_outputs(out_dir: Path) -> dict:
    """What an evaluation wrote besides its metrics: ``maps/index.json``, ``sanity.json``'s
    curves (``{"<method>/<step>": mean}``) and the summed values of each method's saved maps,
    ``None`` where absent."""
    maps = out_dir / "maps"
    index = json.loads((maps / "index.json").read_text()) if (maps / "index.json").is_file() else None
    sanity = json.loads((out_dir / "sanity.json").read_text()) if (out_dir / "sanity.json").is_file() else None
    sums = None
    if maps.is_dir():
        sums = {}
        for path in sorted(maps.rglob("*.npy")):
            method = path.relative_to(maps).parts[0]
            sums[method] = sums.get(method, 0.0) + float(np.load(path).astype(np.float64).sum())
    curves = None if sanity is None else {f"{m}/{step}": v for m, steps in sanity["methods"].items()
                                          for step, v in steps.items()}
    return {"index": index, "sanity": curves, "maps": sums}


SEGMENTATION = ("pixel_acc_", "miou_", "map_mask_")
"""The mask measures: recomputed from the saved maps by their own tests (the pins leave them out)."""


def assert_pinned(got: dict, expected: dict) -> None:
    """``got`` has ``expected``'s keys in its order and its values (float rounding aside); the
    mask measures (:data:`SEGMENTATION`, in ``[0, 1]``) aside."""
    masks = {k: v for k, v in got.items() if k.startswith(SEGMENTATION)}
    assert all(0.0 <= v <= 1.0 for v in masks.values())
    got = {k: v for k, v in got.items() if k not in masks}
    assert list(got) == list(expected)
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-6)  # float32 kernels differ slightly between CPUs


# ---------------------------------------------------------------------------- localisation
def _peak(shape: tuple[int, int], row: int, col: int) -> np.ndarray:
    m = np.zeros(shape, np.float32)
    m[row, col] = 1.0
    return m


def test_localisation_peak_inside_and_outside_a_box():
    box = [[10, 10, 20, 20]]  # x0, y0, x1, y1
    loc = Localisation()
    assert loc.update({"a": _peak((32, 32), 15, 15), "b": _peak((32, 32), 2, 2)}, box)  # a inside, b outside
    assert loc.update({"a": _peak((32, 32), 15, 15), "b": _peak((32, 32), 15, 25)}, box)  # b right of the box
    assert loc.count == 2
    assert loc.compute() == {"pointing_a": 1.0, "energy_a": 1.0, "pointing_b": 0.0, "energy_b": 0.0}
    half = np.zeros((32, 32), np.float32)
    half[15, 15] = half[2, 2] = 1.0  # half the mass in the box; the first maximum (2, 2) outside it
    loc.update({"a": half, "b": half}, box)
    out = loc.compute()
    assert out["pointing_a"] == pytest.approx(2 / 3) and out["energy_a"] == pytest.approx(2.5 / 3)
    assert out["pointing_b"] == 0.0 and out["energy_b"] == pytest.approx(0.5 / 3)
    assert not loc.update({"a": half, "b": half}, [])  # nothing to point at: not scored
    assert loc.count == 3
    loc.reset()
    assert loc.count == 0 and loc.compute() == {}


def test_localisation_one_pixel_tolerance():
    loc = Localisation()
    loc.update({"near": _peak((32, 32), 15, 20)}, [[10, 10, 19.5, 20]])  # centre 20.5: 1 px right of the box
    loc.update({"near": _peak((32, 32), 15, 21)}, [[10, 10, 19.5, 20]])  # centre 21.5: 2 px
    assert loc.compute()["pointing_near"] == 0.5
    strict = Localisation(tolerance=0.0)
    strict.update({"near": _peak((32, 32), 15, 20)}, [[10, 10, 19.5, 20]])
    assert strict.compute()["pointing_near"] == 0.0


def test_localisation_draws_score_their_mean_and_a_constant_map_gets_the_random_baseline():
    """A map given as several draws scores the mean over them; uniform random maps score the
    box's area share of energy and point into the box about as often as a pixel lies there
    (within the 1 px tolerance); a constant map puts exactly the area share on the box, as
    random maps do on average."""
    h, w = 32, 48
    box = [[8, 4, 24, 20]]  # 16 x 16 of 32 x 48
    area = 16 * 16 / (h * w)
    draws = np.random.default_rng(0).uniform(size=(400, h, w)).astype(np.float32)
    ys, xs = np.mgrid[0:h, 0:w] + 0.5
    dx = np.maximum.reduce([8 - xs, np.zeros_like(xs), xs - 24])
    dy = np.maximum.reduce([4 - ys, np.zeros_like(ys), ys - 20])
    chance = float((dx**2 + dy**2 <= 1.0).mean())  # pixels within 1 px of the box
    loc = Localisation()
    loc.update({"random": draws, "constant": np.full((h, w), 0.3, np.float32),
                "two": np.stack([_peak((h, w), 10, 10), _peak((h, w), 30, 40)])}, box)
    out = loc.compute()
    assert loc.count == 1
    assert out["energy_constant"] == pytest.approx(area)
    assert out["energy_random"] == pytest.approx(area, abs=0.01)
    assert out["pointing_random"] == pytest.approx(chance, abs=0.05)
    assert out["pointing_two"] == 0.5 and out["energy_two"] == 0.5  # one draw in, one out


# ---------------------------------------------------------------------------- perturbation
def test_perturbation_auc_of_known_curves_averaged_over_items_not_batches():
    per = Perturbation(first="b")
    straight = torch.tensor([[1.0, 0.5, 0.0]])  # AUC 0.5
    flat = torch.tensor([[1.0, 1.0, 1.0]])  # AUC 1
    per.update({"a": {"deletion": straight, "insertion": flat}, "b": {"deletion": flat, "insertion": straight}})
    early = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # AUC 0.25 and 0
    per.update({"a": {"deletion": early, "insertion": early}, "b": {"deletion": early, "insertion": early}})
    assert per.count == 3
    out = per.compute()
    assert list(out) == ["deletion_auc_a", "insertion_auc_a", "deletion_auc_b", "insertion_auc_b", "deletion_auc",
                         "insertion_auc"]
    assert out["deletion_auc_a"] == pytest.approx((0.5 + 0.25 + 0.0) / 3)  # not the mean of the batch means
    assert out["insertion_auc_a"] == pytest.approx((1.0 + 0.25) / 3)
    assert out["deletion_auc_b"] == pytest.approx((1.0 + 0.25) / 3)
    assert out["deletion_auc"] == out["deletion_auc_b"] and out["insertion_auc"] == out["insertion_auc_b"]
    assert per.curves("deletion")["a"] == pytest.approx([2 / 3, 0.5 / 3, 0.0])
    assert set(per.curves("insertion")) == {"a", "b"}
    assert "deletion_auc" not in Perturbation().compute() and Perturbation().curves() == {}
    per.reset()
    assert per.count == 0 and per.compute() == {}


def test_perturbation_rejects_mismatched_items_and_unknown_modes():
    per = Perturbation()
    with pytest.raises(ValueError, match="same items"):
        per.update({"a": {"deletion": torch.zeros(2, 3)}, "b": {"deletion": torch.zeros(3, 3)}})
    with pytest.raises(ValueError, match="deletion, insertion"):
        per.update({"a": {"removal": torch.zeros(2, 3)}})


# ---------------------------------------------------------------------------- sanity
def test_sanity_means_over_items_per_step_and_writes_the_curves(tmp_path):
    san = Sanity()
    san.write(tmp_path)
    assert not (tmp_path / "sanity.json").exists() and san.compute() == {}  # nothing measured: no file
    san.update({"m": {"block0": torch.tensor([1.0, 0.5]), "all": torch.tensor([0.2, 0.4])},
                "random": {"block0": torch.ones(2), "all": torch.ones(2)}})
    san.update({"m": {"block0": torch.tensor([0.0]), "all": torch.tensor([0.9])},
                "random": {"block0": torch.ones(1), "all": torch.ones(1)}})
    assert san.count == 3
    assert san.compute() == {"sanity_m": pytest.approx(0.5), "sanity_random": 1.0}
    san.write(tmp_path)
    saved = json.loads((tmp_path / "sanity.json").read_text())
    assert saved["steps"] == ["block0", "all"]
    assert saved["methods"]["m"] == pytest.approx({"block0": 0.5, "all": 0.5})
    with pytest.raises(ValueError, match="same items"):
        san.update({"m": {"all": torch.ones(2)}, "random": {"all": torch.ones(1)}})


# ---------------------------------------------------------------------------- saved maps
def test_map_writer_saves_float32_maps_named_by_item_and_the_index(tmp_path):
    writer = MapWriter(tmp_path, "words")
    maps = {"relevance": np.ones((3, 5)), "a/b": np.zeros((3, 5), np.float32)}
    assert writer.update(maps, {"index": 0, "word": "circle"}) == "00000"
    assert writer.update(maps, {"index": 1, "word": "red"}) == "00001"
    assert writer.update(maps, {"index": 7}, name="00007_2") == "00007_2"
    assert writer.count == 3
    assert writer.compute() == {}
    saved = np.load(tmp_path / "maps" / "relevance" / "00001.npy")
    assert saved.dtype == np.float32 and saved.shape == (3, 5) and saved.sum() == 15.0
    assert (tmp_path / "maps" / "relevance" / "00007_2.npy").is_file()
    odd = [p for p in (tmp_path / "maps").iterdir() if p.is_dir() and p.name != "relevance"]
    assert len(odd) == 1 and "/" not in odd[0].name  # a method name never makes a path
    index = json.loads((tmp_path / "maps" / "index.json").read_text())
    assert index == [{"index": 0, "word": "circle"}, {"index": 1, "word": "red"}, {"index": 7}]
    empty = MapWriter(tmp_path / "none")
    empty.compute()
    assert json.loads((tmp_path / "none" / "maps" / "index.json").read_text()) == []


# ---------------------------------------------------------------------------- the classifier, pinned
PINNED_CLASSIFICATION = {
    "deletion_auc": 0.21079405503613607, "deletion_auc_attention": 0.21106191618101938,
    "deletion_auc_random": 0.21213965543678828, "deletion_auc_relevance": 0.21079405503613607,
    "deletion_auc_rollout": 0.21181153186729976, "energy_attention": 0.25126014815419745,
    "energy_random": 0.2697186960501158, "energy_relevance": 0.308193282278081, "energy_rollout": 0.25124842739623,
    "energy_tokens": 0.2821033741377435, "explain_classes": 5.0, "explain_images": 7.0,
    "insertion_auc": 0.22252772535596574, "insertion_auc_attention": 0.2224695086479187,
    "insertion_auc_random": 0.2220781786101205, "insertion_auc_relevance": 0.22252772535596574,
    "insertion_auc_rollout": 0.22224307485989162, "pointing_attention": 0.14285714285714285,
    "pointing_random": 0.2857142857142857, "pointing_relevance": 0.8571428571428571,
    "pointing_rollout": 0.42857142857142855, "pointing_tokens": 0.5714285714285714,
    "saco_attention": 0.3612175554119186, "saco_random": -0.12093920493625834, "saco_relevance": 0.6180911054689459,
    "saco_rollout": 0.1223565613911476,
    "sanity_attention": 0.04201680672268906, "sanity_random": 1.0, "sanity_relevance": 0.13578913347728744,
    "sanity_rollout": 0.1331932773109244, "sanity_tokens": 0.028151260504201674,
}
PINNED_CLASSIFICATION_OUTPUTS = {
    "sanity": {"relevance/head": 0.09705882352941177, "relevance/block1": 0.10588235294117647,
               "relevance/block0": 0.042016806722689086, "relevance/all": 0.13578913347728744,
               "rollout/head": 1.0, "rollout/block1": 0.6420168067226891,  # rollout reads no head weight
               "rollout/block0": -0.31302521008403356, "rollout/all": 0.1331932773109244,
               "attention/head": 1.0, "attention/block1": 0.1554621848739496, "attention/block0": -0.16260504201680673,
               "attention/all": 0.04201680672268906, "tokens/head": 1.0, "tokens/block1": 0.9945378151260504,
               "tokens/block0": 0.9920168067226891, "tokens/all": 0.028151260504201674, "random/head": 1.0,
               "random/block1": 1.0, "random/block0": 1.0, "random/all": 1.0},
    "maps": {"attention": 5843.483348190784, "random": 2986.0210640984587, "relevance": 2744.5116354450583,
             "rollout": 5863.915024399757, "tokens": 4390.543391525745},
    "curves": {"relevance": [0.2197479084134102, 0.21303828805685043, 0.20502707734704018, 0.20266401022672653],
               "rollout": [0.2197479084134102, 0.2143135853111744, 0.20562691241502762, 0.20266401022672653],
               "attention": [0.2197479084134102, 0.21485234797000885, 0.20644435659050941, 0.20266401022672653],
               "random": [0.2197479084134102, 0.21494964137673378, 0.20846359059214592, 0.20266401022672653]},
}


def test_classification_explanation_numbers_are_pinned(shapes_root, tmp_path):
    """The classifier's explanation evaluation on a tiny untrained model and the embedded shapes
    data (its own boxes), three batches: every measure's number, the sanity curves, the saved
    maps and the report's mean deletion curves of the seeded sample keep their values."""
    from vision_attn import create_encoder
    from vision_attn.data.classification import ImageFolderDataset
    from vision_attn.data.transforms import build_eval_transform
    from vision_attn.explain.evaluate import ExplainOptions, explain_eval_split, select_images
    from vision_attn.explain.records import Report
    from vision_attn.tasks import ClassificationTask

    from .conftest import TINY_VIT

    names = ["circle", "cross", "square", "star", "triangle"]
    torch.manual_seed(0)
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=names).eval()
    ds = ImageFolderDataset(shapes_root, "val", names, build_eval_transform(task.data_config))
    options = ExplainOptions(methods=["relevance", "rollout", "attention", "tokens"], num_overlays=4,
                             faithfulness_images=7, steps=3, batch_size=3, save_maps=True, sanity=True)
    report = Report()
    metrics = explain_eval_split(task, ds, options, tmp_path, report)
    assert_pinned(metrics, PINNED_CLASSIFICATION)
    outputs = explanation_outputs(tmp_path)
    picked = select_images(len(ds), 7, "sample", 0)
    assert [e["index"] for e in outputs["index"]] == picked
    assert [e["file"] for e in outputs["index"]] == [ds.samples[i][0] for i in picked]
    assert_pinned(outputs["sanity"], PINNED_CLASSIFICATION_OUTPUTS["sanity"])
    assert outputs["maps"] == pytest.approx(PINNED_CLASSIFICATION_OUTPUTS["maps"], rel=1e-5)
    assert list(report.curves) == list(PINNED_CLASSIFICATION_OUTPUTS["curves"])
    for method, curve in PINNED_CLASSIFICATION_OUTPUTS["curves"].items():
        assert report.curves[method] == pytest.approx(curve, rel=1e-5)
