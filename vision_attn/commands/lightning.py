"""The LightningCLI base of ``fit`` and ``validate`` / ``test``: the guarded parser (refused
imports and parse errors as one line, no abbreviated options) and the command line's
``--allow_import``."""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from vision_attn.commands.args import (
    _null_dataclass_fields,
    condense_parse_error,
    plain_text,
    screen_configs,
    with_suggestions,
)
from vision_attn.commands.policy import (
    ALLOW_IMPORT_FLAG,
    ALLOW_IMPORT_HELP,
    _import_refused,
    import_guard,
    split_allow_import,
)
from vision_attn.distributed import check_accelerator
from vision_attn.errors import ConfigError, VisionAttnError
from vision_attn.tasks.base import (
    VisionTask,
)

log = logging.getLogger("vision_attn")


def _check_writable(folder: Path) -> None:
    """Fail before any work when results could not be written into ``folder``."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-test-"):
            pass
    except OSError as err:
        raise VisionAttnError(f"cannot write results into {folder}: {err.strerror or err}; "
                              "pass a writable --output_dir") from err


class _GuardedParser(LightningArgumentParser):
    """The command's parser: an import refused by :func:`import_guard` is a :class:`ConfigError`
    (one clear line from ``train.py`` / ``eval.py``) instead of a usage dump."""

    main: bool = False

    def format_help(self) -> str:
        return plain_text(super().format_help())

    def error(self, message: str, ex: Exception | None = None):  # type: ignore[override]
        if self.main:
            cause: BaseException | None = ex
            while cause is not None and not isinstance(cause, ConfigError):
                cause = cause.__cause__ or cause.__context__
            if cause is not None:  # refused inside a --config string or file: already ours
                raise cause
            refused = _import_refused(message)
            if refused is not None:
                raise refused from ex
            if not os.environ.get("VISION_ATTN_DEBUG"):
                message = with_suggestions(message, list(self._option_string_actions))
                sys.stderr.write(f"error: {condense_parse_error(message)}\n"
                                 f"(see {self.prog} --help; VISION_ATTN_DEBUG=1 shows the parser's whole message)\n")
                raise SystemExit(2)
        return super().error(message, ex)


class _VisionAttnCLI(LightningCLI):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        argv = kwargs.pop("args", None)
        self._argv, self.allow_import = split_allow_import(list(sys.argv[1:] if argv is None else argv))
        self._argv = _null_dataclass_fields(self._argv)
        screen_configs(self._argv)  # before jsonargparse expands any YAML alias
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("run", False)
        kwargs.setdefault("auto_configure_optimizers", False)
        kwargs.setdefault("parser_class", _GuardedParser)
        if self.allow_import:
            log.warning("%s: configs may also import from %s", ALLOW_IMPORT_FLAG,
                        ", ".join(self.allow_import))
        try:
            with import_guard(self.allow_import):
                super().__init__(VisionTask, *args, **kwargs)
        except ImportError as err:  # refused while building (jsonargparse's ImportDenied)
            refused = _import_refused(str(err))
            if refused is None:
                raise
            raise refused from err

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        parser = super().init_parser(**kwargs)
        parser.main = True
        parser.allow_abbrev = False  # options are spelled out: --trainer.max_epoch is not --trainer.max_epochs
        return parser

    def add_default_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        super().add_default_arguments_to_parser(parser)
        # Taken from the command line before parsing (imports happen while parsing); declared
        # here for --help, and so that one in a config file is refused, not ignored.
        parser.add_argument(ALLOW_IMPORT_FLAG, type=list[str], default=[], metavar="PREFIX",
                            help=ALLOW_IMPORT_HELP)

    def instantiate_classes(self) -> None:
        trainer = self.config.get("trainer") or {}
        check_accelerator(trainer.get("accelerator"), trainer.get("devices"))
        super().instantiate_classes()

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        self.config = parser.parse_args(self._argv)
        if self.config.get("allow_import"):
            raise ConfigError(
                f"allow_import {self.config.allow_import} comes from a config file (or an abbreviated "
                f"option); imports are allowed only by {ALLOW_IMPORT_FLAG} PREFIX, in full, on the "
                "command line"
            )
