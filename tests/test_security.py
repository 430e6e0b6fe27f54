"""Security: nothing a config, checkpoint or weights file contains runs code, reads files it
should not or downloads. Each attack is a small file; each test checks that its attack has no
effect (no import runs, Lightning loads no pickle, checkpoint metadata does not steer weight
loading, no zip bomb expands)."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import resource
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from vision_attn import create_encoder, load_task
from vision_attn.checkpoint_io import SafeCheckpointIO, load_checkpoint_file
from vision_attn.commands.evaluate import eval_main
from vision_attn.commands.run import run_entry
from vision_attn.commands.train import TrainCLI, train_main
from vision_attn.errors import CheckpointError, ConfigError, EncoderError, VisionAttnError
from vision_attn.models.captioner import DecoderConfig
from vision_attn.tasks import ClassificationTask

from .conftest import REPO, TINY_VIT

CONFIG = str(REPO / "configs" / "classification" / "shapes.yaml")
ENC = "--model.init_args.encoder.init_args."


def _tiny_args(root: Path, out: Path) -> list[str]:
    return ["--config", CONFIG, "--data.init_args.root", str(root), "--data.init_args.batching.num_workers", "0",
            "--data.init_args.batching.batch_size", "16", f"{ENC}embed_dim", "32", f"{ENC}depth", "1",
            f"{ENC}num_heads", "2", f"{ENC}patch_size", "8", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.logger", "false",
            "--trainer.default_root_dir", str(out)]


def _hostile_module(folder: Path, name: str, monkeypatch) -> Path:
    """A module ``name`` in ``folder`` (put on sys.path) whose import creates a marker file; it
    also defines a callback class, an encoder class and a function that mark their use."""
    marker = folder / f"{name}.imported"
    (folder / f"{name}.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(marker)!r}).write_text('imported')\n"
        "import lightning.pytorch as pl\n"
        "from vision_attn.models import ViTEncoder\n"
        "class Cb(pl.Callback):\n"
        "    def on_fit_start(self, trainer, pl_module):\n"
        f"        pathlib.Path({str(marker)!r} + '.callback').write_text('ran')\n"
        "class Enc(ViTEncoder):\n"
        "    pass\n"
        "def func(*args, **kwargs):\n"
        f"    pathlib.Path({str(marker)!r} + '.func').write_text('ran')\n"
    )
    monkeypatch.syspath_prepend(str(folder))
    return marker


LAMBDA_CB = ("trainer:\n  callbacks:\n    - class_path: lightning.pytorch.callbacks.LambdaCallback\n"
             "      init_args:\n        on_fit_start: {mod}.func\n")
CALLBACK = "trainer:\n  callbacks:\n    - class_path: {mod}.Cb\n"
TRAINER_GROUP = "callbacks:\n  - class_path: {mod}.Cb\n"
ENCODER = "model:\n  init_args:\n    encoder: {mod}.Enc\n"

# every spelling of the command line that can name an outside module to import
SPELLINGS = {
    "short_c_flag": lambda f, m: ["-c", f(CALLBACK)],
    "inline_config_json": lambda f, m: ["--config",
                                        json.dumps({"trainer": {"callbacks": [{"class_path": f"{m}.Cb"}]}})],
    "abbreviated_conf": lambda f, m: ["--conf", f(CALLBACK)],
    "trainer_group_file": lambda f, m: ["--trainer", f(TRAINER_GROUP)],
    "encoder_key_in_file": lambda f, m: ["--config", f(ENCODER)],
    "encoder_on_command_line": lambda f, m: ["--model.init_args.encoder", f"{m}.Enc"],
    "callback_append": lambda f, m: [f"--trainer.callbacks+={m}.Cb"],
    "lambda_callback_callable": lambda f, m: ["--config", f(LAMBDA_CB)],
    "lambda_callback_command_line": lambda f, m: ["--trainer.callbacks+=LambdaCallback",
                                                  "--trainer.callbacks.on_fit_start", f"{m}.func"],
}


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_no_spelling_of_the_config_imports_an_outside_module(spelling, tmp_path, shapes_root, monkeypatch):
    from jsonargparse import _common

    mod = f"hostile_{spelling}"
    marker = _hostile_module(tmp_path, mod, monkeypatch)

    def write(text: str) -> str:
        path = tmp_path / f"cfg_{len(list(tmp_path.glob('cfg_*')))}.yaml"
        path.write_text(text.format(mod=mod))
        return str(path)

    enforced_before = _common.parsing_settings["import_paths_enforced"]
    # an abbreviated option is no option at all (a usage error); every other spelling is refused by the policy
    refused = (pytest.raises(SystemExit) if spelling == "abbreviated_conf" else
               pytest.raises(ConfigError, match=rf"refusing to import '{mod}\.\w+'.*--allow_import {mod}"))
    with refused:
        train_main([*_tiny_args(shapes_root, tmp_path / "out"), *SPELLINGS[spelling](write, mod)])
    assert not marker.exists() and mod not in sys.modules  # its code never ran
    assert not (tmp_path / "out").exists()  # nothing was built or written
    assert _common.parsing_settings["import_paths_enforced"] == enforced_before  # the policy does not leak


@pytest.mark.parametrize(("arg", "entry"), [("--trainer.callbacks+=os.system", "os"),
                                            ("--model.class_path=subprocess.Popen", "subprocess"),
                                            ("--trainer.callbacks+=torch.hub.load", "torch.hub")])
def test_code_running_paths_are_refused_even_inside_allowed_packages(arg, entry, tmp_path, shapes_root):
    with pytest.raises(ConfigError, match=rf"{entry} can fetch, load or run code"):
        train_main([*_tiny_args(shapes_root, tmp_path / "out"), arg])


def test_allow_import_opts_in_to_a_users_callbacks(tmp_path, shapes_root, monkeypatch):
    mod = "users_callbacks"
    marker = _hostile_module(tmp_path, mod, monkeypatch)
    cfg = tmp_path / "callbacks.yaml"
    cfg.write_text(f"trainer:\n  callbacks:\n    - class_path: {mod}.Cb\n"
                   "    - class_path: lightning.pytorch.callbacks.LambdaCallback\n"
                   f"      init_args:\n        on_fit_start: {mod}.func\n")
    args = [*_tiny_args(shapes_root, tmp_path / "out"), "-c", str(cfg), "--trainer.max_epochs", "1",
            "--trainer.limit_train_batches", "1", "--trainer.limit_val_batches", "1"]
    with pytest.raises(ConfigError, match="--allow_import users_callbacks"):
        train_main(args)
    assert not marker.exists()
    train_main([*args, "--allow_import", mod])
    assert Path(f"{marker}.callback").exists() and Path(f"{marker}.func").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--allow_import", "os"], "os can run commands"),
    (["--allow_import", "jsonargparse"], "jsonargparse can run commands"),
    (["--allow_import", "not a module"], "give a module prefix"),
])
def test_allow_import_refuses_code_running_prefixes(args, message, tmp_path, shapes_root):
    with pytest.raises(ConfigError, match=message):
        TrainCLI(args=[*_tiny_args(shapes_root, tmp_path / "out"), *args])


def test_allow_import_in_a_config_file_is_refused(tmp_path, shapes_root):
    cfg = tmp_path / "allow.yaml"
    cfg.write_text("allow_import: [mymod]\n")
    with pytest.raises(ConfigError, match="only by --allow_import PREFIX, in full, on the"):
        TrainCLI(args=[*_tiny_args(shapes_root, tmp_path / "out"), "--config", str(cfg)])


# ------------------------------------------------------------------ checkpoints

class _Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _pickled_checkpoint(path: Path, marker: Path) -> Path:
    torch.save({"vision_attn": {}, "state_dict": {}, "epoch": 0, "payload": _Payload(marker)}, path)
    return path


@pytest.mark.parametrize("where", ["file", "last", "config"])
def test_resume_from_a_checkpoint_with_pickled_code_is_refused_and_runs_nothing(where, tmp_path, shapes_root):
    marker = tmp_path / "pwned"
    out = tmp_path / "out"
    if where == "last":
        (out / "checkpoints").mkdir(parents=True)
        ckpt = _pickled_checkpoint(out / "checkpoints" / "last.ckpt", marker)
        extra = ["--ckpt_path", "last"]
    else:
        ckpt = _pickled_checkpoint(tmp_path / "evil.ckpt", marker)
        extra = ["--ckpt_path", str(ckpt)]
        if where == "config":
            (tmp_path / "resume.yaml").write_text(f"ckpt_path: {ckpt}\n")
            extra = ["--config", str(tmp_path / "resume.yaml")]
    with pytest.raises(CheckpointError, match=rf"cannot read checkpoint {ckpt}: it contains pickled Python objects"):
        train_main([*_tiny_args(shapes_root, out), *extra])
    assert not marker.exists()
    assert not (out / "config.yaml").exists()  # refused before anything was built


@pytest.mark.parametrize("url", ["https://example.invalid/model.ckpt", "s3://bucket/model.ckpt",
                                 "registry:user/model"])
def test_resume_from_a_url_is_refused(url, tmp_path, shapes_root):
    with pytest.raises(CheckpointError, match="URL|downloading checkpoints is not supported"):
        train_main([*_tiny_args(shapes_root, tmp_path / "out"), "--ckpt_path", url])
    with pytest.raises(CheckpointError, match="is a URL"):
        load_checkpoint_file("https://example.invalid/model.ckpt")


def test_resumed_checkpoints_are_read_by_the_safe_loader(tmp_path, shapes_root):
    """Lightning's own resume path (whatever ``ckpt_path`` resolves to) loads with
    weights_only=True through the suite's loader."""
    marker = tmp_path / "pwned"
    cli = TrainCLI(args=_tiny_args(shapes_root, tmp_path / "out"))  # builds, fits nothing
    io_plugin = cli.trainer.strategy.checkpoint_io
    assert isinstance(io_plugin, SafeCheckpointIO)
    with pytest.raises(CheckpointError, match="pickled"):
        io_plugin.load_checkpoint(_pickled_checkpoint(tmp_path / "evil.ckpt", marker), weights_only=False)
    assert not marker.exists()


