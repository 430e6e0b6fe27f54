"""LightningModule systems, one per task, sharing :class:`VisionTask`."""

from vision_attn.tasks.base import VisionTask, load_task
from vision_attn.tasks.captioning import CaptioningTask
from vision_attn.tasks.classification import ClassificationTask
from vision_attn.tasks.detection import DetectionTask

__all__ = ["CaptioningTask", "ClassificationTask", "DetectionTask", "VisionTask", "load_task"]
