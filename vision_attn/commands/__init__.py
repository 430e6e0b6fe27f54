"""``vision-attn`` (and ``python -m vision_attn``): one command, Lightning's subcommands and ours.

    vision-attn fit      --config CFG [--config MORE] [--section.key value ...]   (= train.py)
    vision-attn validate --ckpt_path C --output_dir O [--config CFG] [overrides]  (= eval.py)
    vision-attn test     --ckpt_path C --output_dir O [--config CFG] [overrides]  (the test split)
    vision-attn predict  --ckpt_path C|M.onnx --images DIR --output_dir O [--no_overlays]
    vision-attn explain  --ckpt_path C --images DIR --output_dir O [--methods ...]
    vision-attn export   --ckpt_path C --output_dir O [--format onnx|safetensors] [--part encoder|model]
    vision-attn data     {shapes,glyphs} [--cache_dir DIR]

One flag vocabulary everywhere: ``--ckpt_path``, ``--output_dir``, ``--overwrite`` (a switch;
``--overwrite true`` also works), ``--config`` (repeatable YAML), ``--allow_import PREFIX``.
Older spellings (``--output FILE`` of export, ``--overwrite true/false`` where a switch is
expected, ``--model`` where ``--ckpt_path`` is meant) still work this version, with a
deprecation message. ``vision-attn SUBCOMMAND --help`` lists each one's options.

Each subcommand's module is imported when it runs, so that ``vision-attn --help`` lists them
without importing torch, timm or Lightning.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable

from vision_attn.commands.args import VERBOSE_ENV, normalize_flags, parse_command, take_verbose

__all__ = ["SUBCOMMANDS", "main", "normalize_flags", "parse_command"]


def _run(module: str, function: str, **kwargs: object) -> Callable[[list[str]], None]:
    """A subcommand that imports ``vision_attn.commands.<module>`` when it runs (torch, timm and
    Lightning load then, not for the listing) and calls its ``function(argv, **kwargs)``."""

    def run(argv: list[str]) -> None:
        getattr(importlib.import_module(f"vision_attn.commands.{module}"), function)(argv, **kwargs)

    return run


SUBCOMMANDS: dict[str, tuple[Callable[[list[str]], None], str]] = {
    "fit": (_run("train", "command"), "train a task from YAML configs (= train.py)"),
    "validate": (_run("evaluate", "command", split="val"), "evaluate a checkpoint on the validation split (= eval.py)"),
    "test": (_run("evaluate", "command", split="test"), "evaluate a checkpoint on the test split"),
    "predict": (_run("predict", "main", prog="vision-attn predict"),
                "predictions (and overlays) for a folder of images, from a checkpoint or ONNX file"),
    "explain": (_run("predict", "main", prog="vision-attn explain", explain=True),
                "attention overlays for a folder of images, from a checkpoint"),
    "export": (_run("export", "main", prog="vision-attn export"), "export a checkpoint as ONNX or safetensors"),
    "data": (_run("data", "main", prog="vision-attn data"), "write an embedded synthetic dataset"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:{width}s}  {text}" for name, (_, text) in SUBCOMMANDS.items()]
    return ("usage: vision-attn SUBCOMMAND [options] [-v]   (vision-attn SUBCOMMAND --help for its options;\n"
            "       -v / --verbose: also show other libraries' banners and warnings)\n\n"
            "subcommands:\n" + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``vision-attn`` console script and ``python -m vision_attn``."""
    argv, verbose = take_verbose(list(sys.argv[1:] if argv is None else argv))
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(usage())
        raise SystemExit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        sys.stderr.write(f"error: unknown subcommand {name!r}\n\n" + usage())
        raise SystemExit(2)
    SUBCOMMANDS[name][0](rest)


if __name__ == "__main__":
    main()
