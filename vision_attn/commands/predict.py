"""``vision-attn predict`` / ``explain`` (and ``python -m vision_attn.predict`` / ``vision_attn.overlay``):
the command line of :func:`vision_attn.predict.predict_folder`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from vision_attn.commands.args import console_logging, parse_command
from vision_attn.commands.options import (
    add_folder_options,
    folder_flags,
    folder_options,
    refuse_other_tasks_flags,
    usable_task_classes,
)
from vision_attn.commands.policy import split_allow_import
from vision_attn.errors import VisionAttnError
from vision_attn.explain.evaluate import ExplainOptions
from vision_attn.explain.methods import METHODS
from vision_attn.explain.overlay import NORMALIZE
from vision_attn.outputs import console_text
from vision_attn.predict import (
    FolderRun,
    ModelSource,
    check_outputs,
    load_source,
    predict_folder,
    task_of,
)

PREDICT = """Predictions for every image under --images (a file, a folder searched recursively, or a
quoted glob), from a checkpoint of any task, a timm model (timm:NAME) or an ONNX file, with
attention overlays (--no_overlays: predictions only).

  vision-attn predict --ckpt_path runs/x/checkpoints/last.ckpt --images photos/ --output_dir out/
  vision-attn predict --ckpt_path timm:vit_small_patch16_224 --weights_file W.safetensors \\
      --images photos/ --output_dir out/

