"""DETR training aids: denoising queries (DN-DETR / DINO), mixed query selection and
look-forward-twice (DINO), one-to-many query groups (Group DETR / H-DETR).

Masks and noise against hand-computed cases; the head's inference (and its matching queries in
training) unchanged by the training-only aids; a few training steps with each aid reduce the loss.
"""

from __future__ import annotations

import math

import pytest
import torch

from vision_attn import capture_attention
from vision_attn.boxes import box_cxcywh_to_xyxy
from vision_attn.models.detr import (
    DETRConfig,
    DETRHead,
    noise_boxes,
    noise_labels,
    query_group_mask,
)
from vision_attn.models.encoder import EncoderOutput
from vision_attn.tasks.detection import SetLossConfig

TARGETS = [{"labels": torch.tensor([0, 2]), "boxes": torch.tensor([[0.3, 0.3, 0.2, 0.2], [0.6, 0.6, 0.3, 0.2]])},
           {"labels": torch.tensor([1]), "boxes": torch.tensor([[0.5, 0.4, 0.4, 0.3]])}]


def _enc(b=2, grid=(3, 4), dim=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    return EncoderOutput(torch.randn(b, 1 + grid[0] * grid[1], dim, generator=g), 1, grid)


def _head(seed=0, **config):
    """A 3-class head on 24-wide tokens; ``config``: fields of its :class:`DETRConfig` besides the small sizes."""
    torch.manual_seed(seed)
    args = dict(num_queries=5, hidden_dim=32, num_layers=2, num_heads=4, dropout=0.0, box_refine=True)
    args.update(config)
    return DETRHead(24, 3, DETRConfig(**args))


def _assert_same_outputs(a: dict, b: dict, exact: bool = True):
    same = torch.equal if exact else (lambda x, y: torch.allclose(x, y, atol=1e-5))
    assert same(a["pred_logits"], b["pred_logits"]) and same(a["pred_boxes"], b["pred_boxes"])
    assert len(a["aux_outputs"]) == len(b["aux_outputs"])
    for x, y in zip(a["aux_outputs"], b["aux_outputs"], strict=True):
        assert same(x["pred_logits"], y["pred_logits"]) and same(x["pred_boxes"], y["pred_boxes"])
    if "cross_attn" in a or "cross_attn" in b:
        assert all(same(x, y) for x, y in zip(a["cross_attn"], b["cross_attn"], strict=True))


# ---------------------------------------------------------------------------------------------- masks


def test_mask_matching_o2m_groups_and_denoising_groups_hand_computed():
    # [m0 m1 | g0 g1 | d00 d01 | d10 d11]: 2 matching, 1 one-to-many group of 2, 2 denoising groups of 2
    expected = torch.tensor([
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [0, 0, 1, 1, 0, 0, 0, 0],
        [0, 0, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 1, 0, 0],  # a denoising group sees the matching queries and itself (DN-DETR)
        [1, 1, 0, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 0, 1, 1],
        [1, 1, 0, 0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    mask = query_group_mask(2, o2m_groups=1, dn_groups=2, dn_group_size=2)
    assert mask.dtype == torch.bool and torch.equal(mask, expected)


def test_mask_group_detr_vs_hybrid():
    group = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 1]], dtype=torch.bool)
    hybrid = torch.tensor([[1, 0, 0], [0, 1, 1], [0, 1, 1]], dtype=torch.bool)  # one one-to-many set
    assert torch.equal(query_group_mask(1, o2m_groups=2, o2m_mode="group"), group)
    assert torch.equal(query_group_mask(1, o2m_groups=2, o2m_mode="hybrid"), hybrid)
    assert torch.equal(query_group_mask(3), torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="o2m_mode must be one of"):
        query_group_mask(1, o2m_groups=1, o2m_mode="many")


def test_self_attention_never_reaches_blocked_queries_or_padding():
    """Captured self-attention probabilities of a training forward with every aid: exactly 0 on
    the entries the mask blocks and on the padding slot of the image with fewer targets."""
    head = _head(dn_groups=2, dn_negatives=True, o2m_groups=2, label_noise_ratio=0.5, box_noise_scale=0.4).train()
    with capture_attention(head, names=["layers.0.self_attn", "layers.1.self_attn"]) as attn:
        out = head(_enc(), targets=TARGETS)
    meta = out["dn_meta"]
    assert meta["groups"] == 2 and meta["group_size"] == 4  # 2 positive + 2 negative slots (at most 2 targets)
    q, t = 5, 5 + 2 * 5 + 2 * 4
    keep = query_group_mask(5, 2, "group", 2, 4)
    for w in attn:
        assert w.shape == (2, 4, t, t)
        assert torch.allclose(w.sum(-1), torch.ones(2, 4, t), atol=1e-5)
        assert torch.all(w[:, :, ~keep] == 0)
        assert torch.all(w[0][:, keep] > 0)  # image 0 has no padding: every allowed entry is used
        # image 1 has one target: slots 1 (positive) and 3 (negative) of each group are padding
        pad = [q + 10 + g * 4 + s for g in range(2) for s in (1, 3)]
        assert torch.all(w[1][:, :, pad] == 0)
        real = [c for c in range(t) if c not in pad]
        assert torch.all(w[1][:, :, real][:, keep[:, real]] > 0)


# ---------------------------------------------------------------------------------------------- noise


@pytest.mark.parametrize(("ratio", "num_classes"), [(0.4, 4), (0.5, 3), (1.0, 5)])
def test_label_noise_flips_half_the_ratio_uniformly_as_dino(ratio, num_classes):
    """DINO's ``prepare_for_cdn``: a label is redrawn with probability ``ratio * 0.5``, uniformly
    from the ``C`` classes (the same class one time in ``C``), so it changes with probability
    ``ratio / 2 * (1 - 1 / C)``; every other class equally often."""
    g = torch.Generator().manual_seed(0)
    n = 200_000
    labels = torch.arange(n) % num_classes
    noised = noise_labels(labels, num_classes=num_classes, ratio=ratio, generator=g)
    changed = noised != labels
    expected = ratio / 2 * (1 - 1 / num_classes)
    assert abs(float(changed.float().mean()) - expected) < 4 * (expected * (1 - expected) / n) ** 0.5 + 1e-4
    for c in range(num_classes):  # a changed label c goes to each of the other classes equally often
        to = torch.bincount(noised[changed & (labels == c)], minlength=num_classes).float()
        assert to[c] == 0 and torch.all((to / to.sum() - 1 / (num_classes - 1)).abs()[torch.arange(num_classes) != c]
                                        < 0.02)
    assert noised.min() >= 0 and noised.max() < num_classes
    assert torch.equal(noise_labels(labels[:10], num_classes, 0.0), labels[:10])


def test_box_noise_bounds_positive_and_negative():
    g = torch.Generator().manual_seed(0)
    n, scale = 4000, 0.4
    boxes = torch.tensor([0.5, 0.5, 0.2, 0.1]).repeat(n, 1)
    negative = torch.arange(n) >= n // 2
    noised = noise_boxes(boxes, scale, negative, generator=g)
    moved = (box_cxcywh_to_xyxy(noised) - box_cxcywh_to_xyxy(boxes)).abs()  # per corner coordinate
    half = torch.tensor([0.1, 0.05, 0.1, 0.05])
    pos, neg = moved[~negative] / half, moved[negative] / half
    assert pos.max() < scale + 1e-5 and pos.max() > 0.95 * scale  # |u| < 1 times scale times half size
    assert neg.min() > scale - 1e-5 and neg.max() < 2 * scale + 1e-5 and neg.min() < 1.05 * scale
    # centre shift at most scale * w / 2, size within [1 - scale, 1 + scale] times the original
    shift = (noised[~negative, :2] - boxes[~negative, :2]).abs()
    assert torch.all(shift <= scale * boxes[~negative, 2:] / 2 + 1e-6)
    ratio = noised[~negative, 2:] / boxes[~negative, 2:]
    assert ratio.min() >= 1 - scale - 1e-5 and ratio.max() <= 1 + scale + 1e-5
    assert ratio.min() < 1 - 0.9 * scale and ratio.max() > 1 + 0.9 * scale
    # clamped to the image
    edge = noise_boxes(torch.tensor([[0.05, 0.95, 0.1, 0.1]]).repeat(100, 1), 1.0, generator=g)
    assert torch.all(box_cxcywh_to_xyxy(edge) >= 0) and torch.all(box_cxcywh_to_xyxy(edge) <= 1)
    assert torch.equal(noise_boxes(boxes[:3], 0.0), boxes[:3])


# ---------------------------------------------------------------------------------------------- denoising queries


def test_denoising_layout_and_reconstruction_start():
    """Without noise the denoising queries start at the true boxes (the box heads start as
    "keep the reference"), and ``dn_meta`` pairs them with their targets by hand."""
    head = _head(dn_groups=2, dn_negatives=True, label_noise_ratio=0.0, box_noise_scale=0.0).train()
    out = head(_enc(), targets=TARGETS)
    meta = out["dn_meta"]
    (q0, t0), (q1, t1) = meta["positive"]
    assert q0.tolist() == [0, 1, 4, 5] and t0.tolist() == [0, 1, 0, 1]
    assert q1.tolist() == [0, 4] and t1.tolist() == [0, 0]
    assert [n.tolist() for n in meta["negative"]] == [[2, 3, 6, 7], [2, 6]]
    dn = out["dn_outputs"]
    assert dn["pred_logits"].shape == (2, 8, 4) and len(dn["aux_outputs"]) == 1
    for layer in [dn, *dn["aux_outputs"]]:
        assert torch.allclose(layer["pred_boxes"][0, q0], TARGETS[0]["boxes"][t0], atol=1e-5)
        assert torch.allclose(layer["pred_boxes"][0, [2, 3, 6, 7]], TARGETS[0]["boxes"][[0, 1, 0, 1]], atol=1e-5)
        assert torch.allclose(layer["pred_boxes"][1, q1], TARGETS[1]["boxes"][t1], atol=1e-5)
    plain = _head(dn_groups=3, label_noise_ratio=0.0, box_noise_scale=0.0).train()(_enc(), targets=TARGETS)
    assert plain["dn_meta"]["group_size"] == 2 and plain["dn_outputs"]["pred_boxes"].shape == (2, 6, 4)
    assert [n.numel() for n in plain["dn_meta"]["negative"]] == [0, 0]


# several targets per image, with different labels and boxes: a pairing of denoising queries with
# the wrong target (another of the same image, or another image's) changes every term
MANY_TARGETS = [
    {"labels": torch.tensor([2, 0]), "boxes": torch.tensor([[0.3, 0.3, 0.2, 0.2], [0.7, 0.6, 0.3, 0.2]])},
    {"labels": torch.tensor([1, 0, 2]),
     "boxes": torch.tensor([[0.5, 0.4, 0.4, 0.3], [0.2, 0.75, 0.2, 0.3], [0.8, 0.2, 0.25, 0.2]])},
]


@pytest.mark.parametrize("focal", [False, True])
def test_denoising_criterion_pairs_each_query_with_its_own_target(focal):
    """The head's ``dn_meta`` through the set criterion, two and three targets per image: outputs
    written by hand from the layout (group ``g`` of size ``2 * 3``: slot ``k`` reconstructs target
    ``k``, slot ``3 + k`` is its negative) are perfect, so the box terms are 0 and the class term
    is the hand-computed loss of rows scoring 4 on the right class and 0 elsewhere."""
    from vision_attn.losses.matcher import HungarianMatcher
    from vision_attn.losses.set_criterion import SetCriterion

    head = _head(dn_groups=2, dn_negatives=True, focal=focal, label_noise_ratio=0.0, box_noise_scale=0.0).train()
    out = head(_enc(), targets=MANY_TARGETS)
    meta = out["dn_meta"]
    assert meta["groups"] == 2 and meta["group_size"] == 6
    c = 3
    logits = torch.full((2, 12, c if focal else c + 1), 7.0)  # padding rows: left out of every term
    boxes = torch.full((2, 12, 4), 0.5)
    for i, t in enumerate(MANY_TARGETS):
        for g in range(2):
            for k, (label, box) in enumerate(zip(t["labels"], t["boxes"], strict=True)):
                positive, negative = g * 6 + k, g * 6 + 3 + k
                logits[i, positive] = 0.0
                logits[i, positive, label] = 4.0
                boxes[i, positive] = box
                logits[i, negative] = 0.0
                if not focal:
                    logits[i, negative, c] = 4.0  # "no object"
                boxes[i, negative] = torch.tensor([0.1, 0.1, 0.05, 0.05])
    dn = {"pred_logits": logits, "pred_boxes": boxes,
          "aux_outputs": [{"pred_logits": logits.clone(), "pred_boxes": boxes.clone()}]}
    main = {k: out[k] for k in ("pred_logits", "pred_boxes", "aux_outputs")}
    crit = SetCriterion(c, HungarianMatcher(focal=focal), eos_coef=0.1, focal=focal, dn=True)
    terms = crit({**main, "dn_outputs": dn, "dn_meta": meta}, MANY_TARGETS, across_processes=False)
    if focal:  # sigmoid focal loss (alpha 0.25, gamma 2) summed over rows and classes, over 5 boxes x 2 groups
        def fl(x, y, a=0.25, gamma=2.0):
            p = 1 / (1 + math.exp(-x))
            pt, at = (p, a) if y else (1 - p, 1 - a)
            return -at * (1 - pt) ** gamma * math.log(pt)

        positives, negatives = 5 * 2, 5 * 2
        expected = (positives * (fl(4.0, 1) + (c - 1) * fl(0.0, 0)) + negatives * c * fl(0.0, 0)) / (5 * 2)
    else:  # every row: -log softmax = log(e^4 + 3) - 4 (the class weights then cancel in the mean)
        expected = math.log(math.exp(4.0) + 3) - 4.0
    for suffix in ("", "_0"):
        assert terms[f"loss_dn_ce{suffix}"].item() == pytest.approx(expected, rel=1e-5)
        assert terms[f"loss_dn_bbox{suffix}"].item() == pytest.approx(0.0, abs=1e-7)
        assert terms[f"loss_dn_giou{suffix}"].item() == pytest.approx(0.0, abs=1e-6)


def test_denoising_with_no_targets_in_the_batch_keeps_the_graph():
    head = _head(dn_groups=2).train()
    empty = [{"labels": torch.zeros(0, dtype=torch.int64), "boxes": torch.zeros(0, 4)}] * 2
    out = head(_enc(), targets=empty)
    assert out["dn_outputs"]["pred_logits"].shape == (2, 0, 4)
    (out["pred_boxes"].sum() + out["dn_outputs"]["pred_logits"].sum()).backward()
    assert head.label_embed.weight.grad is not None  # used (zero gradient), so DDP sees every parameter


AIDS = {
    "dn": dict(dn_groups=3),
    "dn_negatives": dict(dn_groups=2, dn_negatives=True),
    "o2m_group": dict(o2m_groups=2),
    "o2m_hybrid": dict(o2m_groups=2, o2m_mode="hybrid"),
    "all_training_only": dict(dn_groups=2, dn_negatives=True, o2m_groups=2, look_forward_twice=True),
}


@pytest.mark.parametrize("focal", [False, True])
@pytest.mark.parametrize("name", list(AIDS))
def test_inference_is_exactly_the_model_without_the_training_aids(name, focal):
    """The same weights with the training-only aids on and off: identical eval outputs (targets
    are ignored at inference); the aids' own parameters are the only extra weights."""
    on = _head(focal=focal, **AIDS[name]).eval()
    off = _head(seed=1, focal=focal).eval()
    missing, unexpected = off.load_state_dict(on.state_dict(), strict=False)
    assert missing == []
    assert unexpected and set(unexpected) <= {"label_embed.weight", "o2m_anchors"}
    enc = _enc()
    with torch.no_grad():
        a = on(enc, need_weights=True, targets=TARGETS)
        b = off(enc, need_weights=True)
    assert set(a) == set(b) == {"pred_logits", "pred_boxes", "aux_outputs", "cross_attn"}
    _assert_same_outputs(a, b)


@pytest.mark.parametrize("box_refine", [False, True])
def test_o2m_groups_without_box_refine_and_inference_of_the_first_group(box_refine):
    on = _head(box_refine=box_refine, o2m_groups=2).eval()
    off = _head(seed=1, box_refine=box_refine).eval()
    _, unexpected = off.load_state_dict(on.state_dict(), strict=False)
    assert unexpected == ["o2m_anchors" if box_refine else "o2m_query_embed"]
    with torch.no_grad():
        _assert_same_outputs(on(_enc()), off(_enc()))
    on.train()
    out = on(_enc())
    assert len(out["o2m_outputs"]) == 2 and out["o2m_outputs"][1]["pred_boxes"].shape == (2, 5, 4)


@pytest.mark.parametrize("name", list(AIDS))
def test_training_matching_queries_do_not_see_the_extra_queries(name):
    """In training too the matching queries compute what they compute alone (the mask hides the
    denoising and one-to-many queries), up to float rounding of the longer attention."""
    on = _head(**AIDS[name]).train()
    off = _head(seed=1).train()
    off.load_state_dict(on.state_dict(), strict=False)
    a = on(_enc(), need_weights=True, targets=TARGETS)
    b = off(_enc(), need_weights=True, targets=TARGETS)
    assert "o2m_outputs" in a or "dn_outputs" in a
    assert a["cross_attn"][0].shape == b["cross_attn"][0].shape == (2, 4, 5, 12)
    _assert_same_outputs(a, b, exact=False)


# --------------------------------------------------------------------------- DINO's query selection, look forward twice


def test_look_forward_twice_same_values_gradient_reaches_the_previous_box_head():
    on = _head(look_forward_twice=True).train()
    off = _head(seed=1).train()
    off.load_state_dict(on.state_dict())
    for head in (on, off):  # non-zero box deltas, so that the refinement is not the identity
        for box_head in head.box_heads:
            torch.nn.init.normal_(box_head.layers[-1].weight, std=0.1)
    off.load_state_dict(on.state_dict())
    a, b = on(_enc()), off(_enc())
    _assert_same_outputs(a, b)  # the forward values are plain refinement's
    a["pred_boxes"].sum().backward()  # the last layer's (layer 1's) boxes only
    b["pred_boxes"].sum().backward()
    assert on.box_heads[0].layers[-1].weight.grad.abs().sum() > 0  # layer 0's head learns from layer 1
    assert off.box_heads[0].layers[-1].weight.grad is None  # plain refinement detaches it
    assert torch.equal(on.box_heads[1].layers[-1].weight.grad, off.box_heads[1].layers[-1].weight.grad)


@pytest.mark.parametrize("focal", [False, True])
def test_query_selection_anchors_are_the_top_tokens_proposals(focal):
    head = _head(query_selection=True, focal=focal, num_queries=4).eval()
    assert not hasattr(head, "anchors")
    enc = _enc(b=2, grid=(2, 4))
    with torch.no_grad():
        out = head(enc)
        logits = head.enc_class_head(head.enc_norm(head.enc_proj(head.input_proj(enc.patch_tokens))))
    score = logits.amax(-1) if focal else logits.softmax(-1)[..., :-1].amax(-1)
    top = score.topk(4, dim=1).indices
    # one box per patch, row-major: centred on it, two patches wide and high (grid 2 x 4)
    proposals = torch.tensor([[(c + 0.5) / 4, (r + 0.5) / 2, 0.5, 1.0] for r in range(2) for c in range(4)])
    proposals = proposals.clamp(1e-5, 1 - 1e-5)
    enc_out = out["enc_outputs"]
    assert enc_out["pred_logits"].shape == (2, 4, 3 if focal else 4)
    for i in range(2):
        assert torch.allclose(enc_out["pred_boxes"][i], proposals[top[i]], atol=1e-5)  # the box head starts at 0
        assert torch.allclose(enc_out["pred_logits"][i], logits[i, top[i]])
        # layer 0 starts from the selected boxes (its box head too starts at 0)
        assert torch.allclose(out["aux_outputs"][0]["pred_boxes"][i], enc_out["pred_boxes"][i], atol=1e-5)


def test_query_selection_anchors_are_detached_and_checked():
    head = _head(query_selection=True).train()
    out = head(_enc())
    out["pred_boxes"].sum().backward()  # the decoder's boxes do not train the token heads
    assert head.enc_box_head.layers[-1].weight.grad is None and head.query_content.weight.grad is not None
    out = head(_enc())
    out["enc_outputs"]["pred_boxes"].sum().backward()
    assert head.enc_box_head.layers[-1].weight.grad is not None
    with pytest.raises(ValueError, match="query_selection picks num_queries=5 of the 4 patch tokens"):
        head(_enc(grid=(2, 2)))


@pytest.mark.parametrize("focal", [False, True])
def test_dense_encoder_is_training_only_and_adds_no_weights(focal):
    """Co-DETR-style dense supervision of the tokens: every token's logits and box in training
    (the ones query selection scores), nothing at inference, the same weights as without it."""
    on = _head(query_selection=True, dense_encoder=True, focal=focal)
    off = _head(seed=1, query_selection=True, focal=focal)
    off.load_state_dict(on.state_dict())  # strict: no extra parameters
    enc = _enc()
    with torch.no_grad():
        _assert_same_outputs(on.eval()(enc, need_weights=True), off.eval()(enc, need_weights=True))
        assert "dense_outputs" not in on(enc)
        out = on.train()(enc)
    dense = out["dense_outputs"]
    assert dense["pred_logits"].shape == (2, 12, 3 if focal else 4) and dense["pred_boxes"].shape == (2, 12, 4)
    assert torch.allclose(dense["centres"][1, 5], torch.tensor([(1 + 0.5) / 4, (1 + 0.5) / 3]))  # row 1, column 1
    top = out["enc_outputs"]["pred_logits"]  # the selected tokens are rows of the dense outputs
    assert all(any(torch.equal(row, d) for d in dense["pred_logits"][0]) for row in top[0])
    with pytest.raises(ValueError, match="dense_encoder .* set query_selection=True"):
        _head(dense_encoder=True)


@pytest.mark.parametrize("switch", [dict(dn_groups=1), dict(query_selection=True), dict(look_forward_twice=True)])
def test_box_refine_required(switch):
    with pytest.raises(ValueError, match="set box_refine=True"):
        _head(box_refine=False, **switch)


def test_aids_embeddings_are_not_weight_decayed():
    from vision_attn.tasks.optim import no_weight_decay_names

    head = _head(dn_groups=2, query_selection=True, o2m_groups=2)
    names = no_weight_decay_names(torch.nn.Sequential(head))
    assert {"0.label_embed.weight", "0.query_content.weight", "0.o2m_content"} <= names
    assert "0.enc_proj.weight" not in names


# ---------------------------------------------------------------------------------------------- training


SWITCHES = {
    "dn": dict(dn_groups=3),
    "dn_negatives_softmax": dict(dn_groups=2, dn_negatives=True, focal=False),
    "query_selection": dict(query_selection=True),
    "look_forward_twice": dict(look_forward_twice=True),
    "o2m_group": dict(o2m_groups=2),
    "o2m_hybrid": dict(o2m_groups=2, o2m_mode="hybrid", o2m_repeat=2),
    "o2m_plain_detr": dict(o2m_groups=2, box_refine=False, focal=False),
    "all": dict(dn_groups=2, dn_negatives=True, query_selection=True, look_forward_twice=True, o2m_groups=2),
    "dense_encoder": dict(query_selection=True, dense_encoder=True),
}


@pytest.mark.parametrize("name", list(SWITCHES))
def test_a_few_training_steps_with_each_switch_reduce_the_loss(name):
    """Image 32, encoder depth 2: the task's own forward (targets passed, as in its training
    step) and loss, 12 AdamW steps on one batch; the total loss and the matching queries' loss
    both fall, and every parameter is trained."""
    from vision_attn import create_encoder
    from vision_attn.tasks import DetectionTask

    torch.manual_seed(0)
    enc = create_encoder("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)
    kw = dict(box_refine=True, focal=True)
    kw.update(SWITCHES[name])
    loss = SetLossConfig(o2m_repeat=kw.pop("o2m_repeat")) if "o2m_repeat" in kw else SetLossConfig()
    task = DetectionTask(enc, class_names=["a", "b", "c"], loss=loss,
                         head=DETRConfig(num_queries=6, hidden_dim=32, num_layers=2, num_heads=2, **kw)).train()
    images = torch.randn(4, 3, 32, 32)
    targets = [{"labels": torch.tensor([i % 3, (i + 1) % 3][: 1 + i % 2]),
                "boxes": torch.tensor([[0.3, 0.3, 0.2, 0.3], [0.7, 0.6, 0.3, 0.2]])[: 1 + i % 2]} for i in range(4)]
    opt = torch.optim.AdamW(task.parameters(), lr=2e-3)
    totals, mains = [], []
    for _ in range(12):
        out = task(images, targets=targets)
        terms = task.criterion(out, targets, across_processes=False)
        loss = task.criterion.total(terms, len(out["aux_outputs"]))
        main = sum(task.criterion.base_weights[k] * terms[k] for k in ("loss_ce", "loss_bbox", "loss_giou"))
        totals.append(float(loss.detach()))
        mains.append(float(main.detach()))
        opt.zero_grad()
        loss.backward()
        if len(totals) == 1:
            untrained = [n for n, p in task.named_parameters() if p.grad is None]
            assert untrained == [], untrained
        opt.step()
    assert totals[-1] < 0.8 * totals[0], totals
    assert mains[-1] < 0.8 * mains[0], mains
    aids = {"dn_groups": "loss_dn_ce", "query_selection": "loss_enc_ce", "o2m_groups": "loss_o2m_ce",
            "dense_encoder": "loss_dense_ce"}
    for switch, term in aids.items():
        assert (term in terms) == (switch in SWITCHES[name])