def _crafted_checkpoint(path: Path, edit) -> Path:
    torch.manual_seed(0)
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=["a", "b", "c"])
    meta = task.checkpoint_meta()
    edit(meta["model"]["init_args"], meta["model"]["init_args"]["encoder"]["init_args"])
    torch.save({"state_dict": task.state_dict(), "vision_attn": meta}, path)
    return path


def test_nested_class_paths_in_a_checkpoint_are_refused_before_import(tmp_path, monkeypatch, shapes_root):
    mod = "hostile_ckpt_encoder"
    marker = _hostile_module(tmp_path, mod, monkeypatch)

    def outside_encoder(task_args, enc_args):
        task_args["encoder"]["class_path"] = f"{mod}.Enc"

    ckpt = _crafted_checkpoint(tmp_path / "enc.ckpt", outside_encoder)
    refused = rf"encoder class '{mod}.Enc' is not part of vision_attn; refusing to import it"
    with pytest.raises(CheckpointError, match=refused):
        load_task(ckpt)
    args = ["--config", CONFIG, "--data.init_args.root", str(shapes_root), "--ckpt_path", str(ckpt),
            "--output_dir", str(tmp_path / "ev")]
    with pytest.raises(CheckpointError, match=rf"checkpoint {ckpt}: {refused}"):
        eval_main(args)  # eval.py built the model from the stored config, importing the encoder's module
    # a checkpoint names no code: its encoder is refused even when the user allows that very module
    with pytest.raises(CheckpointError, match=rf"checkpoint {ckpt}: {refused}.*with or without --allow_import"):
        eval_main([*args, "--allow_import", mod])
    with pytest.raises(CheckpointError, match=refused):
        load_task(ckpt, allow_import=(mod,))
    assert not marker.exists() and mod not in sys.modules

    def class_path_in_task_args(task_args, enc_args):
        task_args["head"]["pooling"] = {"class_path": f"{mod}.Cb"}

    with pytest.raises(CheckpointError, match=r"model.init_args.head.pooling is a class path"):
        load_task(_crafted_checkpoint(tmp_path / "arg.ckpt", class_path_in_task_args))
    assert not marker.exists()


