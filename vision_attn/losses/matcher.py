"""Hungarian matching of predictions to targets (DETR, Carion et al. 2020).

Each image's ``Q`` predictions are matched one-to-one to its ``G <= Q`` targets so that the
total cost — class cost + L1 box cost + GIoU cost, each weighted — is minimal
(``scipy.optimize.linear_sum_assignment``). Unmatched predictions are trained towards
"no object". The focal class cost is ``torchvision.ops.sigmoid_focal_loss`` of the target class
minus that of its absence (computed from the logits, so it keeps ordering confident mistakes
where ``log(p + eps)`` would saturate).
"""

from __future__ import annotations

import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor, nn
from torchvision.ops import sigmoid_focal_loss

from vision_attn.boxes import box_cxcywh_to_xyxy, generalized_box_iou

__all__ = ["HungarianMatcher", "check_focal_alpha"]


def check_focal_alpha(alpha: float) -> None:
    """Refuse a focal-loss ``alpha`` that ``torchvision.ops.sigmoid_focal_loss`` refuses (at its
    first step), when the model is built."""
    if not (0 <= alpha <= 1 or alpha == -1):
        raise ValueError(f"focal_alpha {alpha} must lie in [0, 1], or be -1 for no class weighting")


class HungarianMatcher(nn.Module):
    """Optimal one-to-one assignment of predictions to targets, per image.

    Args:
        cost_class: weight of the class cost (``-p(class)``, or the focal-loss cost).
        cost_bbox: weight of the L1 distance between ``cxcywh`` boxes.
        cost_giou: weight of ``-GIoU``.
        focal: use the focal-loss class cost (for sigmoid classifiers) instead of ``-softmax``.
        focal_alpha: focal loss alpha, in ``[0, 1]`` (or ``-1``: no class weighting).
        focal_gamma: focal loss gamma.
    """

    def __init__(
        self,
        cost_class: float = 1.0,
        cost_bbox: float = 5.0,
        cost_giou: float = 2.0,
        focal: bool = False,
        focal_alpha: float = 0.25,
        focal_gamma: float = 2.0,
    ) -> None:
        super().__init__()
        if cost_class == 0 and cost_bbox == 0 and cost_giou == 0:
            raise ValueError("all matcher costs are 0")
        check_focal_alpha(focal_alpha)
        self.cost_class, self.cost_bbox, self.cost_giou = cost_class, cost_bbox, cost_giou
        self.focal, self.focal_alpha, self.focal_gamma = focal, focal_alpha, focal_gamma

    def cost_matrix(self, logits: Tensor, boxes: Tensor, labels: Tensor, target_boxes: Tensor) -> Tensor:
        """``[Q, G]`` cost of one image: ``logits [Q, C(+1)]``, ``boxes [Q, 4]`` and targets (cxcywh)."""
        if self.focal:
            x = logits[:, labels]  # (Q, G)
            a, g = self.focal_alpha, self.focal_gamma
            pos = sigmoid_focal_loss(x, torch.ones_like(x), a, g)  # the loss if it were the class
            neg = sigmoid_focal_loss(x, torch.zeros_like(x), a, g)  # the loss if it were not
            c_class = pos - neg
        else:
            c_class = -logits.softmax(-1)[:, labels]
        c_bbox = torch.cdist(boxes, target_boxes, p=1)
        c_giou = -generalized_box_iou(box_cxcywh_to_xyxy(boxes), box_cxcywh_to_xyxy(target_boxes))
        return self.cost_bbox * c_bbox + self.cost_class * c_class + self.cost_giou * c_giou

    @torch.no_grad()
    def forward(self, pred_logits: Tensor, pred_boxes: Tensor,
                targets: list[dict[str, Tensor]]) -> list[tuple[Tensor, Tensor]]:
        """Match a batch.

        Args:
            pred_logits: ``[B, Q, C(+1)]``.
            pred_boxes: ``[B, Q, 4]`` ``cxcywh`` in ``[0, 1]``.
            targets: per image ``{"labels": [G], "boxes": [G, 4] cxcywh}``.

        Returns:
            Per image ``(pred_idx, target_idx)``, int64 tensors of equal length ``min(Q, G)``,
            sorted by ``pred_idx``.
        """
        sizes = [len(t["labels"]) for t in targets]
        empty = torch.empty(0, dtype=torch.int64)
        if sum(sizes) == 0:
            return [(empty, empty) for _ in targets]
        b, q = pred_logits.shape[:2]
        # one cost matrix for the whole batch ([B*Q, sum G], as DETR computes it), then one block
        # per image: the same costs as cost_matrix per image, without a dozen small ops per image
        labels = torch.cat([t["labels"] for t in targets])
        target_boxes = torch.cat([t["boxes"] for t in targets]).float()
        cost = self.cost_matrix(pred_logits.flatten(0, 1).float(), pred_boxes.flatten(0, 1).float(), labels,
                                target_boxes).view(b, q, -1).cpu().numpy()
        out = []
        start = 0
        for i, g in enumerate(sizes):
            if g == 0:
                out.append((empty, empty))
                continue
            rows, cols = linear_sum_assignment(cost[i, :, start : start + g])
            start += g
            order = rows.argsort()
            out.append((torch.as_tensor(rows[order], dtype=torch.int64),
                        torch.as_tensor(cols[order], dtype=torch.int64)))
        return out
