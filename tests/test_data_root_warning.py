"""A data module built for the user's data without ``--data.root`` says so plainly: one WARNING
that names the flag and that the embedded shapes dataset is generated and used instead. Asking
for the embedded data (``synthetic`` settings, as the shapes configs do) or giving a root warns
of nothing."""

from __future__ import annotations

import logging

import pytest

import vision_attn.data.classification as classification
import vision_attn.data.detection as detection
from vision_attn.data.captioning import CaptioningDataModule
from vision_attn.data.classification import ImageFolderDataModule
from vision_attn.data.detection import DetectionDataModule
from vision_attn.data.loading import Batching
from vision_attn.data.synthetic import SceneSetConfig, ShapesConfig, ensure_shapes_coco

TINY_SCENES = SceneSetConfig(image_size=32, num_train=4, num_val=2, captions_per_image=2)
BATCHING = Batching(num_workers=0)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.fixture
def scenes_root(tmp_path_factory):
    return ensure_shapes_coco(TINY_SCENES, tmp_path_factory.mktemp("scenes"))


@pytest.fixture
def embedded(monkeypatch, shapes_root, scenes_root):
    """The embedded datasets replaced by small ones (the defaults are thousands of images)."""
    made: list[str] = []
    monkeypatch.setattr(classification, "ensure_shapes_classification",
                        lambda *a: made.append("classification") or shapes_root)
    monkeypatch.setattr(detection, "ensure_shapes_coco", lambda *a: made.append("coco") or scenes_root)
    return made


@pytest.mark.parametrize("module", [ImageFolderDataModule, DetectionDataModule, CaptioningDataModule])
def test_no_data_root_warns_that_the_embedded_shapes_data_is_used(caplog, embedded, module):
    with caplog.at_level(logging.WARNING):
        dm = module(batching=BATCHING)
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "no --data.root was given" in warnings[0]
    assert "generating" in warnings[0] and "embedded synthetic shapes dataset" in warnings[0]
    assert embedded == ["classification" if module is ImageFolderDataModule else "coco"]
    assert dm.root.is_dir()


@pytest.mark.parametrize("module", [ImageFolderDataModule, DetectionDataModule, CaptioningDataModule])
def test_asking_for_the_embedded_data_or_giving_a_root_warns_of_nothing(caplog, embedded, shapes_root,
                                                                        scenes_root, module):
    synthetic = ShapesConfig() if module is ImageFolderDataModule else TINY_SCENES
    root = shapes_root if module is ImageFolderDataModule else scenes_root
    with caplog.at_level(logging.WARNING):
        module(synthetic=synthetic, batching=BATCHING)
        module(root=str(root), batching=BATCHING)
    assert not [w for w in _warnings(caplog) if "--data.root" in w]
