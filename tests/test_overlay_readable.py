"""Overlays people can read: on the original photo, one colour scale with a colour bar, labels that fit."""

from __future__ import annotations

import cv2
import numpy as np

from vision_attn.explain.overlay import (
    colour_bar,
    crop_box,
    explanation_figure,
    fit_text,
    image_grid,
    put_text,
    scale_maps,
)

PRE = {"input_size": (3, 224, 224), "crop_pct": 0.9, "crop_mode": "center"}  # timm's centre crop


def _tall_photo() -> np.ndarray:
    photo = np.full((400, 150, 3), 128, np.uint8)
    photo[:30] = (255, 0, 0)  # a red band at the top and a blue one at the bottom: outside the model's crop
    photo[-30:] = (0, 0, 255)
    return photo


def test_a_tall_photo_keeps_its_full_height_and_the_crop_is_outlined():
    photo = _tall_photo()
    box = crop_box(photo.shape[:2], PRE)
    assert box is not None and box[1] > 100 and box[3] < 300  # the model sees the middle third only
    assert crop_box((224, 224), {**PRE, "crop_pct": 1.0}) is None  # no crop, no outline
    grid = np.zeros((14, 14))
    grid[7, 7] = 1.0
    fig = explanation_figure(photo, {"relevance": grid}, PRE, caption="cat 0.93", side=200)
    # the panels are 200 px high (the photo's full height, scaled) and 75 wide: find the input panel
    red = np.nonzero((fig[..., 0] > 200) & (fig[..., 1] < 60) & (fig[..., 2] < 60))
    blue = np.nonzero((fig[..., 2] > 200) & (fig[..., 0] < 60) & (fig[..., 1] < 60))
    assert red[0].size and blue[0].size
    assert blue[0].max() - red[0].min() + 1 == 200  # top band to bottom band: the whole photo
    # the overlay panel: the photo's top and bottom are shown as they are, the crop's centre is hot
    x1 = 4 + 75 + 4  # the second panel starts after the padding, the first panel and the padding
    top = int(red[0].min())
    overlay = fig[top : top + 200, x1 : x1 + 75]
    assert (overlay[5, 37] == (255, 0, 0)).all() and (overlay[-5, 37] == (0, 0, 255)).all()
    warmth = overlay[..., 0].astype(int) - overlay[..., 2].astype(int)
    warmth[:35], warmth[-35:] = -999, -999  # the bands outside the crop
    y, x = np.unravel_index(np.argmax(warmth), warmth.shape)
    assert abs(y - 100) <= 8 and abs(x - 37) <= 8  # the map's peak, in the crop's centre


def test_a_colour_bar_runs_from_hot_to_cold_and_says_its_scale():
    bar = colour_bar(120, top=3.0)
    ramp = bar[:, 2].astype(int)  # a column inside the gradient
    assert ramp[0, 0] > 100 and ramp[0, 2] < 30 and ramp[-1, 2] > 100 and ramp[-1, 0] < 30  # red top, blue bottom
    assert len({tuple(c) for c in ramp}) > 60  # a gradient, not a few flat colours
    grid = np.random.default_rng(0).random((14, 14))
    fig = explanation_figure(_tall_photo(), {"rollout": grid}, PRE, side=160)
    hot, cold = np.array([128, 0, 0]), np.array([0, 0, 128])  # jet's ends (RGB)
    rows_hot = np.nonzero((np.abs(fig.astype(int) - hot).sum(-1) < 40).any(1))[0]
    rows_cold = np.nonzero((np.abs(fig.astype(int) - cold).sum(-1) < 40).any(1))[0]
    assert rows_hot.size and rows_cold.size and rows_hot.min() < rows_cold.max()  # the bar in the figure
    assert rows_cold.max() - rows_hot.min() > 150


