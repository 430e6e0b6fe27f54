"""The detection ablation's bookkeeping (benchmarks/detection_ablation.py): the validation curve
read from a run's metrics.csv, the epoch at which map_50 first reaches 0.90, and the table. The
trainings themselves are minutes each and run outside ``make test``."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from benchmarks.detection_ablation import ROWS, markdown, summarise, validation_curve


def write_metrics(run_dir: Path, version: int, rows: list[dict]) -> None:
    folder = run_dir / "csv" / f"version_{version}"
    folder.mkdir(parents=True)
    keys = ["epoch", "step", "train/loss", "val/map", "val/map_50", "val/map_75"]
    with (folder / "metrics.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, keys)
        writer.writeheader()
        writer.writerows(rows)


def test_curve_and_first_epoch_over_the_bar(tmp_path):
    # training rows (no val/map) are skipped; Lightning's epoch is 0-based, the curve's 1-based
    write_metrics(tmp_path, 0, [{"epoch": 0, "step": 9, "train/loss": 3.0},
                                {"epoch": 4, "step": 49, "val/map": 0.3, "val/map_50": 0.6, "val/map_75": 0.2},
                                {"epoch": 9, "step": 99, "val/map": 0.5, "val/map_50": 0.9, "val/map_75": 0.4},
                                {"epoch": 14, "step": 149, "val/map": 0.55, "val/map_50": 0.89, "val/map_75": 0.5},
                                {"epoch": 19, "step": 199, "val/map": 0.6, "val/map_50": 0.93, "val/map_75": 0.6}])
    # an older version of the run is ignored (version_10 sorts numerically after version_2)
    write_metrics(tmp_path, 2, [{"epoch": 4, "step": 1, "val/map": 0.9, "val/map_50": 0.99, "val/map_75": 0.9}])
    (tmp_path / "csv" / "version_0").rename(tmp_path / "csv" / "version_10")
    curve = validation_curve(tmp_path)
    assert [c["epoch"] for c in curve] == [5, 10, 15, 20]
    row = summarise(curve, seconds=200.0, epochs=20)
    assert row["map"] == pytest.approx(0.6) and row["map_75"] == pytest.approx(0.6)
    assert row["epoch_map50_090"] == 10  # the first validation at >= 0.90, not the last
    assert row["seconds_map50_090"] == pytest.approx(100.0)


def test_never_reached_and_failed_run(tmp_path):
    write_metrics(tmp_path, 0, [{"epoch": 4, "step": 1, "val/map": 0.1, "val/map_50": 0.3, "val/map_75": 0.0}])
    row = summarise(validation_curve(tmp_path), seconds=50.0, epochs=5)
    assert row["epoch_map50_090"] is None and row["seconds_map50_090"] is None
    assert validation_curve(tmp_path / "missing") == []
    table = markdown([{"row": "a", **row}, {"row": "failed", "map": None, "seconds": 3.0}])
    lines = table.splitlines()
    assert len(lines) == 4 and "not reached" in lines[2] and "0.100" in lines[2]
    assert lines[3].startswith("| failed | — |")


def test_every_row_is_an_override_of_a_switch_the_task_has():
    import dataclasses
    import typing

    from vision_attn.tasks import DetectionTask

    hints = typing.get_type_hints(DetectionTask.__init__)
    for name, overrides in ROWS.items():
        assert all(o.startswith("--model.init_args.") for o in overrides[::2]), name
        for option in overrides[::2]:
            group, _, field = option[len("--model.init_args."):].partition(".")
            assert group in hints and dataclasses.is_dataclass(hints[group]), (name, option)
            assert field in {f.name for f in dataclasses.fields(hints[group])}, (name, option)


def test_rows_state_every_aid_so_they_do_not_depend_on_the_config():
    """shapes.yaml ships query selection on: a row that left it to the config would silently
    measure something else. Every row sets each aid, and only the query-selection rows turn it on."""
    for name, overrides in ROWS.items():
        last = {k.split(".")[-1]: v for k, v in zip(overrides[::2], overrides[1::2], strict=True)}  # last one wins
        assert {"query_selection", "look_forward_twice", "dn_groups", "o2m_groups", "pyramid", "box_refine",
                "focal", "dense_encoder"} <= set(last), name
        assert (last["query_selection"] == "true") == ("query selection" in name), name


def test_results_table_has_a_column_per_validation_and_the_runs_values(tmp_path):
    import json

    from benchmarks.detection_ablation import write_results_table
    from benchmarks.results_json import validate

    curve = [{"epoch": 3, "val/map_50": 0.4}, {"epoch": 6, "val/map_50": 0.95}]
    rows = [{"row": "a", **summarise(curve, seconds=60.0, epochs=6)},
            {"row": "failed", "map": None, "seconds": 2.0, "curve": []}]
    path = tmp_path / "ablation.json"
    write_results_table(str(path), rows, "configs/detection/shapes.yaml", 6, 3, ["--epochs", "6", "--val_every", "3"])
    data = json.loads(path.read_text())
    assert validate(data) == []
    names = [c if isinstance(c, str) else c["name"] for c in data["columns"]]
    assert names == ["row", "map", "map_50", "map_75", "map_50 epoch 3", "map_50 epoch 6", "map_50 >= 0.90 at epoch",
                     "wall s"]
    assert data["rows"][0] == ["a", None, 0.95, None, 0.4, 0.95, 6, 60.0]  # the curve had no map / map_75
    assert data["rows"][1] == ["failed", None, None, None, None, None, None, 2.0]
    assert data["command"] == "python -m benchmarks.detection_ablation --epochs 6 --val_every 3"
    assert data["machine"]["cores"] >= 1 and data["machine"]["cpu"]
