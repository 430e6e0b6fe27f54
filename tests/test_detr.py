"""DETR head: output contract, auxiliary outputs, cross-attention per query, post-processing."""

from __future__ import annotations

import pytest
import torch

from vision_attn import capture_attention
from vision_attn.models.detr import DETRConfig, DETRHead, post_process
from vision_attn.models.encoder import EncoderOutput


def _enc(b=2, grid=(3, 4), dim=24, prefix=1):
    return EncoderOutput(torch.randn(b, prefix + grid[0] * grid[1], dim), prefix, grid)


@pytest.mark.parametrize("box_refine", [False, True])
@pytest.mark.parametrize("focal", [False, True])
def test_output_contract(box_refine, focal):
    torch.manual_seed(0)
    head = DETRHead(24, num_classes=5, config=DETRConfig(num_queries=7, hidden_dim=32, num_layers=3, num_heads=4,
                                                         focal=focal, box_refine=box_refine, dropout=0.1))
    head.train()
    out = head(_enc(), need_weights=True)
    c = 5 if focal else 6
    assert out["pred_logits"].shape == (2, 7, c) and out["pred_boxes"].shape == (2, 7, 4)
    assert torch.all((out["pred_boxes"] >= 0) & (out["pred_boxes"] <= 1))
    assert len(out["aux_outputs"]) == 2
    assert all(a["pred_boxes"].shape == (2, 7, 4) for a in out["aux_outputs"])
    assert len(out["cross_attn"]) == 3 and out["cross_attn"][-1].shape == (2, 4, 7, 12)
    assert torch.allclose(out["cross_attn"][-1].sum(-1), torch.ones(2, 4, 7), atol=1e-5)
    (out["pred_boxes"].sum() + out["pred_logits"].sum()).backward()


def test_box_refine_starts_from_the_anchor_boxes():
    head = DETRHead(24, 3, config=DETRConfig(num_queries=4, hidden_dim=32, num_layers=2, num_heads=4, box_refine=True,
                                             dropout=0.1)).eval()
    out = head(_enc(b=1))
    assert torch.allclose(out["pred_boxes"][0], head.anchors.clamp(1e-5, 1 - 1e-5), atol=1e-5)


def test_cross_attention_is_capturable_per_query():
    head = DETRHead(24, 3, DETRConfig(num_queries=5, hidden_dim=32, num_layers=2, num_heads=4, dropout=0.1)).eval()
    enc = _enc(b=1)
    ref = head(enc, need_weights=True)["cross_attn"]
    with capture_attention(head, names=["layers.0.cross_attn", "layers.1.cross_attn"]) as attn:
        head(enc)
    assert len(attn) == 2
    assert torch.allclose(attn[1], ref[1], atol=1e-6)


def test_post_process_gives_pixels_of_the_original_non_square_image():
    logits = torch.full((1, 2, 4), -10.0)
    logits[0, 0, 2] = 10.0  # query 0: class 2, sure
    logits[0, 1, 3] = 10.0  # query 1: "no object"
    boxes = torch.tensor([[[0.5, 0.25, 0.5, 0.5], [0.5, 0.5, 1.0, 1.0]]])
    # Original image 200 high, 400 wide (the model saw it resized to a square).
    det = post_process({"pred_logits": logits, "pred_boxes": boxes}, torch.tensor([[200, 400]]), top_k=3)[0]
    assert det["labels"][0] == 2 and det["queries"][0] == 0 and det["scores"][0] > 0.99
    assert torch.allclose(det["boxes"][0], torch.tensor([100.0, 0.0, 300.0, 100.0]))
    # DETR protocol: one detection per query, so 2 (not top_k=3) for 2 queries
    assert len(det["scores"]) == 2 and torch.all(det["scores"][:-1] >= det["scores"][1:])
    foc = post_process({"pred_logits": logits[..., :3], "pred_boxes": boxes}, torch.tensor([[200, 400]]), 2, focal=True)
    assert foc[0]["labels"][0] == 2


def test_post_process_protocols_softmax_one_class_per_query_focal_top_pairs():
    """Hand-computed: softmax (DETR) keeps each query's argmax real class; focal (Deformable
    DETR) keeps the top-k (query, class) pairs, so one query may appear twice."""
    import math

    boxes = torch.tensor([[[0.5, 0.5, 0.2, 0.2], [0.25, 0.25, 0.1, 0.1], [0.75, 0.75, 0.5, 0.5]]])
    size = torch.tensor([[100, 100]])
    # softmax probabilities (class 0, class 1, no object) per query
    probs = torch.tensor([[[0.5, 0.4, 0.1], [0.3, 0.1, 0.6], [0.05, 0.15, 0.8]]])
    det = post_process({"pred_logits": probs.log(), "pred_boxes": boxes}, size, top_k=2)[0]
    # pairs would give (q0, c0, .5), (q0, c1, .4); DETR gives (q0, c0, .5), (q1, c0, .3)
    assert det["queries"].tolist() == [0, 1] and det["labels"].tolist() == [0, 0]
    assert torch.allclose(det["scores"], torch.tensor([0.5, 0.3]))
    assert torch.allclose(det["boxes"], torch.tensor([[40.0, 40.0, 60.0, 60.0], [20.0, 20.0, 30.0, 30.0]]))
    every = post_process({"pred_logits": probs.log(), "pred_boxes": boxes}, size, top_k=100)[0]
    assert every["queries"].tolist() == [0, 1, 2] and every["labels"].tolist() == [0, 0, 1]
    assert torch.allclose(every["scores"], torch.tensor([0.5, 0.3, 0.15]))
    # focal: sigmoid probabilities (class 0, class 1) per query
    sig = torch.tensor([[[0.9, 0.8], [0.7, 0.1], [0.2, 0.3]]])
    logits = torch.log(sig / (1 - sig))
    foc = post_process({"pred_logits": logits, "pred_boxes": boxes}, size, top_k=3, focal=True)[0]
    assert foc["queries"].tolist() == [0, 0, 1] and foc["labels"].tolist() == [0, 1, 0]
    assert torch.allclose(foc["scores"], torch.tensor([0.9, 0.8, 0.7]))
    assert math.isclose(float(foc["boxes"][1, 0]), 40.0, abs_tol=1e-4)


