"""DETR's set prediction loss: match, then classify every query and regress the matched boxes.

:class:`SetCriterion` returns a dict of *named, unweighted* terms (``loss_ce``, ``loss_bbox``,
``loss_giou``, their auxiliary-layer copies ``loss_ce_0`` ..., and ``cardinality_error``, which
is only logged) and owns the weight table ``weight_dict``; :meth:`SetCriterion.total` is the one
place where the weighted sum is formed.

The head's training aids (see :mod:`vision_attn.models.detr`) add terms of the same three kinds,
present only when the head's outputs carry them:

- ``loss_dn_ce``, ``loss_dn_bbox``, ``loss_dn_giou`` (+ ``_0`` ... per auxiliary layer): the
  denoising queries' reconstruction (DN-DETR / DINO). No matching: each positive denoising
  query is paired with the target it was made from (class + L1 + GIoU); DINO's negatives learn
  "no object" (class term only); padding slots are ignored. Normalised by the box count times
  the number of groups (each group holds every target once).
- ``loss_enc_ce``, ``loss_enc_bbox``, ``loss_enc_giou``: the encoder tokens picked by mixed query
  selection, Hungarian-matched like the decoder's output (DINO's two-stage loss).
- ``loss_dense_ce``, ``loss_dense_bbox``, ``loss_dense_giou``: every encoder token's class and box
  (the head's ``dense_encoder``), assigned one-to-many without matching
  (:func:`dense_assignment`: a token belongs to the smallest box its centre lies in, and each
  box owns at least the token nearest its centre; the rest are background), as the auxiliary
  dense heads of Co-DETR (Zong et al. 2023) with FCOS's rule (Tian et al. 2019). Normalised by
  the number of assigned tokens.
- ``loss_o2m_ce``, ``loss_o2m_bbox``, ``loss_o2m_giou`` (+ ``_0`` ...): the one-to-many query
  sets, each Hungarian-matched on its own (Group DETR: one set per group, the terms summed over
  groups) to the targets repeated ``o2m_repeat`` times (H-DETR; 1 for Group DETR).

With ``fdr`` (the head's fine-grained distribution refinement, :mod:`vision_attn.models.fdr`):
``loss_fgl`` (+ ``_0`` ...), the matched queries' edge distributions against their objects
(:func:`~vision_attn.models.fdr.localization_loss`), and ``loss_ddf_0`` ... for every earlier
layer, its distributions distilled from the last layer's
(:func:`~vision_attn.models.fdr.distillation_loss`, matched queries: those of the last layer's
matching). Weights ``weight_fgl`` and ``weight_ddf`` (D-FINE's 0.15 and 1.5).

Each carries the weight of its base term (``weight_ce``, ``weight_bbox``, ``weight_giou``), and
is in the weight table only when the criterion is built for it (``dn``, ``enc``, ``o2m``): with
all three off the table, the terms and the total are exactly DETR's.

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
from vision_attn.models.fdr import distillation_loss, localization_loss

__all__ = ["SetCriterion", "box_iou_pairs", "dense_assignment", "matchability_aware_loss", "sigmoid_focal_loss"]


def dense_assignment(centres: Tensor, boxes: Tensor, mask: Tensor | None = None) -> Tensor:
    """The target box of each token, one-to-many (FCOS's rule, Tian et al. 2019): ``[N]`` indices
    into ``boxes`` (``-1``: background).

    A token whose centre (``centres [N, 2]``, ``(x, y)`` fractions) lies inside a box
    (``boxes [G, 4]`` ``cxcywh``) belongs to it, to the smallest such box where several overlap;
    every box also owns the real token nearest its centre, so that a box smaller than a token
    still has one. ``mask [N]`` (``True`` = real token): padding tokens are never assigned.
    """
    n = centres.shape[0]
    owner = torch.full((n,), -1, dtype=torch.int64, device=centres.device)
    if len(boxes) == 0 or n == 0:
        return owner
    boxes = boxes.to(centres.dtype)
    offset = (centres[:, None, :] - boxes[None, :, :2]).abs()  # (N, G, 2)
    inside = (offset <= boxes[None, :, 2:] / 2).all(-1)
    if mask is not None:
        inside &= mask[:, None]
    area = (boxes[:, 2] * boxes[:, 3])[None, :].expand(n, -1)
    smallest = torch.where(inside, area, torch.full_like(area, float("inf"))).argmin(1)
    owner = torch.where(inside.any(1), smallest, owner)
    dist = (centres[:, None, :] - boxes[None, :, :2]).pow(2).sum(-1)  # (N, G)
    if mask is not None:
        dist = dist.masked_fill(~mask[:, None], float("inf"))
    owner[dist.argmin(0)] = torch.arange(len(boxes), device=centres.device)
    return owner


def box_iou_pairs(a: Tensor, b: Tensor) -> Tensor:
    """IoU of each box of ``a [N, 4]`` with the box of ``b [N, 4]`` in the same row (xyxy)."""
    lt, rb = torch.maximum(a[:, :2], b[:, :2]), torch.minimum(a[:, 2:], b[:, 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    area = (a[:, 2:] - a[:, :2]).clamp(min=0).prod(-1) + (b[:, 2:] - b[:, :2]).clamp(min=0).prod(-1)
    return inter / (area - inter).clamp(min=torch.finfo(a.dtype).tiny)


def matchability_aware_loss(logits: Tensor, matched: tuple[Tensor, Tensor, Tensor], iou: Tensor,
                            gamma: float = 1.5) -> Tensor:
    """DEIM's matchability-aware loss (Huang et al. 2025), summed: binary cross-entropy of every
    query's class logits ``[B, Q, C]``, where a matched query's class has the target ``IoU^gamma``
    (the IoU of its box with its object: a query whose box fits badly is not pushed to full
    confidence) at weight 1, and every other logit the target 0 at the weight ``p^gamma`` (``p``
    its sigmoid, no gradient: confident wrong scores weigh most, as in the focal loss).

    Args:
        logits: ``[B, Q, C]``.
        matched: ``(images, queries, classes)`` of the matched queries, each ``[M]``.
        iou: ``[M]`` their boxes' IoU with their objects.
        gamma: the exponent of the target and of the negatives' weight.
    """
    b_idx, q_idx, labels = matched
    target = torch.zeros_like(logits)
    target[b_idx, q_idx, labels] = iou.to(logits.dtype).clamp(min=0).pow(gamma)
    positive = torch.zeros_like(logits, dtype=torch.bool)
    positive[b_idx, q_idx, labels] = True
    weight = torch.where(positive, torch.ones_like(logits), logits.detach().sigmoid().pow(gamma))
    return F.binary_cross_entropy_with_logits(logits, target, weight=weight, reduction="sum")


def _matched(indices: list, targets: list[dict[str, Tensor]], device: torch.device
             ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A matching's pairs, flattened over the batch: ``(image [M], query [M], class [M], box [M, 4])``."""
    b_idx = torch.cat([torch.full_like(p, i) for i, (p, _) in enumerate(indices)]).to(device)
    q_idx = torch.cat([p for p, _ in indices]).to(device)
    labels = torch.cat([t["labels"][j] for t, (_, j) in zip(targets, indices, strict=True)]).to(device)
    boxes = torch.cat([t["boxes"][j] for t, (_, j) in zip(targets, indices, strict=True)]).to(device)
    return b_idx, q_idx, labels, boxes


def _num_boxes(targets: list[dict[str, Tensor]], device: torch.device, across_processes: bool) -> float:
    """Number of target boxes (averaged over processes when ``across_processes``), at least 1."""
    n = torch.tensor(float(sum(len(t["labels"]) for t in targets)), device=device)
    if across_processes:
        n = mean_across_processes(n)
    return max(float(n), 1.0)


def _box_terms(src: Tensor, target: Tensor, norm: float) -> tuple[Tensor, Tensor]:
    """``(L1, 1 - GIoU)`` of paired ``cxcywh`` boxes, each summed and divided by ``norm``."""
    loss_bbox = F.l1_loss(src, target, reduction="none").sum() / norm
    giou = generalized_box_iou(box_cxcywh_to_xyxy(src), box_cxcywh_to_xyxy(target)).diagonal()
    return loss_bbox, (1 - giou).sum() / norm


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
        mal_gamma: the matching queries' classification by DEIM's matchability-aware loss with this
            ``gamma`` (:func:`matchability_aware_loss`; focal heads) instead of the focal loss;
            ``None``: the focal loss.
        dn: expect denoising outputs (``loss_dn_*`` terms).
        enc: expect the encoder selection's outputs (``loss_enc_*`` terms).
        o2m: expect one-to-many outputs (``loss_o2m_*`` terms).
        o2m_repeat: times each target is repeated for the one-to-many sets (H-DETR's ``K``; 1
            for Group DETR's independent groups).
        dense: expect every encoder token's outputs (``loss_dense_*`` terms, :func:`dense_assignment`).
        fdr_offsets: the head's edge offsets ``[N + 1]`` when it refines edge distributions
            (:func:`~vision_attn.models.fdr.edge_offsets`; ``loss_fgl`` and ``loss_ddf`` terms);
            ``None``: a box-regression head.
        weight_fgl: weight of the localisation term of the distributions.
        weight_ddf: weight of their self-distillation term.
        fdr_temperature: the self-distillation's temperature.
    """

    PARTS = ("", "dn_", "enc_", "o2m_", "dense_")  # term name infixes: loss_ce, loss_dn_ce, loss_enc_ce, ...
    WITH_AUX = ("", "dn_", "o2m_")  # the encoder's selection is one output, without auxiliary layers

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
        dn: bool = False,
        enc: bool = False,
        o2m: bool = False,
        o2m_repeat: int = 1,
        dense: bool = False,
        mal_gamma: float | None = None,
        fdr_offsets: Tensor | None = None,
        weight_fgl: float = 0.15,
        weight_ddf: float = 1.5,
        fdr_temperature: float = 5.0,
    ) -> None:
        super().__init__()
        self.fdr = fdr_offsets is not None
        self.fdr_weights = {"loss_fgl": weight_fgl, "loss_ddf": weight_ddf}
        self.fdr_temperature = fdr_temperature
        if self.fdr:
            self.register_buffer("fdr_offsets", fdr_offsets.detach().clone().float(), persistent=False)
        check_focal_alpha(focal_alpha)
        if mal_gamma is not None and (not focal or not mal_gamma > 0):
            raise ValueError(f"the matchability-aware loss needs a focal (sigmoid) head and mal_gamma > 0, got "
                             f"focal={focal}, mal_gamma={mal_gamma}")
        self.mal_gamma = mal_gamma
        if o2m_repeat < 1:
            raise ValueError(f"o2m_repeat must be >= 1 (1 = Group DETR's independent groups), got {o2m_repeat}")
        self.o2m_repeat = o2m_repeat
        self.parts = tuple(p for p, on in zip(self.PARTS[1:], (dn, enc, o2m, dense), strict=True) if on)
        self.num_classes = num_classes
        self.matcher = matcher
        self.base_weights = {"loss_ce": weight_ce, "loss_bbox": weight_bbox, "loss_giou": weight_giou}
        self.focal, self.focal_alpha, self.focal_gamma = focal, focal_alpha, focal_gamma
        empty = torch.ones(num_classes + 1)
        empty[-1] = eos_coef
        self.register_buffer("empty_weight", empty)

    def weight_dict(self, num_aux: int) -> dict[str, float]:
        """Weights of every term, auxiliary layers included (``loss_ce_0``, ...).

        The main terms first, in the order they always had; then those of the training aids the
        criterion was built for (``loss_dn_*``, ``loss_enc_*``, ``loss_o2m_*``), which count only
        when present (the denoising and one-to-many outputs exist only in training).
        """
        weights = dict(self.base_weights)
        for i in range(num_aux):
            weights.update({f"{k}_{i}": v for k, v in self.base_weights.items()})
        if self.fdr:
            weights["loss_fgl"] = self.fdr_weights["loss_fgl"]
            for i in range(num_aux):
                weights.update({f"{k}_{i}": v for k, v in self.fdr_weights.items()})
        for part in self.parts:
            named = {_name(k, part): v for k, v in self.base_weights.items()}
            weights.update(named)
            if part in self.WITH_AUX:
                for i in range(num_aux):
                    weights.update({f"{k}_{i}": v for k, v in named.items()})
        return weights

    def total(self, terms: dict[str, Tensor], num_aux: int = 0) -> Tensor:
        """The weighted sum of the loss terms — computed here and nowhere else."""
        weights = self.weight_dict(num_aux)
        return sum(weights[k] * v for k, v in terms.items() if k in weights)

    def _terms(self, logits: Tensor, boxes: Tensor, targets: list[dict[str, Tensor]],
               num_boxes: float, corners: dict | None = None, indices: list | None = None) -> dict[str, Tensor]:
        """The matched terms of one layer; ``corners``: the layer's output when it carries edge
        distributions (``loss_fgl``); ``indices``: the matching, when already made."""
        if indices is None:
            indices = self.matcher(logits, boxes, targets)
        b_idx, q_idx, matched_labels, matched_boxes = _matched(indices, targets, logits.device)
        matched_boxes = matched_boxes.to(boxes.dtype)
        fgl = self.fdr and corners is not None and "pred_corners" in corners
        iou = None
        if fgl or (self.focal and self.mal_gamma is not None):
            with torch.no_grad():  # how well each matched query's box already fits its object
                iou = box_iou_pairs(box_cxcywh_to_xyxy(boxes[b_idx, q_idx]), box_cxcywh_to_xyxy(matched_boxes))
        if self.focal and self.mal_gamma is not None:
            loss_ce = matchability_aware_loss(logits, (b_idx, q_idx, matched_labels), iou, self.mal_gamma) / num_boxes
        elif self.focal:
            onehot = torch.zeros_like(logits)
            onehot[b_idx, q_idx, matched_labels] = 1.0
            focal = sigmoid_focal_loss(logits, onehot, self.focal_alpha, self.focal_gamma, reduction="sum")
            loss_ce = focal / num_boxes
        else:
            classes = torch.full(logits.shape[:2], self.num_classes, dtype=torch.int64, device=logits.device)
            classes[b_idx, q_idx] = matched_labels
            loss_ce = F.cross_entropy(logits.transpose(1, 2), classes, weight=self.empty_weight.to(logits.dtype))
        loss_bbox, loss_giou = _box_terms(boxes[b_idx, q_idx], matched_boxes, num_boxes)
        fgl = {} if not fgl else {"loss_fgl": localization_loss(
            corners["pred_corners"][b_idx, q_idx], corners["fdr_initial"][b_idx, q_idx], matched_boxes,
            self.fdr_offsets, iou) / num_boxes}
        with torch.no_grad():  # predicted "objects" vs true count, per image (logged only)
            if self.focal:
                n_pred = (logits.sigmoid().amax(-1) > 0.5).sum(1)
            else:
                n_pred = (logits.argmax(-1) != self.num_classes).sum(1)
            n_true = torch.tensor([len(t["labels"]) for t in targets], device=logits.device)
            card = (n_pred.float() - n_true.float()).abs().mean()
        return {"loss_ce": loss_ce, "loss_bbox": loss_bbox, "loss_giou": loss_giou, **fgl, "cardinality_error": card}

    def _distillation(self, outputs: dict, targets: list[dict[str, Tensor]], indices: list) -> dict[str, Tensor]:
        """``loss_ddf_i``: each earlier layer's edge distributions against the last layer's; the
        weights: the last layer's IoU with its object (matched queries) or its confidence (the rest)."""
        teacher, logits, boxes = outputs["pred_corners"], outputs["pred_logits"], outputs["pred_boxes"]
        with torch.no_grad():
            b_idx, q_idx, _, matched_boxes = _matched(indices, targets, logits.device)
            matched = torch.zeros(logits.shape[:2], dtype=torch.bool, device=logits.device)
            matched[b_idx, q_idx] = True
            weight = logits.sigmoid().amax(-1) if self.focal else logits.softmax(-1)[..., :-1].amax(-1)
            weight[b_idx, q_idx] = box_iou_pairs(box_cxcywh_to_xyxy(boxes[b_idx, q_idx]),
                                                 box_cxcywh_to_xyxy(matched_boxes.to(boxes.dtype))).to(weight.dtype)
        return {f"loss_ddf_{i}": distillation_loss(aux["pred_corners"], teacher, matched, weight, self.fdr_temperature)
                for i, aux in enumerate(outputs.get("aux_outputs", []))}

    def _dn_terms(self, logits: Tensor, boxes: Tensor, targets: list[dict[str, Tensor]], meta: dict,
                  num_boxes: float) -> dict[str, Tensor]:
        """Reconstruction terms of the denoising queries (fixed pairing from ``meta``, no matching)."""
        device = logits.device
        norm = num_boxes * meta["groups"]
        pos_b = torch.cat([torch.full_like(p, i) for i, (p, _) in enumerate(meta["positive"])]).to(device)
        pos_q = torch.cat([p for p, _ in meta["positive"]]).to(device)
        labels = torch.cat([t["labels"][j.to(t["labels"].device)] for t, (_, j) in
                            zip(targets, meta["positive"], strict=True)]).to(device)
        target_boxes = torch.cat([t["boxes"][j.to(t["boxes"].device)] for t, (_, j) in
                                  zip(targets, meta["positive"], strict=True)]).to(device=device, dtype=boxes.dtype)
        neg_b = torch.cat([torch.full_like(n, i) for i, n in enumerate(meta["negative"])]).to(device)
        neg_q = torch.cat(list(meta["negative"])).to(device)
        rows = torch.cat([logits[pos_b, pos_q], logits[neg_b, neg_q]])  # padding slots are left out
        if len(rows) == 0:
            zero = logits.sum() * 0 + boxes.sum() * 0  # keeps the graph (and DDP) whole
            return {"loss_ce": zero, "loss_bbox": zero, "loss_giou": zero}
        if self.focal:
            onehot = torch.zeros_like(rows)
            onehot[torch.arange(len(labels), device=device), labels] = 1.0  # negatives: all zeros
            loss_ce = sigmoid_focal_loss(rows, onehot, self.focal_alpha, self.focal_gamma, reduction="sum") / norm
        else:
            classes = torch.cat([labels, torch.full((len(neg_q),), self.num_classes, dtype=torch.int64, device=device)])
            loss_ce = F.cross_entropy(rows, classes, weight=self.empty_weight.to(logits.dtype))
        loss_bbox, loss_giou = _box_terms(boxes[pos_b, pos_q], target_boxes, norm)
        return {"loss_ce": loss_ce, "loss_bbox": loss_bbox, "loss_giou": loss_giou}

    def _dense_terms(self, out: dict, targets: list[dict[str, Tensor]], across_processes: bool) -> dict[str, Tensor]:
        """Every token's class and box against :func:`dense_assignment` (no matching)."""
        logits, boxes, centres, mask = out["pred_logits"], out["pred_boxes"], out["centres"], out.get("mask")
        device = logits.device
        all_labels = torch.cat([t["labels"] for t in targets]).to(device)
        all_boxes = torch.cat([t["boxes"] for t in targets]).to(device=device, dtype=boxes.dtype)
        # each token's target as an index into the batch's concatenated targets (-1: background)
        owner, start = [], 0
        for i, t in enumerate(targets):
            o = dense_assignment(centres[i], all_boxes[start : start + len(t["labels"])],
                                 None if mask is None else mask[i])
            owner.append(torch.where(o >= 0, o + start, o))
            start += len(t["labels"])
        owner = torch.stack(owner)  # (B, N)
        pos = owner >= 0
        labels = all_labels[owner[pos]]
        n_pos = torch.tensor(float(pos.sum()), device=device)
        if across_processes:
            n_pos = mean_across_processes(n_pos)
        norm = max(float(n_pos), 1.0)
        real = torch.ones_like(pos) if mask is None else mask
        if self.focal:
            onehot = torch.zeros_like(logits)
            onehot[pos] = F.one_hot(labels, self.num_classes).to(logits.dtype)
            focal = sigmoid_focal_loss(logits[real], onehot[real], self.focal_alpha, self.focal_gamma, reduction="sum")
            loss_ce = focal / norm
        else:
            classes = torch.full(pos.shape, self.num_classes, dtype=torch.int64, device=device)
            classes[pos] = labels
            loss_ce = F.cross_entropy(logits[real], classes[real], weight=self.empty_weight.to(logits.dtype))
        if not bool(pos.any()):
            zero = boxes.sum() * 0
            return {"loss_ce": loss_ce, "loss_bbox": zero, "loss_giou": zero}
        loss_bbox, loss_giou = _box_terms(boxes[pos], all_boxes[owner[pos]], norm)
        return {"loss_ce": loss_ce, "loss_bbox": loss_bbox, "loss_giou": loss_giou}

    def _layers(self, out: dict, part: str, terms_of) -> dict[str, Tensor]:
        """``terms_of(logits, boxes)`` for ``out``'s final and auxiliary layers, named for ``part``."""
        terms = {_name(k, part): v for k, v in terms_of(out["pred_logits"], out["pred_boxes"]).items()
                 if k != "cardinality_error"}
        for i, aux in enumerate(out.get("aux_outputs", [])):
            aux_terms = terms_of(aux["pred_logits"], aux["pred_boxes"])
            terms.update({f"{_name(k, part)}_{i}": v for k, v in aux_terms.items() if k != "cardinality_error"})
        return terms

    def forward(self, outputs: dict, targets: list[dict[str, Tensor]],
                across_processes: bool = True) -> dict[str, Tensor]:
        """Loss terms of the final layer and of every ``outputs["aux_outputs"]`` layer.

        Args:
            outputs: ``pred_logits [B, Q, C(+1)]``, ``pred_boxes [B, Q, 4]`` (cxcywh in [0, 1]) and
                optionally ``aux_outputs``: a list of such dicts, one per earlier decoder layer.
                The training aids' outputs, when present: ``dn_outputs`` with ``dn_meta``,
                ``enc_outputs``, ``o2m_outputs`` (see the module docstring).
            targets: per image ``labels [G]`` (0..C-1) and ``boxes [G, 4]`` (cxcywh in [0, 1]).
            across_processes: normalise by the box count averaged over processes (training
                under DDP: the gradient of the global batch); ``False`` in evaluation, whose
                steps must not synchronise per batch.
        """
        for key, part, flag in (("dn_outputs", "dn_", "dn"), ("enc_outputs", "enc_", "enc"),
                                ("o2m_outputs", "o2m_", "o2m"), ("dense_outputs", "dense_", "dense")):
            if key in outputs and part not in self.parts:
                raise ValueError(f"the outputs carry {key} but the criterion has no weights for them: "
                                 f"build SetCriterion with {flag}=True")
        num_boxes = _num_boxes(targets, outputs["pred_logits"].device, across_processes)
        fdr = self.fdr and "pred_corners" in outputs
        if self.fdr and not fdr:
            raise ValueError("the criterion was built for edge distributions (fdr_offsets) but the outputs carry no "
                             "pred_corners: build the head with fdr=True, or the criterion without fdr_offsets")
        indices = self.matcher(outputs["pred_logits"], outputs["pred_boxes"], targets)
        terms = self._terms(outputs["pred_logits"], outputs["pred_boxes"], targets, num_boxes, outputs, indices)
        if fdr:
            terms.update(self._distillation(outputs, targets, indices))
        for i, aux in enumerate(outputs.get("aux_outputs", [])):
            aux_terms = self._terms(aux["pred_logits"], aux["pred_boxes"], targets, num_boxes, aux)
            terms.update({f"{k}_{i}": v for k, v in aux_terms.items() if k != "cardinality_error"})
        if "enc_outputs" in outputs:
            enc = outputs["enc_outputs"]
            terms.update(self._layers({"pred_logits": enc["pred_logits"], "pred_boxes": enc["pred_boxes"]}, "enc_",
                                      lambda lg, bx: self._terms(lg, bx, targets, num_boxes)))
        if "dense_outputs" in outputs:
            dense = self._dense_terms(outputs["dense_outputs"], targets, across_processes)
            terms.update({_name(k, "dense_"): v for k, v in dense.items()})
        if "o2m_outputs" in outputs:
            k = self.o2m_repeat
            repeated = [{"labels": t["labels"].repeat(k), "boxes": t["boxes"].repeat(k, 1)} for t in targets]
            for n, out in enumerate(outputs["o2m_outputs"]):
                group = self._layers(out, "o2m_", lambda lg, bx: self._terms(lg, bx, repeated, num_boxes * k))
                terms.update(group if n == 0 else {name: terms[name] + v for name, v in group.items()})
        if "dn_outputs" in outputs:
            if "dn_meta" not in outputs:
                raise KeyError("outputs has dn_outputs but no dn_meta (the denoising queries' targets)")
            meta = outputs["dn_meta"]
            terms.update(self._layers(outputs["dn_outputs"], "dn_",
                                      lambda lg, bx: self._dn_terms(lg, bx, targets, meta, num_boxes)))
        return terms


def _name(term: str, part: str) -> str:
    """``loss_ce`` -> ``loss_dn_ce`` for part ``dn_`` (unchanged for the main part ``""``)."""
    return term.replace("loss_", f"loss_{part}", 1)
