"""Sanity checks of explanations by model randomisation (Adebayo et al. 2018).

An explanation that still draws the same map once the model's weights are random explains
the image (edges, colours), not the model. :func:`model_cascade` re-initialises a *copy* of the
model from the output down, as Adebayo et al. do: first the head (step ``head``: the classifier,
or the whole decoder of a detector or captioner), then the encoder from the top block down, one
block at a time (:func:`cascading_randomisation`), and finally the embeddings (patch
embedding, position embedding, class / register tokens, final norm). :func:`sanity_check`
recomputes each method's maps after every step and compares them with the trained model's maps
by Spearman rank correlation (:func:`spearman`): high values mean the method does not depend on
the weights.

Re-initialisation follows timm's ViT initialisation: every parameter with two or more
dimensions (linear and convolution weights, position embedding, tokens) is drawn from
``N(0, 0.02^2)`` truncated at two standard deviations, biases become 0 and the other
one-dimensional parameters (LayerNorm and LayerScale weights) 1. Seeded: the same seed gives
the same random model.

The same class (``target``) and the same randomness (a generator seeded alike for every
model) are used for the trained and the randomised maps, so only the weights differ: the
``random`` baseline, which ignores the model, scores 1.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from types import SimpleNamespace

import torch
from torch import Tensor, nn

from vision_attn.errors import ConfigError
from vision_attn.explain.methods import explain_classifier

__all__ = ["StandIn", "cascading_randomisation", "model_cascade", "randomise_", "sanity_check", "spearman"]

INIT_STD = 0.02


def _ranks(x: Tensor) -> Tensor:
    """Ranks ``0..n-1`` of each row of ``[B, n]`` with ties given their average rank."""
    order = x.argsort(dim=1, stable=True)
    sorted_x = x.gather(1, order)
    b, n = x.shape
    ranks = torch.empty_like(x, dtype=torch.float64)
    for i in range(b):  # average ranks of tied runs
        values, counts = torch.unique_consecutive(sorted_x[i], return_counts=True)
        ends = counts.cumsum(0)
        avg = (ends - 1 + ends - counts).double() / 2  # mean of first and last index of each run
        ranks[i, order[i]] = avg.repeat_interleave(counts)
    return ranks


def spearman(a: Tensor, b: Tensor) -> Tensor:
    """Spearman rank correlation of each pair of maps: ``[B, ...]`` and ``[B, ...]`` -> ``[B]``.

    The Pearson correlation of the ranks (ties: average ranks), as ``scipy.stats.spearmanr``.
    A map without any variation has no ranks to correlate: the pair scores 1 when both maps
    are constant (the method gives the same map, whatever the model) and 0 otherwise.

    Args:
        a: ``[B, ...]`` maps.
        b: ``[B, ...]`` maps of the same shape.

    Raises:
        ValueError: maps of different shapes.
    """
    if a.shape != b.shape:
        raise ValueError(f"maps of different shapes: {tuple(a.shape)} and {tuple(b.shape)}")
    ra = _ranks(a.detach().flatten(1).double().cpu())
    rb = _ranks(b.detach().flatten(1).double().cpu())
    ra = ra - ra.mean(dim=1, keepdim=True)
    rb = rb - rb.mean(dim=1, keepdim=True)
    norm = ra.norm(dim=1) * rb.norm(dim=1)
    rho = (ra * rb).sum(dim=1) / norm.clamp(min=1e-300)
    flat_a, flat_b = ra.norm(dim=1) == 0, rb.norm(dim=1) == 0
    rho = torch.where(flat_a | flat_b, (flat_a & flat_b).double(), rho)
    return rho.clamp(-1.0, 1.0)


@torch.no_grad()
def randomise_(module: nn.Module, generator: torch.Generator) -> None:
    """Re-initialise every parameter of ``module`` in place (see the module docstring)."""
    for name, p in module.named_parameters():
        if p.dim() >= 2:
            values = torch.randn(p.shape, generator=generator, dtype=torch.float64) * INIT_STD
            values = torch.where(values.abs() > 2 * INIT_STD, values.sign() * 2 * INIT_STD, values)
            p.copy_(values.to(device=p.device, dtype=p.dtype))
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.fill_(1.0)


def _vit(encoder: nn.Module) -> nn.Module:
    model = getattr(encoder, "model", encoder)
    if len(getattr(model, "blocks", ())) == 0:
        raise ConfigError(f"{type(model).__name__} has no transformer `blocks`: the sanity check randomises a "
                          "ViT's blocks from the top down")
    return model


class StandIn(nn.Module):
    """A decoder head (detection, captioning) on another encoder: the model whose maps are
    compared with the trained model's when its encoder is randomised; ``attributes`` (e.g. the
    captioner's ``tokenizer``) are set as plain attributes."""

    def __init__(self, encoder: nn.Module, head: nn.Module, **attributes) -> None:
        super().__init__()
        self.encoder, self.head = encoder, head
        for name, value in attributes.items():
            setattr(self, name, value)


