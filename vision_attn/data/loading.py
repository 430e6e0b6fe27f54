"""Data loaders of every task: unreadable training images skipped, evaluation sampling across
processes that sees every image exactly once.

Unreadable files. Training skips an image that cannot be decoded, with a warning naming the
file (and how many were skipped so far in that process), and stops with an error after
:data:`MAX_UNREADABLE_IN_A_ROW` unreadable images in a row (a wrong folder, not a bad file).
Evaluation never skips: a silently dropped image would change the metrics, so the first
unreadable file stops it with an error naming the file.

Lightning's default ``DistributedSampler`` pads the dataset with repeated samples so that every
process gets the same number; metrics then count those images twice, and a 2-process
evaluation of 5 images differs from a 1-process one. :class:`UnpaddedDistributedSampler` gives
process ``r`` the images ``r, r + world, r + 2 world, ...`` — no repeats, possibly one batch
fewer on some processes (evaluation steps therefore must not call collectives per batch;
metrics synchronise once, at the end of the epoch).

Paths. An image path named by the data (a COCO ``file_name``, a file found in an ImageFolder)
must stay inside its split folder — ``ROOT/<split>/``, or the images folder given for the split
(``--data.layout.val_images``, ...): :func:`image_path_inside` refuses absolute names, names that
climb out with ``..``, and — unless ``follow_symlinks`` — symbolic links (of the file or of a
folder on its way) that lead outside. The split folder itself is resolved first, so a split
folder that is a symlink is fine. Training skips a refused image with one counted warning;
evaluation stops with an error naming it (:class:`PathRefusals`). Outputs name an image file
relative to the data root, or relative to its split's images folder when that folder was given
outside the root (:func:`relative_file`).

Batch size from the data. :func:`auto_batch_size` is the rule behind ``batch_size: auto``: the
largest power of two that still gives every process ``min_steps_per_epoch`` optimizer steps per
epoch, within ``[min_batch_size, max_batch_size]``. A small dataset thus gets small batches and
enough steps to train, a large one large batches (see :class:`~vision_attn.data.ImageFolderDataModule`).

Repeated augmentation (Hoffer et al. 2020, DeiT): :class:`RepeatedAugmentationSampler` yields
each chosen image ``k`` times per epoch, next to each other (same batch on one process, same
step across processes), so the random transform sees it ``k`` times; the epoch keeps the
dataset's length, i.e. it holds about ``len / k`` distinct images.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from vision_attn.data.imageio import DecodedCache, ImageReadError, cache_budget
from vision_attn.errors import DataError

__all__ = [
    "Batching",
    "MAX_UNREADABLE_IN_A_ROW",
    "PathRefusals",
    "RepeatedAugmentationSampler",
    "RepeatedDataset",
    "SkipUnreadable",
    "link_target",
    "SplitDataModule",
    "UnpaddedDistributedSampler",
    "auto_batch_size",
    "epoch_repeats",
    "distributed_world",
    "eval_sampler",
    "image_path_inside",
    "make_loader",
    "relative_file",
]

log = logging.getLogger(__name__)

MAX_UNREADABLE_IN_A_ROW = 20


FOLLOW_HINT = "pass --data.layout.follow_symlinks true to follow links you trust"


def link_target(path: Path) -> Path | None:
    """Where ``path`` leads, every symbolic link followed; ``None`` for a loop of links."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # RuntimeError: a loop of symbolic links (Python < 3.13)
        return None


def image_path_inside(split_dir: Path, name: str, follow_symlinks: bool = False) -> tuple[Path, str | None]:
    """``(path, None)`` for an image ``name`` that stays inside ``split_dir``, else
    ``(path, why it is refused)``.

    Args:
        split_dir: the split folder, already resolved (``Path.resolve()``).
        name: the image's path relative to the split folder (as the data names it).
        follow_symlinks: accept symbolic links inside the split folder that lead outside it.

    The returned path is the lexically normalised one (``a/../b`` -> ``b``), so that what is
    opened is what was checked.
    """
    if not name or "\0" in name:
        return split_dir / name.replace("\0", ""), "an empty or invalid file name"
    if os.path.isabs(name):
        return Path(name), "an absolute path (file names are relative to the split folder)"
    path = Path(os.path.normpath(split_dir / name))
    if path == split_dir or not path.is_relative_to(split_dir):
        return path, "a path outside the split folder"
    if not follow_symlinks:
        target = link_target(path)
        if target is None:
            return path, "a loop of symbolic links"
        if not target.is_relative_to(split_dir):
            return path, f"a symbolic link to {target}, outside the split folder ({FOLLOW_HINT})"
    return path, None


