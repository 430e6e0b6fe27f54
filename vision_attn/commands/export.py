"""``vision-attn export`` (and ``python -m vision_attn.export``): the command line of
:func:`vision_attn.export.export_onnx` and :func:`vision_attn.export.export_safetensors`."""

from __future__ import annotations

import argparse
from pathlib import Path

from vision_attn.commands.args import console_logging, parse_command
from vision_attn.commands.policy import split_allow_import
from vision_attn.errors import VisionAttnError
from vision_attn.export import export_onnx, export_safetensors

DESCRIPTION = """Export a trained checkpoint: its weights as .safetensors (plain tensors, no pickled code)
or the model as ONNX.

  vision-attn export --ckpt_path runs/x/checkpoints/last.ckpt --output_dir out   # out/encoder.safetensors
  vision-attn export --ckpt_path ... --output_dir out --part model              # out/model.safetensors
  vision-attn export --ckpt_path ... --output_dir out --format onnx             # out/model.onnx

ONNX: input "images" [batch, 3, H, W] normalised as the model's preprocessing says (stored in the
file's metadata with the labels or vocabulary). Outputs: classification "logits"; detection
"pred_logits" and "pred_boxes" (cx, cy, w, h in [0, 1]); captioning the encoder's "tokens" (beam
search stays in PyTorch). --part encoder (default) writes the timm ViT's state dict with timm's
key names, which timm and create_encoder(NAME, weights_file=...) load; --part model writes the
whole task. An existing file is never overwritten unless --overwrite is given."""


def main(argv: list[str] | None = None, prog: str = "python -m vision_attn.export") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt_path", help="checkpoint from training")
    parser.add_argument("--output_dir",
                        help="folder to write into (model.onnx, encoder.safetensors or model.safetensors)")
    parser.add_argument("--output_file", dest="output", default=None,
                        help="the exact file to write instead (its suffix chooses the format)")
    parser.add_argument("--format", choices=["onnx", "safetensors"], default="safetensors",
                        help="safetensors: the weights (--part); onnx: the whole model, images in, predictions out")
    parser.add_argument("--part", choices=["encoder", "model"], default="encoder", help="safetensors: which weights")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing file")
    parser.add_argument("--allow_import", action="append", default=[], metavar="PREFIX",
                        help="let the checkpoint name task classes from this module prefix (your own task)")
    console_logging()
    try:
        args = parse_command(parser, argv, required=("ckpt_path",), renamed={"--output": "--output_file"})
        split_allow_import([a for p in args.allow_import for a in ("--allow_import", p)])  # refuses risky prefixes
        if args.output is None and not args.output_dir:
            parser.error("the following arguments are required: --output_dir")
        output = Path(args.output) if args.output else Path(args.output_dir) / (
            "model.onnx" if args.format == "onnx" else f"{args.part}.safetensors")
        if output.suffix == ".onnx":
            print(export_onnx(args.ckpt_path, output, overwrite=args.overwrite, allow_import=tuple(args.allow_import)))
        else:
            print(export_safetensors(args.ckpt_path, output, args.part, args.overwrite, tuple(args.allow_import)))
    except (VisionAttnError, ValueError) as err:
        parser.exit(2, f"error: {err}\n")


