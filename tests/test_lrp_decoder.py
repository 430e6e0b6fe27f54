"""AttnLRP through the DETR decoder and the caption decoder: conservation per detection and per
word in float64, the maps equal to the ledger's pixel relevance, batching that does not mix
rows, and the ``lrp`` method of both heads' explanations."""

from __future__ import annotations

import math

import pytest
import torch

from tests.test_decoder_relevance import _captioner, _detector, _images
from vision_attn.explain import lrp_decoder
from vision_attn.explain.faithfulness import on_patch_grid
from vision_attn.explain.lrp_decoder import (
    caption_lrp,
    cell_grid,
    decoder_lrp_budget,
    detection_lrp,
    positive_maps,
    smooth_cells,
)

HEADS = [{}, {"box_refine": True}, {"focal": True, "box_refine": True, "query_selection": True}, {"pyramid": True},
         # configs/detection/small.yaml's head
         {"focal": True, "box_refine": True, "query_selection": True, "fdr": True}]


def _relative_gap(budget: dict[str, float]) -> float:
    return abs(budget["total"] - budget["score"]) / max(abs(budget["score"]), 1e-12)


@pytest.mark.parametrize("head", HEADS, ids=["plain", "box_refine", "focal_selection", "pyramid", "small_yaml"])
def test_each_detection_conserves_its_logit(head):
    task = _detector(**head).double()
    images = _images(1).double()
    for query in range(task.head.num_queries):
        budget = decoder_lrp_budget(task, images, query=query)
        assert _relative_gap(budget) <= 0.01, budget
        assert budget["pixels"] != 0.0  # the image holds some of it
    maps = detection_lrp(task, images, [torch.tensor([0, 3])])[0].double()
    for k, query in enumerate((0, 3)):
        # the map is the pixels' share of the ledger, patch by patch
        assert maps[k].sum().item() == pytest.approx(decoder_lrp_budget(task, images, query=query)["pixels"],
                                                     rel=1e-4, abs=1e-9)


def test_each_word_conserves_its_logit():
    task = _captioner().double()
    images = _images(1).double()
    tokens = torch.tensor([4, 5, 6, 4])
    for position in range(len(tokens)):
        budget = decoder_lrp_budget(task, images, tokens=tokens, position=position)
        assert _relative_gap(budget) <= 0.01, budget
        assert budget["queries"] != 0.0  # the words before it (and <bos>) hold a share
    maps = caption_lrp(task, images, [tokens])[0].double()
    pixels = decoder_lrp_budget(task, images, tokens=tokens, position=2)["pixels"]
    assert maps[2].sum().item() == pytest.approx(pixels, rel=1e-4, abs=1e-9)


def test_the_ledger_catches_a_rule_left_out(monkeypatch):
    """Without the softmax's share (as if the rule reported nothing) the books do not balance:
    the conservation check can fail."""
    import vision_attn.explain.lrp as lrp

    task = _detector().double()
    monkeypatch.setattr(lrp, "_softmax_share", lambda probs, grad: torch.zeros((), dtype=torch.float64))
    budget = decoder_lrp_budget(task, _images(1).double(), query=0)
    assert _relative_gap(budget) > 0.01


def test_rows_do_not_mix_and_maps_depend_on_the_image():
    task = _detector()
    images = _images(2)
    both = detection_lrp(task, images, [torch.tensor([0, 1]), torch.tensor([2])], max_rows=2)
    alone = detection_lrp(task, images[1:], [torch.tensor([2])])
    assert torch.allclose(both[1], alone[0], atol=1e-6)
    other = detection_lrp(task, _images(2, seed=9), [torch.tensor([0, 1]), torch.tensor([2])])
    assert not torch.allclose(both[0], other[0])
    shown = positive_maps(both)
    assert all(float(m.min()) >= 0 and float(m.flatten(1).amax(1).max()) == pytest.approx(1.0) for m in shown)
    words = caption_lrp(_captioner(), images, [torch.tensor([4, 5]), torch.tensor([6])], max_rows=1)
    assert [w.shape[0] for w in words] == [2, 1]


