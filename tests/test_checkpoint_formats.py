"""Checkpoints of the older formats load and give the outputs they gave.

``tests/fixtures/checkpoints/`` keeps one tiny checkpoint per task of format 1 (optimisation
settings among the model's flat arguments) and of format 2 (flat arguments, ``optim`` apart, the
run's data settings saved), each written by the version of the package that had that format
(``write_fixtures.py`` in that folder), with the outputs that version computed on a seeded input.
Today's code reads them into its argument groups (format 3) and must reproduce those outputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vision_attn.tasks import TASKS
from vision_attn.tasks.base import (
    CHECKPOINT_FORMAT,
    build_task_from_meta,
    checked_data_settings,
    load_task,
    read_task_meta,
)

FIXTURES = Path(__file__).parent / "fixtures" / "checkpoints"
CASES = [(task, fmt) for task in ("classification", "detection", "captioning") for fmt in (1, 2)]
ATOL = 1e-5


def _fixture(task: str, fmt: int) -> tuple[Path, dict]:
    path = FIXTURES / f"{task}_format{fmt}.ckpt"
    return path, json.loads(path.with_suffix(".json").read_text())


def _images(expected: dict) -> torch.Tensor:
    generator = torch.Generator().manual_seed(expected["seed"])
    return torch.randn(*expected["input_shape"], generator=generator)


def _close(actual: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(actual.float(), torch.tensor(expected, dtype=torch.float32), atol=ATOL, rtol=0)


def _check_outputs(task, expected: dict) -> None:
    """The outputs of ``task`` on the fixture's seeded input equal those the older version wrote."""
    images = _images(expected)
    with torch.no_grad():
        if expected["task"] == "classification":
            _close(task(images), expected["logits"])
        elif expected["task"] == "detection":
            out = task(images)
            _close(out["pred_logits"], expected["pred_logits"])
            _close(out["pred_boxes"], expected["pred_boxes"])
            dets = task.detect(out, torch.tensor([[32, 32], [32, 32]]))
            for det, want in zip(dets, expected["detections"], strict=True):
                assert det["labels"].tolist() == want["labels"] and det["queries"].tolist() == want["queries"]
                _close(det["boxes"], want["boxes"])
                _close(det["scores"], want["scores"])
        else:
            gen = task.generate(images)
            assert gen.tokens.tolist() == expected["tokens"]
            assert task.decode(gen.tokens) == expected["captions"]
            _close(gen.scores, expected["scores"])
            tokens = torch.tensor([[task.tokenizer.bos_id, 4, 5, 6, 7]] * len(images))
            _close(task(images, tokens), expected["teacher_forced_logits"])


def test_the_fixtures_are_small_and_of_the_formats_they_are_named_after():
    total = 0
    for task, fmt in CASES:
        path, expected = _fixture(task, fmt)
        total += path.stat().st_size + path.with_suffix(".json").stat().st_size
        raw = torch.load(path, map_location="cpu", weights_only=True)
        meta = raw["vision_attn"]
        assert meta.get("format", 1) == fmt < CHECKPOINT_FORMAT and meta["task"] == task == expected["task"]
        assert ("data" in meta) == (fmt == 2)  # format 1 did not save the data settings
        assert "optimizer_states" not in raw
    assert total < 600_000


@pytest.mark.parametrize(("task", "fmt"), CASES)
def test_an_older_checkpoint_loads_and_gives_the_same_outputs(task, fmt):
    path, expected = _fixture(task, fmt)
    loaded = load_task(path, expected_task=task)
    assert type(loaded) is TASKS[task]
    _check_outputs(loaded, expected)


@pytest.mark.parametrize(("task", "fmt"), CASES)
def test_an_older_checkpoint_is_read_into_the_argument_groups(task, fmt):
    """The model's flat arguments are moved into the task's groups (every value type-checked
    there), nothing of the older layout is left, and the model it describes, saved again in
    today's format, reads back to the same description and outputs."""
    path, expected = _fixture(task, fmt)
    cls = TASKS[task]
    meta, _ = read_task_meta(path)
    args = meta["model"]["init_args"]
    flat = {old for old, new in cls.legacy_arguments.items() if old != new.split(".", 1)[0]}
    assert not flat & set(args), sorted(flat & set(args))
    groups = {new.split(".", 1)[0] for new in cls.legacy_arguments.values()}
    assert all(isinstance(args[g], dict) for g in groups & set(args))
    task_ = load_task(path)
    again = task_.checkpoint_meta()
    assert again["format"] == CHECKPOINT_FORMAT == 3
    rebuilt = build_task_from_meta(again)
    rebuilt.load_state_dict(task_.state_dict())
    rebuilt.encoder.data_config = task_.encoder.data_config
    _check_outputs(rebuilt.eval(), expected)


