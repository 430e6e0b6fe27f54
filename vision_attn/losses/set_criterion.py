"""DETR's set prediction loss: match, then classify every query and regress the matched boxes.

:class:`SetCriterion` returns a dict of *named, unweighted* terms (``loss_ce``, ``loss_bbox``,
``loss_giou``, their auxiliary-layer copies ``loss_ce_0`` ..., and ``cardinality_error``, which
is only logged) and owns the weight table ``weight_dict``; :meth:`SetCriterion.total` is the one
place where the weighted sum is formed.

Box overlaps and the sigmoid focal loss (Lin et al. 2017) are ``torchvision.ops``'
(:func:`sigmoid_focal_loss` is re-exported here under the name the tests and users import).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torchvision.ops import sigmoid_focal_loss

from vision_attn.boxes import box_cxcywh_to_xyxy, generalized_box_iou
from vision_attn.distributed import mean_across_processes
from vision_attn.losses.matcher import HungarianMatcher, check_focal_alpha

__all__ = ["SetCriterion", "sigmoid_focal_loss"]


def _num_boxes(targets: list[dict[str, Tensor]], device: torch.device, across_processes: bool) -> float:
    """Number of target boxes (averaged over processes when ``across_processes``), at least 1."""
    n = torch.tensor(float(sum(len(t["labels"]) for t in targets)), device=device)
    if across_processes:
        n = mean_across_processes(n)
    return max(float(n), 1.0)


class SetCriterion(nn.Module):
    """Hungarian-matched set loss with auxiliary decoding losses.

    Args:
        num_classes: ``C`` real classes (softmax heads have ``C + 1`` outputs, the last being
            "no object"; focal heads have ``C``).
        matcher: the :class:`HungarianMatcher`.
        weight_ce: weight of the classification term.
        weight_bbox: weight of the L1 box term.
        weight_giou: weight of the GIoU term.
        eos_coef: relative weight of the "no object" class in the softmax cross-entropy.
        focal: sigmoid focal loss over ``C`` classes instead of softmax cross-entropy.
        focal_alpha: focal loss alpha, in ``[0, 1]`` (or ``-1``: no class weighting).
        focal_gamma: focal loss gamma.
    """

    def __init__(
        self,
        num_classes: int,
        matcher: HungarianMatcher,
        weight_ce: float = 1.0,
        weight_bbox: float = 5.0,
        weight_giou: float = 2.0,
        eos_coef: float = 0.1,
        focal: bool = False,
        focal_alpha: float = 0.25,
        focal_gamma: float = 2.0,
    ) -> None:
        super().__init__()
        check_focal_alpha(focal_alpha)
        self.num_classes = num_classes
        self.matcher = matcher
        self.base_weights = {"loss_ce": weight_ce, "loss_bbox": weight_bbox, "loss_giou": weight_giou}
        self.focal, self.focal_alpha, self.focal_gamma = focal, focal_alpha, focal_gamma
        empty = torch.ones(num_classes + 1)
        empty[-1] = eos_coef
        self.register_buffer("empty_weight", empty)

    def weight_dict(self, num_aux: int) -> dict[str, float]:
        """Weights of every term, auxiliary layers included (``loss_ce_0``, ...)."""
        weights = dict(self.base_weights)
        for i in range(num_aux):
            weights.update({f"{k}_{i}": v for k, v in self.base_weights.items()})
        return weights

    def total(self, terms: dict[str, Tensor], num_aux: int = 0) -> Tensor:
        """The weighted sum of the loss terms — computed here and nowhere else."""
        weights = self.weight_dict(num_aux)
        return sum(weights[k] * v for k, v in terms.items() if k in weights)

    def _terms(self, logits: Tensor, boxes: Tensor, targets: list[dict[str, Tensor]], num_boxes: float) -> dict[str, Tensor]:
        indices = self.matcher(logits, boxes, targets)
        b_idx = torch.cat([torch.full_like(p, i) for i, (p, _) in enumerate(indices)]).to(logits.device)
        q_idx = torch.cat([p for p, _ in indices]).to(logits.device)
        matched_labels = torch.cat([t["labels"][j] for t, (_, j) in zip(targets, indices, strict=True)]).to(logits.device)
        matched_boxes = torch.cat([t["boxes"][j] for t, (_, j) in zip(targets, indices, strict=True)]).to(boxes.device)
        if self.focal:
            onehot = torch.zeros_like(logits)
            onehot[b_idx, q_idx, matched_labels] = 1.0
            focal = sigmoid_focal_loss(logits, onehot, self.focal_alpha, self.focal_gamma, reduction="sum")
            loss_ce = focal / num_boxes
        else:
            classes = torch.full(logits.shape[:2], self.num_classes, dtype=torch.int64, device=logits.device)
            classes[b_idx, q_idx] = matched_labels
            loss_ce = F.cross_entropy(logits.transpose(1, 2), classes, weight=self.empty_weight.to(logits.dtype))
        src = boxes[b_idx, q_idx]
        loss_bbox = F.l1_loss(src, matched_boxes, reduction="none").sum() / num_boxes
        giou = generalized_box_iou(box_cxcywh_to_xyxy(src), box_cxcywh_to_xyxy(matched_boxes)).diagonal()
        loss_giou = (1 - giou).sum() / num_boxes
        with torch.no_grad():  # predicted "objects" vs true count, per image (logged only)
            if self.focal:
                n_pred = (logits.sigmoid().amax(-1) > 0.5).sum(1)
            else:
                n_pred = (logits.argmax(-1) != self.num_classes).sum(1)
            n_true = torch.tensor([len(t["labels"]) for t in targets], device=logits.device)
            card = (n_pred.float() - n_true.float()).abs().mean()
        return {"loss_ce": loss_ce, "loss_bbox": loss_bbox, "loss_giou": loss_giou, "cardinality_error": card}

    def forward(self, outputs: dict, targets: list[dict[str, Tensor]], across_processes: bool = True) -> dict[str, Tensor]:
        """Loss terms of the final layer and of every ``outputs["aux_outputs"]`` layer.

        Args:
            outputs: ``pred_logits [B, Q, C(+1)]``, ``pred_boxes [B, Q, 4]`` (cxcywh in [0, 1]) and
                optionally ``aux_outputs``: a list of such dicts, one per earlier decoder layer.
            targets: per image ``labels [G]`` (0..C-1) and ``boxes [G, 4]`` (cxcywh in [0, 1]).
            across_processes: normalise by the box count averaged over processes (training
                under DDP: the gradient of the global batch); ``False`` in evaluation, whose
                steps must not synchronise per batch.
        """
        num_boxes = _num_boxes(targets, outputs["pred_logits"].device, across_processes)
        terms = self._terms(outputs["pred_logits"], outputs["pred_boxes"], targets, num_boxes)
        for i, aux in enumerate(outputs.get("aux_outputs", [])):
            aux_terms = self._terms(aux["pred_logits"], aux["pred_boxes"], targets, num_boxes)
            terms.update({f"{k}_{i}": v for k, v in aux_terms.items() if k != "cardinality_error"})
        return terms
