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

import sys
from collections.abc import Callable

from vision_attn.commands.args import normalize_flags, parse_command

__all__ = ["SUBCOMMANDS", "main", "normalize_flags", "parse_command"]


def _fit(argv: list[str]) -> None:
    from vision_attn.commands.run import run_entry
    from vision_attn.commands.train import train_main

    run_entry(lambda: train_main(argv))


def _evaluate(split: str | None) -> Callable[[list[str]], None]:
    def run(argv: list[str]) -> None:
        from vision_attn.commands.evaluate import eval_main
        from vision_attn.commands.run import run_entry

        run_entry(lambda: eval_main(argv, default_split=split))

    return run


def _predict(argv: list[str]) -> None:
    from vision_attn.commands.predict import main

    main(argv, prog="vision-attn predict")


def _explain(argv: list[str]) -> None:
    from vision_attn.commands.predict import main

    main(argv, prog="vision-attn explain", explain=True)


def _export(argv: list[str]) -> None:
    from vision_attn.commands.export import main

    main(argv, prog="vision-attn export")


def _data(argv: list[str]) -> None:
    from vision_attn.commands.data import main

    main(argv, prog="vision-attn data")


SUBCOMMANDS: dict[str, tuple[Callable[[list[str]], None], str]] = {
    "fit": (_fit, "train a task from YAML configs (= train.py)"),
    "validate": (_evaluate("val"), "evaluate a checkpoint on the validation split (= eval.py)"),
    "test": (_evaluate("test"), "evaluate a checkpoint on the test split"),
    "predict": (_predict, "predictions (and overlays) for a folder of images, from a checkpoint or ONNX file"),
    "explain": (_explain, "attention overlays for a folder of images, from a checkpoint"),
    "export": (_export, "export a checkpoint as ONNX or safetensors"),
    "data": (_data, "write an embedded synthetic dataset"),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:{width}s}  {text}" for name, (_, text) in SUBCOMMANDS.items()]
    return ("usage: vision-attn SUBCOMMAND [options]   (vision-attn SUBCOMMAND --help for its options)\n\n"
            "subcommands:\n" + "\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``vision-attn`` console script and ``python -m vision_attn``."""
    argv = list(sys.argv[1:] if argv is None else argv)
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
