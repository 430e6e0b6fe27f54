"""Data: safe decoding, transforms, the embedded synthetic data and one DataModule per task (with its
argument groups: :class:`Batching`, the layouts, the augmentation)."""

from vision_attn.data.captioning import CaptioningDataModule, CaptionOptions, CocoCaptions
from vision_attn.data.classification import (
    DataError,
    ImageAugment,
    ImageFolderDataModule,
    ImageFolderDataset,
)
from vision_attn.data.detection import CocoDetection, DetectionDataModule, DetectionTransform
from vision_attn.data.imageio import ImageReadError, read_image
from vision_attn.data.images import ImagesDataModule, UnlabeledImages
from vision_attn.data.layout import FolderLayout, SplitLayout
from vision_attn.data.loading import Batching
from vision_attn.data.synthetic import (
    SceneSetConfig,
    ShapesConfig,
    ensure_shapes_classification,
    ensure_shapes_coco,
)
from vision_attn.data.tokenizer import WordTokenizer, normalize_caption

__all__ = [
    "Batching",
    "CaptionOptions",
    "CaptioningDataModule",
    "CocoCaptions",
    "CocoDetection",
    "DetectionDataModule",
    "DetectionTransform",
    "DataError",
    "FolderLayout",
    "ImageAugment",
    "ImageFolderDataModule",
    "ImageFolderDataset",
    "ImageReadError",
    "ImagesDataModule",
    "SceneSetConfig",
    "SplitLayout",
    "UnlabeledImages",
    "ShapesConfig",
    "WordTokenizer",
    "ensure_shapes_classification",
    "ensure_shapes_coco",
    "normalize_caption",
    "read_image",
]