def test_checkpoint_metadata_cannot_steer_weight_loading(tmp_path, caplog):
    garbage = tmp_path / "weights.pth"
    garbage.write_bytes(b"not a weights file")

    def weights_from_elsewhere(task_args, enc_args):
        enc_args.update(pretrained=True, weights_file=str(garbage))

    # building from the checkpoint reads no weights file and downloads nothing (offline here)
    with caplog.at_level(logging.WARNING):
        task = load_task(_crafted_checkpoint(tmp_path / "w.ckpt", weights_from_elsewhere))
    assert task.encoder.init_args["name"] == "vit_tiny_patch16_224"
    assert "ignoring the stored encoder argument weights_file" in caplog.text

    for key, value in [("pretrained_cfg_overlay", {"file": str(garbage)}), ("checkpoint_path", str(garbage)),
                       ("norm_layer", "torch.nn.LayerNorm")]:
        def overlay(task_args, enc_args, key=key, value=value):
            enc_args["timm_kwargs"] = {key: value}

        with pytest.raises(CheckpointError, match=rf"timm_kwargs \['{key}'\] are not architecture arguments"):
            load_task(_crafted_checkpoint(tmp_path / f"{key}.ckpt", overlay))

    def unknown_key(task_args, enc_args):
        enc_args["download_from"] = "https://example.invalid"

    with pytest.raises(CheckpointError, match=r"unknown keys \['download_from'\]"):
        load_task(_crafted_checkpoint(tmp_path / "unknown.ckpt", unknown_key))