def cascading_randomisation(encoder: nn.Module, seed: int = 0) -> Iterator[tuple[str, nn.Module]]:
    """Copies of ``encoder`` randomised from the top block down (``encoder`` is not changed).

    Yields ``(step, encoder)`` with one copy, randomised further at every step: ``block<i>``
    after block ``i`` (the last first) and ``all`` after the embeddings and every other
    parameter outside the blocks. The yielded module changes in place between steps.
    """
    copied = copy.deepcopy(encoder).eval()
    model = _vit(copied)
    gen = torch.Generator().manual_seed(seed)
    blocks = list(model.blocks)
    for i in range(len(blocks) - 1, -1, -1):
        randomise_(blocks[i], gen)
        yield f"block{i}", copied
    in_blocks = {id(p) for blk in blocks for p in blk.parameters()}
    rest = nn.ParameterList([p for p in copied.parameters() if id(p) not in in_blocks])
    randomise_(rest, gen)
    yield "all", copied


def model_cascade(encoder: nn.Module, head: nn.Module, seed: int = 0, cascade: bool = True
                  ) -> Iterator[tuple[str, nn.Module, nn.Module]]:
    """Copies of the model (``encoder`` and ``head``) randomised from the output down (neither is
    changed): yields ``(step, encoder, head)``, first ``("head", encoder, random head)`` (the
    classifier, or a detector's or captioner's decoder, re-initialised as :func:`randomise_` does),
    then the steps of :func:`cascading_randomisation` with that random head.

    ``cascade=False``: only the last step, ``("all", ...)``, the fully randomised model, with the
    same weights as the cascade's last step (the steps before it are randomised, not yielded).
    """
    random_head = copy.deepcopy(head).eval()
    randomise_(random_head, torch.Generator().manual_seed(seed + 1))
    if cascade:
        yield "head", encoder, random_head
    for step, randomised in cascading_randomisation(encoder, seed):
        if cascade or step == "all":
            yield step, randomised, random_head


def sanity_check(
    task,
    images: Tensor,
    methods: Sequence[str],
    target: Tensor,
    seed: int = 0,
    cascade: bool = True,
    **options,
) -> dict[str, dict[str, Tensor]]:
    """Spearman correlation between each method's maps of the trained model and of its
    copies randomised from the output down (:func:`model_cascade`; Adebayo et al. 2018).

    Args:
        task: a classifier (``encoder``, ``head``; see
            :func:`~vision_attn.explain.methods.explain_classifier`). Not modified.
        images: ``[B, 3, H, W]`` model inputs.
        methods: names in :data:`~vision_attn.explain.methods.METHODS`.
        target: ``[B]`` the classes explained (the same for every model).
        seed: of the random weights (and of the ``random`` baseline's noise, the same for every
            model).
        cascade: every step of :func:`model_cascade`; ``False``: only ``all``.
        **options: further arguments of ``explain_classifier`` (``head_fusion``, ``token``, ...).

    Returns:
        ``{method: {step: [B] correlations}}`` with the steps of :func:`model_cascade` in
        order (``head`` first, ``all`` last: the fully randomised model).
    """
    def maps(model) -> dict[str, Tensor]:
        gen = torch.Generator().manual_seed(seed)
        return explain_classifier(model, images, methods, target=target, generator=gen, **options).maps

    trained = maps(task)
    out: dict[str, dict[str, Tensor]] = {m: {} for m in methods}
    for step, encoder, head in model_cascade(task.encoder, task.head, seed, cascade):
        stand_in = SimpleNamespace(encoder=encoder, head=head, class_names=getattr(task, "class_names", None))
        for method, randomised in maps(stand_in).items():
            out[method][step] = spearman(trained[method], randomised)
    return out
