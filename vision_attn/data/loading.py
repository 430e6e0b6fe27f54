"""Data loaders of every task, and evaluation sampling across processes: every image exactly once.

Lightning's default ``DistributedSampler`` pads the dataset with repeated samples so that every
process gets the same number; metrics then count those images twice, and a 2-process
evaluation of 5 images differs from a 1-process one. :class:`UnpaddedDistributedSampler` gives
process ``r`` the images ``r, r + world, r + 2 world, ...`` — no repeats, possibly one batch
fewer on some processes (evaluation steps therefore must not call collectives per batch;
metrics synchronise once, at the end of the epoch).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = ["UnpaddedDistributedSampler", "eval_sampler", "make_loader"]


class UnpaddedDistributedSampler(DistributedSampler):
    """A distributed sampler for evaluation that never repeats a sample (see the module docstring).

    Being a ``DistributedSampler``, Lightning keeps it instead of inserting its own.
    """

    def __init__(self, dataset: Dataset, num_replicas: int | None = None, rank: int | None = None) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        self.num_samples = len(range(self.rank, len(dataset), self.num_replicas))
        self.total_size = len(dataset)

    def __iter__(self):
        return iter(range(self.rank, len(self.dataset), self.num_replicas))

    def __len__(self) -> int:
        return self.num_samples


def eval_sampler(dataset: Dataset) -> UnpaddedDistributedSampler | None:
    """The sampler of an evaluation loader: unpadded when running distributed, else ``None``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return UnpaddedDistributedSampler(dataset)
    return None


def make_loader(dataset: Dataset, batch_size: int, train: bool, num_workers: int,
                collate_fn: Callable | None = None) -> DataLoader:
    """Training: shuffled, last partial batch dropped (Lightning adds its distributed sampler
    under DDP). Evaluation: in order, every sample once (unpadded under DDP)."""
    sampler = None if train else eval_sampler(dataset)
    return DataLoader(dataset, batch_size=batch_size, shuffle=train, sampler=sampler,
                      drop_last=train and len(dataset) > batch_size, num_workers=num_workers,
                      persistent_workers=num_workers > 0, pin_memory=torch.cuda.is_available(),
                      collate_fn=collate_fn)