# ------------------------------------------------------------------ size bounds

def _zip_bomb(path: Path, numel: int) -> Path:
    """A torch archive of one zero tensor, re-packed with deflate (torch reads it as it is)."""
    buf = io.BytesIO()
    torch.save({"state_dict": {"w": torch.zeros(numel)}}, buf)
    src = zipfile.ZipFile(io.BytesIO(buf.getvalue()))
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
        for info in src.infolist():
            out.writestr(info.filename, src.read(info.filename))
    return path


def test_weights_and_checkpoints_that_unpack_far_beyond_their_size_are_refused(tmp_path):
    bomb = _zip_bomb(tmp_path / "bomb.pth", 4_000_000)  # 16 MB of zeros in a few KB
    assert bomb.stat().st_size < 100_000
    assert torch.load(bomb, weights_only=True)["state_dict"]["w"].numel() == 4_000_000  # torch expands it
    with pytest.raises(CheckpointError, match=rf"weights file {bomb} would unpack to 15.3 MiB from .* on disk"):
        create_encoder("vit_tiny_patch16_224", weights_file=str(bomb), **TINY_VIT)
    with pytest.raises(CheckpointError, match="would unpack to"):
        load_task(_zip_bomb(tmp_path / "bomb.ckpt", 4_000_000))


def test_size_limit_is_configurable_and_named_in_the_error(tmp_path, monkeypatch):
    path = tmp_path / "w.pth"
    torch.save({"w": torch.zeros(10_000)}, path)
    monkeypatch.setenv("VISION_ATTN_MAX_LOAD_BYTES", "10K")
    with pytest.raises(CheckpointError, match=r"more than the 10.0 KiB .* VISION_ATTN_MAX_LOAD_BYTES"):
        load_checkpoint_file(path)
    monkeypatch.setenv("VISION_ATTN_MAX_LOAD_BYTES", "1M")
    assert load_checkpoint_file(path)["w"].numel() == 10_000


# ------------------------------------------------------------------ one-line errors

@pytest.mark.parametrize("command", ["train", "eval"])
def test_unpickling_errors_are_one_line_naming_the_file(command, tmp_path, shapes_root, capsys):
    marker = tmp_path / "pwned"
    ckpt = _pickled_checkpoint(tmp_path / "evil.ckpt", marker)
    if command == "train":
        def main():
            train_main([*_tiny_args(shapes_root, tmp_path / "out"), "--ckpt_path", str(ckpt)])
    else:
        def main():
            eval_main(["--config", CONFIG, "--data.init_args.root", str(shapes_root),
                       "--ckpt_path", str(ckpt), "--output_dir", str(tmp_path / "ev")])
    with pytest.raises(SystemExit) as exit_info:
        run_entry(main)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and str(ckpt) in lines[0] and "pickled" in lines[0]
    assert "Traceback" not in err and not marker.exists()


