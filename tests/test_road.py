"""ROAD's noisy linear imputation and SaCo against computations written out by hand."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vision_attn.explain.road import (
    NEIGHBOURS,
    classifier_scores,
    noisy_linear_impute,
    road_curves,
    road_scores,
    saco,
)


def _dense_imputation(image: np.ndarray, removed: np.ndarray) -> np.ndarray:
    """The imputation written out pixel by pixel: one equation per removed pixel, its value
    times the summed weights of its neighbours inside the image equals their weighted values."""
    c, h, w = image.shape
    unknown = [(y, x) for y in range(h) for x in range(w) if removed[y, x]]
    index = {p: i for i, p in enumerate(unknown)}
    a = np.zeros((len(unknown), len(unknown)))
    b = np.zeros((len(unknown), c))
    for i, (y, x) in enumerate(unknown):
        for dy, dx, weight in NEIGHBOURS:
            ny, nx = y + dy, x + dx
            if not (0 <= ny < h and 0 <= nx < w):
                continue
            a[i, i] += weight
            if (ny, nx) in index:
                a[i, index[ny, nx]] -= weight
            else:
                b[i] += weight * image[:, ny, nx]
    out = image.copy()
    solved = np.linalg.solve(a, b)
    for i, (y, x) in enumerate(unknown):
        out[:, y, x] = solved[i]
    return out


def test_imputation_equals_the_equations_solved_by_hand():
    rng = np.random.default_rng(0)
    images = rng.normal(size=(2, 3, 5, 6))
    removed = rng.random((2, 5, 6)) < 0.5
    removed[1, :, :3] = True  # a region touching three borders
    removed[0, 0, 0] = True  # a corner
    out = noisy_linear_impute(torch.from_numpy(images), torch.from_numpy(removed), noise=0.0)
    assert out.dtype == torch.float64 and out.shape == images.shape
    for k in range(2):
        np.testing.assert_allclose(out[k].numpy(), _dense_imputation(images[k], removed[k]), atol=1e-10)
    kept = ~torch.from_numpy(removed)[:, None].expand_as(out)
    assert torch.equal(out[kept], torch.from_numpy(images)[kept])  # the kept pixels untouched


def test_imputation_of_a_flat_image_is_flat_and_the_noise_has_its_spread():
    image = torch.full((1, 3, 32, 32), 0.25)
    removed = torch.zeros(1, 32, 32, dtype=torch.bool)
    removed[0, 4:28, 4:28] = True
    assert torch.allclose(noisy_linear_impute(image, removed, noise=0.0), image, atol=1e-12)
    noisy = noisy_linear_impute(image, removed, noise=0.1, generator=torch.Generator().manual_seed(0))
    drawn = (noisy - image)[:, :, 4:28, 4:28]
    assert drawn.std().item() == pytest.approx(0.1, rel=0.1) and abs(drawn.mean().item()) < 0.01
    assert torch.equal(noisy[:, :, :4], image[:, :, :4])
    with pytest.raises(ValueError, match="every pixel removed"):
        noisy_linear_impute(image, torch.ones(1, 32, 32, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"removed must be \[N, H, W\]"):
        noisy_linear_impute(image, torch.ones(32, 32, dtype=torch.bool))


def _corner_score(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The brightness of the top-left 4x4 patch: the only thing this "model" reads."""
    return x[:, 0, :4, :4].mean(dim=(1, 2))


def test_road_removes_the_decisive_patch_first_or_last_as_the_map_says():
    image = torch.zeros(1, 3, 16, 16)
    image[:, :, :4, :4] = 1.0
    right = torch.zeros(1, 4, 4)
    right[0, 0, 0] = 1.0  # the decisive patch first, every other patch tied
    wrong = 1.0 - right  # the decisive patch last
    rows = torch.zeros(1, dtype=torch.long)
    curves = road_curves(_corner_score, image, torch.cat([right, wrong]), torch.cat([rows, rows]), noise=0.0)
    # most relevant first: the right map removes the patch at every share (imputed from zeros: 0),
    # the wrong one never; least relevant first the other way round
    assert curves["morf"][0].tolist() == [0.0] * 5 and curves["lerf"][0].tolist() == [1.0] * 5
    assert curves["morf"][1].tolist() == [1.0] * 5 and curves["lerf"][1].tolist() == [0.0] * 5
    scores = road_scores(curves)
    assert scores["road"].tolist() == [0.5, -0.5]
    assert scores["morf"].tolist() == [0.0, 1.0] and scores["lerf"].tolist() == [1.0, 0.0]