def relative_file(root: Path | None, images_dir: Path, name: str) -> str:
    """How outputs name the image ``name`` of the split folder ``images_dir``: relative to the
    data ``root`` when the folder lies under it (``val2017/x.jpg``, as with the default layout),
    else relative to the folder itself (``x.jpg``). Both are compared as written (made absolute,
    links not followed), so a root that is a symbolic link keeps its names."""
    folder = Path(os.path.abspath(images_dir))
    inside = Path(os.path.normpath(folder / name))
    if root is not None:
        base = Path(os.path.abspath(root))
        if inside.is_relative_to(base):
            return inside.relative_to(base).as_posix()
    return inside.relative_to(folder).as_posix() if inside.is_relative_to(folder) else name


class PathRefusals:
    """Collects refused image paths of one split: an error at the first one in evaluation
    (``skip=False``), one counted warning naming an example in training (``skip=True``)."""

    def __init__(self, source: Path | str, skip: bool) -> None:
        self.source, self.skip = source, skip
        self.count, self.example = 0, ""

    def refuse(self, what: str, path: Path, why: str) -> None:
        """Record (training) or raise :class:`DataError` for ``what`` (e.g. ``image id 3``)."""
        if not self.skip:
            raise DataError(f"{self.source}: {what} names {path}, {why}; refused "
                            "(image files must lie inside the split folder)")
        self.count += 1
        self.example = self.example or f"{what} -> {path} ({why})"

    def report(self) -> None:
        """Log the training warning (once, if anything was refused)."""
        if self.count:
            log.warning("%s: skipped %d images or folders whose path leaves the split folder, e.g. %s",
                        self.source, self.count, self.example)


class SkipUnreadable:
    """Dataset mixin: ``__getitem__`` loads through :meth:`_load`; with ``skip_unreadable`` set
    (training), an unreadable image is replaced by the next readable one (see the module docstring)."""

    skip_unreadable: bool = False
    _skipped: set[str] | None = None
    _decoded: DecodedCache | None = None

    def cached_read(self, key: Hashable, read: Callable[[], np.ndarray]) -> np.ndarray:
        """``read()`` of the image ``key`` names (its index, and anything else that changes the
        pixels read), kept for the next epochs when the split fits in memory
        (:class:`~vision_attn.data.imageio.DecodedCache`)."""
        if self._decoded is None:
            self._decoded = DecodedCache(len(self))
        return self._decoded.get(key, read)

    def _load(self, index: int):
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __getitem__(self, index: int):
        if not self.skip_unreadable:
            return self._load(index)
        n = len(self)
        last: ImageReadError | None = None
        for attempt in range(min(n, MAX_UNREADABLE_IN_A_ROW)):
            try:
                return self._load((index + attempt) % n)
            except ImageReadError as err:
                last = err
                if self._skipped is None:
                    self._skipped = set()
                if err.path not in self._skipped:
                    self._skipped.add(err.path)
                    log.warning("skipping unreadable training image %s (%s); %d skipped so far in this process",
                                err.path, err.reason, len(self._skipped))
        raise DataError(
            f"{min(n, MAX_UNREADABLE_IN_A_ROW)} unreadable images in a row, the last {last.path} ({last.reason}); "
            "is --data.root the right folder?"
        )


