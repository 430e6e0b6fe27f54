"""Sanity checks by cascading model randomisation (Adebayo et al. 2018): Spearman against scipy,
the real model untouched, a weight-blind method scores 1, a weight-dependent one less."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr
from torch import nn

from vision_attn import create_encoder
from vision_attn.explain.methods import METHODS, register_method
from vision_attn.explain.sanity import cascading_randomisation, model_cascade, sanity_check, spearman
from vision_attn.tasks import ClassificationTask

from .conftest import TINY_VIT


def test_spearman_equals_scipy_with_ties():
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(6, 4, 4, generator=gen)
    b = a + 0.3 * torch.rand(6, 4, 4, generator=gen)
    a[0, :2] = 0.5  # ties
    b[1] = torch.randint(0, 3, (4, 4), generator=gen).float()  # many ties
    b[2] = -a[2]
    ours = spearman(a, b)
    ref = [spearmanr(a[i].flatten().numpy(), b[i].flatten().numpy()).statistic for i in range(6)]
    np.testing.assert_allclose(ours.numpy(), ref, atol=1e-12)
    assert ours[2] == pytest.approx(-1.0)
    flat = torch.zeros(2, 3, 3)
    assert spearman(flat, flat).tolist() == [1.0, 1.0]  # the same constant map: unchanged
    assert spearman(flat, a[:2, :3, :3]).tolist() == [0.0, 0.0]


def _task() -> ClassificationTask:
    torch.manual_seed(0)
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=list("abc"))
    nn.init.normal_(task.head.fc.weight, std=1.0)
    return task.eval()


def test_cascade_randomises_top_block_first_and_leaves_the_model_alone():
    task = _task()
    before = {k: v.clone() for k, v in task.encoder.state_dict().items()}
    steps = []
    for step, enc in cascading_randomisation(task.encoder, seed=1):
        changed = {k for k, v in enc.state_dict().items() if not torch.equal(v, before[k])}
        steps.append((step, changed))
    assert [s for s, _ in steps] == ["block1", "block0", "all"]
    assert steps[0][1] and all(".blocks.1." in k for k in steps[0][1])  # the top block only
    assert any(".blocks.0." in k for k in steps[1][1]) and steps[0][1] <= steps[1][1]
    assert any("pos_embed" in k for k in steps[2][1]) and any("patch_embed" in k for k in steps[2][1])
    assert all(torch.equal(v, before[k]) for k, v in task.encoder.state_dict().items())  # untouched
    again = dict(cascading_randomisation(task.encoder, seed=1))["all"].state_dict()
    assert all(torch.equal(v, steps_v) for v, steps_v in zip(again.values(), enc.state_dict().values(),
                                                             strict=True))  # seeded


def test_model_cascade_randomises_the_head_first_then_the_encoder():
    task = _task()
    nn.init.constant_(task.head.fc.bias, 0.5)  # re-initialised to 0
    enc_before = {k: v.clone() for k, v in task.encoder.state_dict().items()}
    head_before = {k: v.clone() for k, v in task.head.state_dict().items()}
    steps = [(step, {k for k, v in enc.state_dict().items() if not torch.equal(v, enc_before[k])},
              {k for k, v in head.state_dict().items() if not torch.equal(v, head_before[k])}, head)
             for step, enc, head in model_cascade(task.encoder, task.head, seed=1)]
    assert [s[0] for s in steps] == ["head", "block1", "block0", "all"]
    assert not steps[0][1] and steps[0][2] == set(head_before)  # the head alone, every parameter of it
    assert all(s[3] is steps[0][3] and s[2] == set(head_before) for s in steps)  # the random head stays
    assert steps[1][1] and all(".blocks.1." in k for k in steps[1][1])  # then the encoder, top block first
    assert all(torch.equal(v, head_before[k]) for k, v in task.head.state_dict().items())  # untouched
    assert all(torch.equal(v, enc_before[k]) for k, v in task.encoder.state_dict().items())
    w = steps[0][3].fc.weight
    assert w.abs().max() <= 2 * 0.02 and 0.01 < w.std() < 0.02  # timm's truncated N(0, 0.02^2)


def test_without_the_cascade_only_the_fully_randomised_model_with_the_cascades_weights():
    task = _task()
    *_, (step, enc, head) = model_cascade(task.encoder, task.head, seed=1)
    last = {k: v.clone() for k, v in [*enc.state_dict().items(), *head.state_dict().items()]}
    alone = list(model_cascade(task.encoder, task.head, seed=1, cascade=False))
    assert step == "all" and [s for s, *_ in alone] == ["all"]
    got = [*alone[0][1].state_dict().items(), *alone[0][2].state_dict().items()]
    assert [k for k, _ in got] == list(last) and all(torch.equal(v, last[k]) for k, v in got)
    assert not torch.equal(alone[0][1].state_dict()["model.pos_embed"], task.encoder.state_dict()["model.pos_embed"])
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    target = torch.tensor([0, 1, 2])
    every = sanity_check(task, images, ["relevance", "rollout"], target, seed=1)
    only = sanity_check(task, images, ["relevance", "rollout"], target, seed=1, cascade=False)
    assert {m: list(v) for m, v in only.items()} == {"relevance": ["all"], "rollout": ["all"]}
    for m in only:
        torch.testing.assert_close(only[m]["all"], every[m]["all"], rtol=0, atol=0)


def test_weight_blind_method_scores_one_and_relevance_lower():
    @register_method("fixed_map", description="test: the same map whatever the model")
    def _fixed(x):
        ramp = torch.arange(x.grid[0] * x.grid[1], dtype=torch.float32).view(1, *x.grid)
        return ramp.expand(x.images.shape[0], -1, -1).to(x.images.device)

    try:
        task = _task()
        images = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        target = torch.tensor([0, 1, 2, 0])
        out = sanity_check(task, images, ["fixed_map", "relevance", "random"], target, seed=0)
    finally:
        METHODS.pop("fixed_map")
    assert list(out["relevance"]) == ["head", "block1", "block0", "all"]
    assert all(torch.allclose(v, torch.ones(4, dtype=torch.float64)) for v in out["fixed_map"].values())
    assert all(torch.allclose(v, torch.ones(4, dtype=torch.float64)) for v in out["random"].values())  # same noise
    assert out["relevance"]["all"].mean() < 0.8
    assert out["relevance"]["head"].mean() < 0.99  # the class's relevance follows the classifier's weights
