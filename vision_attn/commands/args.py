"""Command-line helpers every command shares: one flag vocabulary (old spellings normalised
with a deprecation message), ``--config FILE`` for the argparse commands, and jsonargparse's
nested errors condensed to one line."""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from vision_attn.errors import ConfigError

log = logging.getLogger("vision_attn")

VERBOSE_FLAGS = ("-v", "--verbose")
VERBOSE_ENV = "VISION_ATTN_VERBOSE"
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


MAX_CONFIG_VALUES = 1 << 18
"""The most values a config may hold with its YAML aliases expanded (:func:`screen_configs`)."""
_CONFIG_SUFFIXES = (".yaml", ".yml")  # JSON has no aliases: annotation files are not read here
_SCREENED_BYTES = 8 << 20  # a larger YAML file another option names is data, not a config


def _screen_yaml(text: str, where: str, depth: int = 0) -> None:
    """Refuse YAML whose aliases expand past :data:`MAX_CONFIG_VALUES` values (safe_load keeps
    them shared, so reading costs what the text costs), then the config files it names."""
    from vision_attn.schema import check_data_size  # torch: only once a config has aliases

    try:
        data = yaml.safe_load(text)
    except (yaml.YAMLError, RecursionError):
        return  # not YAML: the parser names the problem
    check_data_size(data, where, max_values=MAX_CONFIG_VALUES, error=ConfigError)
    if depth < 4:
        for value in _strings(data):
            _screen_file(value, f"{where} -> {value}", depth + 1, named=False)


def _strings(data: Any) -> list[str]:
    if isinstance(data, dict):
        return [v for x in data.values() for v in _strings(x)]
    if isinstance(data, list):
        return [v for x in data for v in _strings(x)]
    return [data] if isinstance(data, str) else []


def _is_file(value: str) -> bool:
    try:
        return Path(value).is_file()
    except (OSError, ValueError):  # a name too long for a file, a NUL
        return False


def _screen_file(value: str, where: str, depth: int, named: bool) -> None:
    """Screen ``value`` when it is a config file (given to ``--config``, or a ``*.yaml`` / ``*.yml``
    file of at most 8 MiB); alias-free text cannot expand, so only text with an anchor is parsed."""
    if not (named or Path(value).suffix.lower() in _CONFIG_SUFFIXES) or not _is_file(value):
        return
    try:
        if not named and Path(value).stat().st_size > _SCREENED_BYTES:
            return
        text = Path(value).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return
    if "&" in text and "*" in text:
        _screen_yaml(text, where, depth)


def screen_configs(argv: Sequence[str]) -> None:
    """Refuse, before any parser expands them, configs whose YAML aliases describe more than
    :data:`MAX_CONFIG_VALUES` values (a file of a few hundred bytes can describe billions: the
    "billion laughs"), contain themselves or nest too deeply: ``--config`` files and strings, and
    the config files other options or those configs name.

    Raises:
        ConfigError: naming the file (or ``--config`` string) and what is wrong with it.
    """
    for i, arg in enumerate(argv):
        option, eq, value = arg.partition("=") if arg.startswith("-") else ("", "", arg)
        if arg.startswith("-") and not eq:
            continue
        named = option in ("--config", "-c") or (not option and i > 0 and argv[i - 1] in ("--config", "-c"))
        where = f"--config {value}" if named else value
        if Path(value).suffix.lower() in _CONFIG_SUFFIXES or named:
            _screen_file(value, where, 0, named)
        if named and "&" in value and "*" in value and not _is_file(value):
            _screen_yaml(value, "the --config string", 0)


def _read_config(path: str) -> dict[str, Any]:
    """A ``--config`` file of an argparse command: a YAML mapping of option names to values, nested
    mappings flattened to dotted names (``group: {field: 1}`` is ``group.field``)."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"--config {path}: cannot read it ({err})") from err
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of option names to values")
    from vision_attn.schema import check_data_size

    check_data_size(data, f"--config {path}", max_values=MAX_CONFIG_VALUES, error=ConfigError)
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[str(key)] = value
    return flat


def _as_given(parser: argparse.ArgumentParser, data: dict[str, Any], path: str) -> dict[str, Any]:
    """``data`` (by destination) with each value converted and checked as the command line's would
    be: the option's ``type`` applied to its text, its ``choices`` enforced, switches true or false,
    a list (or one value) for options that take several values, one value for the others.

    Raises:
        ConfigError: naming the file and the option, for a value the command line would refuse.
    """
    actions = {a.dest: a for a in parser._actions}
    out: dict[str, Any] = {}
    for dest, value in data.items():
        action = actions.get(dest)
        where = f"--config {path}: {action.option_strings[0] if action and action.option_strings else dest}"
        if action is None or value is None:
            out[dest] = value
        elif isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            if not isinstance(value, bool):
                raise ConfigError(f"{where} is a switch: give true or false, not {str(value)[:40]!r}")
            out[dest] = value
        else:
            several = action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction)
            if several:  # one value given alone is a list of one, as on the command line
                out[dest] = [_given_value(action, v, where) for v in (value if isinstance(value, list) else [value])]
            else:
                out[dest] = _given_value(action, value, where)
    return out


def _given_value(action: argparse.Action, value: Any, where: str) -> Any:
    if isinstance(value, (list, dict)):
        raise ConfigError(f"{where}: {str(value)[:40]!r} is not one value")
    text = str(value).lower() if isinstance(value, bool) else str(value)
    try:
        converted = action.type(text) if callable(action.type) else value
    except (ValueError, TypeError, argparse.ArgumentTypeError) as err:
        raise ConfigError(f"{where}: {text[:40]!r} is not valid ({err})") from None
    if action.choices is not None and converted not in action.choices:
        raise ConfigError(f"{where}: {text[:40]!r} is not one of {', '.join(map(str, action.choices))}")
    return converted


def _dests(parser: argparse.ArgumentParser) -> set[str]:
    return {a.dest for a in parser._actions} - {"help", "config"}


def _by_dest(parser: argparse.ArgumentParser, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with each option name (``ckpt_path``) turned into the name argparse stores it under
    (``model``); names that are no option are kept."""
    actions = parser._option_string_actions
    return {(actions[f"--{k}"].dest if f"--{k}" in actions else k): v for k, v in data.items()}


