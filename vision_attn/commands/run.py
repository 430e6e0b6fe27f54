"""The one error policy of every command: the errors a user can fix become one line naming the
file, key or id and what to do, with exit status 2 (``VISION_ATTN_DEBUG=1`` keeps the traceback)."""

from __future__ import annotations

import logging
import os
import pickle
import sys
import zipfile

import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vision_attn.commands.args import one_line
from vision_attn.errors import VisionAttnError

log = logging.getLogger("vision_attn")


def run_entry(fn) -> None:
    """Run a command entry point: errors we anticipate become one clear line, exit code 2."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("faster_coco_eval").setLevel(logging.WARNING)  # its per-evaluation summary tables
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
        sys.stderr.write(f"error: {one_line(cause or err)}\n(set VISION_ATTN_DEBUG=1 for the traceback)\n")
        raise SystemExit(2) from None