def test_bad_items_are_refused():
    task = _detector()
    with pytest.raises(ValueError, match="query index out of range"):
        detection_lrp(task, _images(1), [torch.tensor([99])])
    with pytest.raises(ValueError, match="one of them"):
        decoder_lrp_budget(task, _images(1))
    with pytest.raises(ValueError, match="max_length"):
        caption_lrp(_captioner(), _images(1), [torch.arange(4, 12) % 3 + 4])


def test_lrp_is_a_method_of_both_decoder_heads():
    from vision_attn.explain.captioning import teacher_forced_word_maps
    from vision_attn.explain.detection import detection_maps

    task = _detector()
    maps = detection_maps(task, _images(1), [torch.tensor([1])], [torch.tensor([0])], ["lrp", "attention"])
    # 4 x 4 patches of 8 px, each split into 4 x 4 cells of 2 px
    assert list(maps) == ["lrp", "attention"] and maps["lrp"][0].shape == (1, 16, 16)
    assert maps["attention"][0].shape == (1, 4, 4)
    cap = _captioner()
    words = teacher_forced_word_maps(cap, _images(1), [torch.tensor([4, 5])], ["lrp"])
    assert words["lrp"][0].shape == (2, 16, 16) and float(words["lrp"][0].max()) == pytest.approx(1.0)


def test_cells_split_each_patch_and_sum_to_its_relevance(monkeypatch):
    task = _detector()
    images = _images(1)
    assert cell_grid(task.encoder, 32, 32) == ((16, 16), (2, 2))
    fine = detection_lrp(task, images, [torch.tensor([0, 2])])[0]
    monkeypatch.setattr(lrp_decoder, "CELLS", 1)  # one cell per patch: the patch sums
    assert cell_grid(task.encoder, 32, 32) == ((4, 4), (8, 8))
    coarse = detection_lrp(task, images, [torch.tensor([0, 2])])[0]
    assert coarse.shape == (2, 4, 4)
    assert torch.allclose(on_patch_grid(fine, (4, 4)), coarse, atol=1e-6)
    assert not torch.allclose(fine[0], fine[0].reshape(4, 4, 4, 4).mean(dim=(1, 3), keepdim=True)
                              .expand(4, 4, 4, 4).reshape(16, 16))  # not constant within a patch


@pytest.mark.parametrize(("patch", "expected"), [(16, ((8, 8), (4, 4))), (14, ((4, 4), (7, 7))),
                                                 (7, ((2, 2), (7, 7))), (None, ((2, 2), (16, 16)))])
def test_cell_grid_takes_the_largest_divisor_of_the_patch(patch, expected):
    class Encoder(torch.nn.Module):
        patch_size = patch

        def grid_for(self, height, width):
            return 2, 2

    assert cell_grid(Encoder(), 32, 32) == expected


def test_cells_are_smoothed_by_half_a_cell_and_patches_are_cell_sums():
    spike = torch.zeros(1, 5, 5)
    spike[0, 2, 2] = 1.0
    a = math.exp(-2.0)
    axis = torch.tensor([0.0, a, 1.0, a, 0.0]) / (1 + 2 * a)
    assert torch.allclose(smooth_cells(spike)[0], axis[:, None] * axis[None, :])
    cells = torch.arange(32.0).view(2, 4, 4)
    assert on_patch_grid(cells, (2, 2)).tolist() == [[[10.0, 18.0], [42.0, 50.0]], [[74.0, 82.0], [106.0, 114.0]]]
    assert on_patch_grid(cells, (4, 4)) is cells
    with pytest.raises(ValueError, match="does not split the 3x3 patch grid"):
        on_patch_grid(cells, (3, 3))


