"""Helpers shared by the benchmarks: interleaved repeats, medians, ratios, the machine, run folders."""

from __future__ import annotations

import json
import math
import platform
import shlex
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from benchmarks.results_json import cpu_model


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int = 7, warmup: int = 2) -> dict[str, float]:
    """Median seconds of each function, calling them in turn (A, B, A, B, ...) so that drifts in
    machine load hit every candidate alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def machine() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "threads": str(torch.get_num_threads()),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
    }


def quiet_logging() -> None:
    """A benchmark's console: library warnings off, WARNING and above of our loggers, Lightning's
    errors only (its start-up lines would bury the table)."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


def write_result(path: str | Path | None, result: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2))


def command_line(module: str, argv: Sequence[str]) -> str:
    """The command that reproduces a run of ``python -m MODULE`` with the arguments ``argv``
    (quoted for a POSIX shell): the ``command`` of its results file."""
    return " ".join(["python", "-m", module, *(shlex.quote(str(a)) for a in argv)])


def finite(value: float | int | None, digits: int | None = None) -> float | None:
    """``value`` as a plain float (rounded to ``digits`` when given), ``None`` when it is missing
    or not finite: the cell of a results table (which holds no NaN or infinity)."""
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value):
        return None
    return round(value, digits) if digits is not None else value


def refuse_earlier_run(run_dir: Path, instead: str = "give the run another --name") -> None:
    """Stop a benchmark run before it trains into ``run_dir`` when that folder already holds a
    training's checkpoints: ``train.py`` would write beside them (Lightning versions the new
    ``last.ckpt`` as ``last-v1.ckpt``), ``eval.py`` could then score the earlier model, and the earlier
    run would be mixed with the new one.

    Args:
        run_dir: the run's folder.
        instead: the benchmark's other way out, said in the error (``--name``, ``--work``).

    Raises:
        FileExistsError: naming the folder and what to do.
    """
    earlier = sorted(Path(run_dir).glob("checkpoints/*.ckpt"))
    if earlier:
        raise FileExistsError(f"{run_dir} already holds a training ({earlier[0].name}): {instead}, or move that "
                              "folder away to train it again")


def read_run_record(path: Path, numbers: Sequence[str], mappings: Sequence[str] = ()) -> dict:
    """A finished benchmark run's record (the JSON file a resumable benchmark writes into the run's
    folder): a dict with a number under each of ``numbers`` and a dict under each of ``mappings``.

    Raises:
        ValueError: naming the file when it is not such a record, and what to do.
    """
    try:
        record = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable run record ({e}); move its folder away to train it again") from e
    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    if not isinstance(record, dict) or not all(number(record.get(k)) for k in numbers) or not all(
            isinstance(record.get(k), dict) for k in mappings):
        needs = ", ".join([*(f"a number {k!r}" for k in numbers), *(f"an object {k!r}" for k in mappings)])
        raise ValueError(f"{path}: a run record needs {needs}; move its folder away to train it again")
    return record


def finished_run(run_dir: Path, settings: dict, read: Callable[[Path], dict],
                 record: str = "result.json") -> dict | None:
    """The record of a run that finished earlier in ``run_dir`` with the same ``settings`` (read by
    ``read`` from ``run_dir/record``), or ``None`` when the folder holds no training: checked
    before a resumable benchmark's first training.

    Raises:
        FileExistsError: the folder holds an unfinished training, or a run of other settings.
        ValueError: the record is damaged (from ``read``).
    """
    done = Path(run_dir) / record
    earlier = read(done) if done.is_file() else None
    if earlier is None:
        refuse_earlier_run(run_dir, "give another --work")
    elif {k: earlier.get(k) for k in settings} != settings:
        raise FileExistsError(f"{run_dir} holds a run of other settings ({done.name}): give another --work, or move "
                              "that folder away")
    return earlier
