"""Data: safe decoding, transforms, the embedded synthetic data and one DataModule per task."""

from vision_attn.data.classification import DataError, ImageFolderDataModule, ImageFolderDataset
from vision_attn.data.detection import CocoDetection, DetectionDataModule
from vision_attn.data.imageio import ImageReadError, read_image
from vision_attn.data.synthetic import ShapesConfig, ensure_shapes_classification

__all__ = [
    "CocoDetection",
    "DetectionDataModule",
    "DataError",
    "ImageFolderDataModule",
    "ImageFolderDataset",
    "ImageReadError",
    "ShapesConfig",
    "ensure_shapes_classification",
    "read_image",
]
