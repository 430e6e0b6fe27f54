"""Data: safe decoding, transforms, the embedded synthetic data and one DataModule per task."""

from vision_attn.data.captioning import CaptioningDataModule, CocoCaptions
from vision_attn.data.classification import DataError, ImageFolderDataModule, ImageFolderDataset
from vision_attn.data.detection import CocoDetection, DetectionDataModule
from vision_attn.data.imageio import ImageReadError, read_image
from vision_attn.data.synthetic import (
    SceneSetConfig,
    ShapesConfig,
    ensure_shapes_classification,
    ensure_shapes_coco,
)
from vision_attn.data.tokenizer import WordTokenizer, normalize_caption

__all__ = [
    "CaptioningDataModule",
    "CocoCaptions",
    "CocoDetection",
    "DetectionDataModule",
    "DataError",
    "ImageFolderDataModule",
    "ImageFolderDataset",
    "ImageReadError",
    "SceneSetConfig",
    "ShapesConfig",
    "WordTokenizer",
    "ensure_shapes_classification",
    "ensure_shapes_coco",
    "normalize_caption",
    "read_image",
]
