"""Relevance through the decoder (Chefer et al. 2021b) for the DETR head and the caption decoder.

The batched implementation is compared with a slow reference written here straight from the
paper's equations: one image and one explained item at a time, heads and rows in loops,
explicit matrices (eq. 5: Ā; eqs. 6-7: self-attention; eqs. 8-9: normalisation; eq. 10:
cross-attention).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vision_attn import create_encoder
from vision_attn.data.tokenizer import SPECIAL_TOKENS
from vision_attn.errors import ConfigError
from vision_attn.explain.captioning import word_attention_maps
from vision_attn.explain.capture import attention_modules, capture_attention
from vision_attn.explain.decoder_relevance import caption_relevance, detection_relevance
from vision_attn.explain.detection import query_attention_maps
from vision_attn.models.captioner import DecoderConfig
from vision_attn.models.detr import DETRConfig
from vision_attn.tasks.captioning import CaptioningTask
from vision_attn.tasks.detection import DetectionTask

TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)


def _encoder():
    return create_encoder("vit_tiny_patch16_224", **TINY)


def _detector(**head) -> DetectionTask:
    """A tiny detector; ``head``: fields of its :class:`DETRConfig` besides the tiny sizes."""
    torch.manual_seed(0)
    return DetectionTask(_encoder(), num_classes=2, head=DETRConfig(num_queries=4, hidden_dim=32, num_layers=2,
                                                                    num_heads=2, **head)).eval()


def _captioner() -> CaptioningTask:
    torch.manual_seed(0)
    task = CaptioningTask(_encoder(), vocab=[*SPECIAL_TOKENS, "a", "red", "circle"],
                          decoder=DecoderConfig(hidden_dim=32, num_layers=2, num_heads=2, max_length=6))
    torch.manual_seed(1)  # untrained: let the word embeddings differ visibly
    with torch.no_grad():
        task.head.pos.normal_(0, 0.5)
    return task.eval()


def _images(n: int = 2, seed: int = 3) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- the paper, slowly
def _fuse(a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Eq. 5 for one image: Ā = E_h[(∇A ⊙ A)⁺], heads in a loop (``[H, n, m]`` -> ``[n, m]``)."""
    out = torch.zeros(a.shape[1:], dtype=torch.float64)
    for h in range(a.shape[0]):
        out += torch.clamp(g[h].double() * a[h].double(), min=0) / a.shape[0]
    return out


def _bar(r: torch.Tensor) -> torch.Tensor:
    """Eqs. 8-9: R̂ = R - I, each row divided by its sum (a zero row stays zero), + I."""
    n = r.shape[0]
    hat = r - torch.eye(n, dtype=r.dtype)
    out = torch.zeros_like(hat)
    for m in range(n):
        s = hat[m].sum()
        if s > 0:
            out[m] = hat[m] / s
    return out + torch.eye(n, dtype=r.dtype)


def _reference_map(attn: list[torch.Tensor], grads: list[torch.Tensor], depth: int, layers: int, item: int,
                   prefix: int, grid: tuple[int, int], rule: str = "full") -> torch.Tensor:
    """Attention/gradients of one image in execution order: ``depth`` encoder blocks, then per
    decoder layer its self- and cross-attention. ``rule``: ``full`` (the paper), ``decoder``
    (the encoder's relevance left out: ``R̄^ii = I``), ``decoder_last`` (that, and only the last
    layer's cross-attention term)."""
    t = attn[0].shape[-1]
    r_ii = torch.eye(t, dtype=torch.float64)
    for k in range(depth if rule == "full" else 0):  # eq. 6 on the image
        r_ii = r_ii + _fuse(attn[k][0], grads[k][0]) @ r_ii
    q = attn[depth][0].shape[-1]
    r_qq = torch.eye(q, dtype=torch.float64)
    r_qi = torch.zeros(q, t, dtype=torch.float64)
    for layer in range(layers):
        s, c = depth + 2 * layer, depth + 2 * layer + 1
        a_qq = _fuse(attn[s][0], grads[s][0])
        r_qq, r_qi = r_qq + a_qq @ r_qq, r_qi + a_qq @ r_qi  # eqs. 6, 7
        if rule == "decoder_last" and layer < layers - 1:
            continue
        a_qi = _fuse(attn[c][0], grads[c][0])  # [Q, N]: the memory is the patch tokens
        r_qi = r_qi + _bar(r_qq).T @ a_qi @ _bar(r_ii)[prefix:]  # eq. 10
    row = r_qi[item, prefix:].float().reshape(grid)
    return row / row.max() if row.max() > 0 else row


def _reference_detection(task: DetectionTask, image: torch.Tensor, query: int, label: int | None,
                         score: str = "logit", rule: str = "full") -> torch.Tensor:
    with torch.enable_grad(), capture_attention(task, keep_grad=True) as attn:
        enc = task.encoder(image[None])
        logits = task.head(enc)["pred_logits"][0, query]
    real = logits if task.head.focal else logits[:-1]
    label = int(real.argmax()) if label is None else label
    if score == "probability":
        logits = logits.sigmoid() if task.head.focal else logits.softmax(-1)
    grads = torch.autograd.grad(logits[label], list(attn))
    return _reference_map(list(attn), list(grads), len(attention_modules(task.encoder)), len(task.head.layers), query,
                          enc.num_prefix_tokens, enc.grid, rule)


