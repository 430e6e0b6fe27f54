"""What a distributed run needs beyond Lightning's defaults.

- :func:`gather_objects`: evaluation records from every process (rank order), for results that
  do not depend on the process count; :func:`unique_records` the same, each record once (a
  distributed sampler pads the last batches with repeats);
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

from collections.abc import Callable, Hashable
from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy
from timm.models.vision_transformer import Block
from torch import Tensor

from vision_attn.errors import ConfigError

__all__ = ["FSDP_BLOCKS", "BlockFSDPStrategy", "check_accelerator", "gather_objects", "is_distributed",
           "mean_across_processes", "register_fsdp_block", "unique_records"]


def is_distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def gather_objects(items: list[Any]) -> list[Any]:
    """Concatenate a picklable list from every process (the list itself when not distributed)."""
    if not is_distributed():
        return list(items)
    gathered: list[list[Any]] = [None] * torch.distributed.get_world_size()  # type: ignore[list-item]
    torch.distributed.all_gather_object(gathered, list(items))
    return [x for part in gathered for x in part]


def unique_records(records: list[Any], key: str | Callable[[Any], Hashable] = "index",
                   sort: bool = False) -> list[Any]:
    """The records of every process (:func:`gather_objects`), one per key.

    A distributed sampler pads the last batches with repeats of the first items, so the same
    item can be evaluated twice; its records agree, and one of them is kept. Without ``sort``
    the keys come in the order they first occur (the record kept for a repeated key is its
    last one); with ``sort``, in ascending key order, so the result does not depend on the
    process count.

    Args:
        records: this process's records.
        key: the field that identifies a record (``record[key]``), or a function of the record.
        sort: order the records by key.
    """
    key_of = key if callable(key) else (lambda record: record[key])
    unique = {key_of(r): r for r in gather_objects(records)}
    return [unique[k] for k in sorted(unique)] if sort else list(unique.values())


GPU_ACCELERATORS = ("gpu", "cuda")


def check_accelerator(accelerator: object, devices: object = None, flag: str = "--trainer.accelerator") -> None:
    """Refuse, with one line, a GPU run on a machine without a CUDA device, or more GPUs than it has.

    Args:
        accelerator: Lightning's ``accelerator`` (``"gpu"``, ``"cuda"``, ``"cpu"``, ``"auto"``, ...).
        devices: Lightning's ``devices`` (an int, a list of indices, ``-1``, ``"auto"``).
        flag: how the message names the option to change.

    Raises:
        ConfigError: naming the option and what to pass instead.
    """
    if str(accelerator).lower() not in GPU_ACCELERATORS:
        return
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found == 0:
        raise ConfigError(f"no CUDA device found; use {flag} cpu (or auto), or run on a machine with a GPU")
    wanted = len(devices) if isinstance(devices, (list, tuple)) else devices
    if isinstance(wanted, str) and wanted.strip().lstrip("-").isdigit():
        wanted = int(wanted)
    if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > found:
        raise ConfigError(f"{wanted} GPUs asked for (devices) but this machine has {found}; "
                          f"pass --trainer.devices {found} or fewer")


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
