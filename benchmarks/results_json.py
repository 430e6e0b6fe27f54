"""Results as JSON the documentation renders: one table per file, with the date, the commit, the
machine and the command that reproduces it.

    from benchmarks.results_json import write_results

    write_results("docs/results/merging.json", page="performance", title="Token merging, ViT-S/16",
                  command="python -m benchmarks.merging --repeats 5",
                  columns=["r", "images/s", {"name": "speed-up", "format": ".2f"}], rows=[[0, 15.8, 1.0], ...])

The date, the commit (``git rev-parse --short HEAD``, ``+dirty`` when tracked code differs) and
the machine (CPU model, cores, memory, GPU, operating system, Python and torch versions) are
filled in here, on the machine that ran the benchmark. ``python docs/generate.py results``
turns every ``docs/results/*.json`` written this way into the tables of the results pages and
the README's "Results at a glance".

The file (schema ``vision_attn-results/1``)::

    {
      "schema": "vision_attn-results/1",
      "page": "overview" | "classification" | "detection" | "captioning" | "explanations" | "performance",
      "title": "one line",
      "description": "optional: what the table measures (markdown)",
      "date": "YYYY-MM-DD",
      "commit": "abc1234",
      "machine": {"cpu": str, "cores": int, "memory_gib": float | null, "gpu": str | null,
                  "gpus": int, "os": str, "python": str, "torch": str | null},
      "command": "the command that reproduces the table",
      "columns": ["name", {"name": "map", "format": ".3f"}, ...],
      "rows": [[cell, ...], ...],              # one cell per column: str, number, bool or null
      "notes": ["optional lines under the table"],
      "glance": [{"task", "data", "metric", "time"[, "command"]}],  # optional: rows of the README's
                                                       # summary; "command": the row's own (else the file's)
      "runs": [{...}, ...]   # optional, not rendered: the per-run numbers the rows aggregate, kept
                             # so that a benchmark run later adds to them
    }

A results file of ``make demo``'s summary (``runs/demo/<time>/summary.json``)::

    python -m benchmarks.results_json demo runs/demo/<time>/summary.json --json docs/results/demo.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SCHEMA = "vision_attn-results/1"
PAGES = ("overview", "classification", "detection", "captioning", "explanations", "performance")
"""The results pages a table can go to (``docs/results/<page>.md``; ``overview``: ``index.md``)."""

REQUIRED = ("schema", "page", "title", "date", "commit", "machine", "command", "columns", "rows")
GLANCE_KEYS = ("task", "data", "metric", "time")
REPO = Path(__file__).resolve().parents[1]


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, ``sysctl`` on macOS), else what
    :mod:`platform` says."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware", "processor")) and ":" in line:
                value = line.split(":", 1)[1].strip()
                if value and not value.isdigit():
                    return value
    except OSError:
        pass
    try:
        out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                             timeout=5, check=False)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the system has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def memory_gib() -> float | None:
    """Total memory in GiB (``/proc/meminfo``), ``None`` where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine_info() -> dict[str, Any]:
    """The machine a table was measured on: ``{"cpu", "cores", "memory_gib", "gpu", "gpus", "os",
    "python", "torch"}`` (``gpu``: the first CUDA device's name, ``None`` without one)."""
    info: dict[str, Any] = {"cpu": cpu_model(), "cores": usable_cores(), "memory_gib": memory_gib(),
                            "gpu": None, "gpus": 0, "os": platform.platform(terse=True),
                            "python": platform.python_version(), "torch": None}
    try:
        import torch
    except ImportError:
        return info
    info["torch"] = torch.__version__.split("+")[0]
    if torch.cuda.is_available():
        info["gpus"] = torch.cuda.device_count()
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def git_commit(repo: str | Path = REPO) -> str:
    """The short commit of ``repo`` (``+dirty`` when tracked files other than the documentation
    differ from it: the results files a benchmark writes as it goes, and the pages rendered from
    them, change no result), or ``unknown`` outside a git checkout."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10,
                                 check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs", ":(exclude)*.md")
    return commit + ("+dirty" if dirty else "")


def column_name(column: str | dict[str, Any]) -> str:
    """The header of a column given as a name or as ``{"name", "format"}``."""
    return column if isinstance(column, str) else str(column.get("name", ""))


def validate(data: Any) -> list[str]:
    """What is wrong with a results file's content (an empty list when nothing is)."""
    if not isinstance(data, dict):
        return ["the file is not a JSON object"]
    errors = [f"missing key {key!r}" for key in REQUIRED if key not in data]
    if errors:
        return errors
    if data["schema"] != SCHEMA:
        errors.append(f"schema is {data['schema']!r}, expected {SCHEMA!r}")
    if data["page"] not in PAGES:
        errors.append(f"page {data['page']!r} is not one of {', '.join(PAGES)}")
    for key in ("title", "date", "commit", "command"):
        if not isinstance(data[key], str) or not data[key].strip():
            errors.append(f"{key} must be a non-empty string")
    try:
        _dt.date.fromisoformat(str(data["date"]))
    except ValueError:
        errors.append(f"date {data['date']!r} is not YYYY-MM-DD")
    machine = data["machine"]
    if not isinstance(machine, dict) or not machine.get("cpu") or not isinstance(machine.get("cores"), int):
        errors.append("machine must hold at least 'cpu' (a string) and 'cores' (an integer)")
    columns = data["columns"]
    if not isinstance(columns, list) or not columns:
        errors.append("columns must be a non-empty list")
        columns = []
    for i, column in enumerate(columns):
        if not (isinstance(column, str) or (isinstance(column, dict) and isinstance(column.get("name"), str))):
            errors.append(f"columns[{i}] must be a name or {{'name', 'format'}}")
    rows = data["rows"]
    if not isinstance(rows, list):
        errors.append("rows must be a list")
        rows = []
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != len(columns):
            errors.append(f"rows[{i}] must be a list of {len(columns)} cells")
        elif any(not (cell is None or isinstance(cell, (str, int, float, bool))) for cell in row):
            errors.append(f"rows[{i}] holds a cell that is not a string, number, boolean or null")
    for key in ("notes",):
        if key in data and not (isinstance(data[key], list) and all(isinstance(n, str) for n in data[key])):
            errors.append(f"{key} must be a list of strings")
    if "runs" in data and not (isinstance(data["runs"], list) and all(isinstance(r, dict) for r in data["runs"])):
        errors.append("runs must be a list of objects")
    if "description" in data and not isinstance(data["description"], str):
        errors.append("description must be a string")
    glance = data.get("glance", [])
    if not isinstance(glance, list) or any(not isinstance(g, dict) or not set(GLANCE_KEYS) <= set(g) <= {
            *GLANCE_KEYS, "command"} or not all(isinstance(v, str) for v in g.values()) for g in glance):
        errors.append(f"glance must be a list of {{{', '.join(GLANCE_KEYS)}[, command]}} objects of strings")
    return errors