def _reference_word(task: CaptioningTask, image: torch.Tensor, words: list[int], t: int,
                    rule: str = "full") -> torch.Tensor:
    """Word ``t``'s map, decoding only ``<bos> w_0 .. w_{t-1}`` (nothing after the word)."""
    inp = torch.tensor([[task.tokenizer.bos_id, *words[:t]]])
    with torch.enable_grad(), capture_attention(task, keep_grad=True) as attn:
        enc = task.encoder(image[None])
        logits, _ = task.head(enc, inp)
    logp = F.log_softmax(logits[0, t].float(), dim=-1)[words[t]]
    grads = torch.autograd.grad(logp, list(attn))
    return _reference_map(list(attn), list(grads), len(attention_modules(task.encoder)), len(task.head.layers), t,
                          enc.num_prefix_tokens, enc.grid, rule)


# ---------------------------------------------------------------------------- (a) batched == reference
@pytest.mark.parametrize("kw, score", [({}, "logit"), ({"focal": True, "box_refine": True}, "probability")])
def test_detection_matches_the_papers_equations(kw, score):
    task = _detector(**kw)
    images = _images(2)
    queries = [torch.tensor([2, 0, 3]), torch.tensor([1])]
    labels = [torch.tensor([1, 0, 1]), torch.tensor([0])]
    maps = detection_relevance(task, images, queries, labels, score=score, max_rows=2)  # 2 passes of 2 rows
    for b, (qs, ls) in enumerate(zip(queries, labels, strict=True)):
        for k, (q, c) in enumerate(zip(qs.tolist(), ls.tolist(), strict=True)):
            ref = _reference_detection(task, images[b], q, c, score)
            torch.testing.assert_close(maps[b][k], ref, atol=1e-5, rtol=0)
    default = detection_relevance(task, images, queries, None, score=score)  # labels: each query's best class
    for b, qs in enumerate(queries):
        for k, q in enumerate(qs.tolist()):
            torch.testing.assert_close(default[b][k], _reference_detection(task, images[b], q, None, score),
                                       atol=1e-5, rtol=0)


@pytest.mark.parametrize("rule", ["decoder", "decoder_last"])
def test_the_decoder_rules_match_the_equations_without_the_encoders_part(rule):
    """``decoder``: eq. 10 with ``R̄^ii = I`` (each memory token its own patch); ``decoder_last``:
    that, with the cross-attention term of the last layer only. Both heads, against the slow
    reference; and each differs from the full rule (the encoder part and the layers matter)."""
    det, cap, images = _detector(), _captioner(), _images(2)
    queries, labels = [torch.tensor([2, 0]), torch.tensor([1])], [torch.tensor([1, 0]), torch.tensor([0])]
    maps = detection_relevance(det, images, queries, labels, rule=rule)
    full = detection_relevance(det, images, queries, labels)
    for b, (qs, ls) in enumerate(zip(queries, labels, strict=True)):
        for k, (q, c) in enumerate(zip(qs.tolist(), ls.tolist(), strict=True)):
            torch.testing.assert_close(maps[b][k], _reference_detection(det, images[b], q, c, rule=rule), atol=1e-5,
                                       rtol=0)
    assert not all(torch.allclose(a, b, atol=1e-4) for a, b in zip(maps, full, strict=True))
    tokens = [torch.tensor([4, 5, 6]), torch.tensor([6, 2])]
    words = caption_relevance(cap, images, tokens, rule=rule)
    for b, seq in enumerate(tokens):
        for t in range(len(seq)):
            torch.testing.assert_close(words[b][t], _reference_word(cap, images[b], seq.tolist(), t, rule), atol=1e-5,
                                       rtol=0)
    with pytest.raises(ConfigError, match="decoder relevance rule 'encoder' invalid"):
        caption_relevance(cap, images, tokens, rule="encoder")