def test_train_py_refuses_resume_and_imports_with_one_line(tmp_path, shapes_root):
    """End to end through ``train.py``: a pickled resume checkpoint and an outside import are
    each one ``error:`` line, exit status 2, no traceback, nothing run."""
    marker = tmp_path / "pwned"
    ckpt = _pickled_checkpoint(tmp_path / "evil.ckpt", marker)
    (tmp_path / "evil_cli_mod.py").write_text(f"open({str(marker)!r} + '.import', 'w')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    base = [sys.executable, str(REPO / "train.py"), *_tiny_args(shapes_root, tmp_path / "out")]
    res = subprocess.run([*base, "--ckpt_path", str(ckpt), "--trainer.callbacks+=evil_cli_mod.Cb"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "refusing to import 'evil_cli_mod.Cb'" in lines[0], res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    assert not marker.exists() and not Path(f"{marker}.import").exists()


# ------------------------------------------------------------------ loosely typed values

PROCESS_CLASS = "torch.distributed.elastic.multiprocessing.subprocess_handler.SubprocessHandler"


def _starts_a_process(marker: Path) -> dict:
    """A class-path mapping to a torch class whose constructor starts ``touch marker``."""
    return {"class_path": PROCESS_CLASS,
            "init_args": {"entrypoint": "/usr/bin/touch", "args": [str(marker)], "env": {}, "stdout": None,
                          "stderr": None, "local_rank_id": 0}}


@pytest.mark.parametrize("where", ["timm_kwargs", "timm_kwargs_file", "preprocess", "optimizer", "callback"])
def test_a_class_path_inside_a_config_value_starts_nothing(where, tmp_path, shapes_root, capsys):
    marker = tmp_path / "process-ran"
    spec = _starts_a_process(marker)
    cfg = tmp_path / "hostile.yaml"
    cfg.write_text(json.dumps({"model": {"init_args": {"encoder": {"init_args": {"timm_kwargs": {"x": spec}}}}}}))
    extra = {"timm_kwargs": [f"{ENC}timm_kwargs", json.dumps({"x": spec})],
             "timm_kwargs_file": ["--config", str(cfg)],
             "preprocess": [f"{ENC}preprocess", json.dumps({"crop_pct": spec})],
             "optimizer": ["--optimizer", json.dumps(spec)],
             "callback": [f"--trainer.callbacks+={PROCESS_CLASS}"]}[where]
    with pytest.raises((SystemExit, ConfigError)):
        run_entry(lambda: train_main([*_tiny_args(shapes_root, tmp_path / "out"), *extra]))
    assert [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]  # one line, named
    time.sleep(0.2)
    assert not marker.exists() and not (tmp_path / "out").exists()


def _edited_meta_checkpoint(path: Path, edit) -> Path:
    torch.manual_seed(0)
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=["a", "b", "c"])
    meta = task.checkpoint_meta()
    edit(meta)
    torch.save({"state_dict": task.state_dict(), "vision_attn": meta}, path)
    return path


def _enc_args(meta: dict) -> dict:
    return meta["model"]["init_args"]["encoder"]["init_args"]


@pytest.mark.parametrize("field", ["timm_kwargs", "preprocess", "drop_rate", "data_config"])
def test_a_class_path_stored_in_a_checkpoint_starts_nothing(field, tmp_path, shapes_root, capsys):
    marker = tmp_path / "process-ran"
    spec = _starts_a_process(marker)

    def edit(meta):
        if field == "timm_kwargs":
            _enc_args(meta)["timm_kwargs"] = {"qk_norm": spec}
        elif field == "preprocess":
            _enc_args(meta)["preprocess"] = {"mean": spec}
        elif field == "drop_rate":
            _enc_args(meta)["drop_rate"] = spec
        else:
            meta["data_config"]["crop_pct"] = spec

    ckpt = _edited_meta_checkpoint(tmp_path / f"{field}.ckpt", edit)
    with pytest.raises(CheckpointError, match=r"is not .*plain data of the documented types only"):
        load_task(ckpt)
    args = ["--config", CONFIG, "--data.init_args.root", str(shapes_root), "--ckpt_path", str(ckpt),
            "--output_dir", str(tmp_path / "ev")]
    with pytest.raises(SystemExit) as exit_info:
        run_entry(lambda: eval_main(args))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: checkpoint {ckpt}:") and len(err.strip().splitlines()) == 2
    time.sleep(0.2)
    assert not marker.exists() and not (tmp_path / "ev" / "metrics.json").exists()


def test_allow_import_in_a_config_file_of_predict_or_export_is_refused(tmp_path, capsys):
    from vision_attn.commands import export, predict

    cfg = tmp_path / "c.yaml"
    cfg.write_text("allow_import: [some_module]\n")
    for main in (predict.main, export.main):
        with pytest.raises(SystemExit) as exit_info:
            main(["--config", str(cfg), "--ckpt_path", str(tmp_path / "x.ckpt"), "--images", str(tmp_path),
                  "--output_dir", str(tmp_path / "o")] if main is predict.main else
                 ["--config", str(cfg), "--ckpt_path", str(tmp_path / "x.ckpt"), "--output_dir", str(tmp_path / "o")])
        assert exit_info.value.code == 2
        assert "['allow_import'] may only be given on the command line" in capsys.readouterr().err
    assert "some_module" not in sys.modules


CODE_LOADING = ["torch.hub", "torch.serialization", "torch.package", "torch.utils.cpp_extension",
                "lightning.fabric.utilities.cloud_io", "dill", "joblib", "cloudpickle", "numpy", "builtins",
                "numpy.lib.format", "torch.distributed.elastic"]


@pytest.mark.parametrize("prefix", CODE_LOADING)
def test_allow_import_refuses_modules_that_fetch_or_unpickle_code(prefix, tmp_path, shapes_root, capsys):
    with pytest.raises(ConfigError, match=rf"--allow_import '{re.escape(prefix)}' is refused"):
        TrainCLI(args=[*_tiny_args(shapes_root, tmp_path / "out"), "--allow_import", prefix])
    from vision_attn.commands import predict

    with pytest.raises(SystemExit):
        predict.main(["--ckpt_path", "x.ckpt", "--images", str(tmp_path), "--output_dir", str(tmp_path / "o"),
                      "--allow_import", prefix])
    assert "is refused" in capsys.readouterr().err


def test_abbreviated_options_are_not_options(tmp_path, shapes_root, capsys):
    with pytest.raises(ConfigError, match="spell the option out in full as --allow_import"):
        TrainCLI(args=[*_tiny_args(shapes_root, tmp_path / "out"), "--allow_imp", "mymod"])
    with pytest.raises(SystemExit):
        TrainCLI(args=[*_tiny_args(shapes_root, tmp_path / "out"), "--trainer.max_epoch", "3"])
    assert "unrecognized arguments: --trainer.max_epoch" in capsys.readouterr().err
    from vision_attn.commands import predict

    with pytest.raises(SystemExit):
        predict.main(["--ckpt_path", "x.ckpt", "--images", str(tmp_path), "--output_dir", str(tmp_path / "o"),
                      "--allow_imp", "mymod"])
    assert "unrecognized arguments: --allow_imp" in capsys.readouterr().err
    assert "mymod" not in sys.modules


# ------------------------------------------------------------------ bounded sizes

def _header_only_safetensors(path: Path, shape: list[int]) -> Path:
    """A safetensors file of a few bytes that declares ``head.weight`` of ``shape`` (zero elements)."""
    header = json.dumps({"head.weight": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    return path


def test_a_weights_header_nested_too_deeply_is_a_checkpoint_error(tmp_path):
    from vision_attn.checkpoint_io import safetensors_shapes

    header = b"[" * 200_000
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointError, match=r"deep.safetensors: not a safetensors file"):
        safetensors_shapes(path)


@pytest.mark.parametrize("shape", [[2**24, 0], [2**31, 0]])
def test_a_tiny_weights_file_cannot_declare_a_huge_model(shape, tmp_path):
    from vision_attn.tasks.sources import load_model

    weights = _header_only_safetensors(tmp_path / "w.safetensors", shape)
    assert weights.stat().st_size < 120
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CheckpointError, match=r"tensor 'head.weight' declares shape .* VISION_ATTN_MAX_TENSOR_DIM"):
        load_model("timm:vit_tiny_patch16_224", weights_file=weights)
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) < 500_000  # KiB: nothing sized from it


@pytest.mark.parametrize(("edit", "limit"), [
    (lambda m: _enc_args(m).update(embed_dim=4096, depth=24, num_heads=16), "VISION_ATTN_MAX_MODEL_BYTES"),
    (lambda m: _enc_args(m).update(img_size=100_000), "VISION_ATTN_MAX_IMG_SIZE"),
    (lambda m: m["data_config"].update(input_size=[3, 40_000, 40_000]), "VISION_ATTN_MAX_INPUT_SIZE"),
    (lambda m: _enc_args(m).update(num_classes=2**26), "VISION_ATTN_MAX_NUM_CLASSES"),
    (lambda m: m["model"]["init_args"].update(class_names=[str(i) for i in range(2**20 + 1)]),
     "VISION_ATTN_MAX_NUM_CLASSES"),
])
def test_checkpoint_sizes_are_bounded_before_anything_is_allocated(edit, limit, tmp_path):
    ckpt = _edited_meta_checkpoint(tmp_path / "big.ckpt", edit)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(VisionAttnError, match=limit):
        load_task(ckpt)
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) < 1_000_000  # KiB


