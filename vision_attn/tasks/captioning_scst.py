"""Self-critical sequence training of the captioning task (Rennie et al. 2017;
:mod:`vision_attn.losses.scst`): the steps :class:`~vision_attn.tasks.captioning.CaptioningTask`
takes instead of cross-entropy when ``scst.enabled``."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from vision_attn.errors import DataError
from vision_attn.losses.scst import baselines, sample_rewards, scst_loss
from vision_attn.metrics.caption import CiderD
from vision_attn.models.encoder import EncoderOutput

__all__ = ["CaptionSelfCritical"]

log = logging.getLogger("vision_attn.tasks.captioning")  # the task's logger: its messages read as before


class CaptionSelfCritical:
    """The self-critical steps of :class:`~vision_attn.tasks.captioning.CaptioningTask` (a mixin:
    it reads the task's encoder, decoder head, tokenizer and ``scst_config``)."""

    def _scst_statistics(self) -> tuple[CiderD, list[list[str]]]:
        """CIDEr-D's document frequencies from the training references, computed on first use and
        kept (every DDP process reads the whole training split: the same statistics everywhere)."""
        if self.scst_cider is None:
            dm = getattr(self.trainer, "datamodule", None)
            if dm is None or not hasattr(dm, "train_references"):
                raise DataError("--model.scst needs the training references: train with a CaptioningDataModule "
                                "(train.py's data section), not bare dataloaders")
            self.scst_references = dm.train_references()
            self.scst_cider = CiderD(self.scst_references)
            log.info("SCST: CIDEr-D document frequencies from %d training images", len(self.scst_references))
        return self.scst_cider, self.scst_references

    @contextmanager
    def _eval_mode(self, active: bool = True) -> Iterator[None]:
        """Every module in eval mode (no dropout, no stochastic depth) inside the block, when
        ``active``; each module's own mode restored afterwards. Gradients are untouched."""
        modes = {m: m.training for m in self.modules()}
        try:
            if active:
                self.eval()
            yield
        finally:
            for m, mode in modes.items():
                m.training = mode

    def _greedy_captions(self, images: Tensor, max_new: int, enc: EncoderOutput | None = None) -> Tensor:
        """The greedy captions' tokens, decoded as at test time (eval mode, no gradients, no
        decoding constraint); every module's mode is restored afterwards. ``enc``: the images'
        encoder output when it was already computed in eval mode (not encoded again)."""
        with self._eval_mode(), torch.no_grad():
            enc = self.encoder(images) if enc is None else enc
            return self.head.generate(enc, self.tokenizer.bos_id, self.tokenizer.eos_id, max_new, 1).tokens

    def _scst_loss(self, images: Tensor, indices: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The self-critical loss of a batch, with the samples' rewards and baselines ``(B, S)``."""
        config, tok = self.scst_config, self.tokenizer
        scorer, references = self._scst_statistics()
        refs = [references[i] for i in indices.tolist()]
        s = config.samples
        max_new = config.max_length or self.decoder_config.max_length - 1
        enc = self.encode(images)
        temperature = float(config.temperature)
        samples = self.head.sample(enc, tok.bos_id, tok.eos_id, s, max_new, temperature=temperature)  # tokens only
        rewards = sample_rewards(scorer, self.decode(samples.tokens), refs).to(images.device)  # (B, S)
        greedy = None
        if config.baseline == "greedy":
            # the step already runs in eval mode (scst.dropout false): its encoding is the greedy decode's
            greedy_tokens = self._greedy_captions(images, max_new, None if self.training else enc)
            greedy = sample_rewards(scorer, self.decode(greedy_tokens), refs)[:, 0].to(images.device)  # (B,)
        baseline = baselines(rewards, config.baseline, greedy)  # (B, S)
        logp = self.head.token_logprobs(enc, samples.tokens, tok.bos_id, repeats=s, temperature=temperature)  # (B*S, T)
        loss = scst_loss(logp, samples.lengths, rewards, baseline)
        return loss, rewards, baseline

    def _scst_step(self, batch) -> Tensor:
        """One self-critical step (:mod:`vision_attn.losses.scst`): ``scst.samples`` sampled captions per
        image, rewarded by CIDEr-D against all of the image's training references, minus the
        baseline; ``-(reward - baseline) * log p(sample)`` averaged over the samples. Unless
        ``scst.dropout``, the whole step runs without dropout or stochastic depth, so samples,
        greedy baseline and log-probabilities all come from the same network."""
        images, _, indices = batch[:3]
        with self._eval_mode(not self.scst_config.dropout):
            loss, rewards, baseline = self._scst_loss(images, indices)
        self.check_finite(loss, {"scst": loss})
        n = len(images)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=True, batch_size=n, sync_dist=True)
        self.log("train/reward", rewards.mean(), prog_bar=True, on_step=True, on_epoch=True, batch_size=n,
                 sync_dist=True)
        self.log("train/baseline", baseline.mean(), on_step=True, on_epoch=True, batch_size=n, sync_dist=True)
        return loss
