"""Hungarian matcher: optimal (brute force on small cases), batched == per image, empty targets."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy.optimize import linear_sum_assignment

from vision_attn.losses.matcher import HungarianMatcher


def _targets(gs, c, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in gs:
        cxcy = torch.rand(n, 2, generator=g) * 0.6 + 0.2
        wh = torch.rand(n, 2, generator=g) * 0.3 + 0.05
        out.append({"labels": torch.randint(0, c, (n,), generator=g), "boxes": torch.cat([cxcy, wh], 1)})
    return out


def _preds(b, q, c, seed):
    g = torch.Generator().manual_seed(seed)
    cxcy = torch.rand(b, q, 2, generator=g) * 0.6 + 0.2
    wh = torch.rand(b, q, 2, generator=g) * 0.3 + 0.05
    return torch.randn(b, q, c + 1, generator=g), torch.cat([cxcy, wh], -1)


@pytest.mark.parametrize("focal", [False, True])
def test_matching_is_optimal_on_brute_forced_cases(focal):
    matcher = HungarianMatcher(focal=focal)
    logits, boxes = _preds(3, 5, 4, seed=0)
    targets = _targets([3, 1, 4], 4, seed=1)
    result = matcher(logits, boxes, targets)
    for b, (pi, ti) in enumerate(result):
        cost = matcher.cost_matrix(logits[b], boxes[b], targets[b]["labels"], targets[b]["boxes"])
        g = len(targets[b]["labels"])
        best = min(sum(cost[p, t] for t, p in enumerate(perm)) for perm in itertools.permutations(range(5), g))
        assert len(pi) == len(ti) == g
        assert torch.isclose(cost[pi, ti].sum(), torch.as_tensor(best), atol=1e-5)
        assert sorted(ti.tolist()) == list(range(g))  # every target matched exactly once
        assert pi.tolist() == sorted(pi.tolist())


def test_batched_equals_per_image_and_empty_targets():
    matcher = HungarianMatcher()
    logits, boxes = _preds(3, 6, 3, seed=2)
    targets = _targets([2, 0, 3], 3, seed=3)
    batched = matcher(logits, boxes, targets)
    for b in range(3):
        single = matcher(logits[b : b + 1], boxes[b : b + 1], [targets[b]])[0]
        assert torch.equal(single[0], batched[b][0]) and torch.equal(single[1], batched[b][1])
    assert batched[1][0].numel() == 0 and batched[1][0].dtype == torch.int64
    for b in (0, 2):  # the batch's cost blocks are each image's own cost matrix
        cost = matcher.cost_matrix(logits[b], boxes[b], targets[b]["labels"], targets[b]["boxes"]).numpy()
        rows, cols = linear_sum_assignment(cost)
        assert batched[b][0].tolist() == rows.tolist() and batched[b][1].tolist() == cols.tolist()
    none = matcher(logits[:2], boxes[:2], [targets[1], targets[1]])  # no target in the whole batch
    assert all(p.numel() == 0 and t.numel() == 0 for p, t in none)


def test_perfect_predictions_are_matched_to_themselves():
    targets = _targets([4], 3, seed=4)
    boxes = targets[0]["boxes"][[2, 0, 3, 1]].unsqueeze(0)
    logits = torch.full((1, 4, 4), -5.0)
    for q, t in enumerate([2, 0, 3, 1]):
        logits[0, q, targets[0]["labels"][t]] = 5.0
    pi, ti = HungarianMatcher()(logits, boxes, targets)[0]
    assert ti.tolist() == [2, 0, 3, 1] and pi.tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="all matcher costs"):
        HungarianMatcher(0, 0, 0)


def test_focal_cost_keeps_ordering_confident_mistakes():
    """The focal class cost comes from torchvision's sigmoid focal loss on the logits: a query
    sure that the object is absent (logit -60) costs more than a less sure one (-30), where
    ``-log(p + 1e-8)`` saturated both at the same value."""
    matcher = HungarianMatcher(cost_bbox=0, cost_giou=0, focal=True)
    logits = torch.tensor([[-30.0, 0.0], [-60.0, 0.0]])
    boxes = torch.tensor([[0.5, 0.5, 0.2, 0.2]] * 2)
    cost = matcher.cost_matrix(logits, boxes, torch.tensor([0]), boxes[:1])
    assert cost[1, 0] - cost[0, 0] == pytest.approx(0.25 * 30, rel=1e-3)  # alpha * (60 - 30)
    with pytest.raises(ValueError, match="focal_alpha 2"):
        HungarianMatcher(focal=True, focal_alpha=2)