def test_size_limits_can_be_raised_by_environment(tmp_path, monkeypatch):
    ckpt = _edited_meta_checkpoint(tmp_path / "c.ckpt", lambda m: None)  # img_size 32
    monkeypatch.setenv("VISION_ATTN_MAX_IMG_SIZE", "16")
    with pytest.raises(CheckpointError, match=r"img_size = 32 lies outside 1..16.*VISION_ATTN_MAX_IMG_SIZE"):
        load_task(ckpt)
    monkeypatch.setenv("VISION_ATTN_MAX_IMG_SIZE", "32")
    monkeypatch.setenv("VISION_ATTN_MAX_MODEL_BYTES", "10K")
    with pytest.raises(VisionAttnError, match=r"would take .* KiB .* more than the 10.0 KiB .*VISION_ATTN_MAX_MODEL"):
        load_task(ckpt)
    monkeypatch.delenv("VISION_ATTN_MAX_MODEL_BYTES")
    assert load_task(ckpt).encoder.init_args["img_size"] == 32


def test_weights_of_other_shapes_are_one_clear_line(tmp_path):
    torch.manual_seed(0)
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=["a", "b", "c"])
    state = task.state_dict()
    state["encoder.model.blocks.0.mlp.fc1.weight"] = torch.zeros(7, 32)
    ckpt = tmp_path / "shapes.ckpt"
    torch.save({"state_dict": state, "vision_attn": task.checkpoint_meta()}, ckpt)
    with pytest.raises(CheckpointError, match=r"weights do not fit .* shapes differ: \['encoder.model.blocks.0.mlp"
                                              r".fc1.weight \(7, 32\) \(model \(64, 32\)\)'\]") as info:
        load_task(ckpt)
    assert "\n" not in str(info.value)
    weights = tmp_path / "enc.pth"
    torch.save({k[len("encoder.model."):]: v for k, v in state.items() if k.startswith("encoder.model.")}, weights)
    with pytest.raises(EncoderError, match=r"does not fit .* shapes differ for 1 tensors, e.g. blocks.0.mlp.fc1"):
        create_encoder("vit_tiny_patch16_224", weights_file=str(weights), **TINY_VIT)