Writes into --output_dir: predictions.json (one record per image), overlays/<file>.png,
skipped.json (files that could not be read, with the reason) and report.html. A folder that
already holds any of them is refused unless --overwrite is given. The model's task adds its own
options (below, each named after its task; only those of the model's task are taken)."""

EXPLAIN = """Attention overlays for every image under --images, from a checkpoint or a timm model
(timm:NAME): one panel per explanation method (--methods), drawn as the model's task draws its
explanations (e.g. per detected object or per caption word).

  vision-attn explain --ckpt_path runs/x/checkpoints/last.ckpt --images photos/ --output_dir out/
  vision-attn explain --ckpt_path timm:vit_small_patch16_224 --weights_file W.safetensors \\
      --images photos/ --output_dir out/ --methods relevance rollout attention

Writes overlays/<file>.png, predictions.json, skipped.json and report.html into --output_dir. The
model's task adds its own options (below, each named after its task; only those of the model's task
are taken)."""


def build_parser(prog: str, description: str, expected_task: str | None = None,
                 explain: bool = False) -> argparse.ArgumentParser:
    """The options of the folder commands (``predict``, ``explain``, ``vision_attn.overlay``) that
    every model takes; a model's task adds its own
    (:func:`~vision_attn.commands.options.add_folder_options`)."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt_path", "--model", dest="model", metavar="SOURCE",
                        help="a .ckpt from training, timm:NAME (any timm ViT / DeiT / register model, e.g. "
                             "timm:vit_base_patch16_224.augreg_in21k_ft_in1k)" + ("" if expected_task or explain else
                             ", or a .onnx from vision-attn export (--model is the same option)"))
    parser.add_argument("--weights_file", default=None,
                        help="timm:NAME: local weights (.safetensors / .pth state dict, read without executing "
                             "pickles); without it the weights come from timm's hub (needs network access)")
    parser.add_argument("--class_names", default=None, metavar="FILE",
                        help="timm:NAME with a head that is not ImageNet's: a text file, one class name per line")
    parser.add_argument("--images", help="an image file, a folder (searched recursively) or a quoted glob "
                                         "('photos/**/*.jpg')")
    parser.add_argument("--output_dir", help="where predictions.json, overlays/, skipped.json, report.html go")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the outputs of an earlier run (predictions.json, skipped.json, report.html, "
                             "overlays/) in --output_dir")
    parser.add_argument("--follow_symlinks", action="store_true",
                        help="read images that symbolic links in --images lead to outside it (default: skipped)")
    parser.add_argument("--batch_size", type=int, default=16, help="images per forward pass")
    parser.add_argument("--num_workers", type=int, default=2, help="DataLoader processes decoding the images")
    if not explain:
        parser.add_argument("--no_overlays", action="store_true", help="predictions only")
    parser.add_argument("--methods", nargs="+", default=None, choices=list(METHODS),
                        help="explanation methods drawn, side by side (default: each head's own, its best "
                             "measured first; a method that does not apply to the model is skipped with a "
                             "warning): " + "; ".join(f"{name}: {spec.description}" for name, spec in METHODS.items()))
    parser.add_argument("--merge_r", type=int, default=0, metavar="R",
                        help="token merging (ToMe, Bolya et al. 2023): merge R tokens in every encoder block: "
                             "faster inference, slightly less accurate (0: off)")
    parser.add_argument("--head_fusion", default="mean", metavar="FUSION",
                        help="how rollout and raw attention fuse the heads: mean, max, min, or head<K> for head K "
                             "alone (head0, head1, ...)")
    parser.add_argument("--alpha", type=float, default=0.5, help="heat-map opacity")
    parser.add_argument("--overlay.normalize", dest="normalize", default="shared", choices=list(NORMALIZE),
                        help="the overlays' colour scale: shared (default: one scale for every panel of a "
                             "figure, a weak map stays weak) or per_map (each map scaled to its own maximum)")
    parser.add_argument("--report.full_attention", dest="full_attention", action="store_true",
                        help="report.html keeps every layer and head of the per-patch attention view (the page "
                             "then grows with the model and the number of images, about 7.4 MB per image on "
                             "ViT-B/16); default: what fits a page of at most 10 MB (the last layer, heads "
                             "averaged, on large models)")
    parser.add_argument("--device", "--accelerator", dest="device", default="auto",
                        choices=["auto", "cpu", "cuda", "gpu"],
                        help="where the model runs (auto: a GPU when there is one)")
    parser.add_argument("--devices", default="1", help="processes / GPUs sharing the images (Lightning's devices)")
    parser.add_argument("--allow_import", action="append", default=[], metavar="PREFIX",
                        help="let the checkpoint name task classes from this module prefix (your own task; "
                             "importing a module runs its code)")
    return parser


def _source(args: argparse.Namespace, expected_task: str | None) -> ModelSource:
    return ModelSource(args.model, args.weights_file, args.class_names, tuple(args.allow_import), expected_task,
                       args.merge_r)


class _TaskOptions:
    """The ``extend`` step of :func:`~vision_attn.commands.args.parse_command`: loads the model the
    command line names and adds its task's inference options
    (:func:`~vision_attn.commands.options.add_folder_options`); for ``--help``, or before the model
    is known, those of every task the command may name."""

    def __init__(self, argv: list[str] | None, expected_task: str | None) -> None:
        self.argv, self.expected_task = list(sys.argv[1:] if argv is None else argv), expected_task
        self.model: Any = None

    def __call__(self, parser: argparse.ArgumentParser, known: argparse.Namespace, helping: bool) -> None:
        tasks = usable_task_classes(tuple(known.allow_import))
        task_flags = {flag for cls in tasks for flag in folder_flags(cls).values()}
        strangers = [a for a in self.argv if a.startswith("--") and a.split("=", 1)[0] not in task_flags
                     and a.split("=", 1)[0] not in parser._option_string_actions]
        if helping or strangers or not (known.model and known.images and known.output_dir):
            # help, an option no task has (refused by the full parse, before any model loads) or
            # too little to load a model: every task's options
            add_folder_options(parser, tasks)
            return
        split_allow_import([a for p in known.allow_import for a in ("--allow_import", p)])  # refuses risky prefixes
        check_outputs(Path(known.output_dir), known.overwrite)  # before the model loads
        self.model = load_source(_source(known, self.expected_task))
        task_cls = type(task_of(self.model))
        refuse_other_tasks_flags(self.argv, task_cls, tasks, known.model)
        add_folder_options(parser, [task_cls])


def run_cli(argv: list[str] | None, prog: str, description: str, expected_task: str | None = None,
            explain: bool = False) -> None:
    """The command line of :func:`predict_folder` (``vision-attn predict`` / ``explain``,
    ``python -m vision_attn.predict`` and ``python -m vision_attn.overlay``)."""
    parser = build_parser(prog, description, expected_task, explain)
    console_logging()
    task_options = _TaskOptions(argv, expected_task)
    try:
        args = parse_command(parser, argv, required=("model", "images", "output_dir"), extend=task_options)
        devices = int(args.devices) if str(args.devices).isdigit() else args.devices
        run = FolderRun(batch_size=args.batch_size, num_workers=args.num_workers, device=args.device,
                        devices=devices, overwrite=args.overwrite, full_attention=args.full_attention,
                        follow_symlinks=args.follow_symlinks)
        drawn = ExplainOptions(methods=list(args.methods) if args.methods else None, alpha=args.alpha,
                               normalize=args.normalize, head_fusion=args.head_fusion)
        model = task_options.model
        result = predict_folder(_source(args, expected_task), args.images, args.output_dir, run, drawn,
                                folder_options(args, type(task_of(model))), explain or not args.no_overlays, model)
    except VisionAttnError as err:
        sys.stderr.write(f"error: {console_text(str(err))}\n")
        raise SystemExit(2) from None
    print(f"{len(result['predictions'])} images, {len(result['skipped'])} skipped -> {args.output_dir}")


def main(argv: list[str] | None = None, prog: str = "python -m vision_attn.predict", explain: bool = False) -> None:
    run_cli(argv, prog, EXPLAIN if explain else PREDICT, explain=explain)