def test_caption_matches_the_papers_equations():
    task = _captioner()
    images = _images(2)
    tokens = [torch.tensor([4, 5, 6, 4]), torch.tensor([6, 2])]  # different lengths; the second ends with <eos>
    maps = caption_relevance(task, images, tokens, max_rows=3)
    for b, words in enumerate(tokens):
        assert maps[b].shape == (len(words), 4, 4)
        for t in range(len(words)):
            ref = _reference_word(task, images[b], words.tolist(), t)
            torch.testing.assert_close(maps[b][t], ref, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------- (b) it explains the image
def test_detection_map_depends_on_the_image_and_is_not_raw_attention():
    task = _detector()
    a, b = _images(1, seed=3), _images(1, seed=4)
    q = [torch.tensor([0, 1, 2, 3])]
    ma, mb = detection_relevance(task, a, q)[0], detection_relevance(task, b, q)[0]
    assert (ma - mb).abs().amax(dim=(1, 2)).min() > 1e-2
    with torch.no_grad():
        out = task.head(task.encoder(a), need_weights=True)
    for layers in ("last", "mean"):
        raw = query_attention_maps(out["cross_attn"], q[0], (4, 4), layers)
        assert (ma - raw).abs().amax(dim=(1, 2)).min() > 1e-2


def test_caption_map_depends_on_the_image_and_is_not_raw_attention():
    task = _captioner()
    a, b = _images(1, seed=3), _images(1, seed=4)
    words = torch.tensor([4, 5, 6])
    ma, mb = caption_relevance(task, a, [words])[0], caption_relevance(task, b, [words])[0]
    assert (ma - mb).abs().amax(dim=(1, 2)).min() > 1e-2
    with torch.no_grad():
        _, cross = task.head(task.encoder(a), torch.tensor([[task.tokenizer.bos_id, 4, 5]]), need_weights=True)
    att = torch.stack([w[0].mean(0) for w in cross], dim=1)  # (T, L, N) as Generation.attention
    for layers in ("last", "mean"):
        raw = word_attention_maps(att, 3, (4, 4), layers)
        assert (ma - raw).abs().amax(dim=(1, 2)).min() > 1e-2


# ---------------------------------------------------------------------------- (c) the model is left alone
def _state(task):
    return {
        "params": {k: v.detach().clone() for k, v in task.state_dict().items()},
        "grads": [p.grad for p in task.parameters()],
        "requires_grad": [p.requires_grad for p in task.parameters()],
        "training": [m.training for m in task.modules()],
        "fused": [m.fused_attn for _, m in attention_modules(task)],
        "hooks": [(len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks)) for m in task.modules()],
    }


def _assert_same_state(before, after):
    assert before["params"].keys() == after["params"].keys()
    for k in before["params"]:
        assert torch.equal(before["params"][k], after["params"][k]), k
    assert all(g is None for g in after["grads"])
    for key in ("requires_grad", "training", "fused", "hooks"):
        assert before[key] == after[key], key


def test_model_state_is_unchanged_and_modes_restored():
    det, cap = _detector(), _captioner()
    images = _images(2)
    q = [torch.tensor([0, 3]), torch.tensor([2])]
    words = [torch.tensor([4, 5]), torch.tensor([6])]
    for task, run in ((det, lambda t: detection_relevance(t, images, q)),
                      (cap, lambda t: caption_relevance(t, images, words))):
        before = _state(task)
        expected = run(task)
        _assert_same_state(before, _state(task))
        task.train()  # explanations use evaluation mode inside and give the training mode back
        before = _state(task)
        got = run(task)
        _assert_same_state(before, _state(task))
        assert all(m.training for m in task.modules())
        task.eval()
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g, e, atol=1e-6, rtol=0)
        # under a caller's no_grad / inference_mode (Lightning's predict loop) and with frozen weights
        with torch.no_grad():
            torch.testing.assert_close(run(task), expected, atol=1e-6, rtol=0)
        with torch.inference_mode():
            torch.testing.assert_close(run(task), expected, atol=1e-6, rtol=0)
        task.requires_grad_(False)
        before = _state(task)
        torch.testing.assert_close(run(task), expected, atol=1e-6, rtol=0)
        _assert_same_state(before, _state(task))
        task.requires_grad_(True)


def test_hooks_and_flags_restored_after_an_error(monkeypatch):
    task = _detector()
    before = _state(task)

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(task.head, "forward", broken)
    with pytest.raises(RuntimeError, match="boom"):
        detection_relevance(task, _images(1), [torch.tensor([0])])
    monkeypatch.undo()
    _assert_same_state(before, _state(task))


# ---------------------------------------------------------------------------- (d) shapes and ranges
def test_shapes_ranges_and_empty_items():
    det, cap = _detector(), _captioner()
    images = _images(3)
    maps = detection_relevance(det, images, [torch.tensor([1, 2]), torch.tensor([], dtype=torch.long),
                                             torch.tensor([0])])
    assert [tuple(m.shape) for m in maps] == [(2, 4, 4), (0, 4, 4), (1, 4, 4)]
    caps = caption_relevance(cap, images, [torch.tensor([4]), torch.tensor([], dtype=torch.long),
                                           torch.tensor([5, 6, 2])])
    assert [tuple(m.shape) for m in caps] == [(1, 4, 4), (0, 4, 4), (3, 4, 4)]
    for m in [*maps, *caps]:
        assert m.dtype == torch.float32 and m.device.type == "cpu"
        for item in m:
            assert item.min() >= 0 and torch.isclose(item.max(), torch.tensor(1.0))
    assert not det.training and not cap.training
    assert detection_relevance(det, images[:0], []) == []


def test_bad_arguments_are_named():
    det, cap = _detector(), _captioner()
    with pytest.raises(ValueError, match="query index out of range"):
        detection_relevance(det, _images(1), [torch.tensor([4])])
    with pytest.raises(ValueError, match="2 images but 1 query lists"):
        detection_relevance(det, _images(2), [torch.tensor([0])])
    with pytest.raises(ValueError, match="max_length"):
        caption_relevance(cap, _images(1), [torch.tensor([4] * 7)])