def parse_command(parser: argparse.ArgumentParser, argv: Sequence[str] | None, required: Sequence[str] = (),
                  renamed: dict[str, str] | None = None,
                  extend: Callable[[argparse.ArgumentParser, argparse.Namespace, bool], None] | None = None,
                  ) -> argparse.Namespace:
    """Parse an argparse subcommand the vision_attn way: old spellings normalised
    (:func:`normalize_flags`), no abbreviated options, ``--config FILE`` (repeatable; YAML mapping
    of option names to values, later files and the command line win) as defaults, ``required``
    options checked after the config files are applied.

    Args:
        extend: adds options that depend on others (a model's own options): called with the parser,
            the options known so far (config files applied) and whether help was asked for, before
            the command line is parsed in full.

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
    helping = any(a in ("-h", "--help") for a in argv)
    plain = [a for a in argv if a not in ("-h", "--help")]
    configs = [(path, _read_config(path)) for path in parser.parse_known_args(plain)[0].config]
    for path, data in configs:
        only_here = sorted(str(k) for k in _by_dest(parser, data) if k in COMMAND_LINE_ONLY)
        if only_here:  # before anything the command line names is loaded
            raise ConfigError(
                f"--config {path}: {only_here} may only be given on the command line (--allow_import PREFIX "
                "opens the import policy, which no file may do)"
            )
    if extend is not None:
        known = _dests(parser)
        parser.set_defaults(**{k: v for _, data in configs for k, v in _by_dest(parser, data).items() if k in known})
        extend(parser, parser.parse_known_args(plain)[0], helping)
    dests = _dests(parser)
    for path, data in configs:
        data = _by_dest(parser, data)
        unknown = sorted(str(k) for k in data if k not in dests)
        if unknown:
            raise ConfigError(f"--config {path}: unknown options {unknown}; see {parser.prog} --help")
        parser.set_defaults(**_as_given(parser, data, path))
    args = parser.parse_args(argv)
    missing = [f"--{r}" for r in required if getattr(args, r, None) in (None, "")]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)}")
    return args


_PARSER_KEY = re.compile(r'Parser key "([^"]+)"')


_GIVEN = re.compile(r"(Got value|Given value): .*")


_EXPECTED = re.compile(r"Expected an? <class '([^']+)'>")


def condense_parse_error(message: str, width: int = 240) -> str:
    """One line from jsonargparse's nested error message: the full key (``model.encoder.preprocess``)
    and the innermost reason, with long values cut."""
    keys: list[str] = []
    for key in _PARSER_KEY.findall(message):
        if not keys or keys[-1] != key:
            keys.append(key)
    lines = [ln.strip(" -") for ln in message.splitlines() if ln.strip(" -")]
    skip = ("Parser key", "Does not validate", "Subtypes:", "Errors:", "Given value type", "Problem with given")
    reasons = [ln for ln in lines if not ln.startswith(skip) and not ln.startswith("Given value:")]
    expected = [m.group(1) for ln in reasons if (m := _EXPECTED.match(ln))]
    if len(set(expected)) > 1:
        given = next((m.group(0) for ln in lines if (m := _GIVEN.search(ln))), "")
        reason = f"expected one of {', '.join(dict.fromkeys(expected))}" + (f"; {given}" if given else "")
    else:
        reason = reasons[0] if reasons else lines[0] if lines else message
    reason = _GIVEN.sub(lambda m: m.group(0)[:80] + ("..." if len(m.group(0)) > 80 else ""), reason)
    text = f"config key {'.'.join(keys)}: {reason}" if keys else reason
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


# The argument groups (dataclasses) of the suite's tasks and data modules.
_GROUPS = {"model": ("optim", "head", "loss", "mix", "decoder", "generate", "training", "scst"),
           "data": ("layout", "batching", "augment", "transform", "captions")}
_DATACLASS_FIELD = re.compile(
    "|".join(rf"--({section})\.(?:init_args\.)?({'|'.join(groups)})\.(\w+)" for section, groups in _GROUPS.items()))


_NULLS = ("null", "none", "~")


def _null_dataclass_fields(argv: list[str]) -> list[str]:
    """``argv`` with ``--model.GROUP.FIELD null`` given as ``--model.GROUP '{"FIELD": null}'`` (likewise
    ``--data.GROUP.FIELD``) for the argument groups of the suite's tasks and data modules
    (``--model.optim.encoder_lr null``, ``--data.batching.eval_batch_size null``).

    jsonargparse (4.53) rejects a null given to one field of a dataclass inside a model's
    ``init_args`` ("Expected a <class 'NoneType'>, given value: None"); the mapping form sets the
    same field and keeps the others.
    """
    out: list[str] = []
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        match = _DATACLASS_FIELD.fullmatch(name)
        if not eq and i + 1 < len(argv):
            value = argv[i + 1]
        if match and value.strip().lower() in _NULLS:
            section, group, field = (g for g in match.groups() if g is not None)
            out += [f"--{section}.{group}", json.dumps({field: None})]
            i += 1 if eq else 2
            continue
        out.append(argv[i])
        i += 1
    return out


def _config_class_paths(argv: list[str]) -> dict[str, str]:
    """``{"model": class path, "data": class path}`` named by the ``--config`` files in ``argv``
    (read as plain YAML; later files win), for ``--help``."""
    found: dict[str, str] = {}
    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg in ("--config", "-c") and i + 1 < len(argv) else (
            arg.split("=", 1)[1] if arg.startswith("--config=") else None)
        if not path or not Path(path).is_file():
            continue
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        for key in ("model", "data"):
            spec = data.get(key) if isinstance(data, dict) else None
            if isinstance(spec, dict) and isinstance(spec.get("class_path"), str):
                found[key] = spec["class_path"]
    return found


def _take_flag(argv: list[str], flag: str) -> tuple[list[str], bool]:
    """``(argv without flag, whether it was there)`` for a switch given as ``flag`` or ``flag=...``."""
    rest = [a for a in argv if a != flag and not a.startswith(flag + "=")]
    return rest, len(rest) != len(argv)


def _option_value(argv: list[str], flag: str) -> str | None:
    """The last value given to ``flag`` (``--flag V`` or ``--flag=V``) in ``argv``."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def console_logging() -> None:
    """The commands' log lines on the console (``LEVEL logger: message``, INFO and above), every
    message passed through :func:`~vision_attn.outputs.console_text` (names and ids from files
    cannot forge a line or move the cursor)."""
    from vision_attn.outputs import ConsoleText

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, ConsoleText) for f in handler.filters):
            handler.addFilter(ConsoleText())


