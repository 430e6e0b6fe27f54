"""Models: the timm ViT encoder and the task heads (plain ``nn.Module``s)."""

from vision_attn.models.classifier import ClassificationHead
from vision_attn.models.encoder import EncoderOutput, ViTEncoder, create_encoder

__all__ = ["ClassificationHead", "EncoderOutput", "ViTEncoder", "create_encoder"]