def _linear_model(weights: torch.Tensor):
    def score(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return (x * weights).flatten(1).sum(1)

    return score


def _saco_by_hand(sal: np.ndarray, effect_of_patch: np.ndarray, groups: int) -> float:
    """SaCo of one map on a model whose score is a sum over patches: rank the patches, cut the
    ranking into equal groups, compare every pair of groups."""
    order = np.argsort(-sal.ravel(), kind="stable")
    parts = np.array_split(order, groups)
    s = [sal.ravel()[p].sum() for p in parts]
    d = [effect_of_patch.ravel()[p].sum() for p in parts]
    num = den = 0.0
    for i, j in itertools.combinations(range(groups), 2):
        weight = abs(s[i] - s[j])
        num += weight if (d[i] >= d[j]) == (s[i] >= s[j]) else -weight
        den += weight
    return num / den if den else 0.0


def test_saco_equals_the_pairs_counted_by_hand():
    gen = torch.Generator().manual_seed(0)
    patch_weight = torch.rand(4, 4, generator=gen)  # each 4x4 patch's contribution to the score
    weights = patch_weight.repeat_interleave(4, 0).repeat_interleave(4, 1)[None, None]
    image = torch.ones(1, 3, 16, 16)
    effect = (patch_weight.double() * 16 * 3).numpy()  # the score lost when a patch goes to zero
    maps = torch.cat([patch_weight[None], -patch_weight[None], torch.ones(1, 4, 4), torch.rand(5, 4, 4, generator=gen)])
    rows = torch.zeros(len(maps), dtype=torch.long)
    got = saco(_linear_model(weights), image, torch.zeros_like(image), maps, rows, groups=8)
    assert got[0].item() == pytest.approx(1.0) and got[1].item() == pytest.approx(-1.0)  # right / reversed
    assert got[2].item() == 0.0  # no salience differences: no evidence either way
    for k in range(len(maps)):
        assert got[k].item() == pytest.approx(_saco_by_hand(maps[k].double().numpy(), effect, 8), abs=1e-6)
    with pytest.raises(ValueError, match="groups"):
        saco(_linear_model(weights), image, torch.zeros_like(image), maps, rows, groups=17)


def test_random_maps_score_near_zero_and_below_the_right_map():
    gen = torch.Generator().manual_seed(1)
    patch_weight = torch.rand(8, 8, generator=gen)
    weights = patch_weight.repeat_interleave(2, 0).repeat_interleave(2, 1)[None, None]
    images = torch.rand(1, 3, 16, 16, generator=gen)  # texture: what imputation smooths away

    def texture(x: torch.Tensor) -> torch.Tensor:  # each patch's texture, weighted
        smooth = F.avg_pool2d(x, 2).repeat_interleave(2, 2).repeat_interleave(2, 3)
        return ((x - smooth).abs() * weights).flatten(1).sum(1)

    full = texture(images)

    def proba(x: torch.Tensor) -> torch.Tensor:  # two classes; the first one's probability 0.5 on the image
        logit = 4 * (texture(x) / full - 1)
        return torch.stack([logit, -logit], 1).softmax(1)

    random = torch.rand(64, 8, 8, generator=gen)
    maps = {"right": patch_weight[None].expand(64, 8, 8), "random": random}
    scores = classifier_scores(proba, images.expand(64, -1, -1, -1), maps, torch.zeros(64, dtype=torch.long),
                               road=True)
    assert set(scores["right"]) == {"saco", "road", "road_morf", "road_lerf"}
    assert scores["right"]["saco"].mean() > 0.9 > 0.2 > abs(scores["random"]["saco"].mean().item())
    assert scores["right"]["road"].mean() > scores["random"]["road"].mean() + 0.02
    assert scores["right"]["road_morf"].mean() < scores["random"]["road_morf"].mean()
    assert scores["right"]["road_lerf"].mean() > scores["random"]["road_lerf"].mean()