@pytest.mark.parametrize("head", HEADS[:3], ids=["plain", "box_refine", "focal_selection"])
def test_own_query_holds_the_other_queries_constant_in_self_attention(head):
    """Same logits; the explained score's gradient reaches no other query's content, which it
    does without the option; the maps change."""
    from vision_attn.explain.decoder_relevance import _explaining
    from vision_attn.explain.lrp_decoder import _decoder_sources, _detection_scores, _own_query

    task = _detector(**head)
    images = _images(1).repeat(2, 1, 1, 1)
    queries, classes = torch.tensor([0, 3]), torch.tensor([-1, -1])
    got = {}
    with _explaining(task):
        for own in (False, True):
            with _decoder_sources(task.head) as sources, _own_query(task.head, queries if own else None):
                score, _ = _detection_scores(task, images, queries, classes)
                score.sum().backward()
            grad = sources["queries"][0].grad  # (rows, Q, hidden): the first layer's query contents
            got[own] = score.detach()
            others = torch.ones(grad.shape[:2], dtype=torch.bool)
            others[torch.arange(2), queries] = False
            if own:
                assert grad[others].abs().max() == 0 and grad[~others].abs().sum() > 0
            else:
                assert grad[others].abs().max() > 0
    assert torch.allclose(got[True], got[False])
    shipped = detection_lrp(task, images[:1], [queries])[0]
    lrp_decoder.OWN_QUERY = True
    try:
        own_maps = detection_lrp(task, images[:1], [queries])[0]
    finally:
        lrp_decoder.OWN_QUERY = False
    assert not torch.allclose(own_maps, shipped)


def test_gate_by_attention_spreads_each_patch_bilinearly_and_multiplies():
    from vision_attn.explain.lrp_decoder import gate_by_attention

    relevance = torch.ones(1, 4, 4)
    relevance[0, 0, 1] = -2.0  # negative relevance is no evidence: gated to zero
    attention = torch.tensor([[[1.0, 0.0], [0.0, 0.0]]])  # one 2 x 2 patch grid, each patch 2 x 2 cells
    # cell centres at patch coordinates -0.25, 0.25, 0.75, 1.25 (edges held): the first patch's weight
    axis = torch.tensor([1.0, 0.75, 0.25, 0.0])
    expected = axis[:, None] * axis[None, :]
    expected[0, 1] = 0.0
    torch.testing.assert_close(gate_by_attention(relevance, attention)[0], expected)
    # the product, not either map: high relevance where the attention is zero stays zero
    relevance[0, 3, 3] = 9.0
    gated = gate_by_attention(relevance, attention)[0]
    assert float(gated[3, 3]) == 0.0 and float(gated.max()) == pytest.approx(1.0)
    same = torch.rand(2, 3, 3, generator=torch.Generator().manual_seed(0))
    signed = torch.randn(2, 3, 3, generator=torch.Generator().manual_seed(1))
    product = signed.clamp(min=0) * same
    torch.testing.assert_close(gate_by_attention(signed, same), product / product.flatten(1).amax(1)[:, None, None])
    with pytest.raises(ValueError, match="same K"):
        gate_by_attention(torch.ones(2, 4, 4), torch.ones(1, 2, 2))


def test_lrp_attention_is_lrp_gated_by_the_items_attention_in_every_head():
    from vision_attn.explain.captioning import teacher_forced_word_maps
    from vision_attn.explain.detection import detection_maps
    from vision_attn.explain.lrp_decoder import gate_by_attention
    from vision_attn.explain.methods import explain_classifier

    def check(maps: dict, key=lambda m: m) -> None:
        gated, lrp, att = key(maps["lrp_attention"]), key(maps["lrp"]), key(maps["attention"])
        torch.testing.assert_close(gated, gate_by_attention(lrp, att))
        assert not torch.allclose(gated, lrp, atol=1e-3)  # the attention changes it

    task = _detector()
    check(detection_maps(task, _images(1), [torch.tensor([1, 2])], [torch.tensor([0, 1])],
                         ["lrp_attention", "lrp", "attention"]), key=lambda m: m[0])
    only = detection_maps(task, _images(1), [torch.tensor([1, 2])], [torch.tensor([0, 1])], ["lrp_attention"])
    assert list(only) == ["lrp_attention"] and only["lrp_attention"][0].shape == (2, 16, 16)
    cap = _captioner()
    check(teacher_forced_word_maps(cap, _images(1), [torch.tensor([4, 5])], ["lrp_attention", "lrp", "attention"]),
          key=lambda m: m[0])
    from tests.test_lrp import _images as classifier_images
    from tests.test_lrp import _task as classifier

    check(explain_classifier(classifier(), classifier_images(2), ["lrp_attention", "lrp", "attention"]).maps)