class UnpaddedDistributedSampler(DistributedSampler):
    """A distributed sampler for evaluation that never repeats a sample (see the module docstring).

    Being a ``DistributedSampler``, Lightning keeps it instead of inserting its own.

    Why not Lightning's: ``lightning.pytorch.overrides.distributed.UnrepeatedDistributedSampler``
    (what Lightning uses for ``predict``) splits the same way, but it lives in Lightning's
    internal ``overrides`` package (no stability promise) and asserts that every process gets at
    least one sample, so evaluating fewer images than processes (5 images on 8 GPUs, or one on
    two: a case ``tests/test_distributed.py`` covers) fails with a bare ``AssertionError``. Our
    evaluation steps never synchronise per batch, so a process with no batch is fine here.
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


def distributed_world() -> tuple[int, int]:
    """``(number of processes, this process's rank)`` of the initialised default process group,
    ``(1, 0)`` when not running distributed."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(), torch.distributed.get_rank()
    return 1, 0


MAX_AUTO_WORKERS = 8
"""Upper bound of ``num_workers: auto`` per training process."""


def usable_cpus() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def local_processes() -> int:
    """Training processes on this machine: ``LOCAL_WORLD_SIZE`` (torchrun, Lightning's DDP
    launcher), else one per visible GPU, else 1."""
    value = os.environ.get("LOCAL_WORLD_SIZE")
    if value and value.isdigit() and int(value) > 0:
        return int(value)
    return max(torch.cuda.device_count(), 1) if torch.cuda.is_available() else 1


def check_num_workers(num_workers: object) -> None:
    """A clear error for a ``--data.batching.num_workers`` that is neither a count nor ``auto``."""
    if num_workers == "auto":
        return
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise DataError(f"--data.batching.num_workers must be 0 (load in the training process), a positive number "
                        f"of loader processes, or 'auto', got {num_workers!r}")


def resolve_num_workers(num_workers: int | str) -> int:
    """Loader processes per training process: ``num_workers`` itself, or for ``auto`` the usable
    cores left after two for each training process (its own compute threads), shared among this
    machine's training processes, at most :data:`MAX_AUTO_WORKERS`. So ``auto`` is 0 on a 2-core
    machine — where the loader processes competed with the training step for the same cores (the
    small classification recipe on 1.3k images: 108 s with 2 workers, 91 s with 1, 80 s with 0) —
    2 on 4 cores and 8 on a 16-core machine with one GPU.
    """
    check_num_workers(num_workers)
    if num_workers != "auto":
        return int(num_workers)
    procs = local_processes()
    return max(0, min(MAX_AUTO_WORKERS, (usable_cpus() - 2 * procs) // procs))


def check_batch_sizing(batch_size: object, min_steps: object, min_batch: object, max_batch: object,
                       eval_batch: object) -> None:
    """Clear errors for batch-size settings that cannot work, naming the key."""
    if batch_size != "auto" and not (isinstance(batch_size, int) and not isinstance(batch_size, bool)
                                     and batch_size >= 1):
        raise DataError(f"--data.batching.batch_size must be a positive integer or 'auto', got {batch_size!r}")
    for key, value in (("min_steps_per_epoch", min_steps), ("min_batch_size", min_batch),
                       ("max_batch_size", max_batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise DataError(f"--data.batching.{key} must be a positive integer, got {value!r}")
    if max_batch < min_batch:
        raise DataError(f"--data.batching.max_batch_size {max_batch} is below --data.batching.min_batch_size "
                        f"{min_batch}; raise max_batch_size or lower min_batch_size")
    if eval_batch is not None and (not isinstance(eval_batch, int) or isinstance(eval_batch, bool) or eval_batch < 1):
        raise DataError(f"--data.batching.eval_batch_size must be a positive integer (or unset), got {eval_batch!r}")


@dataclass(frozen=True)
class Batching:
    """How a data module batches and loads: the training batch (fixed, or sized from the data),
    the evaluation batch and the loader processes (``--data.batching.*``; each data module has its
    own defaults).

    Attributes:
        batch_size: training images per batch (per process), or ``auto``: the largest power of
            two that leaves ``min_steps_per_epoch`` optimizer steps per epoch on every process,
            within ``[min_batch_size, max_batch_size]`` (:func:`auto_batch_size`; logged and saved
            in the data module's hyper-parameters).
        min_steps_per_epoch: ``auto`` only: optimizer steps every epoch makes at least.
        min_batch_size: ``auto`` only: the smallest batch the rule picks.
        max_batch_size: ``auto`` only: the largest batch the rule picks (memory bound); also the
            evaluation batch when ``eval_batch_size`` is unset.
        eval_batch_size: images per batch in validation/test (default ``batch_size``; with
            ``auto``, ``max_batch_size``: evaluation results do not depend on it).
        num_workers: loader processes per training process; ``auto``: the usable cores left after
            two per training process, at most 8 — 0 on a 2-core machine
            (:func:`resolve_num_workers`).
        fill_epoch: ``auto`` only: when even ``min_batch_size`` leaves fewer than
            ``min_steps_per_epoch`` steps (a small training set), an epoch shows every training
            image several times, each time with its own augmentation, until it makes them
            (:func:`epoch_repeats`): the number of optimizer steps then follows the data's size
            as the batch size does, and a recipe's ``max_epochs`` means as much training on 300
            images as on 1,500.
    """

    batch_size: int | Literal["auto"] = 64
    min_steps_per_epoch: int = 40
    min_batch_size: int = 8
    max_batch_size: int = 256
    eval_batch_size: int | None = None
    num_workers: int | Literal["auto"] = "auto"
    fill_epoch: bool = False

    def __post_init__(self) -> None:
        check_batch_sizing(self.batch_size, self.min_steps_per_epoch, self.min_batch_size, self.max_batch_size,
                           self.eval_batch_size)
        check_num_workers(self.num_workers)


BATCHING_LEGACY = {k: f"batching.{k}" for k in ("batch_size", "min_steps_per_epoch", "min_batch_size",
                                                  "max_batch_size", "eval_batch_size", "num_workers")}
"""Where the flat batch arguments of older data modules went (:attr:`SplitDataModule.legacy_arguments`)."""


def auto_batch_size(train_images: int, min_steps_per_epoch: int, min_batch_size: int, max_batch_size: int,
                    processes: int = 1, accumulate_grad_batches: int = 1) -> int:
    """The per-process training batch size of ``batch_size: auto``.

    The largest power of two ``b`` with ``b <= images per process / (min_steps_per_epoch *
    accumulate_grad_batches)``, clamped to ``[min_batch_size, max_batch_size]``. Images per
    process are ``ceil(train_images / processes)``: under DDP each process sees its share of an
    epoch, so the rule gives every process (and so the run) ``min_steps_per_epoch`` optimizer
    steps per epoch whatever the number of GPUs. Training drops the last partial batch, so an
    epoch makes ``floor(images per process / b) >= min_steps_per_epoch`` batches unless the
    clamp to ``min_batch_size`` wins (datasets smaller than ``min_steps_per_epoch *
    min_batch_size`` images).

    Args:
        train_images: images in the training split (all processes together).
        min_steps_per_epoch: optimizer steps every epoch must make at least.
        min_batch_size: lower bound (statistics of tiny batches are too noisy).
        max_batch_size: upper bound (memory; large datasets need no larger batches).
        processes: number of training processes (``trainer.world_size``).
        accumulate_grad_batches: batches per optimizer step (``trainer.accumulate_grad_batches``).
    """
    per_process = math.ceil(train_images / max(1, processes))
    fits = per_process // max(1, min_steps_per_epoch * accumulate_grad_batches)
    power = 1 << (fits.bit_length() - 1) if fits >= 1 else 1
    return max(min_batch_size, min(max_batch_size, power))


def epoch_repeats(train_images: int, batch: int, min_steps_per_epoch: int, processes: int = 1,
                  accumulate_grad_batches: int = 1) -> int:
    """How many times an epoch shows each training image under ``fill_epoch``: the fewest
    ``k >= 1`` with ``floor(ceil(k * train_images / processes) / batch) >= min_steps_per_epoch *
    accumulate_grad_batches`` (1 when one pass already makes the steps)."""
    wanted = min_steps_per_epoch * accumulate_grad_batches * batch * max(1, processes)
    k = max(1, math.ceil(wanted / max(1, train_images)))
    while math.ceil(k * train_images / max(1, processes)) // batch < min_steps_per_epoch * accumulate_grad_batches:
        k += 1
    return k


class RepeatedDataset(Dataset):
    """``dataset`` shown ``times`` times in a row: index ``i`` is ``dataset[i % len(dataset)]``
    (each showing draws its own augmentation). The training loaders' view under ``fill_epoch``."""

    def __init__(self, dataset: Dataset, times: int) -> None:
        self.dataset, self.times = dataset, int(times)

    def __len__(self) -> int:
        return len(self.dataset) * self.times

    def __getitem__(self, index: int):
        return self.dataset[index % len(self.dataset)]


class RepeatedAugmentationSampler(DistributedSampler):
    """Training sampler for repeated augmentation: each epoch, ``ceil(len / repeats)`` images
    drawn at random, each ``repeats`` times in a row, cut to the dataset's length and dealt out
    to the processes in turn (see the module docstring).

    The order is a seeded function of ``(seed, epoch)`` only (call :meth:`set_epoch` every
    epoch; Lightning does), identical on every process, which then takes positions ``rank,
    rank + num_replicas, ...``: the copies of one image go to neighbouring ranks at the same
    position of their batch (one process: into the same batch). Every process yields
    ``ceil(len / num_replicas)`` indices, so processes never wait for each other (with
    ``repeats = 1`` and a length the processes do not divide, the order wraps around and a few
    images are shown twice, as ``DistributedSampler`` pads).

    It is a ``DistributedSampler``, so Lightning keeps it under DDP instead of inserting its own;
    ``num_replicas`` and ``rank`` default to the initialised process group (one process when
    there is none).

    Args:
        dataset: the training dataset (only its length is used).
        repeats: ``k``, how many times a chosen image appears in an epoch (``1``: a plain
            shuffled epoch).
        num_replicas: number of processes (default: the process group's, else 1).
        rank: this process (default: the process group's, else 0).
        seed: base seed of the permutations (the same on every process).
    """

    def __init__(self, dataset: Dataset, repeats: int, num_replicas: int | None = None, rank: int | None = None,
                 seed: int = 0) -> None:
        if int(repeats) < 1:
            raise DataError(f"--data.augment.repeated_augmentation must be >= 1 (1 = off), got {repeats}")
        world, here = distributed_world()
        num_replicas = world if num_replicas is None else num_replicas
        rank = here if rank is None else rank
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self.repeats = int(repeats)
        self.num_samples = math.ceil(len(dataset) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def epoch_order(self) -> torch.Tensor:
        """The whole epoch's order of dataset indices (all processes together, ``total_size`` long)."""
        n = len(self.dataset)
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        distinct = math.ceil(self.total_size / self.repeats)
        chosen = torch.randperm(n, generator=g)
        if distinct > n:  # fewer images than processes: cycle through them
            chosen = chosen.repeat(math.ceil(distinct / n))
        return chosen[:distinct].repeat_interleave(self.repeats)[: self.total_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_order()[self.rank : self.total_size : self.num_replicas].tolist())

    def __len__(self) -> int:
        return self.num_samples


def make_loader(dataset: Dataset, batch_size: int, train: bool, num_workers: int,
                collate_fn: Callable | None = None, sampler: Sampler | None = None) -> DataLoader:
    """Training: shuffled (or ``sampler``'s order), last partial batch dropped (Lightning adds its
    distributed sampler under DDP unless ``sampler`` is a ``DistributedSampler``). Evaluation: in
    order, every sample once (unpadded under DDP)."""
    if sampler is None and not train:
        sampler = eval_sampler(dataset)
    length = len(sampler) if sampler is not None else len(dataset)
    return DataLoader(dataset, batch_size=batch_size, shuffle=train and sampler is None, sampler=sampler,
                      drop_last=train and length > batch_size, num_workers=num_workers,
                      persistent_workers=num_workers > 0, pin_memory=torch.cuda.is_available(),
                      collate_fn=collate_fn)


class SplitDataModule(L.LightningDataModule):
    """What every task's DataModule shares: one dataset per split from :meth:`dataset`, the
    loaders (:func:`make_loader` with the task's :meth:`collate_fn`), and ``eval_dataloader(split)``
    for ``eval.py``. Subclasses set ``root``, ``train_split``, ``val_split``, ``batch_size``,
    ``num_workers`` (or call :meth:`_init_batching`), ``datasets = {}`` and implement
    :meth:`dataset`."""

    eval_batch_size: int | None = None
    batch_size: int | str = 16
    num_workers: int | str = 0
    resolved_batch_size: int | None = None
    min_steps_per_epoch, min_batch_size, max_batch_size = 40, 8, 256
    # where the flat constructor arguments of older versions went: old name -> "group.field"
    # (checkpoints keep the data settings of their run; tasks/base.py converts them)
    legacy_arguments: dict[str, str] = {}

    def _init_batching(self, batching: Batching) -> None:
        """Keep the batch settings (:class:`Batching`, checked when it was built; see
        :func:`auto_batch_size`)."""
        try:
            cache_budget()  # a bad VISION_ATTN_DECODED_CACHE_MB stops here, not in a loader worker
        except ValueError as err:
            raise DataError(str(err)) from err
        batch_size = batching.batch_size
        self.batching = batching
        self.batch_size = batch_size  # as configured: an int or "auto"
        self.num_workers = batching.num_workers
        self.min_steps_per_epoch, self.min_batch_size, self.max_batch_size = (
            batching.min_steps_per_epoch, batching.min_batch_size, batching.max_batch_size)
        self.resolved_batch_size = batch_size if isinstance(batch_size, int) else None
        self.repeats = 1  # training passes per epoch (fill_epoch), set with the batch size
        self.eval_batch_size = batching.eval_batch_size or (
            batch_size if isinstance(batch_size, int) else batching.max_batch_size)

    def dataset(self, split: str, train: bool = False) -> Dataset:
        raise NotImplementedError

    def collate_fn(self) -> Callable | None:
        return None

    def setup(self, stage: str | None = None) -> None:
        if stage in ("fit", None):
            self.datasets["train"] = self.dataset(self.train_split, train=True)
            self.resolve_batch_size()  # before the schedule is planned from the loader's length
        if stage in ("fit", "validate", "test", None):
            self.datasets["val"] = self.dataset(self.val_split)

    def resolve_batch_size(self) -> int:
        """The training batch per process: ``batch_size``, or the ``auto`` rule applied to the
        training split and the attached trainer's processes and gradient accumulation (see
        :func:`auto_batch_size`). Logs it and records it in :attr:`hparams` (``batch_size``,
        ``batch_size_rule``, ``train_images``, ``batches_per_epoch``: what the loggers record and
        the checkpoint holds)."""
        if "train" not in self.datasets:
            self.datasets["train"] = self.dataset(self.train_split, train=True)
        images = len(self.datasets["train"])
        trainer = self.trainer
        processes = trainer.world_size if trainer is not None else distributed_world()[0]
        accumulate = trainer.accumulate_grad_batches if trainer is not None else 1
        if self.batch_size == "auto":
            batch = auto_batch_size(images, self.min_steps_per_epoch, self.min_batch_size, self.max_batch_size,
                                    processes, accumulate)
        else:
            batch = int(self.batch_size)
        fill = self.batch_size == "auto" and getattr(self.batching, "fill_epoch", False)
        self.repeats = epoch_repeats(images, batch, self.min_steps_per_epoch, processes, accumulate) if fill else 1
        per_process = -(-images * self.repeats // processes)
        batches = per_process // batch if per_process > batch else 1  # training drops the last partial batch
        if self.resolved_batch_size != batch or not self.hparams:
            if trainer is None or trainer.is_global_zero:
                rule = (f"auto: largest power of two <= {-(-images // processes)} images per process / "
                        f"(min_steps_per_epoch {self.min_steps_per_epoch} x accumulate_grad_batches {accumulate}), "
                        f"within [{self.min_batch_size}, {self.max_batch_size}]"
                        if self.batch_size == "auto" else "fixed")
                log.info("training batch size %d per process (%s): %d training images, %d process(es), "
                         "%d batches per epoch", batch, rule, images, processes, batches)
                if self.repeats > 1:
                    log.info("fill_epoch: each epoch shows the %d training images %d times (%d batches, at least "
                             "min_steps_per_epoch %d)", images, self.repeats, batches, self.min_steps_per_epoch)
            self.save_hyperparameters({"batch_size": batch, "batch_size_rule": str(self.batch_size),
                                       "train_images": images, "batches_per_epoch": batches,
                                       **({"epoch_repeats": self.repeats} if fill else {})})
        self.resolved_batch_size = batch
        return batch

    def train_batch_size(self) -> int:
        """Images per training batch and process (``batch_size``, or the ``auto`` rule's)."""
        return self.resolve_batch_size() if self.resolved_batch_size is None else self.resolved_batch_size

    def evaluation_batch_size(self) -> int:
        """Images per evaluation batch and process (``eval_batch_size``, which
        :meth:`_init_batching` defaults to the training batch, or ``max_batch_size`` with ``auto``)."""
        return self.eval_batch_size or self.batch_size

    def train_sampler(self, ds: Dataset) -> Sampler | None:
        """The training loader's sampler; ``None``: shuffled (Lightning's sampler under DDP)."""
        return None

    def _loader(self, ds: Dataset, train: bool) -> DataLoader:
        workers = resolve_num_workers(self.num_workers)
        if train:
            if self.num_workers == "auto":
                log.info("num_workers auto: %d loader process(es) per training process (%d usable cores)",
                         workers, usable_cpus())
            return make_loader(ds, self.train_batch_size(), True, workers, self.collate_fn(),
                               sampler=self.train_sampler(ds))
        return make_loader(ds, self.evaluation_batch_size(), False, workers, self.collate_fn())

    def train_dataloader(self) -> DataLoader:
        batch = self.train_batch_size()  # sets the epoch's repeats (fill_epoch)
        ds = self.datasets["train"]
        repeats = getattr(self, "repeats", 1)
        if repeats > 1 and batch:
            ds = RepeatedDataset(ds, repeats)
        return self._loader(ds, True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.datasets["val"], False)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()

    def eval_dataloader(self, split: str) -> DataLoader:
        """Loader over any split with the evaluation transform (used by ``eval.py``)."""
        return self._loader(self.dataset(split), False)
