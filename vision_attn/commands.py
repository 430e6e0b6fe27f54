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

This module holds the helpers the argparse-based subcommands share (:func:`parse_command`).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

from vision_attn.errors import ConfigError

__all__ = ["SUBCOMMANDS", "main", "normalize_flags", "parse_command"]

log = logging.getLogger("vision_attn")

TRUE, FALSE = ("true", "yes", "1", "on"), ("false", "no", "0", "off")
COMMAND_LINE_ONLY = ("allow_import",)  # options a --config file may not set


def normalize_flags(argv: Sequence[str], renamed: dict[str, str] | None = None,
                    switches: Sequence[str] = (), valued_bools: Sequence[str] = ()) -> list[str]:
    """``argv`` in today's vocabulary, warning once for each old spelling.

    Args:
        renamed: old flag -> new flag (``--output`` -> ``--output_dir``).
        switches: flags that are switches here (argparse ``store_true``): ``--flag true`` becomes
            ``--flag``, ``--flag false`` is dropped.
        valued_bools: flags that take a value here (jsonargparse ``bool``): a bare ``--flag``
            becomes ``--flag true``.
    """
    renamed = renamed or {}
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if name in renamed:
            log.warning("%s is deprecated and will be removed in the next version; use %s", name, renamed[name])
            name = renamed[name]
            arg = name + eq + value
        nxt = args[i + 1] if i + 1 < len(args) else None
        if name in switches:
            given = value if eq else (nxt if nxt is not None and nxt.lower() in TRUE + FALSE else None)
            if given is not None:
                log.warning("%s %s is deprecated: %s is a switch (give it or leave it out)", name, given, name)
                if given.lower() in TRUE:
                    out.append(name)
                i += 1 if eq else 2
                continue
        if name in valued_bools and not eq and (nxt is None or nxt.startswith("--")):
            out += [name, "true"]
            i += 1
            continue
        out.append(arg)
        i += 1
    return out


def parse_command(parser: argparse.ArgumentParser, argv: Sequence[str] | None, required: Sequence[str] = (),
                  renamed: dict[str, str] | None = None) -> argparse.Namespace:
    """Parse an argparse subcommand the vision_attn way: old spellings normalised
    (:func:`normalize_flags`), no abbreviated options, ``--config FILE`` (repeatable; YAML mapping
    of option names to values, later files and the command line win) as defaults, ``required``
    options checked after the config files are applied.

    Raises:
        ConfigError: for a config file that cannot be read, is not a mapping, names an option the
            command does not have, or sets one that only the command line may give
            (:data:`COMMAND_LINE_ONLY`).
    """
    parser.allow_abbrev = False  # an option is spelled out: --allow_imp is not --allow_import
    switches = [a.option_strings[0] for a in parser._actions
                if isinstance(a, argparse._StoreTrueAction) and a.option_strings]
    argv = normalize_flags(sys.argv[1:] if argv is None else argv, renamed, switches)
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="YAML file of option: value pairs (repeatable; the command line wins)")
    pre, _ = parser.parse_known_args(argv)
    dests = {a.dest for a in parser._actions} - {"help", "config"}
    for path in pre.config:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"--config {path}: cannot read it ({err})") from err
        if not isinstance(data, dict):
            raise ConfigError(f"--config {path}: expected a mapping of option names to values")
        unknown = sorted(str(k) for k in data if k not in dests)
        if unknown:
            raise ConfigError(f"--config {path}: unknown options {unknown}; see {parser.prog} --help")
        only_here = sorted(str(k) for k in data if k in COMMAND_LINE_ONLY)
        if only_here:
            raise ConfigError(
                f"--config {path}: {only_here} may only be given on the command line (--allow_import PREFIX "
                "opens the import policy, which no file may do)"
            )
        parser.set_defaults(**data)
    args = parser.parse_args(argv)
    missing = [f"--{r}" for r in required if getattr(args, r, None) in (None, "")]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)}")
    return args


def _fit(argv: list[str]) -> None:
    from vision_attn.cli import run_entry, train_main

    run_entry(lambda: train_main(argv))


def _evaluate(split: str | None) -> Callable[[list[str]], None]:
    def run(argv: list[str]) -> None:
        from vision_attn.cli import eval_main, run_entry

        run_entry(lambda: eval_main(argv, default_split=split))

    return run


def _predict(argv: list[str]) -> None:
    from vision_attn.predict import main

    main(argv, prog="vision-attn predict")


def _explain(argv: list[str]) -> None:
    from vision_attn.predict import main

    main(argv, prog="vision-attn explain", explain=True)


def _export(argv: list[str]) -> None:
    from vision_attn.export import main

    main(argv, prog="vision-attn export")


def _data(argv: list[str]) -> None:
    from vision_attn.data.__main__ import main

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
