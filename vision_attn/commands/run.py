"""The one error policy of every command: the errors a user can fix become one line naming the
file, key or id and what to do, with exit status 2 (``VISION_ATTN_DEBUG=1`` keeps the traceback)."""

from __future__ import annotations

import logging
import os
import pickle
import sys
import warnings
import zipfile

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vision_attn.commands.args import console_logging, one_line, take_verbose
from vision_attn.errors import VisionAttnError
from vision_attn.outputs import console_text

log = logging.getLogger("vision_attn")


# what other libraries say on every run that a user cannot act on: platform banners, adverts
_CHATTY_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                   "lightning.fabric.utilities.seed", "lightning.pytorch.accelerators.cuda", "faster_coco_eval")
_CHATTY_MODULES = r"(lightning|lightning_fabric|pytorch_lightning|lightning_utilities|jsonargparse|torch|torchvision|" \
                  r"timm|torchmetrics|tensorboard|onnx|onnxscript|huggingface_hub|pkg_resources)(\.|$)"


def quiet_console(verbose: bool = False) -> None:
    """Keep the console to the suite's own lines and Lightning's progress bar: other libraries'
    platform banners, adverts, deprecation warnings and hints are hidden unless ``verbose``."""
    if verbose:
        return
    for name in _CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for category in (DeprecationWarning, FutureWarning, UserWarning):
        warnings.filterwarnings("ignore", category=category, module=_CHATTY_MODULES)


def run_entry(fn, verbose: bool | None = None) -> None:
    """Run a command entry point: errors we anticipate become one clear line, exit code 2.

    Args:
        fn: the command, called without arguments.
        verbose: show other libraries' banners and warnings (default: ``-v`` / ``--verbose`` on the
            command line, which is then taken out of it, or ``VISION_ATTN_VERBOSE=1``).
    """
    if verbose is None:
        sys.argv[1:], verbose = take_verbose(sys.argv[1:])
    console_logging()
    quiet_console(verbose)
    torch.set_float32_matmul_precision("high")
    ours = (VisionAttnError,)
    try:
        fn()
    except SIGTERMException:
        sys.stderr.write("interrupted by SIGTERM: last.ckpt holds the state; continue with --ckpt_path last\n")
        raise SystemExit(143) from None
    except (*ours, ValueError, RuntimeError, TypeError, pickle.UnpicklingError, zipfile.BadZipFile, EOFError) as err:
        if os.environ.get("VISION_ATTN_DEBUG"):
            raise
        # jsonargparse wraps errors raised while building classes: report the original one.
        cause: BaseException | None = err
        while cause is not None and not isinstance(cause, ours):
            cause = cause.__cause__ or cause.__context__
        message = console_text(one_line(cause or err))
        sys.stderr.write(f"error: {message}\n(set VISION_ATTN_DEBUG=1 for the traceback)\n")
        raise SystemExit(2) from None