def test_query_attention_maps_last_and_mean():
    from vision_attn.explain.detection import query_attention_maps

    torch.manual_seed(0)
    layers = [torch.softmax(torch.randn(1, 2, 4, 6), -1) for _ in range(3)]
    last = query_attention_maps(layers, torch.tensor([2, 0]), (2, 3), "last")
    row = layers[-1][0].mean(0)[2].reshape(2, 3)
    assert last.shape == (2, 2, 3) and torch.allclose(last[0], row / row.max())
    mean = query_attention_maps(layers, torch.tensor([2]), (2, 3), "mean")
    row = torch.stack([a[0].mean(0)[2] for a in layers]).mean(0).reshape(2, 3)
    assert torch.allclose(mean[0], row / row.max())


# --- the training aids switched off leave the plain head exactly ------------------------------------


def _plain_head_forward(head: DETRHead, enc: EncoderOutput) -> dict:
    """The head's forward without any training aid (no denoising, query selection, query groups
    or look-forward-twice), from its own modules."""
    from vision_attn.models.detr import _box_sine_embedding, _inverse_sigmoid
    from vision_attn.models.layers import sine_position_embedding_2d

    memory = head.input_proj(enc.patch_tokens)
    b = memory.shape[0]
    memory_pos = sine_position_embedding_2d(enc.grid, head.hidden_dim).unsqueeze(0)
    x = memory.new_zeros(b, head.num_queries, head.hidden_dim)
    reference = head.anchors.unsqueeze(0).expand(b, -1, -1) if head.box_refine else None
    outputs, weights = [], []
    for i, layer in enumerate(head.layers):
        if head.box_refine:
            query_pos = head.pos_mlp(_box_sine_embedding(reference, head.hidden_dim))
        else:
            query_pos = head.query_embed.weight.unsqueeze(0)
        x, w = layer(x, memory, query_pos=query_pos, memory_pos=memory_pos, need_weights=True)
        weights.append(w)
        if head.box_refine or i == len(head.layers) - 1 or head.training:
            k = i if head.box_refine else 0
            h = head.norm(x)
            logits, delta = head.class_heads[k](h), head.box_heads[k](h)
            boxes = (delta + _inverse_sigmoid(reference)).sigmoid() if head.box_refine else delta.sigmoid()
            outputs.append({"pred_logits": logits, "pred_boxes": boxes})
            if head.box_refine:
                reference = boxes.detach()
    return {**outputs[-1], "aux_outputs": outputs[:-1], "cross_attn": weights}


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("box_refine", [False, True])
@pytest.mark.parametrize("focal", [False, True])
def test_switches_off_is_exactly_the_plain_head(training, box_refine, focal):
    torch.manual_seed(0)
    head = DETRHead(24, 5, config=DETRConfig(num_queries=7, hidden_dim=32, num_layers=3, num_heads=4, dropout=0.0,
                                             focal=focal, box_refine=box_refine)).train(training)
    names = {n.split(".")[0] for n, _ in head.named_parameters()}
    assert names == {"input_proj", "layers", "norm", "class_heads", "box_heads"} | (
        {"anchors", "pos_mlp"} if box_refine else {"query_embed"})
    enc = _enc()
    targets = [{"labels": torch.tensor([1]), "boxes": torch.tensor([[0.5, 0.5, 0.2, 0.2]])}] * 2
    out = head(enc, need_weights=True, targets=targets)  # targets are unused without denoising
    ref = _plain_head_forward(head, enc)
    assert set(out) == set(ref)
    assert torch.equal(out["pred_logits"], ref["pred_logits"]) and torch.equal(out["pred_boxes"], ref["pred_boxes"])
    assert len(out["aux_outputs"]) == len(ref["aux_outputs"]) == (2 if box_refine or training else 0)
    for a, b in zip(out["aux_outputs"], ref["aux_outputs"], strict=True):
        assert torch.equal(a["pred_logits"], b["pred_logits"]) and torch.equal(a["pred_boxes"], b["pred_boxes"])
    assert all(torch.equal(a, b) for a, b in zip(out["cross_attn"], ref["cross_attn"], strict=True))