def test_the_conversion_of_each_task_keeps_every_older_setting():
    """Spot checks of where the older flat arguments went (the fixtures' non-default settings)."""
    cls_args = read_task_meta(FIXTURES / "classification_format2.ckpt")[0]["model"]["init_args"]
    assert cls_args["head"] == {"kind": "linear", "pooling": "mean", "dropout": 0.1}
    assert cls_args["mix"] == {"mixup": 0.2, "cutmix": 0.0, "prob": 0.5, "switch_prob": 0.5}
    assert cls_args["label_smoothing"] == 0.2
    det = load_task(FIXTURES / "detection_format2.ckpt")
    head, loss = det.head_config, det.loss_config
    assert (head.num_queries, head.hidden_dim, head.top_k, head.dn_groups, head.o2m_mode) == (4, 16, 3, 1, "hybrid")
    assert (loss.cost_class, loss.weight_ce, loss.o2m_repeat) == (2.0, 2.0, 2)
    assert det.criterion.o2m_repeat == 2 and det.head.query_selection and det.head.look_forward_twice
    cap = load_task(FIXTURES / "captioning_format2.ckpt")
    assert cap.decoder_config.embedding_memory and cap.decoder_config.pixel_memory
    assert (cap.generation.beam_size, cap.generation.min_length, cap.generation.repetition_penalty) == (2, 2, 1.2)
    assert cap.generation.max_length == cap.decoder_config.max_length - 1
    training = cap.training_config
    assert (training.grounding_weight, training.concept_weight, training.word_dropout) == (0.3, 1.0, 0.1)
    assert training.grounding_classes and training.concept_words and cap.grounding_head is not None
    assert (cap.scst_config.samples, cap.scst_config.baseline, cap.scst_config.enabled) == (3, "mean", False)
    old = load_task(FIXTURES / "captioning_format1.ckpt")
    assert (old.generation.beam_size, old.generation.length_penalty) == (2, 0.5)
    assert not old.decoder_config.pixel_memory and old.training_config.grounding_classes is None


@pytest.mark.parametrize("task", ["classification", "detection", "captioning"])
def test_the_saved_data_settings_of_format_2_are_grouped(task):
    meta, _ = read_task_meta(FIXTURES / f"{task}_format2.ckpt")
    data = checked_data_settings(meta, "test")
    assert data == meta["data"]
    init_args = data["init_args"]
    assert init_args["batching"]["batch_size"] == 4 and init_args["batching"]["num_workers"] == 0
    assert init_args["layout"]["train_split"] == "train" and init_args["synthetic"]["num_train"] in (12, 20)
    assert not {"batch_size", "num_workers", "train_split", "max_pixels", "follow_symlinks"} & set(init_args)
    if task == "classification":
        assert init_args["augment"]["preset"] == "small" and init_args["layout"]["val_fraction"] is None
    elif task == "detection":
        transform = init_args["transform"]
        assert transform["resize"] == "square" and list(transform["scale_jitter"]) == [1.0, 1.0]
    else:
        assert init_args["captions"]["max_length"] == 32 and init_args["captions"]["per_image"] == 1


@pytest.mark.parametrize("task", ["classification", "detection", "captioning"])
def test_eval_runs_on_a_format_2_checkpoint_without_a_config(task, tmp_path):
    """``eval.py`` takes the model and the data settings from the checkpoint alone (format 2's flat
    data settings, in their groups), a saved data key overridable in today's spelling."""
    from vision_attn.commands.evaluate import eval_main

    metrics = eval_main(["--ckpt_path", str(FIXTURES / f"{task}_format2.ckpt"), "--output_dir", str(tmp_path / "out"),
                         "--data.init_args.cache_dir", str(tmp_path / "data"), "--data.init_args.batching.batch_size",
                         "2", "--explain.num_overlays", "0", "--explain.faithfulness", "false",
                         "--explain.report", "false", "--trainer.enable_progress_bar", "false"])
    headline = {"classification": "acc_top1", "detection": "map", "captioning": "cider"}[task]
    assert headline in metrics
    assert json.loads((tmp_path / "out" / "metrics.json").read_text()) == metrics


@pytest.mark.parametrize("fmt", [1, 2])
def test_predict_runs_on_an_older_checkpoint(fmt, tmp_path):
    from PIL import Image

    from vision_attn.predict import FolderRun, ModelSource, predict_folder

    folder = tmp_path / "images"
    folder.mkdir()
    for i, image in enumerate(_images(_fixture("classification", fmt)[1])):
        array = ((image.clamp(-2, 2) + 2) / 4 * 255).byte().permute(1, 2, 0).numpy()
        Image.fromarray(array).save(folder / f"{i}.png")
    source = ModelSource(FIXTURES / f"classification_format{fmt}.ckpt", expected_task="classification")
    result = predict_folder(source, folder, tmp_path / "out", FolderRun(progress=False), overlays=False)
    assert [r["file"] for r in result["predictions"]] == ["0.png", "1.png"]
    assert all(len(r["topk"]) == 5 for r in result["predictions"])


def test_the_checks_hold_on_the_converted_arguments(tmp_path):
    """An older checkpoint's flat values are type-checked and bounded in their groups: a class path,
    a wrong type or an oversized value is refused (naming the grouped key), nothing is imported;
    an argument given both flat and in its group, or a group that is not a mapping, is refused."""
    from vision_attn.errors import CheckpointError

    raw = torch.load(FIXTURES / "detection_format2.ckpt", map_location="cpu", weights_only=True)

    def crafted(edit) -> Path:
        meta = json.loads(json.dumps(raw["vision_attn"]))
        edit(meta["model"]["init_args"])
        path = tmp_path / "crafted.ckpt"
        torch.save({**raw, "vision_attn": meta}, path)
        return path

    cases = [
        (lambda a: a.update(num_layers={"class_path": "os.system"}), r"model\.init_args\.head\.num_layers is a class"),
        (lambda a: a.update(focal="yes"), r"model\.init_args\.head\.focal = 'yes' is not a boolean"),
        (lambda a: a.update(num_queries=1 << 40), r"model\.init_args\.head\.num_queries = .* lies outside"),
        (lambda a: a.update(cost_class=[1.0]), r"model\.init_args\.loss\.cost_class = \[1\.0\] is not"),
        (lambda a: a.update(head={"num_queries": 4}), r"gives num_queries and head\.num_queries"),
        (lambda a: a.update(head=7), r"model\.init_args\.head is not a mapping"),
    ]
    for edit, message in cases:
        with pytest.raises(CheckpointError, match=message):
            load_task(crafted(edit))
