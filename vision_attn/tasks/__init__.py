"""LightningModule systems, one per task, sharing :class:`VisionTask`; :data:`TASKS` maps a
task name to its class (:func:`register_task`). Each task's constructor takes its settings in
named groups (dataclasses), re-exported here with the tasks, as are their inference options
(:attr:`VisionTask.inference_options`: ``ClassificationOptions``, ``DetectionOptions``,
``GenerationOptions``, ``EmbeddingOptions``). :class:`PretrainTask` pretrains an encoder on
unlabelled images (masked image modelling)."""

from vision_attn.models.captioner import DecoderConfig, GenerationOptions
from vision_attn.models.classifier import ClassifierConfig
from vision_attn.models.detr import DETRConfig
from vision_attn.tasks.base import TASKS, Explained, VisionTask, load_task, register_task
from vision_attn.tasks.captioning import CaptioningTask
from vision_attn.tasks.captioning_config import CaptionTraining, SCSTConfig
from vision_attn.tasks.classification import ClassificationOptions, ClassificationTask, MixConfig
from vision_attn.tasks.detection import DetectionOptions, DetectionTask, SetLossConfig
from vision_attn.tasks.embedding import EmbeddingOptions, EmbeddingTask
from vision_attn.tasks.optim import Optimization
from vision_attn.tasks.pretrain import MaskingConfig, PixelDecoderConfig, PretrainTask

__all__ = ["TASKS", "CaptionTraining", "CaptioningTask", "ClassificationOptions", "ClassificationTask",
           "ClassifierConfig", "DETRConfig", "DecoderConfig", "DetectionOptions", "DetectionTask", "EmbeddingOptions",
           "EmbeddingTask", "Explained",
           "GenerationOptions", "MaskingConfig", "MixConfig", "Optimization", "PixelDecoderConfig",
           "PretrainTask", "SCSTConfig", "SetLossConfig", "VisionTask", "load_task",
           "register_task"]
