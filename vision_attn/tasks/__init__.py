"""LightningModule systems, one per task, sharing :class:`VisionTask`."""

from vision_attn.tasks.base import VisionTask, load_task
from vision_attn.tasks.classification import ClassificationTask

__all__ = ["ClassificationTask", "VisionTask", "load_task"]
