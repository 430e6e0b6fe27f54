"""read_image: every mode to RGB uint8, EXIF upright, bad files named in one clear error."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from vision_attn.data.imageio import ImageReadError, read_image


def _save(img: Image.Image, path, **kw):
    img.save(path, **kw)
    return path


@pytest.mark.parametrize("mode", ["L", "LA", "RGBA", "CMYK", "P", "RGB", "1", "I;16"])
def test_any_mode_becomes_rgb_uint8(tmp_path, mode):
    ext = ".tif" if mode == "CMYK" else ".png"
    img = Image.new("RGB", (20, 10), (200, 100, 50)).convert(mode) if mode != "I;16" else Image.new("I;16", (20, 10), 1000)
    arr = read_image(_save(img, tmp_path / f"x{ext}"))
    assert arr.shape == (10, 20, 3) and arr.dtype == np.uint8


def test_16_bit_is_scaled_not_clipped(tmp_path):
    data = np.array([[0, 32896, 65535]], dtype=np.uint16)
    arr = read_image(_save(Image.fromarray(data), tmp_path / "d.png"))
    assert arr[0, :, 0].tolist() == [0, 128, 255]


def test_transparency_is_composited_on_black(tmp_path):
    rgba = np.zeros((2, 2, 4), np.uint8)
    rgba[..., 0] = 200
    rgba[0, 0, 3] = 255  # one opaque pixel, the rest transparent
    rgba[0, 1, 3] = 128
    arr = read_image(_save(Image.fromarray(rgba, "RGBA"), tmp_path / "t.png"))
    assert arr[0, 0, 0] == 200 and arr[1, 1, 0] == 0 and 95 <= arr[0, 1, 0] <= 105
    p = Image.new("P", (2, 1))
    p.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    p.putpixel((0, 0), 0)
    p.putpixel((1, 0), 1)
    p.info["transparency"] = 1
    arr = read_image(_save(p, tmp_path / "p.png", transparency=1))
    assert arr[0, 0].tolist() == [255, 0, 0] and arr[0, 1].tolist() == [0, 0, 0]


def test_exif_orientation_is_applied(tmp_path):
    img = Image.new("RGB", (30, 10), (0, 0, 0))
    img.paste((255, 255, 255), (0, 0, 5, 10))  # white stripe on the left
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    path = tmp_path / "rot.jpg"
    img.save(path, exif=exif, quality=95)
    arr = read_image(path)
    assert arr.shape == (30, 10, 3)  # upright: portrait
    assert arr[:5].mean() > 200 and arr[-5:].mean() < 50  # the stripe is now on top


def test_bad_files_raise_one_clear_error_naming_the_file(tmp_path):
    empty = tmp_path / "empty.jpg"
    empty.write_bytes(b"")
    text = tmp_path / "notes.jpg"
    text.write_text("not an image")
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(buf, "JPEG")
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(buf.getvalue()[: len(buf.getvalue()) // 2])
    for path, reason in [
        (tmp_path / "missing.png", "no such file"),
        (empty, "empty"),
        (text, "not a readable image"),
        (truncated, "truncated"),
    ]:
        with pytest.raises(ImageReadError, match=reason) as info:
            read_image(path)
        assert str(path) in str(info.value)


def test_decompression_bomb_refused(tmp_path):
    path = _save(Image.new("L", (1000, 1000)), tmp_path / "big.png")
    with pytest.raises(ImageReadError, match="exceeds the limit"):
        read_image(path, max_pixels=500_000)
