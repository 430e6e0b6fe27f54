"""``vision-attn export`` (and ``python -m vision_attn.export``): the command line of
:func:`vision_attn.export.export_onnx` and :func:`vision_attn.export.export_safetensors`."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from vision_attn.commands.args import parse_command
from vision_attn.commands.policy import split_allow_import
from vision_attn.errors import VisionAttnError
from vision_attn.export import export_onnx, export_safetensors

DESCRIPTION = "Export a trained checkpoint: weights as ``.safetensors`` (plain tensors, no pickled code) or\nthe model as ONNX.\n\n    vision-attn export --ckpt_path runs/x/checkpoints/last.ckpt --output_dir out   # out/encoder.safetensors\n    vision-attn export --ckpt_path ... --output_dir out --part model              # out/model.safetensors\n    vision-attn export --ckpt_path ... --output_dir out --format onnx             # out/model.onnx\n\nONNX (chosen by the ``.onnx`` suffix): input ``images`` ``[batch, 3, H, W]`` normalised as the\nmodel's preprocessing says (stored in the file's metadata with the labels or vocabulary), any\nbatch size. Outputs: classification ``logits [B, C]``; detection ``pred_logits [B, Q, C(+1)]``\nand ``pred_boxes [B, Q, 4]`` (cxcywh in [0, 1]); captioning the encoder's ``tokens [B, T, D]``\n(beam search stays in PyTorch).\n\n``--part encoder`` (default) writes the timm ViT's state dict — keys exactly as timm names\nthem, so ``create_encoder(NAME, weights_file=...)`` or timm itself can load it; ``--part model``\nwrites the whole task (encoder and head, keys as in the checkpoint's ``state_dict``). The\narchitecture, preprocessing and labels go into the file's metadata as JSON. An existing file is\nnever overwritten (a link in its place included); the file is written through a fresh temporary\nfile in the same folder and renamed (:func:`vision_attn.outputs.atomic_output`).\n"


def main(argv: list[str] | None = None, prog: str = "python -m vision_attn.export") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt_path", help="checkpoint from training")
    parser.add_argument("--output_dir", help="folder to write into (model.onnx, encoder.safetensors or model.safetensors)")
    parser.add_argument("--output_file", dest="output", default=None,
                        help="the exact file to write instead (its suffix chooses the format)")
    parser.add_argument("--format", choices=["onnx", "safetensors"], default="safetensors")
    parser.add_argument("--part", choices=["encoder", "model"], default="encoder", help="safetensors: which weights")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing file")
    parser.add_argument("--allow_import", action="append", default=[], metavar="PREFIX",
                        help="let the checkpoint name task classes from this module prefix (your own task)")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
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


