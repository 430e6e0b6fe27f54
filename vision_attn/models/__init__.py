"""Models: the timm ViT encoder and the task heads (plain ``nn.Module``s)."""

from vision_attn.models.captioner import CaptionDecoder, Generation, GenerationOptions
from vision_attn.models.classifier import ClassificationHead
from vision_attn.models.encoder import EncoderOutput, ViTEncoder, create_encoder

__all__ = [
    "CaptionDecoder",
    "ClassificationHead",
    "EncoderOutput",
    "Generation",
    "GenerationOptions",
    "ViTEncoder",
    "create_encoder",
]