def test_shared_scale_keeps_a_weak_map_weak_per_map_saturates_it():
    strong, weak = np.zeros((4, 4)), np.zeros((4, 4))
    strong[0, 0], weak[3, 3] = 2.0, 0.2
    shared, tops = scale_maps([strong, weak], "shared")
    assert shared[0].max() == 1.0 and np.isclose(shared[1].max(), 0.1) and tops == [2.0, 2.0]
    own, tops = scale_maps([strong, weak], "per_map")
    assert own[0].max() == 1.0 and own[1].max() == 1.0 and np.allclose(tops, [2.0, 0.2])
    photo = np.full((64, 64, 3), 128, np.uint8)
    flat = np.full((8, 8), 0.01)
    figs = {mode: explanation_figure(photo, {"a": strong.repeat(2, 0).repeat(2, 1), "flat": flat}, None,
                                     normalize=mode, side=64) for mode in ("shared", "per_map")}
    # the flat map's panel (third from the left): solid red when scaled to itself, cold when shared
    panel = lambda fig: fig[-30:-10, 4 + 2 * 68 + 10 : 4 + 2 * 68 + 50].reshape(-1, 3).mean(0)  # noqa: E731
    warm = {mode: panel(fig)[0] - panel(fig)[2] for mode, fig in figs.items()}
    assert warm["per_map"] > 30 and warm["shared"] < -30, warm


def test_long_labels_fit_their_panel():
    text = "a very long class name, with commas, that would run over the edge of any small panel 0.93"
    lines, scale = fit_text(text, 120)
    assert len(lines) > 1 and all(cv2.getTextSize(ln, cv2.FONT_HERSHEY_SIMPLEX, scale, 1)[0][0] <= 120 for ln in lines)
    assert " ".join(lines).replace("...", "") in text or lines[-1].endswith("...")
    short, _ = fit_text("cat 0.93", 120)
    assert short == ["cat 0.93"]
    # on a picture: the text band stays inside; in a grid: the title is not cut at a fixed count
    img = put_text(np.full((100, 120, 3), 255, np.uint8), text)
    dark = np.nonzero((img < 50).all(-1))
    assert dark[1].max() < 120 and dark[0].max() > 20  # wrapped onto more lines, inside the width
    grid = image_grid([np.zeros((8, 8, 3), np.uint8)] * 2, titles=["relevance (class token, last layer)", "x"],
                      cell=128)
    assert grid.shape[1] == 2 * 130 + 2
    lines, scale = fit_text(text, 60, max_lines=3)
    assert len(lines) == 3 and lines[-1].endswith("...")
    assert all(cv2.getTextSize(ln, cv2.FONT_HERSHEY_SIMPLEX, scale, 1)[0][0] <= 60 for ln in lines)


def test_explanation_panel_passes_normalize_through_and_draws_on_the_original_picture():
    import torch

    from vision_attn.explain.evaluate import ExplainOptions, explanation_panel

    strong, weak = torch.zeros(1, 4, 4), torch.zeros(1, 4, 4)
    strong[0, 0, 0], weak[0, 3, 3] = 2.0, 0.2
    photo = _tall_photo()
    display = np.full((224, 224, 3), 128, np.uint8)
    panels = {mode: explanation_panel(display, {"a": strong, "b": weak}, 0, "cat 0.93", 0.5, picture=photo, pre=PRE,
                                      normalize=mode) for mode in ("shared", "per_map")}
    assert not np.array_equal(*panels.values())  # (the colour bars' labels differ: "2" and "max")
    assert np.array_equal(panels["shared"], explanation_figure(photo, {"a": strong[0], "b": weak[0]}, PRE,
                                                               "cat 0.93", 0.5, "shared"))
    assert ExplainOptions().normalize == "shared"


def test_explain_command_per_map_overlays_differ_from_shared(tmp_path):
    from PIL import Image

    from vision_attn.commands.predict import main

    from .test_export import _checkpoint, _tasks

    ckpt = _checkpoint(_tasks()["classification"], tmp_path / "m.ckpt")
    images = tmp_path / "imgs"
    images.mkdir()
    Image.fromarray((np.random.default_rng(0).random((40, 56, 3)) * 255).astype(np.uint8)).save(images / "a.png")
    drawn = {}
    for mode in ("shared", "per_map"):
        out = tmp_path / mode
        main(["--ckpt_path", str(ckpt), "--images", str(images), "--output_dir", str(out), "--num_workers", "0",
              "--device", "cpu", "--methods", "rollout", "attention", "--overlay.normalize", mode], explain=True)
        drawn[mode] = cv2.imread(str(out / "overlays" / "a.png.png"))
    assert drawn["shared"] is not None and drawn["per_map"] is not None
    assert not np.array_equal(drawn["shared"], drawn["per_map"])


