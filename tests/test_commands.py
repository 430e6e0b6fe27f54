"""The ``vision-attn`` command: dispatch, one flag vocabulary, old spellings, help, print_config."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vision_attn.commands import SUBCOMMANDS, main, normalize_flags, parse_command
from vision_attn.commands.train import train_main
from vision_attn.errors import ConfigError

from .conftest import REPO

CONFIG = str(REPO / "configs" / "classification" / "shapes.yaml")


def test_subcommands_are_lightnings_and_ours():
    assert list(SUBCOMMANDS) == ["fit", "validate", "test", "predict", "explain", "export", "data"]


def test_no_or_unknown_subcommand_prints_usage(capsys):
    with pytest.raises(SystemExit) as ex:
        main([])
    assert ex.value.code == 2 and "fit" in capsys.readouterr().out
    with pytest.raises(SystemExit) as ex:
        main(["trian"])
    err = capsys.readouterr().err
    assert ex.value.code == 2 and "unknown subcommand 'trian'" in err and "validate" in err


def test_console_script_and_module_run(tmp_path):
    script = Path(sys.executable).parent / "vision-attn"
    assert script.is_file(), "pip install -e . installs the vision-attn console script"
    for cmd in ([str(script), "--help"], [sys.executable, "-m", "vision_attn", "--help"]):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and "predict" in res.stdout and "export" in res.stdout


def test_old_spellings_become_todays_with_a_deprecation_message(caplog):
    with caplog.at_level(logging.WARNING, logger="vision_attn"):
        assert normalize_flags(["--output", "a.onnx"], renamed={"--output": "--output_file"}) == ["--output_file",
                                                                                                 "a.onnx"]
        assert normalize_flags(["--output=a.onnx"], renamed={"--output": "--output_file"}) == ["--output_file=a.onnx"]
        # where --overwrite is a switch, "--overwrite true" is the switch and "false" leaves it out
        assert normalize_flags(["--overwrite", "true", "--x", "1"], switches=["--overwrite"]) == ["--overwrite",
                                                                                                  "--x", "1"]
        assert normalize_flags(["--overwrite=false"], switches=["--overwrite"]) == []
    assert sum("deprecated" in r.message for r in caplog.records) == 4
    # where it takes a value (eval.py), a bare --overwrite means true; given values pass through
    assert normalize_flags(["--overwrite"], valued_bools=["--overwrite"]) == ["--overwrite", "true"]
    assert normalize_flags(["--overwrite", "--a", "b"], valued_bools=["--overwrite"]) == ["--overwrite", "true",
                                                                                          "--a", "b"]
    assert normalize_flags(["--overwrite", "false"], valued_bools=["--overwrite"]) == ["--overwrite", "false"]
    assert normalize_flags(["--overwrite", "true"], switches=["--overwrite"]) == ["--overwrite"]


def test_argparse_commands_take_a_config_file(tmp_path):
    import argparse

    def parser():
        p = argparse.ArgumentParser(prog="x")
        p.add_argument("--images")
        p.add_argument("--batch_size", type=int, default=16)
        p.add_argument("--overwrite", action="store_true")
        return p

    cfg = tmp_path / "p.yaml"
    cfg.write_text("images: photos\nbatch_size: 4\n")
    args = parse_command(parser(), ["--config", str(cfg), "--batch_size", "8"], required=("images",))
    assert (args.images, args.batch_size, args.overwrite) == ("photos", 8, False)  # the command line wins
    with pytest.raises(SystemExit):  # required and not given anywhere
        parse_command(parser(), [], required=("images",))
    cfg.write_text("imgs: photos\n")
    with pytest.raises(ConfigError, match=r"unknown options \['imgs'\]"):
        parse_command(parser(), ["--config", str(cfg)])
    cfg.write_text("- a\n")
    with pytest.raises(ConfigError, match="mapping"):
        parse_command(parser(), ["--config", str(cfg)])


def test_a_config_files_values_are_checked_as_the_command_lines(tmp_path):
    """argparse applies ``type`` and ``choices`` to what the command line gives, not to defaults:
    a config's values go through the same checks, with errors naming the file and the option."""
    import argparse

    def parser():
        p = argparse.ArgumentParser(prog="x")
        p.add_argument("--batch_size", type=int, default=16)
        p.add_argument("--methods", nargs="+", choices=["rollout", "relevance"], default=None)
        p.add_argument("--overlay.normalize", dest="normalize", default="shared", choices=["shared", "per_map"])
        p.add_argument("--overwrite", action="store_true")
        return p

    cfg = tmp_path / "p.yaml"
    for text, match in (("methods: [nope]", r"p.yaml: --methods: 'nope' is not one of rollout, relevance"),
                        ("overlay: {normalize: bogus}", r"--overlay.normalize: 'bogus' is not one of shared"),
                        ("batch_size: ten", r"--batch_size: 'ten' is not valid"),
                        ("batch_size: [1, 2]", r"--batch_size: .* is not one value"),
                        ("overwrite: 3", r"--overwrite is a switch: give true or false")):
        cfg.write_text(text + "\n")
        with pytest.raises(ConfigError, match=match):
            parse_command(parser(), ["--config", str(cfg)])
    cfg.write_text("methods: relevance\nbatch_size: '8'\noverwrite: true\noverlay: {normalize: per_map}\n")
    args = parse_command(parser(), ["--config", str(cfg)])
    assert (args.methods, args.batch_size, args.overwrite, args.normalize) == (["relevance"], 8, True, "per_map")


