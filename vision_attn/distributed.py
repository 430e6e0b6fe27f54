"""What a distributed run needs beyond Lightning's defaults.

- :func:`gather_objects`: evaluation records from every process (rank order), for results that
  do not depend on the process count;
- :func:`mean_across_processes`: loss normalisers (DETR's box count, the caption token count)
  averaged over processes, so that DDP's gradient averaging gives the gradient of the global
  batch. Training only: evaluation steps may differ in number between processes (see
  :mod:`vision_attn.data.loading`) and must not call collectives per batch;
- :class:`BlockFSDPStrategy`: FSDP that shards per transformer block (encoder blocks and
  decoder layers) instead of the whole model as one unit.

The models are batch-norm free (LayerNorm; the conv stem uses GroupNorm), so no SyncBatchNorm
is needed.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy
from timm.models.vision_transformer import Block
from torch import Tensor

__all__ = ["FSDP_BLOCKS", "BlockFSDPStrategy", "gather_objects", "is_distributed", "mean_across_processes",
           "register_fsdp_block"]


def is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def gather_objects(items: list[Any]) -> list[Any]:
    """Concatenate a picklable list from every process (the list itself when not distributed)."""
    if not is_distributed():
        return list(items)
    gathered: list[list[Any]] = [None] * torch.distributed.get_world_size()  # type: ignore[list-item]
    torch.distributed.all_gather_object(gathered, list(items))
    return [x for part in gathered for x in part]


def mean_across_processes(value: Tensor) -> Tensor:
    """The mean of a scalar over all processes (the value itself when not distributed)."""
    if not is_distributed():
        return value
    value = value.detach().clone().float()
    torch.distributed.all_reduce(value)
    return value / torch.distributed.get_world_size()


FSDP_BLOCKS: set[type] = {Block}
"""The module classes that :class:`BlockFSDPStrategy` wraps one by one: timm's ``Block`` and every
transformer layer class the suite's models register (:func:`register_fsdp_block`)."""


def register_fsdp_block(cls: type) -> type:
    """Class decorator: shard ``cls`` as one FSDP unit under :class:`BlockFSDPStrategy`."""
    FSDP_BLOCKS.add(cls)
    return cls


class BlockFSDPStrategy(FSDPStrategy):
    """Fully sharded data parallel, one FSDP unit per transformer block (timm ``Block`` and the
    suite's ``DecoderLayer``), original parameters kept (``use_orig_params``) so the task's
    weight-decay groups still see named parameters. Any ``FSDPStrategy`` argument
    (``sharding_strategy``, ``cpu_offload``, ``activation_checkpointing_policy``, ...) passes through.
    """

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("auto_wrap_policy", set(FSDP_BLOCKS))
        kwargs.setdefault("use_orig_params", True)
        super().__init__(**kwargs)
