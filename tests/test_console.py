"""What a user sees on the console: one line on a wrong turn, no banners, no long waits offline."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from vision_attn.commands.args import take_verbose, with_suggestions
from vision_attn.commands.run import quiet_console
from vision_attn.commands.train import TrainCLI
from vision_attn.distributed import check_accelerator
from vision_attn.errors import ConfigError, EncoderError

from .conftest import REPO

CONFIG = str(REPO / "configs" / "classification" / "shapes.yaml")


def _args(root, out) -> list[str]:
    enc = "--model.init_args.encoder.init_args."
    return ["--config", CONFIG, "--data.init_args.root", str(root), f"{enc}depth", "1", "--trainer.logger", "false",
            "--trainer.default_root_dir", str(out)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a GPU")
@pytest.mark.parametrize("accelerator", ["gpu", "cuda"])
def test_a_gpu_asked_for_on_a_machine_without_one_is_one_line(accelerator, tmp_path, shapes_root):
    with pytest.raises(ConfigError, match=r"^no CUDA device found; use --trainer.accelerator cpu"):
        TrainCLI(args=[*_args(shapes_root, tmp_path / "out"), "--trainer.accelerator", accelerator])
    with pytest.raises(ConfigError, match="no CUDA device found; use --device cpu"):
        check_accelerator("gpu", 1, flag="--device")
    assert not (tmp_path / "out").exists()


def test_more_gpus_than_the_machine_has_are_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="8 GPUs asked for .* has 2; pass --trainer.devices 2"):
        check_accelerator("gpu", 8)
    check_accelerator("gpu", [0, 1])
    check_accelerator("cpu", 64)


def test_an_unknown_option_names_the_closest_known_one(tmp_path, shapes_root, capsys):
    with pytest.raises(SystemExit) as exit_info:
        TrainCLI(args=[*_args(shapes_root, tmp_path / "out"), "--trainer.max_epocs", "3"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == ("error: unrecognized arguments: --trainer.max_epocs 3 (--trainer.max_epocs: did you mean "
                      "--trainer.max_epochs?)")
    assert len(err) == 2  # the error, then where to look; no usage dump
    assert with_suggestions("unrecognized arguments: --zzz 1", ["--trainer.max_epochs"]) == \
        "unrecognized arguments: --zzz 1"


def test_the_console_keeps_to_the_suites_lines(tmp_path, shapes_root, caplog):
    quiet_console(verbose=False)
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as caught:
        quiet_console(verbose=False)
        TrainCLI(args=_args(shapes_root, tmp_path / "out"))
        warnings.warn("an old API", DeprecationWarning, stacklevel=1)  # attributed to this test: kept
    banners = [r.getMessage() for r in caplog.records if r.name.startswith("lightning")]
    assert not [m for m in banners if "GPU available" in m or "TPU available" in m or "litlogger" in m]
    assert [str(w.message) for w in caught] == ["an old API"]


def test_verbose_flag_is_taken_out_of_the_command_line(monkeypatch):
    monkeypatch.delenv("VISION_ATTN_VERBOSE", raising=False)
    assert take_verbose(["fit", "-v", "--config", "c.yaml"]) == (["fit", "--config", "c.yaml"], True)
    assert take_verbose(["fit"]) == (["fit"], False)
    monkeypatch.setenv("VISION_ATTN_VERBOSE", "1")
    assert take_verbose(["fit"]) == (["fit"], True)


def test_an_unreachable_hub_is_asked_once_then_the_weights_file_advice(monkeypatch):
    import socket

    import huggingface_hub.constants as hub

    from vision_attn.tasks.sources import load_model

    attempts = []

    def unreachable(address, timeout=None, **kwargs):
        attempts.append(address)
        raise OSError("network is unreachable")

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(socket, "create_connection", unreachable)
    with pytest.raises(EncoderError, match=r"Offline\? Pass the weights as a local file: --weights_file FILE"):
        load_model("timm:vit_tiny_patch16_224")
    assert attempts == [("huggingface.co", 443)]  # the probe; no download was tried after it
    assert hub.HF_HUB_OFFLINE is False  # restored


def test_help_is_plain_text_and_each_command_describes_itself(capsys):
    from vision_attn.commands import main

    texts = {}
    for command in (["fit", "--config", CONFIG], ["predict"], ["explain"], ["export"]):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        texts[command[0]] = capsys.readouterr().out
    for name, text in texts.items():
        assert "``" not in text and ":meth:" not in text and ":class:" not in text, name
    assert texts["predict"].split("options:")[0] != texts["explain"].split("options:")[0]
    assert "Attention overlays for every image" in texts["explain"]
    # fit accepts evaluation's options (one YAML serves both) but does not list them
    assert "--explain." not in texts["fit"] and "--generate." not in texts["fit"]
    assert "--trainer.max_epochs" in texts["fit"]


def test_reports_name_no_absolute_path_of_the_machine(tmp_path, monkeypatch):
    from vision_attn.outputs import display_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "x").mkdir(parents=True)
    assert display_path(tmp_path / "runs" / "x" / "last.ckpt") == "runs/x/last.ckpt"
    assert display_path("/somewhere/else/run/last.ckpt") == ".../run/last.ckpt"
    assert display_path("timm:vit_small_patch16_224") == "timm:vit_small_patch16_224"
    assert display_path("runs/x") == "runs/x"
