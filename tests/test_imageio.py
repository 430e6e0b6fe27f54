"""read_image: every mode to RGB uint8, EXIF upright, bad files named in one clear error."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from vision_attn.data.imageio import IMAGE_EXTENSIONS, ImageReadError, read_image


def _save(img: Image.Image, path, **kw):
    img.save(path, **kw)
    return path


@pytest.mark.parametrize("mode", ["L", "LA", "RGBA", "CMYK", "P", "RGB", "1", "I;16"])
def test_any_mode_becomes_rgb_uint8(tmp_path, mode):
    ext = ".tif" if mode == "CMYK" else ".png"
    if mode == "I;16":
        img = Image.new("I;16", (20, 10), 1000)
    else:
        img = Image.new("RGB", (20, 10), (200, 100, 50)).convert(mode)
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


def test_every_listed_extension_reads_and_other_formats_are_refused_whatever_the_name(tmp_path):
    """Pillow picks a decoder from the content, not the name: only the listed formats are tried,
    so PostScript (Ghostscript's input), icons or Targa files named ``.png`` are refused."""
    img = Image.new("RGB", (12, 8), (200, 100, 50))
    for ext in IMAGE_EXTENSIONS:
        arr = read_image(_save(img, tmp_path / f"x{ext}"))
        assert arr.shape == (8, 12, 3), ext
    for fmt in ("EPS", "ICO", "TGA", "PCX"):
        path = tmp_path / f"{fmt.lower()}_inside.png"
        img.save(path, fmt)
        with pytest.raises(ImageReadError, match=f"{path.name}.*not a readable image"):
            read_image(path)


def test_decompression_bomb_refused(tmp_path):
    path = _save(Image.new("L", (1000, 1000)), tmp_path / "big.png")
    with pytest.raises(ImageReadError, match="exceeds the limit"):
        read_image(path, max_pixels=500_000)


def test_alpha_is_composited_in_integers_exactly(tmp_path):
    """Every (value, alpha) pair: round(v * a / 255) exactly, within 1 of compositing in float32."""
    v, a = np.meshgrid(np.arange(256, dtype=np.uint8), np.arange(256, dtype=np.uint8), indexing="ij")
    rgba = np.stack([v, 255 - v, v // 2, a], axis=-1)  # (256, 256, 4)
    arr = read_image(_save(Image.fromarray(rgba, "RGBA"), tmp_path / "all.png"))
    exact = np.round(rgba[..., :3].astype(np.float64) * rgba[..., 3:4] / 255.0)
    assert np.array_equal(arr, exact.astype(np.uint8))
    in_float32 = (rgba[..., :3].astype(np.float32) * (rgba[..., 3:4].astype(np.float32) / 255.0)).round()
    assert np.abs(arr.astype(np.int16) - in_float32.astype(np.int16)).max() <= 1


@pytest.mark.parametrize("mode", ["RGBA", "I;16"])
def test_conversion_makes_no_full_size_copy(mode, monkeypatch):
    """Alpha is not composited on a full-size float32 copy (44 bytes per pixel here, 1.9 GB for a
    36-megapixel RGBA PNG): beyond the 3-byte result only a block of rows is held."""
    import tracemalloc

    from vision_attn.data import imageio
    from vision_attn.data.imageio import to_rgb_array

    monkeypatch.setattr(imageio, "_BLOCK_PIXELS", 1 << 15)
    rng = np.random.default_rng(0)
    h, w = 512, 1024
    if mode == "RGBA":
        img = Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "RGBA")
    else:
        img = Image.fromarray(rng.integers(0, 65536, (h, w), dtype=np.uint16))
    tracemalloc.start()
    try:
        out = to_rgb_array(img)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.shape == (h, w, 3) and out.dtype == np.uint8
    assert peak < 4.5 * h * w, f"{peak / (h * w):.1f} bytes per pixel"


def _png_header_only(path, width, height, bit_depth, colour_type):
    """A PNG that declares its size in IHDR and holds no pixel data worth decoding."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, colour_type, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
                     + chunk(b"IEND", b""))
    return path


def test_decoding_is_bounded_by_bytes_before_decoding(tmp_path, monkeypatch):
    from PIL import ImageFile

    def no_decoding(self):
        raise AssertionError("decoding was attempted")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    # 9400 x 9400 RGBA: under PIL's pixel limits (88 M < 89 M) but 337 MiB decoded.
    big = _png_header_only(tmp_path / "big.png", 9400, 9400, 8, 6)
    with pytest.raises(ImageReadError, match="337 MiB decoded, which exceeds the limit of 320 MiB") as info:
        read_image(big)
    assert str(big) in str(info.value)
    # A 36-megapixel 16-bit RGBA PNG, with a tighter cap.
    png16 = _png_header_only(tmp_path / "rgba16.png", 6000, 6000, 16, 6)
    with pytest.raises(ImageReadError, match=r"6000x6000 RGBA image takes 137 MiB decoded.*max_bytes"):
        read_image(png16, max_bytes=100 * 2**20)


def test_fifo_and_folder_are_refused_without_opening(tmp_path):
    import os

    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)  # opening it for reading would block until a writer comes
    with pytest.raises(ImageReadError, match="FIFO") as info:
        read_image(fifo)
    assert str(fifo) in str(info.value)
    (tmp_path / "dir.png").mkdir()
    with pytest.raises(ImageReadError, match="a folder"):
        read_image(tmp_path / "dir.png")


def test_decoded_cache_keeps_a_split_that_fits_and_hands_out_copies():
    from vision_attn.data.imageio import ENTRY_OVERHEAD, DecodedCache

    calls = []

    def read(value, side=2):
        def go():
            calls.append(value)
            return np.full((side, 3, 3), value, dtype=np.uint8)  # 9 * side bytes
        return go

    one = 18 + ENTRY_OVERHEAD
    cache = DecodedCache(items=3, max_bytes=3 * one)  # the split fits
    first = cache.get(0, read(5))
    first[:] = 0  # a transform writing into its input
    again = cache.get(0, read(99))
    assert calls == [5] and again.tolist() == np.full((2, 3, 3), 5).tolist()  # read once, unchanged
    assert again is not cache.get(0, read(99))
    cache.get(1, read(1))
    cache.get(2, read(2, side=40))  # larger than the first image suggested: the budget still holds
    cache.get(3, read(3))
    assert len(cache) == 3 and cache.used == 3 * one and calls == [5, 1, 2, 3]
    cache.get(2, read(2, side=40))
    assert calls == [5, 1, 2, 3, 2]  # not kept: read again


def test_decoded_cache_keeps_nothing_when_the_split_does_not_fit(monkeypatch):
    from vision_attn.data.imageio import ENTRY_OVERHEAD, DecodedCache, cache_budget

    n = []
    read = lambda: n.append(1) or np.zeros((2, 3, 3), dtype=np.uint8)  # noqa: E731
    big = DecodedCache(items=4, max_bytes=3 * (18 + ENTRY_OVERHEAD))  # 4 images do not fit in 3: off
    for _ in range(3):
        big.get(0, read)
    assert len(n) == 3 and len(big) == 0 and big.enabled is False
    monkeypatch.setenv("VISION_ATTN_DECODED_CACHE_MB", "0")
    off = DecodedCache(items=1)
    off.get(0, read), off.get(0, read)
    assert len(n) == 5 and len(off) == 0
    monkeypatch.setenv("VISION_ATTN_DECODED_CACHE_MB", "1.5")
    assert cache_budget() == 3 * 2**19
    for bad in ("lots", "inf", "1e400", "-1", "nan"):
        monkeypatch.setenv("VISION_ATTN_DECODED_CACHE_MB", bad)
        with pytest.raises(ValueError, match="VISION_ATTN_DECODED_CACHE_MB must be a number of MiB"):
            cache_budget()


def test_decoded_cache_budget_is_shared_among_loader_workers(monkeypatch):
    """Each worker holds its own copy of the dataset, so each gets its share of the budget."""
    import torch.utils.data as tud

    from vision_attn.data.imageio import DEFAULT_CACHE_BYTES, DecodedCache

    monkeypatch.delenv("VISION_ATTN_DECODED_CACHE_MB", raising=False)
    assert DecodedCache(items=1).max_bytes == DEFAULT_CACHE_BYTES
    monkeypatch.setattr(tud, "get_worker_info", lambda: type("Info", (), {"num_workers": 4})())
    assert DecodedCache(items=1).max_bytes == DEFAULT_CACHE_BYTES // 4