def results(page: str, title: str, command: str, columns: Sequence[str | dict[str, Any]],
            rows: Sequence[Sequence[Any]], *, description: str | None = None, notes: Sequence[str] = (),
            glance: Sequence[dict[str, str]] = (), date: str | None = None, commit: str | None = None,
            machine: dict[str, Any] | None = None, runs: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """A results table as the schema describes it, the date, commit and machine filled in unless
    given.

    Raises:
        ValueError: listing what does not follow the schema.
    """
    data: dict[str, Any] = {
        "schema": SCHEMA,
        "page": page,
        "title": title,
        **({"description": description} if description else {}),
        "date": date or _dt.date.today().isoformat(),
        "commit": commit or git_commit(),
        "machine": machine or machine_info(),
        "command": command,
        "columns": [c if isinstance(c, str) else dict(c) for c in columns],
        "rows": [list(r) for r in rows],
        **({"notes": list(notes)} if notes else {}),
        **({"glance": [dict(g) for g in glance]} if glance else {}),
        **({"runs": list(runs)} if runs else {}),
    }
    errors = validate(data)
    if errors:
        raise ValueError(f"results {title!r}: " + "; ".join(errors))
    return data


def write_results(path: str | Path, page: str, title: str, command: str, columns: Sequence[str | dict[str, Any]],
                  rows: Sequence[Sequence[Any]], **kwargs: Any) -> Path:
    """Write one results table to ``path`` (see :func:`results` for the arguments); returns the
    path. Non-finite numbers are refused: write ``None`` for a value that was not measured."""
    data = results(page, title, command, columns, rows, **kwargs)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------------------- make demo's summary

DEMO_DATA = {
    "classification": "embedded shapes: 5 classes, 32 px, 4000 train / 500 val",
    "detection": "embedded shape scenes: 64 px, 1-4 objects, 2000 train / 200 val",
    "captioning": "embedded shape scenes: 64 px, 5 captions each, 5500 train / 200 val",
}
DEMO_METRICS = {"classification": ("acc_top1",), "detection": ("map", "map_50"), "captioning": ("bleu4", "cider")}


def demo_results(summary: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """The results table of a ``make demo`` run from its ``summary.json`` (``{task: {"metrics",
    "train_seconds", ...}}``): one row per task with its headline metrics and training time, and
    the same rows for the README's summary."""
    columns = ["task", "data", "metric", "value", {"name": "training (s)", "format": ".0f"}, "command"]
    rows, glance = [], []
    for task, run in summary.items():
        metrics = run.get("metrics", {})
        command = f"python -m vision_attn.demo --tasks {task}"
        names = [m for m in DEMO_METRICS.get(task, tuple(run.get("headline", ())[:1])) if m in metrics]
        for name in names:
            rows.append([task, DEMO_DATA.get(task, ""), name, metrics[name], run.get("train_seconds"), command])
        shown = ", ".join(f"{name} {metrics[name]:.3f}" for name in names)
        glance.append({"task": task, "data": DEMO_DATA.get(task, ""), "metric": shown,
                       "time": f"{run.get('train_seconds', 0):.0f} s training"})
    description = ("`make demo` trains each task on its embedded data with the shipped `shapes.yaml` config, "
                   "then evaluates it on the validation split.")
    return results("overview", "make demo", "make demo", columns, rows, description=description, glance=glance,
                   **kwargs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.results_json",
                                     description="Write or check results files of the documentation.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a results file from make demo's summary.json")
    demo.add_argument("summary", help="runs/demo/<time>/summary.json")
    demo.add_argument("--json", default="docs/results/demo.json", help="the results file to write")
    check = sub.add_parser("check", help="check results files against the schema")
    check.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    if args.command == "demo":
        data = demo_results(json.loads(Path(args.summary).read_text(encoding="utf-8")))
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(data, indent=2, allow_nan=False) + "\n", encoding="utf-8")
        print(args.json)
        return
    failed = False
    for name in args.files:
        errors = validate(json.loads(Path(name).read_text(encoding="utf-8")))
        for error in errors:
            print(f"{name}: {error}")
        failed = failed or bool(errors)
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
