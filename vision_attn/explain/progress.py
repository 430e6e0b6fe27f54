"""Progress of long work (explanation measures, exports): what is being done, how far, the time left.

:class:`Progress` is a ``tqdm`` bar on stderr when stderr is a terminal, as Lightning's own
progress bar; otherwise (a log file, a pipe, a notebook's captured output) it writes a log line
at most every ``log_every`` seconds (``explanation measures: 64/256 images, 1:02 elapsed, about
3:05 left``), so a long run never looks hung. Nothing at all when the ``vision_attn`` logger is
quieter than ``INFO`` (``quiet``), or with ``enabled=False``. With ``delay``, nothing is shown
before the work has taken that long (a folder scan that ends in a second says nothing).
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["Progress"]

log = logging.getLogger("vision_attn.progress")


def _clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """A progress report over ``total`` units (``None``: unknown; the count and rate are shown).

    Args:
        desc: what is being done (``deletion / insertion curves``).
        total: the units expected.
        unit: what a unit is (``image``, ``step``).
        enabled: ``None``: when the ``vision_attn`` logger shows ``INFO``; ``False``: nothing.
        stream: where the bar goes (default: ``sys.stderr``); a bar only when it is a terminal.
        log_every: seconds between log lines when there is no bar.
        delay: seconds of work before anything is shown (the bar, or the first log line).
        start: when the work began (``time.monotonic()``; default: now), for work that began
            before its first unit could be counted.
    """

    def __init__(self, desc: str, total: int | None = None, unit: str = "item", enabled: bool | None = None,
                 stream: TextIO | None = None, log_every: float = 30.0, delay: float = 0.0,
                 start: float | None = None) -> None:
        self.desc, self.total, self.unit, self.log_every, self.delay = desc, total, unit, log_every, delay
        self.n = 0
        self.start = time.monotonic() if start is None else start
        self._last_log = self.start
        quiet = not logging.getLogger("vision_attn").isEnabledFor(logging.INFO)
        self.enabled = (not quiet) if enabled is None else enabled
        stream = stream if stream is not None else sys.stderr
        self.bar: Any = None
        if self.enabled and getattr(stream, "isatty", lambda: False)():
            self.bar = tqdm(total=total, desc=desc, unit=unit, file=stream, dynamic_ncols=True, leave=False,
                            delay=delay)
            self.bar.start_t -= time.monotonic() - self.start  # tqdm's clock: the work's start

    def set_description(self, desc: str) -> None:
        """Say what is being done now (the next log line and the bar show it)."""
        self.desc = desc
        if self.bar is not None:
            self.bar.set_description(desc)

    def update(self, n: int = 1) -> None:
        """``n`` more units done."""
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and time.monotonic() - self.start >= self.delay and (
                time.monotonic() - self._last_log >= self.log_every
                or (self.total is not None and self.n >= self.total)):
            self._last_log = time.monotonic()
            log.info("%s", self.line())

    def line(self) -> str:
        """The report as one line: ``desc: n/total units, elapsed, about T left``."""
        elapsed = time.monotonic() - self.start
        units = self.unit if self.unit.endswith("s") else self.unit + "s"
        if self.total:
            left = elapsed * (self.total - self.n) / self.n if self.n else None
            eta = f", about {_clock(left)} left" if left is not None and self.n < self.total else ""
            return f"{self.desc}: {self.n}/{self.total} {units}, {_clock(elapsed)} elapsed{eta}"
        return f"{self.desc}: {self.n} {units}, {_clock(elapsed)} elapsed"

    def close(self) -> None:
        """End the report (the bar is removed)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