def one_line(err: BaseException) -> str:
    """The message of ``err``; for errors re-raised from a DataLoader worker, the original one."""
    text = str(err)
    if "Original Traceback" in text:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        last = lines[-1]
        return last.split(": ", 1)[1] if ": " in last and last.split(": ", 1)[0].endswith("Error") else last
    if "\n" in text.strip():  # jsonargparse's nested report of a value it could not build
        return condense_parse_error(text)
    return text


def with_suggestions(message: str, options: Sequence[str]) -> str:
    """``message`` of an "unrecognized arguments" error with the closest known option of each
    unknown one (``--trainer.max_epocs``: did you mean ``--trainer.max_epochs``?)."""
    if not message.startswith("unrecognized arguments:"):
        return message
    unknown = [a.split("=", 1)[0] for a in message.split(":", 1)[1].split() if a.startswith("--")]
    hints = []
    for option in unknown:
        close = difflib.get_close_matches(option, [o for o in options if o.startswith("--")], n=1, cutoff=0.75)
        if close:
            hints.append(f"{option}: did you mean {close[0]}?")
    return f"{message} ({'; '.join(hints)})" if hints else message


def take_verbose(argv: list[str]) -> tuple[list[str], bool]:
    """``(argv without -v / --verbose, whether it was there or VISION_ATTN_VERBOSE is set)``."""
    rest = [a for a in argv if a not in VERBOSE_FLAGS]
    return rest, len(rest) != len(argv) or os.environ.get(VERBOSE_ENV, "") not in ("", "0")


_ROLE = re.compile(r":(?:py:)?(?:func|meth|class|mod|attr|data|obj|exc):`~?([^`]+)`")


def plain_text(text: str) -> str:
    """Help text without documentation markup: ``:meth:`~a.B.c``` -> ``c``, ````x```` -> ``x``."""
    text = _ROLE.sub(lambda m: m.group(1).rsplit(".", 1)[-1] if m.group(0).count("~") else m.group(1), text)
    return text.replace("``", "")


def hide_options(parser: argparse.ArgumentParser, groups: Sequence[str]) -> None:
    """Keep the options ``--GROUP`` and ``--GROUP.*`` of ``groups`` working but out of ``--help``."""
    for action in parser._actions:
        dest = action.dest.split(".", 1)[0]
        if dest in groups:
            action.help = argparse.SUPPRESS
