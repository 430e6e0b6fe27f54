"""Real input sizes for detection: aspect-preserving resize, padded batches with key padding
masks through the encoder and the decoder, boxes in original pixels."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image

from vision_attn import create_encoder
from vision_attn.data.detection import (
    DETECTION_BATCHING,
    CocoDetection,
    DetectionDataModule,
    DetectionTransform,
    build_detection_transform,
    detection_collate,
)
from vision_attn.data.layout import SplitLayout
from vision_attn.data.loading import Batching
from vision_attn.data.transforms import AspectResize, aspect_resize_size
from vision_attn.errors import DataError, EncoderError
from vision_attn.models.detr import DETRConfig
from vision_attn.tasks.detection import DetectionTask

PRE = {"input_size": (3, 32, 32), "mean": (0.0,) * 3, "std": (1.0,) * 3, "interpolation": "bilinear", "crop_pct": 1.0}
TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)


# ---------------------------------------------------------------------------- resize sizes, by hand
@pytest.mark.parametrize("hw, short, max_size, expected", [
    ((480, 640), 800, 1333, (800, 1067)),   # 640 * 800 / 480 = 1066.67 -> 1067
    ((640, 480), 800, 1333, (1067, 800)),   # portrait: the width is the shorter side
    ((400, 1200), 800, 1333, (444, 1333)),  # 1200 * 2 = 2400 > 1333: the cap wins, 400 * 1333 / 1200 = 444.3
    ((427, 640), 800, 1333, (800, 1199)),   # 640 * 800 / 427 = 1199.06
    ((500, 500), 512, 1333, (512, 512)),
    ((40, 80), 30, 100, (30, 60)),
    ((40, 80), 30, 50, (25, 50)),           # 60 > 50: scale 50 / 80
    ((1000, 750), 480, None, (640, 480)),   # no cap
    ((300, 4000), 800, 1333, (100, 1333)),  # 300 * 1333 / 4000 = 99.975 -> 100
])
def test_aspect_resize_sizes_by_hand(hw, short, max_size, expected):
    assert aspect_resize_size(*hw, short, max_size) == expected


def test_aspect_resize_refuses_bad_sizes():
    with pytest.raises(ValueError, match="positive"):
        aspect_resize_size(0, 10, 800)
    with pytest.raises(ValueError, match="max_size 500 is below"):
        AspectResize([480, 800], 500)


def test_aspect_resize_draws_the_training_sizes():
    tf = AspectResize([16, 24], max_size=100)
    from torchvision import tv_tensors

    seen = set()
    torch.manual_seed(0)
    for _ in range(20):
        image = tv_tensors.Image(torch.zeros(3, 40, 80, dtype=torch.uint8))
        boxes = tv_tensors.BoundingBoxes(torch.tensor([[10.0, 10.0, 30.0, 20.0]]), format="XYXY", canvas_size=(40, 80))
        out, b, _ = tf(image, boxes, torch.tensor([0]))
        seen.add(tuple(out.shape[-2:]))
        scale = out.shape[-2] / 40
        torch.testing.assert_close(b.as_subclass(torch.Tensor), torch.tensor([[10.0, 10.0, 30.0, 20.0]]) * scale)
    assert seen == {(16, 32), (24, 48)}


# ---------------------------------------------------------------------------- the data
def _coco(root, split="val"):
    """Two non-square images (80 x 40 and 50 x 100, w x h), each with a white box on black."""
    (root / split).mkdir(parents=True, exist_ok=True)
    (root / "annotations").mkdir(exist_ok=True)
    images = [{"id": 7, "file_name": "a.png", "width": 80, "height": 40},
              {"id": 9, "file_name": "b.png", "width": 50, "height": 100}]
    anns = [{"id": 1, "image_id": 7, "category_id": 3, "bbox": [16, 8, 32, 16]},
            {"id": 2, "image_id": 9, "category_id": 5, "bbox": [10, 40, 20, 40]}]
    for im, a in zip(images, anns, strict=True):
        pixels = np.zeros((im["height"], im["width"], 3), np.uint8)
        x, y, w, h = a["bbox"]
        pixels[y : y + h, x : x + w] = 255
        Image.fromarray(pixels).save(root / split / im["file_name"])
    cats = [{"id": 3, "name": "box"}, {"id": 5, "name": "tall"}]
    (root / "annotations" / f"instances_{split}.json").write_text(
        json.dumps({"images": images, "annotations": anns, "categories": cats}))
    return root


def test_aspect_dataset_keeps_the_ratio_pads_the_batch_and_records_sizes(tmp_path):
    tf = build_detection_transform(PRE, train=False, resize="aspect", eval_size=24, max_size=40)
    ds = CocoDetection(_coco(tmp_path), "val", tf, with_size=True)
    items = [ds[0], ds[1]]
    # 40 x 80 -> shorter 24 -> 24 x 48 > 40: capped, 20 x 40; 100 x 50 -> 48 x 24 > 40: capped, 40 x 20
    assert [tuple(im.shape[-2:]) for im, _ in items] == [(20, 40), (40, 20)]
    assert [t["size"].tolist() for _, t in items] == [[20, 40], [40, 20]]
    images, targets = detection_collate(items)
    assert images.shape == (2, 3, 40, 40)
    for (im, _), padded in zip(items, images, strict=True):
        h, w = im.shape[-2:]
        assert torch.equal(padded[:, :h, :w], im)
        assert padded[:, h:].abs().sum() == 0 and padded[:, :, w:].abs().sum() == 0  # zeros: padding
    # boxes are fractions of each image's own size: on the white pixels of the padded batch
    for b, t in enumerate(targets):
        h, w = t["size"].tolist()
        cx, cy, bw, bh = t["boxes"][0].tolist()
        x0, y0, x1, y1 = (cx - bw / 2) * w, (cy - bh / 2) * h, (cx + bw / 2) * w, (cy + bh / 2) * h
        inside = images[b, 0, round(y0) + 1 : round(y1) - 1, round(x0) + 1 : round(x1) - 1]
        assert inside.numel() > 0 and inside.min() > 0.9
        assert images[b, 0, : round(y0) - 1].abs().max() < 0.1 and images[b, 0, :, round(x1) + 1 :].abs().max() < 0.1


def test_square_path_is_unchanged(tmp_path):
    ds = CocoDetection(_coco(tmp_path), "val", build_detection_transform(PRE, train=False))
    items = [ds[0], ds[1]]
    assert all(tuple(im.shape) == (3, 32, 32) and "size" not in t for im, t in items)
    images, targets = detection_collate(items)
    assert torch.equal(images, torch.stack([items[0][0], items[1][0]]))
    with pytest.raises(DataError, match="resize aspect"):
        detection_collate([(torch.zeros(3, 8, 8), {}), (torch.zeros(3, 8, 16), {})])


def test_datamodule_aspect_mode_and_its_errors(tmp_path):
    root = _coco(tmp_path, "train")
    _coco(root, "val")
    dm = DetectionDataModule(str(root), transform=DetectionTransform(resize="aspect", train_sizes=(16, 24),
                                                                     eval_size=24, max_size=40),
                             batching=Batching(batch_size=2, num_workers=0))
    dm.preprocess = PRE
    images, targets = dm.collate_fn()([dm.dataset("val")[i] for i in range(2)])
    assert images.shape == (2, 3, 40, 40) and [t["size"].tolist() for t in targets] == [[20, 40], [40, 20]]
    assert "size" in dm.dataset("train", train=True)[0][1]
    square = DetectionDataModule(str(root), batching=replace(DETECTION_BATCHING, num_workers=0))
    square.preprocess = PRE
    assert "size" not in square.dataset("val")[0][1] and square.resize == "square"
    with pytest.raises(DataError, match="--data.transform.resize"):
        DetectionDataModule(str(root), transform=DetectionTransform(resize="crop"))
    with pytest.raises(DataError, match="max_size 20 is below"):
        DetectionDataModule(str(root), transform=DetectionTransform(resize="aspect", train_sizes=(16,), eval_size=24,
                                                                    max_size=20))
    DetectionDataModule(str(root), transform=DetectionTransform(max_size=20))  # square: the aspect sizes are not used


# ---------------------------------------------------------------------------- masks: padding changes nothing
def _encoder(stem="patch", **kw):
    torch.manual_seed(0)
    return create_encoder("vit_tiny_patch16_224", stem=stem, **TINY, **kw).eval()


def _padded(images, size):
    out = torch.zeros(len(images), 3, *size)
    for i, im in enumerate(images):
        out[i, :, : im.shape[-2], : im.shape[-1]] = im
    return out, torch.tensor([list(im.shape[-2:]) for im in images])


@pytest.mark.parametrize("stem, kw", [("patch", {}), ("conv", {}), ("patch", {"reg_tokens": 2, "no_embed_class": True}),
                                      ("spt", {}), ("conv", {"lsa": True}),
                                      ("patch", {"class_token": False, "global_pool": "avg"})])
def test_encoder_padded_tokens_equal_each_image_alone(stem, kw):
    enc = _encoder(stem, **kw)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 24, 40, generator=g), torch.randn(3, 40, 16, generator=g)
    batch, sizes = _padded([a, b], (40, 48))
    with torch.no_grad():
        out = enc(batch, image_sizes=sizes)
        alone = [enc(a[None]), enc(b[None])]
    assert out.grid == (5, 6) and out.valid_grids() == [(3, 5), (5, 2)]
    assert out.patch_mask.shape == (2, 30) and out.patch_mask.sum(1).tolist() == [15, 10]
    p = out.num_prefix_tokens
    for i, (ref, (h, w)) in enumerate(zip(alone, [(3, 5), (5, 2)], strict=True)):
        tokens = out.tokens[i, p:].reshape(5, 6, -1)[:h, :w]
        torch.testing.assert_close(tokens, ref.patch_tokens[0].reshape(h, w, -1), atol=1e-5, rtol=0)
        torch.testing.assert_close(out.tokens[i, :p], ref.tokens[0, :p], atol=1e-5, rtol=0)
    # without the mask, the padding changes the image's tokens (the check above can fail)
    with torch.no_grad():
        unmasked = enc(batch)
    first = unmasked.tokens[0, p:].reshape(5, 6, -1)[:3, :5]
    assert (first - alone[0].patch_tokens[0].reshape(3, 5, -1)).abs().max() > 1e-3


def test_encoder_same_size_batch_takes_timm_s_own_forward():
    enc = _encoder()
    x = torch.randn(2, 3, 32, 40)
    with torch.no_grad():
        plain, sized = enc(x), enc(x, image_sizes=torch.tensor([[32, 40], [30, 33]]))  # ceil to the full grid
    assert sized.patch_mask is None and torch.equal(plain.tokens, sized.tokens)
    with pytest.raises(EncoderError, match="does not fit"):
        enc(x, image_sizes=torch.tensor([[32, 48], [32, 40]]))


HEADS = [{}, {"box_refine": True, "focal": True, "query_selection": True}, {"box_refine": True, "pyramid": True},
         {"pyramid": True, "box_refine": True, "query_selection": True}]


@pytest.mark.parametrize("kw", HEADS)
def test_padded_image_gives_the_same_detections_as_alone(kw):
    torch.manual_seed(0)
    task = DetectionTask(_encoder(), num_classes=3, head=DETRConfig(num_queries=6, hidden_dim=32, num_layers=2,
                                                                    num_heads=2, **kw)).eval()
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(3, 24, 40, generator=g), torch.randn(3, 48, 16, generator=g)
    batch, sizes = _padded([a, b], (48, 56))
    with torch.no_grad():
        out = task(batch, image_sizes=sizes, need_weights=True)
        alone = [task(a[None], need_weights=True), task(b[None], need_weights=True)]
        unmasked = task(batch)
    for i, (ref, (h, w)) in enumerate(zip(alone, [(3, 5), (6, 2)], strict=True)):
        for k in ("pred_logits", "pred_boxes"):
            torch.testing.assert_close(out[k][i], ref[k][0], atol=1e-5, rtol=0)
        dets = task.detect({k: out[k][i : i + 1] for k in ("pred_logits", "pred_boxes")}, torch.tensor([[100, 200]]))
        ref_dets = task.detect(ref, torch.tensor([[100, 200]]))
        torch.testing.assert_close(dets[0]["boxes"], ref_dets[0]["boxes"], atol=1e-3, rtol=0)
        torch.testing.assert_close(dets[0]["scores"], ref_dets[0]["scores"], atol=1e-5, rtol=0)
        # the cross-attention never reaches the padding (over the patch grid of the batch)
        grid = out["cross_attn"][-1][i].reshape(*out["cross_attn"][-1].shape[1:3], 6, 7)
        assert grid[..., h:, :].abs().sum() < 1e-6 and grid[..., :, w:].abs().sum() < 1e-6
        torch.testing.assert_close(grid[..., :h, :w].flatten(-2), ref["cross_attn"][-1][0], atol=1e-5, rtol=0)
    # the mask matters (untrained refinement heads keep their anchor boxes: the logits show it)
    assert (unmasked["pred_logits"][0] - alone[0]["pred_logits"][0]).abs().max() > 1e-4


def test_batch_not_a_multiple_of_the_patch_is_padded_by_the_task():
    torch.manual_seed(0)
    task = DetectionTask(_encoder(), num_classes=2, head=DETRConfig(num_queries=4, hidden_dim=32, num_layers=1,
                                                                    num_heads=2)).eval()
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(3, 21, 35, generator=g), torch.randn(3, 30, 12, generator=g)
    batch, sizes = _padded([a, b], (30, 35))
    with torch.no_grad():
        out = task(batch, image_sizes=sizes)
        ref = task(torch.nn.functional.pad(a, (0, 5, 0, 3))[None])  # alone, padded to 24 x 40 as the encoder needs
    torch.testing.assert_close(out["pred_boxes"][0], ref["pred_boxes"][0], atol=1e-5, rtol=0)


def test_padded_batches_refuse_patch_dropout_in_training():
    enc = _encoder(patch_drop_rate=0.5).train()
    batch, sizes = _padded([torch.randn(3, 16, 24), torch.randn(3, 24, 16)], (24, 24))
    with pytest.raises(EncoderError, match="patch_drop_rate"):
        enc(batch, image_sizes=sizes)
    enc.eval()(batch, image_sizes=sizes)  # no dropout at evaluation: fine


# ---------------------------------------------------------------------------- boxes in original pixels
@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`")
def test_predictions_json_boxes_are_in_original_pixels_of_non_square_images(tmp_path, monkeypatch):
    """The whole evaluation path with a stand-in network that predicts each target's own box:
    aspect resize, padded collate, image_sizes to the model, post-processing by each image's
    original size, the COCO results list."""
    root = _coco(tmp_path)
    dm = DetectionDataModule(str(root), layout=SplitLayout(train_split="val"),
                             transform=DetectionTransform(resize="aspect", train_sizes=(24,), eval_size=24,
                                                          max_size=40), batching=replace(DETECTION_BATCHING,
                                                                                         num_workers=0))
    dm.preprocess = PRE
    ds = dm.dataset("val")
    task = DetectionTask(_encoder(), head=DETRConfig(num_queries=3, hidden_dim=32, num_layers=1, num_heads=2))
    task.build_from_data(dm)
    task.eval()
    batch = dm.collate_fn()([ds[0], ds[1]])
    seen = {}

    def perfect(images, need_weights=False, targets=None, image_sizes=None):
        seen["sizes"] = image_sizes
        logits = torch.full((len(batch[1]), 3, 3), -10.0)
        boxes = torch.full((len(batch[1]), 3, 4), 0.5)
        for i, t in enumerate(batch[1]):
            logits[i, 0, int(t["labels"][0])] = 10.0
            boxes[i, 0] = t["boxes"][0]
        return {"pred_logits": logits, "pred_boxes": boxes, "aux_outputs": []}

    monkeypatch.setattr(task, "forward", perfect)
    task.on_test_epoch_start()
    task._shared_step(batch, "test")
    assert seen["sizes"].tolist() == [[20, 40], [40, 20]]
    metrics, results = task.eval_results(ds)
    best = {r["image_id"]: r for r in sorted(results, key=lambda r: r["score"])}
    assert best[7]["category_id"] == 3 and best[9]["category_id"] == 5
    np.testing.assert_allclose(best[7]["bbox"], [16, 8, 32, 16], atol=1.0)  # x, y, w, h in the 80 x 40 original
    np.testing.assert_allclose(best[9]["bbox"], [10, 40, 20, 40], atol=1.0)  # in the 50 x 100 original
    assert metrics["map_50"] == pytest.approx(1.0)


def test_explanations_of_an_aspect_mode_dataset_use_the_inference_geometry(tmp_path, caplog):
    """Images of different sizes cannot be explained as one batch nor mapped back by the square
    geometry: explain_eval reads them as single-image inference does (the input size)."""
    import logging

    from vision_attn.explain.evaluate import ExplainOptions

    root = _coco(tmp_path)
    dm = DetectionDataModule(str(root), layout=SplitLayout(train_split="val"),
                             transform=DetectionTransform(resize="aspect", train_sizes=(24,), eval_size=24,
                                                          max_size=40), batching=replace(DETECTION_BATCHING,
                                                                                         num_workers=0))
    dm.preprocess = PRE
    ds = dm.dataset("val")
    torch.manual_seed(0)
    task = DetectionTask(_encoder(), head=DETRConfig(num_queries=3, hidden_dim=32, num_layers=1, num_heads=2,
                                                     pyramid=True))
    task.build_from_data(dm)
    task.eval()
    options = ExplainOptions(methods=["attention", "relevance"], num_overlays=2, faithfulness_images=2, steps=2,
                             score_threshold=0.0)
    with caplog.at_level(logging.INFO):
        metrics = task.explain_eval(ds, options, tmp_path / "out")
    assert "not by the aspect-preserving evaluation resize" in caplog.text
    assert len(list((tmp_path / "out" / "overlays").glob("*.png"))) == 2
    assert metrics and all(np.isfinite(v) for v in metrics.values())
    assert ds.with_size and ds[0][0].shape[-2:] == (20, 40)  # the dataset itself is left as it was


def test_fit_and_test_with_padded_batches(tmp_path):
    """Training (multi-scale, padded batches, denoising and query selection over the pyramid) and
    testing run through Lightning; predictions come back in original pixels."""
    import lightning as L

    root = _coco(tmp_path, "train")
    _coco(root, "val")
    dm = DetectionDataModule(str(root), transform=DetectionTransform(resize="aspect", train_sizes=(16, 24),
                                                                     eval_size=24, max_size=40),
                             batching=Batching(batch_size=2, num_workers=0))
    torch.manual_seed(0)
    task = DetectionTask(_encoder().train(), head=DETRConfig(num_queries=4, hidden_dim=32, num_layers=2, num_heads=2,
                                                             box_refine=True, focal=True, pyramid=True, dn_groups=1,
                                                             query_selection=True))
    trainer = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, num_sanity_val_steps=0)
    trainer.fit(task, datamodule=dm)
    assert torch.isfinite(trainer.callback_metrics["train/loss"]) and "val/map" in trainer.callback_metrics
    trainer.test(task, dataloaders=dm.eval_dataloader("val"))
    _, results = task.eval_results(dm.dataset("val"))
    sizes = {7: (80, 40), 9: (50, 100)}  # (w, h) of the originals
    for r in results:
        x, y, w, h = r["bbox"]
        assert -1e-3 <= x and x + w <= sizes[r["image_id"]][0] + 1e-3 and y + h <= sizes[r["image_id"]][1] + 1e-3
