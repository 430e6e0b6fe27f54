"""train.py / eval.py: the command-line contracts of DESIGN.md, end to end on tiny settings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vision_attn.commands.evaluate import eval_main
from vision_attn.commands.train import train_main
from vision_attn.errors import ConfigError, VisionAttnError
from vision_attn.explain.evaluate import select_images

from .conftest import REPO

CONFIG = str(REPO / "configs" / "classification" / "shapes.yaml")


def _tiny(root: Path) -> list[str]:
    enc = "--model.init_args.encoder.init_args."
    return [
        "--config", CONFIG,
        "--data.init_args.root", str(root),
        "--data.init_args.batching.num_workers", "0",
        "--data.init_args.batching.batch_size", "16",
        f"{enc}embed_dim", "32", f"{enc}depth", "2", f"{enc}num_heads", "2", f"{enc}patch_size", "8",
        "--trainer.max_epochs", "2",
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
    ]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, shapes_root):
    out = tmp_path_factory.mktemp("run") / "cls"
    train_main([*_tiny(shapes_root), "--trainer.default_root_dir", str(out)])
    return out


def test_train_writes_config_checkpoints_and_logs(trained_run):
    assert (trained_run / "config.yaml").is_file()
    assert (trained_run / "checkpoints" / "last.ckpt").is_file()
    assert list((trained_run / "checkpoints").glob("best-*.ckpt"))
    assert list(trained_run.glob("tensorboard/version_0/events.out.tfevents.*"))
    metrics_csv = trained_run / "csv" / "version_0" / "metrics.csv"
    assert "val/acc_top1" in metrics_csv.read_text().splitlines()[0]
    cfg = yaml.safe_load((trained_run / "config.yaml").read_text())
    assert cfg["trainer"]["max_epochs"] == 2
    assert cfg["model"]["init_args"]["encoder"]["init_args"]["embed_dim"] == 32


def test_train_without_checkpoints_writes_none_and_logs_as_usual(shapes_root, tmp_path):
    out = tmp_path / "run"
    train_main([*_tiny(shapes_root), "--trainer.default_root_dir", str(out), "--trainer.enable_checkpointing", "false",
                "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"])
    assert not list(out.rglob("*.ckpt"))
    assert (out / "config.yaml").is_file()
    assert "val/acc_top1" in (out / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0]


def test_eval_writes_contract_outputs(trained_run, shapes_root, tmp_path):
    out = tmp_path / "eval"
    # The config's model section differs from the checkpoint's (embed_dim, preprocessing): the
    # checkpoint wins, so the trained architecture, classes and preprocessing are evaluated.
    metrics = eval_main(["--config", CONFIG, "--data.init_args.root", str(shapes_root),
                         "--data.init_args.batching.num_workers", "0",
                         "--model.init_args.encoder.init_args.embed_dim", "64",
                         "--model.init_args.encoder.init_args.preprocess", "{mean: [0.1, 0.1, 0.1]}",
                         "--explain.num_overlays", "3", "--explain.faithfulness_images", "8", "--explain.steps", "4",
                         "--explain.mistakes", "0",  # the sample only (the mistakes: tests/test_mistakes.py)
                         "--ckpt_path", str(trained_run / "checkpoints" / "last.ckpt"), "--output_dir", str(out)])
    saved = json.loads((out / "metrics.json").read_text())
    assert saved == metrics
    assert {"acc_top1", "acc_macro", "acc_top5", "deletion_auc", "deletion_auc_random", "insertion_auc",
            "insertion_auc_random", "deletion_auc_rollout", "deletion_auc_relevance"} <= set(saved)
    assert saved["deletion_auc"] == saved["deletion_auc_relevance"]  # the first method is "the" method
    overlays = sorted((out / "overlays").glob("*.png"))
    chosen = select_images(25, 3, "sample", 0)  # the default: the seeded sample spread over the split
    assert len(overlays) == 3 and [int(p.name.split("_")[0]) for p in overlays] == chosen
    page = (out / "report.html").read_text()
    assert page.count('"kind": "patches"') == 3 and '<svg id="deletion"' in page
    counts = {"explain_images", "explain_classes"}  # how many images / classes the sample covered
    assert all(isinstance(v, float) for v in saved.values())
    assert all(0.0 <= v <= 1.0 + 1e-6 for k, v in saved.items() if k not in counts and not k.startswith("saco_"))
    assert {"saco_relevance", "saco_random"} <= set(saved)
    assert all(-1.0 <= v <= 1.0 for k, v in saved.items() if k.startswith("saco_"))  # a coefficient
    assert 1.0 <= saved["explain_images"] <= 8.0 and 1.0 <= saved["explain_classes"] <= 5.0
    preds = json.loads((out / "predictions.json").read_text())
    assert len(preds) == 25
    assert set(preds[0]) == {"file", "label", "pred", "score"}
    assert [p.name.split("_")[1] for p in overlays] == [preds[i]["label"] for i in chosen]
    assert len({p.name.split("_")[1] for p in overlays}) >= 2  # not the first class only
    assert (shapes_root / preds[0]["file"]).is_file()
    assert preds[0]["file"].split("/")[1] == preds[0]["label"]
    # acc_top1 is exactly the share of correct rows in predictions.json
    assert saved["acc_top1"] == pytest.approx(sum(p["label"] == p["pred"] for p in preds) / len(preds))
    # A second evaluation into the same folder does not overwrite it.
    before = (out / "metrics.json").read_bytes()
    with pytest.raises(FileExistsError, match="already holds evaluation results"):
        eval_main(["--config", CONFIG, "--data.init_args.root", str(shapes_root),
                   "--ckpt_path", str(trained_run / "checkpoints" / "last.ckpt"), "--output_dir", str(out)])
    assert (out / "metrics.json").read_bytes() == before


def test_second_run_into_same_folder_is_refused_and_resume_continues(trained_run, shapes_root):
    config_before = (trained_run / "config.yaml").read_bytes()
    last_before = (trained_run / "checkpoints" / "last.ckpt").read_bytes()
    with pytest.raises(FileExistsError, match="already holds a training run"):
        train_main([*_tiny(shapes_root), "--trainer.default_root_dir", str(trained_run)])
    assert (trained_run / "config.yaml").read_bytes() == config_before
    assert (trained_run / "checkpoints" / "last.ckpt").read_bytes() == last_before
    # Resuming continues the step count from last.ckpt (2 epochs -> 3 epochs).
    cli = train_main([*_tiny(shapes_root), "--trainer.default_root_dir", str(trained_run),
                      "--trainer.max_epochs", "3", "--ckpt_path", "last"])
    assert cli.trainer.current_epoch == 3
    assert cli.trainer.global_step == 3 * (60 // 16)
    assert (trained_run / "config.yaml").read_bytes() == config_before
    assert (trained_run / "config.resume-1.yaml").is_file()


def _run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def _command(args: list[str], capsys, main=train_main) -> tuple[int, str]:
    """``(exit status, stderr)`` of ``train.py ARGS`` run in this process (what train.py runs);
    ``main=eval_main``: of ``eval.py ARGS``."""
    from vision_attn.commands.run import run_entry

    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        run_entry(lambda: main(args))
    return exit_info.value.code, capsys.readouterr().err


def test_missing_data_root_gives_one_clear_error(tmp_path, capsys):
    code, err = _command(["--config", CONFIG, "--data.init_args.root", str(tmp_path / "absent"),
                          "--trainer.default_root_dir", str(tmp_path / "out")], capsys)
    assert code == 2
    assert f"error: data root {tmp_path / 'absent'} does not exist" in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_unknown_model_name_gives_one_clear_error(tmp_path, shapes_root, capsys):
    code, err = _command(["--config", CONFIG, "--data.init_args.root", str(shapes_root),
                          "--model.init_args.encoder.init_args.name", "vit_tiny_patch16_2244",
                          "--trainer.default_root_dir", str(tmp_path / "out")], capsys)
    assert code == 2
    assert "Unknown timm model name 'vit_tiny_patch16_2244'" in err
    assert "vit_tiny_patch16_224" in err


@pytest.mark.parametrize("config", sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").rglob("*.yaml")))
def test_every_config_parses(config):
    from vision_attn.commands.train import TrainCLI

    class ParseOnly(TrainCLI):  # parse and validate; build nothing, generate nothing, download nothing
        def instantiate_classes(self) -> None:
            pass

    cfg = yaml.safe_load((REPO / config).read_text())
    assert isinstance(cfg, dict)
    args = ["--config", str(REPO / config)]
    if "model" not in cfg:  # trainer-only fragments are composed with a task config
        args = ["--config", CONFIG, *args]
    elif "class_path" not in cfg["model"]:  # a second-phase fragment (scst.yaml) composes with its folder's task config
        args = ["--config", str(REPO / Path(config).parent / "shapes.yaml"), *args]
    parsed = ParseOnly(args=args).config
    assert parsed.model.class_path.startswith("vision_attn.")
    assert parsed.data.class_path.startswith("vision_attn.")


def test_corrupt_image_skipped_in_training_fatal_in_evaluation_and_empty_class_folder(tmp_path, shapes_root, capsys):
    import shutil

    root = tmp_path / "data"
    shutil.copytree(shapes_root, root)
    bad = root / "train" / "circle" / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    args = [str(REPO / "train.py"), *_tiny(root), "--data.init_args.batching.num_workers", "1",
            "--trainer.max_epochs", "1"]
    res = _run([*args, "--trainer.default_root_dir", str(tmp_path / "out")], tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]  # training skips it, with a warning naming it
    assert f"skipping unreadable training image {bad}" in res.stderr
    # evaluation fails fast: a silently dropped image would change the metrics
    bad_val = root / "val" / "square" / "broken.png"
    shutil.copy(bad, bad_val)
    code, err = _command([*_tiny(root), "--data.init_args.batching.num_workers", "1",
                          "--ckpt_path", str(tmp_path / "out" / "checkpoints" / "last.ckpt"),
                          "--output_dir", str(tmp_path / "ev")], capsys, main=eval_main)
    assert code == 2, err[-2000:]
    last = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(last) == 1 and str(bad_val) in last[0] and "cannot read image" in last[0]
    assert not (tmp_path / "ev" / "metrics.json").exists()
    bad.unlink()
    for f in (root / "val" / "star").iterdir():
        f.unlink()
    code, err = _command([*args[1:], "--trainer.default_root_dir", str(tmp_path / "out2")], capsys)
    assert code == 2
    assert f"class folder {root / 'val' / 'star'} contains no images" in err


def test_folder_overlay_command_explains_and_skips_bad_files(trained_run, tmp_path):
    import numpy as np
    from PIL import Image

    from vision_attn.commands.predict import main
    from vision_attn.overlay import explain_folder

    images = tmp_path / "imgs"
    (images / "sub").mkdir(parents=True)
    Image.new("RGB", (48, 40), (200, 30, 30)).save(images / "a.jpg")
    grey = (np.random.default_rng(0).random((33, 65)) * 255).astype(np.uint8)
    Image.fromarray(grey, "L").save(images / "sub" / "b.png")
    Image.new("RGBA", (32, 32), (0, 200, 0, 128)).save(images / "sub" / "c.png")
    (images / "broken.png").write_bytes(b"not an image")
    out = tmp_path / "out"
    ckpt = trained_run / "checkpoints" / "last.ckpt"
    res = explain_folder(ckpt, images, out, methods=("rollout", "attention"), batch_size=2, progress=False)
    files = sorted(p["file"] for p in res["predictions"])
    assert files == ["a.jpg", "sub/b.png", "sub/c.png"]
    assert [s["file"] for s in res["skipped"]] == ["broken.png"]
    assert json.loads((out / "predictions.json").read_text()) == res["predictions"]
    assert json.loads((out / "skipped.json").read_text())[0]["file"] == "broken.png"
    # the image's extension is kept in the overlay's name (a.jpg and a.png never share one)
    assert sorted(str(p.relative_to(out / "overlays")) for p in (out / "overlays").rglob("*.png")) == [
        "a.jpg.png", "sub/b.png.png", "sub/c.png.png"]
    with pytest.raises(SystemExit):  # results there already: refused, nothing overwritten
        main(["--ckpt_path", str(ckpt), "--images", str(images), "--output_dir", str(out)])
    # A checkpoint is required to be a classification one; a foreign file is refused clearly.
    bad = tmp_path / "x.ckpt"
    bad.write_bytes(b"garbage")
    with pytest.raises(SystemExit):
        main(["--ckpt_path", str(bad), "--images", str(images), "--output_dir", str(tmp_path / "o2")])


def test_detection_train_and_eval_contract(tmp_path):
    cfg = str(REPO / "configs" / "detection" / "shapes.yaml")
    enc = "--model.init_args.encoder.init_args."
    common = ["--config", cfg, "--data.init_args.synthetic.num_train", "16", "--data.init_args.synthetic.num_val", "4",
              "--data.init_args.synthetic.image_size", "32", "--data.init_args.batching.num_workers", "0",
              "--data.init_args.cache_dir", str(tmp_path / "data")]
    out = tmp_path / "det"
    train_main([*common, f"{enc}img_size", "32", f"{enc}embed_dim", "32", f"{enc}depth", "1", f"{enc}num_heads", "2",
                "--model.init_args.head.hidden_dim", "32", "--model.init_args.head.num_layers", "2",
                "--model.init_args.head.num_heads", "2", "--trainer.max_epochs", "1",
                "--trainer.check_val_every_n_epoch", "1",
                "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(out)])
    assert "val/map" in (out / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    metrics = eval_main([*common, "--ckpt_path", str(out / "checkpoints" / "last.ckpt"),
                         "--output_dir", str(out / "eval"),
                         "--explain.num_overlays", "2", "--explain.score_threshold", "0.0",
                         "--explain.faithfulness_images", "2", "--explain.steps", "4", "--explain.mistakes", "0"])
    saved = json.loads((out / "eval" / "metrics.json").read_text())
    assert saved == metrics and {"map", "map_50", "map_75"} <= set(saved)
    preds = json.loads((out / "eval" / "predictions.json").read_text())
    assert preds and set(preds[0]) == {"image_id", "category_id", "bbox", "score"}
    assert {p["category_id"] for p in preds} <= {1, 2, 3, 4, 5}
    assert len(list((out / "eval" / "overlays").glob("*.png"))) == 2
    assert '"kind": "boxes"' in (out / "eval" / "report.html").read_text()


def test_eval_from_the_checkpoint_alone_equals_eval_with_the_config(trained_run, shapes_root, tmp_path):
    # the run saved its data settings in the checkpoint: eval.py needs no --config
    ckpt = str(trained_run / "checkpoints" / "last.ckpt")
    fast = ["--explain.num_overlays", "1", "--explain.faithfulness_images", "4", "--explain.steps", "4",
            "--explain.report", "false"]
    with_config = eval_main(["--config", CONFIG, "--data.init_args.root", str(shapes_root),
                             "--data.init_args.batching.num_workers", "0", *fast, "--ckpt_path", ckpt,
                             "--output_dir", str(tmp_path / "a")])
    alone = eval_main([*fast, "--ckpt_path", ckpt, "--output_dir", str(tmp_path / "b")])
    assert alone == pytest.approx(with_config, abs=1e-5)  # (the config's batch size differs: float noise)
    preds_a, preds_b = (json.loads((tmp_path / d / "predictions.json").read_text()) for d in "ab")
    assert ([(p["file"], p["label"], p["pred"]) for p in preds_a]
            == [(p["file"], p["label"], p["pred"]) for p in preds_b])
    assert [p["score"] for p in preds_a] == pytest.approx([p["score"] for p in preds_b], abs=1e-5)
    # any saved data setting can be overridden; a bare --overwrite (the switch spelling) works too
    with pytest.raises((VisionAttnError, ValueError), match="absent"):  # jsonargparse wraps it
        eval_main([*fast, "--ckpt_path", ckpt, "--output_dir", str(tmp_path / "b"), "--overwrite",
                   "--data.init_args.root", str(tmp_path / "absent")])


def test_validate_and_test_subcommands(trained_run, tmp_path, capsys):
    from vision_attn.commands import main

    ckpt = str(trained_run / "checkpoints" / "last.ckpt")
    fast = ["--explain.num_overlays", "0", "--explain.faithfulness", "false", "--explain.report", "false"]
    main(["validate", "--ckpt_path", ckpt, "--output_dir", str(tmp_path / "v"), *fast])
    assert json.loads((tmp_path / "v" / "metrics.json").read_text())["acc_top1"] >= 0.0
    # the shapes data has no test split: one clear line, exit status 2, nothing written
    with pytest.raises(SystemExit) as ex:
        main(["test", "--ckpt_path", ckpt, "--output_dir", str(tmp_path / "t"), *fast])
    assert ex.value.code == 2
    assert "test" in capsys.readouterr().err and not (tmp_path / "t" / "metrics.json").exists()


def test_a_checkpoint_without_data_settings_asks_for_the_config(trained_run, tmp_path):
    import torch

    ckpt = torch.load(trained_run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    del ckpt["vision_attn"]["data"]
    old = tmp_path / "old.ckpt"
    torch.save(ckpt, old)
    with pytest.raises(ConfigError, match="holds no data settings.*--config CFG"):
        eval_main(["--ckpt_path", str(old), "--output_dir", str(tmp_path / "o")])


def test_optimizer_and_scheduler_are_chosen_on_the_command_line(shapes_root, tmp_path):
    import torch

    cli = train_main([*_tiny(shapes_root), "--trainer.max_epochs", "1", "--trainer.default_root_dir",
                      str(tmp_path / "sgd"), "--optimizer", "SGD", "--optimizer.momentum", "0.8",
                      "--lr_scheduler", "StepLR", "--lr_scheduler.step_size", "1"])
    opt = cli.trainer.optimizers[0]
    assert isinstance(opt, torch.optim.SGD) and opt.defaults["momentum"] == 0.8
    assert cli.model.optimizer_init["class_path"] == "torch.optim.SGD"
    assert isinstance(cli.trainer.lr_scheduler_configs[0].scheduler, torch.optim.lr_scheduler.StepLR)
    saved = yaml.safe_load((tmp_path / "sgd" / "config.yaml").read_text())
    assert saved["optimizer"]["class_path"] == "torch.optim.SGD"


def test_eval_merge_r_merges_tokens_and_zero_is_the_model_as_trained(trained_run, tmp_path):
    ckpt = str(trained_run / "checkpoints" / "last.ckpt")
    fast = ["--explain.num_overlays", "1", "--explain.faithfulness_images", "4", "--explain.steps", "4",
            "--explain.report", "false", "--ckpt_path", ckpt]
    plain = eval_main([*fast, "--output_dir", str(tmp_path / "plain")])
    zero = eval_main([*fast, "--merge_r", "0", "--output_dir", str(tmp_path / "zero")])
    eval_main([*fast, "--merge_r", "8", "--output_dir", str(tmp_path / "merged")])
    assert zero == plain
    probs = {d: [p["score"] for p in json.loads((tmp_path / d / "predictions.json").read_text())]
             for d in ("plain", "merged")}
    assert len(probs["merged"]) == len(probs["plain"])
    assert probs["merged"] != probs["plain"]  # r=8 of the 64 patch tokens per block changes the model's outputs
    assert list((tmp_path / "merged" / "overlays").glob("*.png"))  # explanations of the merged model still drawn
