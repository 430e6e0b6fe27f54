"""Each task's own inference options (``VisionTask.inference_options``): declared by the task, added
to the command line by the generic commands (``eval.py``, ``predict``, ``explain``, hidden in
``fit``) under the task's flag group, and handed to the task by ``set_inference_options``; an
explanation method that does not apply to the model is skipped with a warning."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vision_attn.commands import main as vision_attn_main
from vision_attn.commands.evaluate import eval_main
from vision_attn.commands.train import train_main
from vision_attn.errors import ConfigError
from vision_attn.explain.evaluate import ExplainOptions
from vision_attn.models import create_encoder
from vision_attn.models.captioner import GenerationOptions
from vision_attn.predict import FolderRun, predict_folder
from vision_attn.tasks import CaptioningTask, ClassificationTask, DetectionTask
from vision_attn.tasks.classification import ClassificationOptions, ClassifierConfig
from vision_attn.tasks.detection import DetectionOptions

from .conftest import REPO, TINY_VIT
from .test_export import _checkpoint, _tasks

PLUGIN = "tests.plugins"
PLUGIN_DATA = {"class_path": "tests.plugins.multilabel.ShapeSetsDataModule",
               "init_args": {"num_train": 8, "num_val": 6, "batch_size": 6, "num_workers": 0}}


@pytest.fixture
def images(tmp_path) -> Path:
    folder = tmp_path / "imgs"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in ("a.png", "b.png"):
        Image.fromarray((rng.random((40, 48, 3)) * 255).astype(np.uint8)).save(folder / name)
    return folder


def _predict(*argv: str, command: str = "predict") -> None:
    vision_attn_main([command, *argv, "--num_workers", "0"])


def _records(out: Path) -> list[dict]:
    return json.loads((out / "predictions.json").read_text())


def test_each_task_declares_its_options_and_receives_them_through_one_method():
    declared = {cls: (cls.inference_options, cls.inference_group)
                for cls in (ClassificationTask, DetectionTask, CaptioningTask)}
    assert declared == {ClassificationTask: (ClassificationOptions, None), DetectionTask: (DetectionOptions, None),
                        CaptioningTask: (GenerationOptions, "generate")}
    with pytest.raises(ConfigError, match="topk must be an integer >= 1"):
        ClassificationOptions(topk=0)
    with pytest.raises(ConfigError, match="token 'distil' invalid"):
        ClassificationOptions(token="distil")
    task = _tasks()["classification"]
    assert task.inference == ClassificationOptions()  # the defaults until options are given
    with pytest.raises(ConfigError, match="takes ClassificationOptions"):
        task.set_inference_options(DetectionOptions())
    with pytest.raises(ConfigError, match="'zebra' is not a class name"):  # refused before any image runs
        task.set_inference_options(ClassificationOptions(target_class="zebra"))
    given = ExplainOptions(methods=None, alpha=0.3)
    assert task.explain_options(given) is given  # no options given: the explanation's own fields
    task.set_inference_options(ClassificationOptions(topk=2, target_class="b", token="cls"))
    filled = task.explain_options(given)
    assert (filled.topk, filled.target_class, filled.token, filled.alpha) == (2, "b", "cls", 0.3)
    assert filled.methods_default and (given.topk, given.target_class) == (5, None)  # a copy; defaults kept


def test_predict_and_explain_take_the_classifiers_and_the_detectors_options(images, tmp_path, capsys):
    classifier = _checkpoint(_tasks()["classification"], tmp_path / "cls.ckpt")
    _predict("--ckpt_path", str(classifier), "--images", str(images), "--output_dir", str(tmp_path / "k2"),
             "--topk", "2", "--no_overlays")
    assert [len(r["topk"]) for r in _records(tmp_path / "k2")] == [2, 2]
    config = tmp_path / "predict.yaml"  # a task option from a --config file, as any other option
    config.write_text(f"ckpt_path: {classifier}\ntopk: 1\nno_overlays: true\n")
    _predict("--config", str(config), "--images", str(images), "--output_dir", str(tmp_path / "k1"))
    assert [len(r["topk"]) for r in _records(tmp_path / "k1")] == [1, 1]
    _predict("--ckpt_path", str(classifier), "--images", str(images), "--output_dir", str(tmp_path / "ex"),
             "--topk", "1", "--target_class", "c", "--methods", "relevance", command="explain")
    assert [len(r["topk"]) for r in _records(tmp_path / "ex")] == [1, 1]
    assert len(list((tmp_path / "ex" / "overlays").glob("*.png"))) == 2

    detector = _checkpoint(_tasks()["detection"], tmp_path / "det.ckpt")
    for threshold, out in (("0", "all"), ("1.01", "none")):
        _predict("--ckpt_path", str(detector), "--images", str(images), "--output_dir", str(tmp_path / out),
                 "--score_threshold", threshold, "--no_overlays")
    assert all(r["detections"] for r in _records(tmp_path / "all"))
    assert not any(r["detections"] for r in _records(tmp_path / "none"))
    # another task's option is refused, naming the task it belongs to
    with pytest.raises(SystemExit) as ex:
        _predict("--ckpt_path", str(detector), "--images", str(images), "--output_dir", str(tmp_path / "bad"),
                 "--topk", "3")
    err = capsys.readouterr().err
    assert ex.value.code == 2 and "--topk is an option of classification models" in err and "detection" in err
    assert not (tmp_path / "bad" / "predictions.json").exists()


def test_predict_takes_the_captioners_generate_group(images, tmp_path):
    captioner = _checkpoint(_tasks()["captioning"], tmp_path / "cap.ckpt")
    _predict("--ckpt_path", str(captioner), "--images", str(images), "--output_dir", str(tmp_path / "long"),
             "--generate.min_length", "4", "--generate.beam_size", "1", "--no_overlays")
    assert all(len(r["caption"].split()) >= 4 for r in _records(tmp_path / "long"))
    config = tmp_path / "predict.yaml"  # a group as a mapping in a --config file
    config.write_text("generate:\n  max_length: 1\n")
    _predict("--ckpt_path", str(captioner), "--images", str(images), "--output_dir", str(tmp_path / "short"),
             "--config", str(config), "--no_overlays")
    assert all(len(r["caption"].split()) <= 1 for r in _records(tmp_path / "short"))


def test_help_without_a_model_lists_every_tasks_options_named_after_its_task(capsys):
    with pytest.raises(SystemExit):
        vision_attn_main(["predict", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, task in (("--topk", "classification"), ("--target_class", "classification"),
                       ("--score_threshold", "detection"), ("--generate.beam_size", "captioning")):
        assert re.search(rf"{re.escape(flag)} \S+ {task}: ", text), flag
    with pytest.raises(SystemExit):
        eval_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, task in (("--explain.topk", "classification"), ("--explain.score_threshold", "detection")):
        assert re.search(rf"{re.escape(flag)} \S+ {task}: ", text), flag
    assert "--generate.beam_size" in text and "--explain.num_overlays" in text


@pytest.fixture(scope="module")
def plugin_ckpt(tmp_path_factory) -> Path:
    """An untrained multi-label plugin model (its own ``--labels.threshold``) with its data settings."""
    from tests.plugins.multilabel import LabelOptions, MultiLabelTask

    task = MultiLabelTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=["a", "b", "c", "d", "e"])
    task.run_data = PLUGIN_DATA
    assert (task.inference_options, task.inference_group) == (LabelOptions, "labels")
    return _checkpoint(task, tmp_path_factory.mktemp("plugin") / "multilabel.ckpt")


def test_a_plugin_tasks_own_option_group_works_from_predict_and_eval(plugin_ckpt, images, tmp_path, capsys):
    allow = ["--allow_import", PLUGIN]
    for threshold, out in (("0.0", "all"), ("1.0", "none")):
        _predict("--ckpt_path", str(plugin_ckpt), "--images", str(images), "--output_dir", str(tmp_path / out),
                 "--labels.threshold", threshold, "--no_overlays", *allow)
    assert [r["labels"] for r in _records(tmp_path / "all")] == [["a", "b", "c", "d", "e"]] * 2
    assert [r["labels"] for r in _records(tmp_path / "none")] == [[], []]
    quick = ["--explain.num_overlays", "0", "--explain.report", "false", *allow]
    eval_main(["--ckpt_path", str(plugin_ckpt), "--output_dir", str(tmp_path / "eval"), "--labels.threshold",
               "0.0", *quick])
    predictions = _records(tmp_path / "eval")
    assert len(predictions) == 6 and all(p["labels"] == ["a", "b", "c", "d", "e"] for p in predictions)
    # eval.py's help lists the checkpoint's task group, and only its
    with pytest.raises(SystemExit):
        eval_main(["--ckpt_path", str(plugin_ckpt), "--output_dir", str(tmp_path / "h"), *allow, "--help"])
    text = capsys.readouterr().out
    assert "--labels.threshold" in text and "--generate.beam_size" not in text and "--explain.topk" not in text
    with pytest.raises(SystemExit):  # another task's group is not this checkpoint's
        eval_main(["--ckpt_path", str(plugin_ckpt), "--output_dir", str(tmp_path / "g"), "--generate.beam_size",
                   "1", *quick])
    assert "generate.beam_size" in capsys.readouterr().err


def _pooled_classifier(shapes_root: Path, path: Path) -> Path:
    """A classifier whose head pools with attention (timm's ``global_pool="map"``): no row of the
    encoder's attention describes what it reads, so rollout does not apply to it."""
    names = sorted(p.name for p in (shapes_root / "train").iterdir() if p.is_dir())
    encoder = create_encoder("vit_tiny_patch16_224", global_pool="map", num_classes=len(names), **TINY_VIT)
    task = ClassificationTask(encoder, class_names=names, head=ClassifierConfig(kind="timm"))
    task.run_data = {"class_path": "vision_attn.data.ImageFolderDataModule",
                     "init_args": {"root": str(shapes_root), "batching": {"num_workers": 0}}}
    return _checkpoint(task, path)


def test_an_inapplicable_method_is_skipped_with_a_warning(shapes_root, images, tmp_path, caplog, monkeypatch):
    ckpt = _pooled_classifier(shapes_root, tmp_path / "pooled.ckpt")
    with caplog.at_level("WARNING", logger="vision_attn.explain.methods"):
        result = predict_folder(ckpt, images, tmp_path / "pred", FolderRun(progress=False),
                                ExplainOptions(methods=["lrp", "gradcam"]))
    assert len(result["predictions"]) == 2 and len(list((tmp_path / "pred" / "overlays").glob("*.png"))) == 2
    assert any("'lrp' does not apply to" in r.getMessage() and "AttentionPoolLatent" in r.getMessage()
               for r in caplog.records)

    received: list[ClassificationOptions] = []
    real = ClassificationTask.set_inference_options
    monkeypatch.setattr(ClassificationTask, "set_inference_options",
                        lambda self, options: (received.append(options), real(self, options))[1])
    caplog.clear()
    with caplog.at_level("WARNING", logger="vision_attn.explain.methods"):
        metrics = eval_main(["--ckpt_path", str(ckpt), "--output_dir", str(tmp_path / "eval"),
                             "--explain.methods", "[lrp, gradcam]", "--explain.num_overlays", "1",
                             "--explain.mistakes", "0", "--explain.faithfulness_images", "2", "--explain.steps", "2",
                             "--explain.report", "false", "--explain.topk", "2", "--explain.token", "cls"])
    assert "deletion_auc_gradcam" in metrics and not any("lrp" in k for k in metrics)
    assert any("'lrp' does not apply to checkpoint" in r.getMessage() for r in caplog.records)
    assert received == [ClassificationOptions(topk=2, token="cls")]  # --explain.topk reached the task's options


def test_fit_accepts_the_tasks_options_without_listing_them(capsys):
    config = str(REPO / "configs" / "captioning" / "shapes.yaml")
    with pytest.raises(SystemExit) as ex:
        train_main(["--config", config, "--generate.beam_size", "1", "--explain.topk", "3",
                    "--explain.score_threshold", "0.5", "--print_config"])
    assert ex.value.code == 0 and "default_root_dir" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        train_main(["--config", config, "--help"])
    listed = set(re.findall(r"^\s+(--[\w.]+)", capsys.readouterr().out, re.MULTILINE))
    assert "--trainer.max_epochs" in listed and "--model.generate.beam_size" in listed  # the model's own argument
    assert not [f for f in listed if f.startswith(("--explain", "--generate", "--topk", "--score_threshold"))]


GENERIC_COMMANDS = ("__init__.py", "args.py", "evaluate.py", "lightning.py", "options.py", "policy.py", "predict.py",
                    "run.py", "train.py")


def test_the_generic_command_line_names_no_task_and_no_tasks_option():
    """The commands know each task's options only through the task: no task name, option class,
    option name or special case appears in their source."""
    named = re.compile(r"\b(classification|detection|captioning|multilabel)\b|ClassificationOptions|DetectionOptions|"
                       r"GenerationOptions|set_generation|--generate\.|\b(topk|score_threshold|target_class|"
                       r"beam_size)\b|--token\b")
    folder = REPO / "vision_attn" / "commands"
    for path in [folder / name for name in GENERIC_COMMANDS] + [REPO / "vision_attn" / "predict.py"]:
        text = path.read_text()
        if path.name == "predict.py" and path.parent.name == "vision_attn":
            text = text[text.index('"""', 3):]  # the module's docstring describes each task's records
        found = sorted({m.group(0) for m in named.finditer(text)})
        assert not found, f"{path.relative_to(REPO)} names {found}"
