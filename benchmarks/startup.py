"""How long the command line takes before it does anything: ``vision-attn --help`` and each
subcommand's ``--help`` in a fresh process, medians of repeats, side by side with a bare
``python -c pass`` (the interpreter's own start-up).

    python -m benchmarks.startup --repeats 5 --json docs/results/performance_startup.json
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.results_json import write_results

COMMANDS: list[tuple[str, list[str]]] = [
    ("python -c pass", [sys.executable, "-c", "pass"]),
    ("vision-attn --help", [sys.executable, "-m", "vision_attn", "--help"]),
    ("vision-attn predict --help", [sys.executable, "-m", "vision_attn", "predict", "--help"]),
    ("vision-attn fit --help", [sys.executable, "-m", "vision_attn", "fit", "--help"]),
]


def wall_seconds(argv: list[str], repeats: int) -> list[float]:
    """Wall time of ``argv`` run ``repeats`` times (after one run that warms the file cache)."""
    subprocess.run(argv, capture_output=True, check=True)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return times


def rows(repeats: int) -> list[list]:
    out = []
    for name, argv in COMMANDS:
        times = wall_seconds(argv, repeats)
        out.append([name, round(statistics.median(times), 3), round(min(times), 3), round(max(times), 3)])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.startup", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the results file here")
    args = parser.parse_args(argv)
    table = rows(args.repeats)
    for row in table:
        print(f"{row[0]:32s} median {row[1]:.3f} s  (min {row[2]:.3f}, max {row[3]:.3f})")
    if args.json:
        write_results(Path(args.json), page="performance", title="Command-line start-up",
                      command=f"python -m benchmarks.startup --repeats {args.repeats} --json {args.json}",
                      columns=["command", {"name": "median s", "format": ".3f"}, {"name": "min s", "format": ".3f"},
                               {"name": "max s", "format": ".3f"}],
                      rows=table, notes=[f"fresh process each time, {args.repeats} repeats after one warm-up run"])


if __name__ == "__main__":
    main()
