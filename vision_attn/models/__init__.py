"""Models: the timm ViT encoder and the task heads (plain ``nn.Module``s)."""

from vision_attn.models.captioner import CaptionDecoder, Generation, GenerationOptions
from vision_attn.models.classifier import ClassificationHead
from vision_attn.models.encoder import EncoderOutput, ViTEncoder, create_encoder
from vision_attn.models.smalldata import (
    LocalitySelfAttention,
    SequencePooling,
    ShiftedPatchTokenizer,
)

__all__ = [
    "CaptionDecoder",
    "ClassificationHead",
    "EncoderOutput",
    "Generation",
    "GenerationOptions",
    "LocalitySelfAttention",
    "SequencePooling",
    "ShiftedPatchTokenizer",
    "ViTEncoder",
    "create_encoder",
]
