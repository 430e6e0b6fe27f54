"""``vision-attn predict`` / ``explain`` (and ``python -m vision_attn.predict`` / ``vision_attn.overlay``):
the command line of :func:`vision_attn.predict.predict_folder`."""

from __future__ import annotations

import argparse
import logging
import sys

from vision_attn.commands.args import parse_command
from vision_attn.commands.policy import split_allow_import
from vision_attn.errors import VisionAttnError
from vision_attn.explain.methods import METHODS, TOKENS
from vision_attn.predict import predict_folder

PREDICT = """Predictions for every image under --images (a file, a folder searched recursively, or a
quoted glob), from a checkpoint of any task, a timm model (timm:NAME) or an ONNX file, with
attention overlays (--no_overlays: predictions only).

  vision-attn predict --ckpt_path runs/x/checkpoints/last.ckpt --images photos/ --output_dir out/
  vision-attn predict --ckpt_path timm:vit_small_patch16_224 --weights_file W.safetensors \\
      --images photos/ --output_dir out/

Writes into --output_dir: predictions.json (one record per image), overlays/<file>.png,
skipped.json (files that could not be read, with the reason) and report.html. A folder that
already holds any of them is refused unless --overwrite is given."""

EXPLAIN = """Attention overlays for every image under --images, from a checkpoint or a timm model
(timm:NAME): one panel per explanation method (--methods), each detected object's query or each
caption word for the detection and captioning heads.

  vision-attn explain --ckpt_path runs/x/checkpoints/last.ckpt --images photos/ --output_dir out/
  vision-attn explain --ckpt_path timm:vit_small_patch16_224 --weights_file W.safetensors \\
      --images photos/ --output_dir out/ --methods relevance rollout attention

Writes overlays/<file>.png, predictions.json, skipped.json and report.html into --output_dir."""


def build_parser(prog: str, description: str, expected_task: str | None = None,
                 explain: bool = False) -> argparse.ArgumentParser:
    """The options of the folder commands (``predict``, ``explain``, ``vision_attn.overlay``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt_path", "--model", dest="model", metavar="SOURCE",
                        help="a .ckpt from training, timm:NAME (any timm ViT / DeiT / register model, e.g. "
                             "timm:vit_base_patch16_224.augreg_in21k_ft_in1k)" + ("" if expected_task or explain else
                             ", or a .onnx from vision-attn export (--model is the same option)"))
    parser.add_argument("--weights_file", default=None,
                        help="timm:NAME: local weights (.safetensors / .pth state dict, read without executing "
                             "pickles); without it the weights come from timm's hub (needs network access)")
    parser.add_argument("--class_names", default=None, metavar="FILE",
                        help="timm:NAME with a head that is not ImageNet's: a text file, one class name per line")
    parser.add_argument("--topk", type=int, default=5, help="classification: the K best classes of each image")
    parser.add_argument("--target_class", default=None, metavar="NAME|INDEX",
                        help="classification: explain this class instead of the predicted one")
    parser.add_argument("--token", default="auto", choices=list(TOKENS),
                        help="classification: the token row explained (auto: what the head reads; distilled DeiT: "
                             "cls, dist or their mean)")
    parser.add_argument("--images", help="an image file, a folder (searched recursively) or a quoted glob "
                                         "('photos/**/*.jpg')")
    parser.add_argument("--output_dir", help="where predictions.json, overlays/, skipped.json, report.html go")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the outputs of an earlier run (predictions.json, skipped.json, report.html, "
                             "overlays/) in --output_dir")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--num_workers", type=int, default=2, help="DataLoader processes decoding the images")
    if not explain:
        parser.add_argument("--no_overlays", action="store_true", help="predictions only")
    parser.add_argument("--methods", nargs="+", default=None, choices=list(METHODS),
                        help="explanation methods drawn, side by side (default: each head's best measured "
                             "first: classification relevance, rollout, attention; detection and "
                             "captioning relevance, attention): "
                             + "; ".join(f"{name}: {spec.description}" for name, spec in METHODS.items()))
    parser.add_argument("--merge_r", type=int, default=0, metavar="R",
                        help="token merging (ToMe, Bolya et al. 2023): merge R tokens in every encoder block: "
                             "faster inference, slightly less accurate (0: off)")
    parser.add_argument("--score_threshold", type=float, default=0.3, help="detection: keep boxes scoring at least this")
    parser.add_argument("--alpha", type=float, default=0.5, help="heat-map opacity")
    parser.add_argument("--device", "--accelerator", dest="device", default="auto", choices=["auto", "cpu", "cuda", "gpu"],
                        help="where the model runs (auto: a GPU when there is one)")
    parser.add_argument("--devices", default="1", help="processes / GPUs sharing the images (Lightning's devices)")
    parser.add_argument("--allow_import", action="append", default=[], metavar="PREFIX",
                        help="let the checkpoint name task classes from this module prefix (your own task; "
                             "importing a module runs its code)")
    return parser


def run_cli(argv: list[str] | None, prog: str, description: str, expected_task: str | None = None,
            explain: bool = False) -> None:
    """The command line of :func:`predict_folder` (``vision-attn predict`` / ``explain``,
    ``python -m vision_attn.predict`` and ``python -m vision_attn.overlay``)."""
    parser = build_parser(prog, description, expected_task, explain)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        args = parse_command(parser, argv, required=("model", "images", "output_dir"))
        split_allow_import([a for p in args.allow_import for a in ("--allow_import", p)])  # refuses risky prefixes
        devices = int(args.devices) if str(args.devices).isdigit() else args.devices
        result = predict_folder(args.model, args.images, args.output_dir, args.batch_size,
                                explain or not args.no_overlays, tuple(args.methods) if args.methods else None, args.score_threshold, args.alpha,
                                args.device, args.overwrite, expected_task=expected_task, num_workers=args.num_workers,
                                devices=devices, allow_import=tuple(args.allow_import), weights_file=args.weights_file,
                                class_names=args.class_names, topk=args.topk, target_class=args.target_class,
                                token=args.token, merge_r=args.merge_r)
    except VisionAttnError as err:
        sys.stderr.write(f"error: {err}\n")
        raise SystemExit(2) from None
    print(f"{len(result['predictions'])} images, {len(result['skipped'])} skipped -> {args.output_dir}")


def main(argv: list[str] | None = None, prog: str = "python -m vision_attn.predict", explain: bool = False) -> None:
    run_cli(argv, prog, EXPLAIN if explain else PREDICT, explain=explain)