def test_weights_with_nan_are_named_in_a_warning(tmp_path, caplog):
    enc = create_encoder("vit_tiny_patch16_224", **TINY_VIT)
    state = enc.model.state_dict()
    state["blocks.1.attn.qkv.weight"][0, 0] = float("nan")
    weights = tmp_path / "nan.pth"
    torch.save(state, weights)
    with caplog.at_level(logging.WARNING):
        create_encoder("vit_tiny_patch16_224", weights_file=str(weights), **TINY_VIT)
    assert "1 tensors hold NaN or infinite values (e.g. blocks.1.attn.qkv.weight)" in caplog.text


def test_a_checkpoint_cannot_make_loading_read_another_file(tmp_path, caplog):
    from vision_attn.tasks import CaptioningTask

    other = tmp_path / "other.ckpt"
    other.write_bytes(b"not a checkpoint: reading it would fail")
    torch.manual_seed(0)
    task = CaptioningTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT),
                          vocab=["<pad>", "<bos>", "<eos>", "<unk>", "a", "circle"],
                          decoder=DecoderConfig(hidden_dim=32, num_layers=1, num_heads=2))
    meta = task.checkpoint_meta()
    meta["model"]["init_args"]["training"]["init_from"] = str(other)  # "start from this checkpoint" planted
    ckpt = tmp_path / "cap.ckpt"
    torch.save({"state_dict": task.state_dict(), "vision_attn": meta}, ckpt)
    with caplog.at_level(logging.WARNING):
        loaded = load_task(ckpt)
    assert "ignoring the stored argument training.init_from" in caplog.text and loaded.init_from is None


def test_config_sizes_are_bounded_before_anything_is_built(tmp_path, shapes_root):
    with pytest.raises(ConfigError, match=r"model.init_args.num_classes = 67108864 .*VISION_ATTN_MAX_NUM_CLASSES"):
        TrainCLI(args=[*_tiny_args(shapes_root, tmp_path / "out"), "--model.init_args.num_classes", str(2**26)])
    with pytest.raises(VisionAttnError, match=r"encoder vit_tiny_patch16_224: the model it describes would take"):
        run_entry_raising(lambda: TrainCLI(args=[*_tiny_args(shapes_root, tmp_path / "out"), f"{ENC}embed_dim",
                                                 "8192", f"{ENC}depth", "64", f"{ENC}num_heads", "64"]))
    assert not (tmp_path / "out").exists()


def run_entry_raising(fn):
    """``fn()``, re-raising the suite's error that the config parser wrapped while building."""
    try:
        return fn()
    except ValueError as err:
        cause: BaseException | None = err
        while cause is not None and not isinstance(cause, VisionAttnError):
            cause = cause.__cause__ or cause.__context__
        raise (cause or err) from None


def test_the_security_page_lists_what_a_config_may_name_and_the_limits():
    from vision_attn.commands.policy import (
        _TORCH_LIGHTNING_CLASSES,
        CODE_LOADING_MODULES,
        _suite_classes,
    )
    from vision_attn.schema import LIMITS

    page = (REPO / "docs" / "security.md").read_text()
    names = [n for group in _TORCH_LIGHTNING_CLASSES.values() for n in group] + [c.__name__ for c in _suite_classes()]
    assert [n for n in names if f"`{n}`" not in page and f".{n}`" not in page] == []
    listed = {m for m in CODE_LOADING_MODULES if f"`{m}`" in page}
    assert len(listed) >= 25 and "`torch.hub`" in page and "`numpy`" in page
    assert [k for k in LIMITS if f"VISION_ATTN_MAX_{k.upper()}" not in page] == []


