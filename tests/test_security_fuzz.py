"""Fuzzing: every field of a real config and of a real checkpoint replaced by hostile values.

Each value (a class-path mapping naming a class of torch that starts a process, a huge number,
NaN, a value of the wrong type, a string of Unicode controls) goes where a user's file could
put it. Whatever the field, the command either takes the value as data or refuses it with one
line, and nothing else happens: no process starts (the marker file stays absent), no module
outside the allowed classes is imported, memory stays bounded and nothing is written.
"""

from __future__ import annotations

import copy
import json
import random
import resource
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from vision_attn import create_encoder, load_task
from vision_attn.commands.evaluate import EvalCLI
from vision_attn.commands.run import run_entry
from vision_attn.commands.train import TrainCLI
from vision_attn.errors import VisionAttnError
from vision_attn.tasks import ClassificationTask

from .conftest import REPO, TINY_VIT

PROCESS_CLASS = "torch.distributed.elastic.multiprocessing.subprocess_handler.SubprocessHandler"
PROCESS_MODULE = PROCESS_CLASS.rpartition(".")[0]
ENC = "--model.init_args.encoder.init_args."


def _process_spec(marker: Path) -> dict[str, Any]:
    """A class-path mapping that, if it were ever built, would run ``touch marker``."""
    return {"class_path": PROCESS_CLASS,
            "init_args": {"entrypoint": "/usr/bin/touch", "args": [str(marker)], "env": {}, "stdout": None,
                          "stderr": None, "local_rank_id": 0}}


def hostile_values(marker: Path) -> dict[str, Any]:
    return {
        "class_path": _process_spec(marker),
        "huge": 10**12,
        "nan": float("nan"),
        "wrong_type": [{"nested": [1, "two"]}],
        "unicode": "\u202egnp.exe\u200b\u0000\n../../x",
    }


def leaf_paths(tree: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into ``tree`` (mappings and lists), inner nodes included."""
    paths = [prefix] if prefix else []
    if isinstance(tree, dict):
        for k, v in tree.items():
            paths += leaf_paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            paths += leaf_paths(v, (*prefix, i))
    return paths


def replaced(tree: Any, path: tuple, value: Any) -> Any:
    out = copy.deepcopy(tree)
    node = out
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return out


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.fixture
def untouched(tmp_path):
    """The marker file, and the checks that hold after every case: no process ran, the class that
    would start one was never imported, memory stayed bounded."""
    marker = tmp_path / "process-ran"
    sys.modules.pop(PROCESS_MODULE, None)
    before = _peak_rss_mb()
    yield marker
    assert not marker.exists(), "a hostile value started a process"
    assert PROCESS_MODULE not in sys.modules, "a hostile value imported a module outside the allowed classes"
    assert _peak_rss_mb() - before < 1500, "a hostile value made the process allocate gigabytes"


def _one_line_or_accepted(fn, capsys) -> str:
    """Run ``fn`` as a command runs it; return ``accepted`` or the one error line it printed."""
    try:
        run_entry(fn)
    except SystemExit as exit_info:
        assert exit_info.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        lines = [ln for ln in err if ln.startswith("error:")]
        assert len(lines) == 1, err  # one line, never a traceback or a usage dump
        assert all(ln.startswith(("error:", "(")) or "WARNING" in ln or "INFO" in ln for ln in err), err
        return lines[0]
    return "accepted"


# ------------------------------------------------------------------ checkpoints

def _checkpoint(tmp_path: Path, shapes_root: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    torch.manual_seed(0)
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=["a", "b", "c"])
    task.run_data = {"class_path": "vision_attn.data.ImageFolderDataModule",
                     "init_args": {"root": str(shapes_root), "num_workers": 0, "batch_size": 8}}
    return task.checkpoint_meta(), task.state_dict()


def test_every_checkpoint_field_takes_hostile_values_as_data_or_refuses_them(tmp_path, shapes_root, untouched, capsys):
    meta, state = _checkpoint(tmp_path, shapes_root)
    paths = leaf_paths(meta)
    assert len(paths) > 40  # the walk reaches the task's, the encoder's, the preprocessing's and the data's fields
    values = hostile_values(untouched)
    outcomes: dict[str, int] = {}
    out = tmp_path / "eval"
    for path in paths:
        for kind, value in values.items():
            ckpt = tmp_path / "hostile.ckpt"
            torch.save({"state_dict": state, "vision_attn": replaced(meta, path, value)}, ckpt)
            try:
                load_task(ckpt)
                outcome = "accepted"
            except VisionAttnError as err:
                assert "\n" not in str(err), (path, kind, str(err))
                outcome = "refused"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
            if kind == "class_path":  # eval.py builds the model through the config parser
                _one_line_or_accepted(
                    lambda: EvalCLI(args=["--ckpt_path", str(ckpt), "--output_dir", str(out)]),  # noqa: B023
                    capsys)
            assert not out.exists() or not any(out.iterdir())  # nothing written
    assert outcomes.get("refused", 0) > len(paths)  # most hostile values are refused outright
    assert outcomes.get("accepted", 0) > 0  # and the walk did build models: the fields are live


# ------------------------------------------------------------------ configs

def _resolved_config(tmp_path: Path, shapes_root: Path, capsys) -> dict[str, Any]:
    args = ["--config", str(REPO / "configs" / "classification" / "shapes.yaml"), "--data.init_args.root",
            str(shapes_root), f"{ENC}embed_dim", "32", f"{ENC}depth", "1", f"{ENC}num_heads", "2",
            f"{ENC}patch_size", "8", "--trainer.logger", "false", "--print_config"]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        TrainCLI(args=args)
    return yaml.safe_load(capsys.readouterr().out)


def test_every_config_field_takes_hostile_values_as_data_or_refuses_them(tmp_path, shapes_root, untouched, capsys):
    cfg = _resolved_config(tmp_path, shapes_root, capsys)
    out = tmp_path / "run"
    cfg["trainer"]["default_root_dir"] = str(out)
    cfg["trainer"]["callbacks"] = []
    cfg["data"]["init_args"]["batching"]["num_workers"] = 0
    paths = [p for p in leaf_paths({"model": cfg["model"], "data": cfg["data"]})
             if p[-1] not in ("class_path", "root", "cache_dir")]
    assert len(paths) > 60
    values = hostile_values(untouched)
    rng = random.Random(0)
    # the class path everywhere; the other hostile values on a seeded sample of the fields
    cases = [(p, "class_path") for p in paths] + [(p, k) for p in rng.sample(paths, 25) for k in values
                                                  if k != "class_path"]
    refused = 0
    for path, kind in cases:
        file = tmp_path / "hostile.yaml"
        file.write_text(json.dumps(replaced(cfg, path, values[kind])))  # JSON is YAML; NaN written as NaN
        result = _one_line_or_accepted(lambda: TrainCLI(args=["--config", str(file)]), capsys)  # noqa: B023
        refused += result != "accepted"
        assert not out.exists(), (path, kind)  # nothing written, whatever happened
    assert refused >= len(paths)  # a class path is refused in every field that is not a class
