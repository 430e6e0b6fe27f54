"""The run's own callbacks: the resolved config saved once per run folder, and the best-and-last
checkpoint that is refreshed every epoch and on interruption."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vision_attn.errors import RunExistsError

log = logging.getLogger("vision_attn")


class RunConfigCallback(SaveConfigCallback):
    """Save the resolved config as ``ROOT/config.yaml``; never overwrite a previous run's.

    A run into a folder that already holds a ``config.yaml`` is refused unless it resumes from
    a checkpoint (``--ckpt_path``), in which case the config goes to ``config.resume-N.yaml``.
    """

    def __init__(self, *args: Any, resuming: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resuming = resuming

    def setup(self, trainer: Trainer, pl_module: Any, stage: str) -> None:
        if self.already_saved or stage != "fit":
            return
        root = Path(trainer.default_root_dir)
        target = root / self.config_filename
        if trainer.is_global_zero:
            if target.exists():
                if not self.resuming:
                    raise RunExistsError(
                        f"{root} already holds a training run ({target} exists). Refusing to overwrite it: "
                        "pass another --trainer.default_root_dir, or resume it with --ckpt_path last."
                    )
                n = 1
                while (root / f"config.resume-{n}.yaml").exists():
                    n += 1
                target = root / f"config.resume-{n}.yaml"
            root.mkdir(parents=True, exist_ok=True)
            self.parser.save(self.config, target, overwrite=False, multifile=False)
        self.already_saved = True
        trainer.strategy.barrier()


class RunCheckpoint(ModelCheckpoint):
    """The best checkpoint by the task's validation metric, plus ``last.ckpt`` refreshed at the end
    of every training epoch. (Lightning 2.6 refreshes ``last`` only when it also saves a new
    best one, so without this a run whose metric stops improving resumes from a stale state.)"""

    _last_saved_step: int = -1

    def on_train_epoch_end(self, trainer: Trainer, pl_module: Any) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if (self.save_last and not trainer.sanity_checking and not trainer.fast_dev_run
                and trainer.state.fn == "fit" and self._last_saved_step != trainer.global_step):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def _save_last_checkpoint(self, trainer: Trainer, monitor_candidates: dict[str, Any]) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        self._last_saved_step = trainer.global_step

    def on_exception(self, trainer: Trainer, pl_module: Any, exception: BaseException) -> None:
        """An interruption (SIGTERM, Ctrl-C) saves ``last.ckpt`` so ``--ckpt_path last`` continues
        from there; any other failure (a diverged loss, a data error) keeps the last good one."""
        if not isinstance(exception, (SIGTERMException, KeyboardInterrupt)):
            return
        if (self.save_last and not trainer.sanity_checking and trainer.state.fn == "fit"
                and self._last_saved_step != trainer.global_step):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
            log.warning("interrupted at step %d: saved %s; continue with --ckpt_path last",
                        trainer.global_step, self.last_model_path)