def _warmth(tile: np.ndarray) -> float:
    """Red less blue of a region (RGB): positive on jet's hot end, negative on its cold end."""
    mean = tile.reshape(-1, 3).astype(float).mean(0)
    return float(mean[0] - mean[2])


def test_detection_tiles_share_one_scale_unless_per_map():
    import torch

    from vision_attn.explain.detection import detection_figure

    photo = np.full((64, 64, 3), 128, np.uint8)
    maps = {"attention": torch.stack([torch.full((4, 4), 1.0), torch.full((4, 4), 0.1)])}  # a strong, a weak map
    objects = [("query 0", "a 0.90", [0, 0, 8, 8]), ("query 1", "b 0.80", [0, 0, 8, 8])]
    figs = {mode: detection_figure(photo, objects, maps, normalize=mode) for mode in ("shared", "per_map")}
    cell, pad, title = 128, 2, 18  # image_grid's cells: the picture, then one tile per object

    def tile(fig, k):
        x, y = pad + k * (cell + pad), pad + title
        return fig[y + 40 : y + cell - 10, x + 40 : x + cell - 10]

    assert _warmth(tile(figs["shared"], 1)) > 30 and _warmth(tile(figs["per_map"], 1)) > 30  # the strong map
    assert _warmth(tile(figs["per_map"], 2)) > 30  # the weak map at its own maximum: saturated
    assert _warmth(tile(figs["shared"], 2)) < -30  # on the figure's scale: weak
    for fig in figs.values():  # a colour bar to the right of the tiles
        assert fig.shape[1] > pad + 3 * (cell + pad)
        right = fig[:, pad + 3 * (cell + pad) :]
        assert (np.abs(right.astype(int) - [128, 0, 0]).sum(-1) < 40).any()  # jet's hot end
    ok, png = cv2.imencode(".png", cv2.cvtColor(figs["shared"], cv2.COLOR_RGB2BGR))
    assert ok and cv2.imdecode(png, cv2.IMREAD_COLOR).shape == figs["shared"].shape


def test_caption_strips_share_one_scale_unless_per_map():
    import torch

    from vision_attn.explain.captioning import caption_figure

    photo = np.full((32, 32, 3), 128, np.uint8)
    maps = {"attention": torch.stack([torch.full((4, 4), 1.0), torch.full((4, 4), 0.1)]),
            "relevance": torch.stack([torch.full((4, 4), 0.5), torch.full((4, 4), 0.5)])}
    figs = {mode: caption_figure(photo, ["a", "circle"], maps, normalize=mode) for mode in ("shared", "per_map")}
    band, cell, pad, title = 22, 128, 2, 18  # caption_strip: the caption band, then image_grid's cells
    strip_h = band + pad + title + cell + pad

    def tile(fig, method, k):
        x, y = pad + k * (cell + pad), method * strip_h + band + pad + title
        return fig[y + 20 : y + cell - 20, x + 20 : x + cell - 20]

    assert _warmth(tile(figs["per_map"], 0, 2)) > 30 and _warmth(tile(figs["shared"], 0, 2)) < -30  # the weak word
    assert _warmth(tile(figs["per_map"], 1, 1)) > 30  # relevance's flat 0.5: saturated on its own scale
    assert _warmth(tile(figs["shared"], 1, 1)) < _warmth(tile(figs["per_map"], 1, 1)) - 30  # half the figure's top
    assert figs["shared"].shape[0] >= 2 * strip_h and figs["shared"].shape[1] > pad + 3 * (cell + pad)  # the bar
