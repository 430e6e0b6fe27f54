"""LightningModule systems, one per task, sharing :class:`VisionTask`; :data:`TASKS` maps a
task name to its class (:func:`register_task`)."""

from vision_attn.tasks.base import TASKS, Explained, VisionTask, load_task, register_task
from vision_attn.tasks.captioning import CaptioningTask
from vision_attn.tasks.classification import ClassificationTask
from vision_attn.tasks.detection import DetectionTask
from vision_attn.tasks.optim import Optimization

__all__ = ["TASKS", "CaptioningTask", "ClassificationTask", "DetectionTask", "Explained", "Optimization",
           "VisionTask", "load_task", "register_task"]