# ------------------------------------------------------------------ shared references: pickle and YAML aliases

def _doubled(levels: int) -> list:
    """``x = [x, x]`` ``levels`` times: a few bytes per level, ``2**levels`` values when walked."""
    x: list = [0]
    for _ in range(levels):
        x = [x, x]
    return x


def test_a_checkpoint_of_shared_lists_is_refused_at_once_not_walked_for_days(tmp_path):
    """Pickle keeps shared lists shared: a kilobyte describing 2**24 values (2**40 would take days
    to walk). Every check of the metadata walks it, so it is counted first, once per distinct list."""
    from vision_attn.tasks.base import read_task_meta

    def edit(meta):
        meta["data"] = {"class_path": "vision_attn.data.ImageFolderDataModule",
                        "init_args": {"root": "x", "junk": _doubled(23)}}

    ckpt = _edited_meta_checkpoint(tmp_path / "bomb.ckpt", edit)
    start = time.perf_counter()
    with pytest.raises(CheckpointError, match=r"bomb.ckpt: vision_attn holds more than 4194304 values"):
        read_task_meta(ckpt)
    assert time.perf_counter() - start < 20  # walking it takes longer

    def cyclic(meta):
        loop: list = []
        loop.append(loop)
        _enc_args(meta)["timm_kwargs"] = {"x": loop}

    with pytest.raises(CheckpointError, match="contains itself"):
        read_task_meta(_edited_meta_checkpoint(tmp_path / "cycle.ckpt", cyclic))


def test_shared_values_are_counted_each_time_they_appear_in_linear_time():
    from vision_attn.schema import MAX_DATA_DEPTH, check_data_size

    shared = (0.5, 0.5, 0.5)
    check_data_size({"mean": shared, "std": shared, "names": [str(i) for i in range(10**5)]}, "ok")
    check_data_size(_doubled(20), "ok", max_values=2**22)  # 2**22 - 1 values with the leaves
    with pytest.raises(CheckpointError, match="x: k holds more than 100 values"):
        check_data_size(_doubled(7), "x", "k", max_values=100)  # 255 values
    deep: list = []
    cur = deep
    for _ in range(MAX_DATA_DEPTH + 1):
        cur.append([])
        cur = cur[0]
    with pytest.raises(CheckpointError, match=f"more than {MAX_DATA_DEPTH} deep"):
        check_data_size(deep, "x")


def _alias_bomb(levels: int) -> str:
    lines = ["x0: &x0 [1, 2]"] + [f"x{i}: &x{i} [*x{i - 1}, *x{i - 1}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_a_yaml_alias_bomb_is_refused_before_the_parser_expands_it(tmp_path):
    """A config of 900 bytes whose aliases describe 2**30 values: refused naming the file, by
    fit / validate / test (jsonargparse) and by the argparse commands, from a file, a --config
    string, or a file a config names; anchors of ordinary size are fine."""
    from vision_attn.commands.args import _read_config, screen_configs

    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(_alias_bomb(30))
    assert bomb.stat().st_size < 1000
    with pytest.raises(ConfigError, match=r"--config .*bomb.yaml holds more than 262144 values"):
        screen_configs(["--config", str(bomb)])
    with pytest.raises(ConfigError, match="bomb.yaml holds more than"):
        screen_configs([f"--config={bomb}"])
    with pytest.raises(ConfigError, match="the --config string holds more than"):
        screen_configs(["--config", "{" + _alias_bomb(30).replace("\n", ", ").rstrip(", ") + "}"])
    outer = tmp_path / "outer.yaml"
    outer.write_text(f"anchor: &a 1\nalso: *a\nmodel: {bomb}\n")
    with pytest.raises(ConfigError, match=r"outer.yaml -> .*bomb.yaml holds more than"):
        screen_configs(["--config", str(outer)])
    with pytest.raises(ConfigError, match="--model.*bomb.yaml holds more than|bomb.yaml holds more than"):
        screen_configs(["--model", str(bomb)])
    with pytest.raises(ConfigError, match="bomb.yaml holds more than"):
        _read_config(str(bomb))
    fine = tmp_path / "fine.yaml"
    fine.write_text("defaults: &d {lr: 0.001, weight_decay: 0.05}\nmodel:\n  optim:\n    <<: *d\n")
    screen_configs(["fit", "--config", str(fine), "--trainer.max_epochs", "1"])
    start = time.perf_counter()
    with pytest.raises(ConfigError, match="holds more than"):
        TrainCLI(args=["--config", str(bomb), "--print_config"])
    assert time.perf_counter() - start < 60
