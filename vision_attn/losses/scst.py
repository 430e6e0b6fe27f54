"""Self-critical sequence training (SCST): Rennie et al. 2017, "Self-critical Sequence Training for
Image Captioning" (CVPR), a second training phase after cross-entropy.

The captioner is a policy; a caption's reward is its CIDEr-D against its image's references.
REINFORCE with a baseline gives the gradient
``-(r(w^s) - b) * grad sum_t log p(w^s_t | w^s_<t, image)`` for a sampled caption ``w^s``; the
*self-critical* baseline ``b`` is the reward of the model's own greedy caption (the test-time
decoder), so samples better than what the model would say now are made likelier and worse ones
less likely. COCO: CIDEr-D 104.9 -> 114.7 (Rennie et al., Att2in); later Transformer and
Up-Down reproductions gain 12 to 13 points.

Here (:class:`~vision_attn.tasks.captioning.CaptioningTask` with ``scst=True``):

- ``S`` samples per image (multinomial from the decoder's softmax, batched, with the
  key/value cache, no graph: :meth:`~vision_attn.models.captioner.CaptionDecoder.sample`),
  their log-probabilities recomputed with gradients in one teacher-forced pass
  (:meth:`~vision_attn.models.captioner.CaptionDecoder.token_logprobs`; the same numbers when
  dropout is off: tested).
- Baseline :func:`baselines`: ``greedy`` (Rennie et al.: the greedy caption's reward, decoded
  in eval mode without gradients) or ``mean`` (the mean reward of the image's *other* samples,
  the "new SCST" of Luo 2020, which needs ``S >= 2`` and no greedy decode).
- Reward: CIDEr-D (:class:`~vision_attn.metrics.caption.CiderD`) against *all* references of
  the image, with document frequencies computed once from the training set's references (so
  the same on every DDP process: each one reads the whole training set's captions). No
  gradient flows through the reward or the baseline.
- Loss :func:`scst_loss`: ``-(r - b) * sum of the sampled tokens' log-probabilities`` (up to
  and including ``<eos>``; nothing after it), averaged over the samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from vision_attn.metrics.caption import CiderD

__all__ = ["BASELINES", "baselines", "sample_rewards", "scst_loss", "sequence_mask"]

BASELINES = ("greedy", "mean")
"""The baselines :func:`baselines` knows."""


def sample_rewards(scorer: CiderD, captions: Sequence[str], references: Sequence[Sequence[str]]) -> Tensor:
    """CIDEr-D ``[B, S]`` of ``B * S`` normalised captions, image-major (image ``i``'s are
    ``captions[i * S : (i + 1) * S]``), each against all of its image's ``references[i]``."""
    b = len(references)
    if b == 0 or len(captions) % b:
        raise ValueError(f"{len(captions)} captions do not split evenly over {b} images")
    s = len(captions) // b
    rows = [scorer.scores(captions[i * s : (i + 1) * s], references[i]) for i in range(b)]
    return torch.tensor(rows, dtype=torch.float32)


def baselines(rewards: Tensor, kind: str, greedy_rewards: Tensor | None = None) -> Tensor:
    """The baseline ``[B, S]`` of each sample's reward ``rewards [B, S]``.

    Args:
        rewards: the samples' rewards, one row per image.
        kind: ``greedy`` — the reward of the image's greedy caption (``greedy_rewards [B]``),
            the same for all its samples (Rennie et al. 2017); ``mean`` — the mean reward of
            the image's other ``S - 1`` samples (each sample's baseline leaves it out, so it
            stays independent of the sample: an unbiased gradient).
        greedy_rewards: ``[B]``, needed by ``greedy``.
    """
    if kind == "greedy":
        if greedy_rewards is None:
            raise ValueError("the greedy baseline needs the greedy captions' rewards")
        return greedy_rewards.to(rewards)[:, None].expand_as(rewards)
    if kind == "mean":
        s = rewards.shape[1]
        if s < 2:
            raise ValueError("the mean baseline needs at least 2 samples per image (scst_samples)")
        return (rewards.sum(dim=1, keepdim=True) - rewards) / (s - 1)
    raise ValueError(f"unknown SCST baseline {kind!r}; choose one of {', '.join(BASELINES)}")


def sequence_mask(lengths: Tensor, length: int) -> Tensor:
    """``[R, length]`` boolean: position ``t`` of row ``r`` is a generated token (``t < lengths[r]``,
    ``<eos>`` included; what follows it is padding)."""
    return torch.arange(length, device=lengths.device)[None] < lengths[:, None]


def scst_loss(token_logprobs: Tensor, lengths: Tensor, rewards: Tensor, baseline: Tensor) -> Tensor:
    """``mean over samples of -(reward - baseline) * sum_t log p(token_t)``.

    Args:
        token_logprobs: ``[R, T]`` log-probabilities of the sampled tokens (with gradients).
        lengths: ``[R]`` tokens up to and including ``<eos>``: later positions are left out
            (their entries may be anything, even infinite).
        rewards: ``[R]`` (or any shape with ``R`` elements) rewards of the samples.
        baseline: like ``rewards``.

    The advantage is detached: no gradient through the reward or the baseline.
    """
    mask = sequence_mask(lengths, token_logprobs.shape[1])
    logp = torch.where(mask, token_logprobs, torch.zeros((), dtype=token_logprobs.dtype,
                                                         device=token_logprobs.device)).sum(dim=1)  # (R,)
    advantage = (rewards.reshape(-1) - baseline.reshape(-1)).to(logp).detach()
    return -(advantage * logp).mean()