def test_fit_word_and_print_config_show_the_run_folder_loggers_and_callbacks(capsys):
    # LightningCLI's spelling "train.py fit --config ..." works; --print_config prints what the run
    # will really use: its folder, the TensorBoard + CSV loggers, the checkpoint and LR callbacks
    with pytest.raises(SystemExit) as ex:
        train_main(["fit", "--config", CONFIG, "--print_config"])
    assert ex.value.code == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    trainer = cfg["trainer"]
    assert trainer["default_root_dir"] == str(Path("runs") / "shapes")
    assert [lg["class_path"].rsplit(".", 1)[1] for lg in trainer["logger"]] == ["TensorBoardLogger", "CSVLogger"]
    assert [c["class_path"].rsplit(".", 1)[1] for c in trainer["callbacks"]] == ["RunCheckpoint",
                                                                                 "LearningRateMonitor"]
    ckpt = trainer["callbacks"][0]["init_args"]
    assert (ckpt["dirpath"], ckpt["monitor"], ckpt["mode"]) == (str(Path("runs") / "shapes" / "checkpoints"),
                                                                "val/acc_top1", "max")
    assert "print_config" not in cfg


def test_print_config_keeps_the_users_logger_and_checkpoint_callback(capsys, tmp_path):
    with pytest.raises(SystemExit):
        train_main(["--config", CONFIG, "--trainer.default_root_dir", str(tmp_path / "r"), "--trainer.logger", "false",
                    "--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.monitor", "val/loss",
                    "--print_config"])
    trainer = yaml.safe_load(capsys.readouterr().out)["trainer"]
    assert trainer["logger"] is False
    # the user's checkpoint callback replaces ours; nothing logs, so no learning-rate monitor
    assert [c["class_path"].rsplit(".", 1)[1] for c in trainer["callbacks"]] == ["ModelCheckpoint"]


def test_checkpoints_switched_off_add_no_checkpoint_callback(capsys):
    # --trainer.enable_checkpointing false: no checkpoint callback of ours (Lightning refuses the
    # combination), the loggers and the learning-rate monitor as usual
    with pytest.raises(SystemExit):
        train_main(["--config", CONFIG, "--trainer.enable_checkpointing", "false", "--print_config"])
    trainer = yaml.safe_load(capsys.readouterr().out)["trainer"]
    assert trainer["enable_checkpointing"] is False
    assert [c["class_path"].rsplit(".", 1)[1] for c in trainer["callbacks"]] == ["LearningRateMonitor"]


def test_fit_help_lists_the_model_and_data_options_of_the_configs_classes(capsys):
    with pytest.raises(SystemExit) as ex:
        train_main(["--config", CONFIG, "--help"])
    out = capsys.readouterr().out
    assert ex.value.code == 0
    assert "--trainer.max_epochs" in out  # the general help
    for key in ("--model.head.pooling", "--model.optim.lr", "--data.root", "--data.batching.batch_size"):
        assert key in out, key
