"""``vision-attn validate`` / ``test`` / ``python eval.py --ckpt_path CKPT --output_dir OUT``.

Writes ``OUT/metrics.json``, ``OUT/predictions.json`` and the task's own files beside them
(:meth:`~vision_attn.tasks.VisionTask.eval_files`, e.g. ``per_class.json``). The model comes
from the checkpoint (read without executing pickled code), the data from ``--config`` or the
data settings saved in the checkpoint.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.cli import LightningArgumentParser

from vision_attn.commands.args import _config_class_paths, _option_value, normalize_flags
from vision_attn.commands.lightning import _check_writable, _VisionAttnCLI
from vision_attn.commands.options import (
    add_eval_options,
    config_task_class,
    eval_options,
    usable_task_classes,
)
from vision_attn.commands.policy import split_allow_import
from vision_attn.commands.run import run_entry
from vision_attn.errors import CheckpointError, ConfigError, RunExistsError, VisionAttnError
from vision_attn.explain.methods import skip_inapplicable
from vision_attn.explain.records import Report
from vision_attn.models.merging import merge_tokens
from vision_attn.outputs import display_path, write_json, write_result
from vision_attn.report import read_training_curves, write_report
from vision_attn.report.budget import ReportOptions
from vision_attn.report.mistakes import write_mistakes_page
from vision_attn.tasks.base import (
    TASKS,
    VisionTask,
    checked_data_settings,
    read_task_meta,
    resolve_class,
    restore_from_checkpoint,
)

log = logging.getLogger("vision_attn")


class EvalCLI(_VisionAttnCLI):
    """``eval.py`` / ``vision-attn validate`` / ``test``: the model (architecture, classes,
    preprocessing) comes from the checkpoint; the data from ``--config`` or, without one that
    names data, from the data settings saved in the checkpoint (any key overridable, e.g.
    ``--data.init_args.root DIR``). The checkpoint's task class decides which inference options
    the command takes besides ``--explain.*`` (its :attr:`~vision_attn.tasks.VisionTask.inference_options`:
    ``--GROUP.FIELD``, or ``--explain.FIELD`` for a task without a group of its own)."""

    def __init__(self, args: list[str] | None = None, default_split: str | None = None) -> None:
        argv = normalize_flags(list(sys.argv[1:] if args is None else args),
                               valued_bools=("--overwrite", "--report.full_attention"))
        self.default_split = default_split
        self._read: tuple[str, dict[str, Any], dict[str, Any]] | None = None  # (path, meta, checkpoint)
        self.task_classes: list[type[VisionTask]] = []  # the checkpoint's (or the config's) task
        super().__init__(save_config_callback=None, args=self._from_checkpoint(argv))

    def _from_checkpoint(self, argv: list[str]) -> list[str]:
        """``argv`` with the checkpoint's model (and its saved data settings, unless a config
        names data or ``--data`` is given) in front, so no ``--config`` is needed. The file is
        read once; building the model reuses what was read here."""
        rest, allowed = split_allow_import(argv)
        ckpt = _option_value(rest, "--ckpt_path")
        helping = any(a in ("-h", "--help") for a in rest)
        if not ckpt or helping or ckpt == "last":
            named = _named_task_class(rest, allowed, ckpt if helping else None)
            every = usable_task_classes(allowed) if helping else []  # --help of no model: every task's options
            self.task_classes = [named] if named is not None else every
            return argv
        meta, checkpoint = read_task_meta(ckpt, allowed)
        self._read = (ckpt, meta, checkpoint)
        self.task_classes = [TASKS[meta["task"]]]  # its inference options are this command's
        if self.task_classes[0].no_inference:
            raise ConfigError(f"checkpoint {ckpt}: {self.task_classes[0].no_inference}")
        front = ["--model", json.dumps(meta["model"])]
        has_data = "data" in _config_class_paths(rest) or any(a == "--data" or a.startswith("--data=") for a in rest)
        if not has_data:
            data = checked_data_settings(meta, f"checkpoint {ckpt}")
            if data is None:
                if not any(a in ("--config", "-c") or a.startswith("--config=") for a in rest):
                    raise ConfigError(
                        f"checkpoint {ckpt} holds no data settings (it was written before they were saved); "
                        "pass the training config: --config CFG"
                    )
            else:
                front += ["--data", json.dumps(data)]
        return front + argv

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--ckpt_path", type=str, required=True, help="Checkpoint to evaluate.")
        parser.add_argument("--output_dir", type=str, required=True, help="Where metrics.json etc. go.")
        parser.add_argument("--split", type=str | None, default=None,
                            help="Split to evaluate (default: the data's validation split; `vision-attn test`: its "
                                 "test split).")
        parser.add_argument("--overwrite", type=bool, default=False,
                            help="Replace results already in --output_dir (a bare --overwrite means true).")
        parser.add_argument("--merge_r", type=int, default=0,
                            help="Token merging (ToMe, Bolya et al. 2023): merge R tokens in every encoder block: "
                                 "faster, slightly less accurate (0: off, the model as trained).")
        parser.add_class_arguments(ReportOptions, "report", instantiate=False)
        add_eval_options(parser, self.task_classes)
        parser.set_defaults({"seed_everything": 0, "trainer.logger": False})

    def before_instantiate_classes(self) -> None:
        ckpt = self.config.ckpt_path
        if ckpt == "last" and self.config.trainer.get("default_root_dir"):
            ckpt = str(Path(self.config.trainer.default_root_dir) / "checkpoints" / "last.ckpt")
        if self._read is not None and self._read[0] == ckpt:
            self.ckpt_meta, self.ckpt = self._read[1:]
            self._read = None
        else:
            self.ckpt_meta, self.ckpt = read_task_meta(ckpt, self.allow_import)
        self.ckpt_file = ckpt
        out = Path(self.config.output_dir)
        _check_writable(out)
        model_cfg = self.ckpt_meta["model"]
        what = f"checkpoint {ckpt}"
        task_cls = resolve_class(model_cfg["class_path"], VisionTask, what, self.allow_import)
        existing = [name for name in result_file_names(task_cls) if (out / name).exists()]
        if existing and not self.config.overwrite:
            raise RunExistsError(
                f"{out} already holds evaluation results ({', '.join(existing)}); "
                "pass another --output_dir or --overwrite true"
            )
        # The data and trainer come from the config; the model (architecture, class names,
        # preprocessing) from the checkpoint, exactly as it was trained, with no download.
        config_class = self.config.model.class_path
        if resolve_class(config_class, VisionTask, what, self.allow_import) is not task_cls:
            raise CheckpointError(
                f"checkpoint {ckpt} holds a {self.ckpt_meta.get('task')!r} model ({model_cfg['class_path']}) "
                f"but the config describes {config_class}"
            )
        self.config.model = None
        self.config = self.parser.parse_object({"model": model_cfg}, self.config)

    def after_instantiate_classes(self) -> None:
        restore_from_checkpoint(self.model, self.ckpt_meta, self.ckpt, f"checkpoint {self.ckpt_file}")
        if self.config.get("merge_r"):
            merge_tokens(self.model, int(self.config.merge_r))

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        config["enable_checkpointing"] = False
        config["default_root_dir"] = self.config.output_dir
        return super()._instantiate_trainer(config, callbacks)


def _named_task_class(argv: list[str], allowed: tuple[str, ...], ckpt: str | None) -> type[VisionTask] | None:
    """The task class of the checkpoint ``ckpt`` (read for ``--help``) or, without one, of the model
    the ``--config`` files name; ``None`` when neither says (the command's own errors follow)."""
    if ckpt and ckpt != "last":
        try:
            return TASKS[read_task_meta(ckpt, allowed)[0]["task"]]
        except (VisionAttnError, OSError, ValueError, KeyError):
            return None
    return config_task_class(argv, allowed)


RESULT_FILES = ("metrics.json", "predictions.json")  # what every task's evaluation writes


def result_file_names(task_cls: type[VisionTask]) -> list[str]:
    """The result files an evaluation into a folder refuses to overwrite (without ``--overwrite``):
    :data:`RESULT_FILES` and the task files (:attr:`~vision_attn.tasks.base.VisionTask.eval_file_names`)
    of ``task_cls`` and of every registered task, so that no earlier evaluation's files, whatever
    its task, are replaced or left beside new results that they do not describe."""
    names = list(RESULT_FILES)
    for cls in (task_cls, *TASKS.values()):
        names += [n for n in cls.eval_file_names if n not in names]
    return names


def _task_files(model: VisionTask, dataset: Any) -> dict[str, Any]:
    """``model.eval_files(dataset)``, checked against the names the task declared (those were
    checked for earlier results before evaluating)."""
    files = model.eval_files(dataset)
    undeclared = sorted(set(files) - set(model.eval_file_names))
    if undeclared or set(files) & set(RESULT_FILES):
        raise VisionAttnError(
            f"{type(model).__name__}.eval_files gave {sorted(files)}, but its eval_file_names declares "
            f"{list(model.eval_file_names)} (and may not name {', '.join(RESULT_FILES)}): declare every file it writes"
        )
    return files


class _SplitData(L.LightningDataModule):
    """One split of a task's datamodule for ``trainer.test``. The loader is built when Lightning
    asks for it — after the processes of a distributed run have started — so that it samples
    every image exactly once (see :mod:`vision_attn.data.loading`)."""

    def __init__(self, datamodule: L.LightningDataModule, split: str) -> None:
        super().__init__()
        self.datamodule, self.split = datamodule, split
        self.loader = None

    def test_dataloader(self):
        self.loader = self.datamodule.eval_dataloader(self.split)
        return self.loader


def eval_main(args: list[str] | None = None, default_split: str | None = None) -> dict[str, float]:
    """Entry point of ``eval.py`` (``vision-attn validate``; ``test`` with ``default_split="test"``):
    returns the metrics it wrote."""
    cli = EvalCLI(args=args, default_split=default_split)
    dm, model, trainer = cli.datamodule, cli.model, cli.trainer
    model.configure_datamodule(dm)
    explain, task_options = eval_options(cli.config, type(model))
    if task_options is not None:
        model.set_inference_options(task_options)
    model.evaluation_options = explain  # read by a task whose metrics take options
    split = cli.config.split or (_test_split(dm) if cli.default_split == "test" else dm.val_split)
    data = _SplitData(dm, split)
    trainer.test(model, datamodule=data, verbose=False)
    metrics, predictions = model.eval_results(data.loader.dataset)
    if trainer.is_global_zero:
        out = Path(cli.config.output_dir)
        model.eval()
        options = model.explain_options(explain)
        options.methods = skip_inapplicable(model, options.methods, f"checkpoint {cli.ckpt_file}")
        options.predictions = predictions  # the worst mistakes are explained too (--explain.mistakes)
        report = Report() if options.report else None
        files = _task_files(model, data.loader.dataset)  # of the test run, before the explanations run the model
        if options.methods:
            metrics.update(model.explain_eval(data.loader.dataset, options, out, report=report))
            if getattr(model, "eval_mistakes", None) is not None:  # a detector's mistakes browser
                write_mistakes_page(out / "mistakes.html", model.eval_mistakes, root=out)
                log.info("wrote %d mistakes to %s", len(model.eval_mistakes.cards), out / "mistakes.html")
        else:
            log.warning("no explanation method applies to %s: no overlays or explanation numbers", cli.ckpt_file)
        write_json(out / "predictions.json", predictions, root=out)
        for name, content in files.items():
            write_result(out / name, content, root=out)
        for name in result_file_names(type(model)):  # an earlier evaluation's files (--overwrite)
            if name not in files and name not in RESULT_FILES and (out / name).is_file():
                log.info("removed %s: an earlier evaluation's file that this one does not write", out / name)
                (out / name).unlink()
        write_json(out / "metrics.json", metrics, root=out)
        if report is not None:
            data_settings = cli.config.data.as_dict()
            for key in ("root", "cache_dir"):
                if (data_settings.get("init_args") or {}).get(key):
                    data_settings["init_args"][key] = display_path(data_settings["init_args"][key])
            summary = {"checkpoint": display_path(cli.ckpt_file), "split": split, "model": cli.ckpt_meta["model"],
                       "preprocessing": cli.ckpt_meta.get("data_config"), "data": data_settings}
            write_report(out / "report.html", f"vision_attn {model.task_name} evaluation", metrics, summary,
                         report.items, report.curves, root=out, task=model.task_name,
                         sections=model.report_sections(files, metrics), headline=model.headline_metric,
                         mistakes=model.mistake_cards(report.items, predictions), predictions=predictions,
                         training_curves=read_training_curves(cli.ckpt_file), split_size=len(data.loader.dataset),
                         full_attention=bool(cli.config.get("report.full_attention", False)))
        log.info("evaluation of %s on split %r written to %s", cli.ckpt_file, split, out)
        for line in eval_summary(model.headline_metrics, metrics, files):
            log.info("%s", line)
    return metrics


def eval_summary(headline: Sequence[str], metrics: dict[str, float], files: dict[str, Any]) -> list[str]:
    """The few lines ``eval.py`` ends with: the ``headline`` metrics, the three worst classes of
    ``per_class.csv`` (by AP where it has one, else by F1) and TIDE's error split when measured."""
    lines = []
    shown = [f"{k} {metrics[k]:.4f}" for k in headline if isinstance(metrics.get(k), int | float)]
    if shown:
        lines.append("results: " + ", ".join(shown))
    rows = files.get("per_class.csv") or []
    key = "ap" if rows and "ap" in rows[0] else "f1"
    scored = sorted((r for r in rows if isinstance(r.get(key), int | float) and r[key] >= 0), key=lambda r: r[key])
    if scored:
        lines.append(f"worst classes by {'AP' if key == 'ap' else 'F1'}: "
                     + ", ".join(f"{r['class']} {r[key]:.3f}" for r in scored[:3]))
    if "tide_ap50" in metrics:
        split = ", ".join(f"{k} {metrics[f'tide_{k}']:.3f}" for k in ("cls", "loc", "both", "dupe", "bkg", "miss"))
        lines.append(f"TIDE dAP at IoU 0.5: {split}; false positives {metrics['tide_fp']:.3f}, false negatives "
                     f"{metrics['tide_fn']:.3f}")
    return lines


def _test_split(dm: Any) -> str:
    split = getattr(dm, "test_split", None)
    if not split:
        raise ConfigError(f"{type(dm).__name__} has no test split; pass --split NAME or use vision-attn validate")
    return split


def command(argv: list[str], split: str | None = None) -> None:
    """``vision-attn validate`` / ``test ARGS``: :func:`eval_main` under the one error policy."""
    run_entry(lambda: eval_main(argv, default_split=split))
