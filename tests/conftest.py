"""Shared fixtures: offline, CPU, tiny models (image 32, depth 2), a small shapes dataset."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.utils.data

from ._ci_policy import pytest_runtest_makereport  # noqa: F401  (a hook: skips fail under CI)

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never touch the hub in tests
os.environ.setdefault("VISION_ATTN_JAVA_METRICS", "0")  # METEOR starts a JVM: only the tests that ask for it
if os.environ.get("PYTEST_XDIST_WORKER"):
    # one thread per worker, inherited by the commands and notebook kernels the tests start:
    # two workers on two cores, never more threads than cores (oversubscription is slow)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))

# A DataLoader whose worker raised (the tests of unreadable images do that on purpose) leaves the
# worker waiting, and PyTorch joins it with a timeout of this many seconds (5) when the loader is
# collected, in whichever later test that happens; the join timeout alone reads it at run time.
torch.utils.data._utils.MP_STATUS_CHECK_INTERVAL = 0.5

REPO = Path(__file__).resolve().parents[1]

# A from-scratch ViT small enough for CPU tests.
TINY_VIT = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)


def save_timm_weights(name: str, folder: Path, seed: int = 0) -> Path:
    """``folder/<name>.safetensors``: a timm model made and saved by plain timm code (random
    weights, its default head), as a user saves weights for ``--weights_file``."""
    import safetensors.torch
    import timm

    torch.manual_seed(seed)
    model = timm.create_model(name, pretrained=False)
    path = folder / f"{name}.safetensors"
    safetensors.torch.save_file(model.state_dict(), str(path))
    return path


def write_exif_rotated_jpeg(root: Path) -> Path:
    """``root/val/a.jpg`` (and an empty ``root/annotations/``): 40x20 stored pixels with a white
    square at x 28..36, y 2..10, and EXIF orientation 6 (rotate 90 degrees clockwise to display)."""
    import numpy as np
    from PIL import Image

    (root / "val").mkdir()
    (root / "annotations").mkdir()
    stored = np.zeros((20, 40, 3), np.uint8)
    stored[2:10, 28:36] = 255
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(stored).save(root / "val" / "a.jpg", exif=exif, quality=100)
    return root / "val" / "a.jpg"


@pytest.fixture(scope="session", autouse=True)
def _data_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """All generated datasets of the session go to one temporary cache folder."""
    cache = tmp_path_factory.mktemp("vision_attn_data")
    old = os.environ.get("VISION_ATTN_DATA")
    os.environ["VISION_ATTN_DATA"] = str(cache)
    yield cache
    if old is None:
        os.environ.pop("VISION_ATTN_DATA", None)
    else:
        os.environ["VISION_ATTN_DATA"] = old


@pytest.fixture(scope="session")
def shapes_root(_data_cache: Path) -> Path:
    from vision_attn.data.synthetic import ShapesConfig, ensure_shapes_classification

    return ensure_shapes_classification(ShapesConfig(image_size=32, num_train=60, num_val=25, seed=3), _data_cache)


@pytest.fixture
def tiny_encoder():
    from vision_attn import create_encoder

    torch.manual_seed(0)
    return create_encoder("vit_tiny_patch16_224", **TINY_VIT).eval()


def cached_and_uncached_epochs(make_dataset, monkeypatch, seed: int = 3) -> tuple[list, list]:
    """Items of a second epoch over ``make_dataset()`` with the decoded-image cache on (the
    first epoch filled it) and of one epoch over a fresh dataset with it off, both drawn after
    seeding every random source with ``seed``: a training transform then draws the same."""
    import random

    import numpy as np
    import torch

    def epoch(ds):
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        return [ds[i] for i in range(len(ds))]

    monkeypatch.delenv("VISION_ATTN_DECODED_CACHE_MB", raising=False)
    cached = make_dataset()
    epoch(cached)
    on = epoch(cached)
    assert cached._decoded is not None and len(cached._decoded) == len(cached)  # every image kept
    monkeypatch.setenv("VISION_ATTN_DECODED_CACHE_MB", "0")
    uncached = make_dataset()
    off = epoch(uncached)
    assert len(uncached._decoded) == 0
    return on, off


def assert_same_items(a, b) -> None:
    """Items (tuples / dicts / lists of tensors, arrays and plain values) equal element by element."""
    import numpy as np
    import torch

    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same_items(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_items(x, y)
    else:
        assert a == b


CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="session")
def browser():
    """Headless Chromium; installed from Debian's packages when missing (skipped, saying why, where impossible)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is part of the dev extra")
    if not Path(CHROMIUM).exists():
        if shutil.which("apt-get") is None:
            pytest.skip("no Chromium at /usr/bin/chromium and no apt-get to install Debian's chromium package")
        install = ["apt-get", "install", "-y", "-q", "chromium"]
        res = subprocess.run(install, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=600)
            res = subprocess.run(install, capture_output=True, text=True, timeout=600)
        if res.returncode != 0 or not Path(CHROMIUM).exists():
            pytest.skip(f"Debian's chromium package could not be installed: {res.stderr.strip()[-300:]}")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()
