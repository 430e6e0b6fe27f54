"""Captioning system: training, self-describing checkpoints (tokenizer included), eval.py contract."""

from __future__ import annotations

import copy
import json
import logging
import math
import shutil
from dataclasses import replace

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from vision_attn import create_encoder, load_task
from vision_attn.commands.evaluate import eval_main
from vision_attn.commands.train import train_main
from vision_attn.data.captioning import CaptioningDataModule, CaptionOptions, caption_collate
from vision_attn.data.loading import Batching
from vision_attn.data.synthetic import SceneSetConfig
from vision_attn.data.tokenizer import normalize_caption
from vision_attn.errors import CheckpointError, ConfigError
from vision_attn.metrics.caption import caption_metrics
from vision_attn.models.captioner import DecoderConfig, GenerationOptions
from vision_attn.tasks import CaptioningTask
from vision_attn.tasks.captioning import CaptionTraining, SCSTConfig, concept_targets, concept_vocabulary
from vision_attn.tasks.optim import Optimization

from .conftest import REPO

TINY_DATA = SceneSetConfig(image_size=32, num_train=24, num_val=6)
CONTENT_KEYS = {"content_exact", "kinds_exact", "content_precision", "content_recall", "count_acc", "content_images"}


@pytest.fixture
def with_java(monkeypatch):
    """Requested by the tests whose evaluations run METEOR (where Java is installed)."""
    monkeypatch.setenv("VISION_ATTN_JAVA_METRICS", "1")


@pytest.fixture(autouse=True)
def _no_java(request, monkeypatch):
    """METEOR's Java start costs seconds per evaluation: on only where a test asks for it."""
    if "with_java" not in request.fixturenames:
        monkeypatch.setenv("VISION_ATTN_JAVA_METRICS", "0")


TINY_DECODER = DecoderConfig(hidden_dim=32, num_layers=2, num_heads=2, mlp_ratio=2.0, dropout=0.0, max_length=24)


def _task(**kw) -> CaptioningTask:
    torch.manual_seed(0)
    enc = create_encoder("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    return CaptioningTask(enc, **{"decoder": TINY_DECODER, **kw})


def _trainer(tmp_path, **kw) -> L.Trainer:
    return L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                     accelerator="cpu", **kw)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("capfit")
    dm = CaptioningDataModule(synthetic=TINY_DATA, cache_dir=str(tmp / "data"),
                              batching=Batching(batch_size=8, num_workers=0), captions=CaptionOptions(max_length=24))
    L.seed_everything(0)  # the caption drawn per image comes from Python's random module
    task = _task(optim=Optimization(lr=3e-3), generate=GenerationOptions(beam_size=2))
    trainer = _trainer(tmp, max_epochs=60, enable_checkpointing=False, check_val_every_n_epoch=60)
    trainer.fit(task, datamodule=dm)
    ckpt = tmp / "cap.ckpt"
    trainer.save_checkpoint(ckpt)
    return task, dm, trainer, ckpt


def test_training_learns_the_captions(fitted):
    task, dm, trainer, _ = fitted
    assert task.tokenizer.vocab == dm.tokenizer.vocab  # built from the data when training started
    metrics = trainer.callback_metrics
    # an untrained model scores log(V) per token; 180 tiny steps must take it well below
    assert float(metrics["train/loss_epoch"]) < 0.7 * math.log(len(task.tokenizer))
    assert float(metrics["val/bleu1"]) > 0.2  # scored on generated captions
    # validation also says whether the captions name what is there (the split has instances)
    assert {f"val/{k}" for k in CONTENT_KEYS} <= set(metrics)
    assert 0.0 <= float(metrics["val/content_exact"]) <= float(metrics["val/kinds_exact"]) <= 1.0
    assert float(metrics["val/content_images"]) == len(dm.datasets["val"])


def test_captions_depend_on_the_image(fitted):
    """An image-blind language model could pass the learning thresholds above on these templated
    captions, but it cannot tell an image's captions from another image's. This model must:
    on the training images (an image-blind model cannot memorise which caption is whose either)
    its loss and its captions' scores are clearly better with the true images than with the
    images shuffled across the captions."""
    task, dm, _, _ = fitted
    task.eval()
    data = dm.datasets["train"]
    n = len(data)
    images, tokens, _ = caption_collate([data[i] for i in range(n)], dm.tokenizer.pad_id)
    other = torch.roll(torch.arange(n), 1)  # caption i paired with image i - 1

    def cross_entropy(imgs):  # per target token, no label smoothing
        logits = task(imgs, tokens[:, :-1])
        return float(F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), ignore_index=dm.tokenizer.pad_id))

    with torch.no_grad():
        true_loss, shuffled_loss = cross_entropy(images), cross_entropy(images[other])
        hyps = dict(enumerate(task.decode(task.generate(images, beam_size=1).tokens)))
    assert true_loss < 0.9 * shuffled_loss, (true_loss, shuffled_loss)
    # the generated captions against the image's own references and against another image's
    own = {i: [normalize_caption(c) for c in data.references[i]] for i in range(n)}
    true_scores = caption_metrics(hyps, own)
    shuffled_scores = caption_metrics(hyps, {i: own[int(other[i])] for i in range(n)})
    assert true_scores["bleu4"] > shuffled_scores["bleu4"] + 0.1, (true_scores, shuffled_scores)
    assert true_scores["cider"] > 2 * shuffled_scores["cider"], (true_scores, shuffled_scores)


def _eval_on(task, data, images: torch.Tensor) -> tuple[dict, list]:
    """``eval_results`` of the captions the task generates for ``images`` (the data's, in order)."""
    with torch.no_grad():
        captions = task.decode(task.generate(images).tokens)
    task.eval_records = [{"index": i, "caption": c} for i, c in enumerate(captions)]
    return task.eval_results(data)


def test_image_dependence_and_content_of_a_trained_model(fitted):
    """eval's image_dependence: large for the trained model on its images, exactly 0 when every
    image is blank (one caption for all: any pairing scores the same). Content accuracy is there
    (the embedded data has instances files) and falls with blank images."""
    task, dm, _, _ = fitted
    task.eval()
    data = dm.datasets["train"]
    images = torch.stack([data[i][0] for i in range(len(data))])
    metrics, predictions = _eval_on(task, data, images)
    assert CONTENT_KEYS <= set(metrics) and metrics["content_images"] == len(data)
    assert metrics["image_dependence"] > 0.5 * metrics["cider"] > 0.5, metrics
    assert sum(p["cider"] for p in predictions) / len(predictions) == pytest.approx(metrics["cider"], abs=1e-9)
    blank, _ = _eval_on(task, data, torch.zeros_like(images))
    assert blank["image_dependence"] == pytest.approx(0.0, abs=1e-9)
    assert blank["kinds_exact"] < metrics["kinds_exact"] and blank["content_recall"] < metrics["content_recall"]
    assert 0.0 <= metrics["content_exact"] <= metrics["kinds_exact"] <= 1.0


def test_decoding_options_reach_the_decoder(fitted):
    task, dm, _, _ = fitted
    task.eval()
    saved = copy.copy(task.generation)
    images = torch.stack([dm.datasets["val"][i][0] for i in range(4)])
    try:
        task.set_inference_options(GenerationOptions(beam_size=2, min_length=6, repetition_penalty=1.5))
        assert (task.generation.beam_size, task.generation.length_penalty) == (2, saved.length_penalty)  # None keeps
        with torch.no_grad():
            out = task.generate(images)
            direct = task.head.generate(task.encode(images), task.tokenizer.bos_id, task.tokenizer.eos_id,
                                        saved.max_length, 2, saved.length_penalty, min_length=6, repetition_penalty=1.5)
        assert torch.equal(out.tokens, direct.tokens) and (out.lengths > 6).all()
        for key, value in (("min_length", -1), ("repetition_penalty", 0.0), ("beam_size", 0)):
            with pytest.raises(ConfigError, match=rf"--generate\.{key} must be"):
                task.set_inference_options(GenerationOptions(**{key: value}))
    finally:
        task.generation = saved


def test_eval_points_at_the_named_objects(fitted, tmp_path, with_java):
    """eval.py on data with boxes (the embedded scenes have instances_<split>.json) writes the
    pointing-game metrics of a model whose captions name the objects, content accuracy, and
    METEOR where Java runs (SPICE needs CoreNLP, absent here: left out)."""
    _, _, _, ckpt = fitted
    cache = next(ckpt.parent.glob("data"))
    assert next(cache.glob("*/annotations/instances_val.json")).is_file()
    out = tmp_path / "eval"
    metrics = eval_main(["--config", str(REPO / "configs" / "captioning" / "shapes.yaml"),
                         "--data.init_args.synthetic.num_train", str(TINY_DATA.num_train),
                         "--data.init_args.synthetic.num_val", str(TINY_DATA.num_val),
                         "--data.init_args.synthetic.image_size", str(TINY_DATA.image_size),
                         "--data.init_args.batching.num_workers", "0", "--data.init_args.cache_dir", str(cache),
                         "--ckpt_path", str(ckpt), "--output_dir", str(out), "--explain.num_overlays", "0",
                         "--explain.report", "false"])
    saved = json.loads((out / "metrics.json").read_text())
    assert saved == metrics
    assert {"pointing_acc", "pointing_acc_random", "pointing_words"} <= set(saved)
    assert saved["pointing_words"] >= 1 and 0.0 < saved["pointing_acc_random"] < 1.0
    assert saved["pointing_acc"] > saved["pointing_acc_random"]  # the named object's attention peaks on it
    # every decoder method gets its own pointing score; the old names are raw attention's
    assert {"pointing_attention", "pointing_lrp_attention", "pointing_random"} <= set(saved)
    assert saved["pointing_acc"] == saved["pointing_attention"]
    assert saved["pointing_random"] == saved["pointing_acc_random"]
    assert CONTENT_KEYS | {"rouge_l", "image_dependence"} <= set(saved)
    if shutil.which("java") is not None:
        assert 0.0 < saved["meteor"] < 1.0


def test_checkpoint_restores_tokenizer_and_generation(fitted):
    task, dm, _, ckpt = fitted
    loaded = load_task(ckpt, expected_task="captioning")
    assert loaded.tokenizer.vocab == task.tokenizer.vocab
    images = torch.stack([dm.datasets["train"][i][0] for i in range(3)])
    task.eval()
    a, b = task.generate(images), loaded.generate(images)
    assert torch.equal(a.tokens, b.tokens)
    assert loaded.decode(b.tokens) == task.decode(a.tokens)


def test_checkpoint_without_tokenizer_is_a_clear_error(fitted, tmp_path):
    _, _, _, ckpt = fitted
    raw = torch.load(ckpt, weights_only=False)
    del raw["vision_attn"]["model"]["init_args"]["vocab"]
    bad = tmp_path / "no_vocab.ckpt"
    torch.save(raw, bad)
    with pytest.raises(CheckpointError, match=r"does not store the model's tokenizer vocabulary"):
        load_task(bad)


def test_frozen_encoder_does_not_change(tmp_path):
    dm = CaptioningDataModule(synthetic=TINY_DATA, cache_dir=str(tmp_path / "data"),
                              batching=Batching(batch_size=8, num_workers=0), captions=CaptionOptions(max_length=24))
    task = _task(training=CaptionTraining(freeze_encoder=True))
    before = {k: v.clone() for k, v in task.encoder.state_dict().items()}
    _trainer(tmp_path, max_steps=3, enable_checkpointing=False, limit_val_batches=0).fit(task, datamodule=dm)
    assert all(torch.equal(before[k], v) for k, v in task.encoder.state_dict().items())
    assert not task.encoder.training  # frozen: no dropout either


def test_train_and_eval_contract(tmp_path):
    cfg = str(REPO / "configs" / "captioning" / "shapes.yaml")
    enc = "--model.init_args.encoder.init_args."
    common = ["--config", cfg, "--data.init_args.synthetic.num_train", "16", "--data.init_args.synthetic.num_val", "5",
              "--data.init_args.synthetic.image_size", "32", "--data.init_args.batching.num_workers", "0",
              "--data.init_args.cache_dir", str(tmp_path / "data")]
    out = tmp_path / "cap"
    train_main([*common, f"{enc}img_size", "32", f"{enc}embed_dim", "32", f"{enc}depth", "1", f"{enc}num_heads", "2",
                "--model.init_args.decoder.hidden_dim", "32", "--model.init_args.decoder.num_layers", "1",
                "--model.init_args.decoder.num_heads", "2", "--trainer.max_epochs", "1",
                "--trainer.check_val_every_n_epoch", "1",
                "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(out)])
    assert "val/cider" in (out / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    ckpt = str(out / "checkpoints" / "last.ckpt")
    metrics = eval_main([*common, "--ckpt_path", ckpt, "--output_dir", str(out / "eval"), "--explain.num_overlays", "2",
                         "--explain.mistakes", "0"])
    saved = json.loads((out / "eval" / "metrics.json").read_text())
    assert saved == metrics
    assert {"bleu1", "bleu2", "bleu3", "bleu4", "cider", "rouge_l", "image_dependence"} <= set(saved)
    assert CONTENT_KEYS <= set(saved) and "meteor" not in saved  # VISION_ATTN_JAVA_METRICS=0
    # the content words checked against the references alone (vision_attn.metrics.reference_content)
    assert {"objects_exact", "relations_exact", "hallucination_rate", "hallucinated_captions"} <= set(saved)
    # (pointing metrics of a model that names objects: test_eval_points_at_the_named_objects)
    preds = json.loads((out / "eval" / "predictions.json").read_text())
    val = json.loads(next((tmp_path / "data").glob("*/annotations/captions_val.json")).read_text())
    assert [p["image_id"] for p in preds] == [im["id"] for im in val["images"]]
    assert all(set(p) == {"image_id", "caption", "cider"} and isinstance(p["caption"], str) for p in preds)
    assert sum(p["cider"] for p in preds) / len(preds) == pytest.approx(saved["cider"], abs=1e-9)
    # per image: caption, references, CIDEr-D and the content checks, which average to the metrics
    per_image = json.loads((out / "eval" / "results_per_image.json").read_text())
    assert [(e["image_id"], e["caption"], e["cider"]) for e in per_image] == [
        (p["image_id"], p["caption"], p["cider"]) for p in preds]
    assert all(e["references"] for e in per_image)
    checked = [e for e in per_image if e["objects_exact"] is not None]
    assert sum(e["objects_exact"] for e in checked) / len(checked) == pytest.approx(saved["objects_exact"])
    assert sum(e["relations_exact"] for e in checked) / len(checked) == pytest.approx(saved["relations_exact"])
    assert sum(bool(e["hallucinated"]) for e in checked) / len(checked) == pytest.approx(saved["hallucinated_captions"])
    # the browser: every object word no reference has, once per caption, with its map
    browser = (out / "eval" / "mistakes.html").read_text()
    start = browser.index("const CARDS=") + len("const CARDS=")
    cards = json.JSONDecoder().raw_decode(browser[start:])[0]
    assert sorted((c["image"], c["category"]) for c in cards) == sorted(
        (str(e["image_id"]), w) for e in per_image for w in dict.fromkeys(e["hallucinated"]))
    assert all(c["kind"] == "hallucinated" and c["map"] for c in cards)
    words = (out / "eval" / "per_class.csv").read_text().splitlines()
    assert words[0] == "class,said,referenced,tp,fp,fn,precision,recall,f1" and len(words) > 1
    assert len(list((out / "eval" / "overlays").glob("*.png"))) == 2
    page = (out / "eval" / "report.html").read_text()
    assert '"kind": "words"' in page  # per-word interactive views
    # greedy instead of the config's beam search, into another folder
    words = tmp_path / "words.txt"
    words.write_text("circle\nsquare\n")
    greedy = eval_main([*common, "--ckpt_path", ckpt, "--output_dir", str(out / "greedy"), "--generate.beam_size", "1",
                        "--generate.min_length", "4", "--generate.repetition_penalty", "1.2", "--explain.num_overlays",
                        "0", "--explain.content_words", str(words)])
    assert greedy["content_vocabulary"] == 2.0
    with pytest.raises(ConfigError, match="empty.txt: no word"):
        (tmp_path / "empty.txt").write_text("\n")
        eval_main([*common, "--ckpt_path", ckpt, "--output_dir", str(out / "none"), "--explain.num_overlays", "0",
                   "--explain.content_words", str(tmp_path / "empty.txt")])
    assert not (out / "none" / "metrics.json").exists()
    assert set(greedy) >= {"bleu4", "cider"}
    greedy_preds = json.loads((out / "greedy" / "predictions.json").read_text())
    assert all(len(p["caption"].split()) >= 4 for p in greedy_preds)


def test_word_dropout_replaces_only_words_and_only_in_training():
    vocab = ["<pad>", "<bos>", "<eos>", "<unk>", "a", "red", "circle", "square"]
    task = _task(vocab=vocab, training=CaptionTraining(word_dropout=0.5))
    tok = task.tokenizer
    w = [tok.index[x] for x in ("a", "red", "circle")]
    tokens = torch.tensor([[tok.bos_id, *w, tok.eos_id, tok.pad_id, tok.pad_id]] * 400)
    torch.manual_seed(1)
    dropped = task._drop_words(tokens[:, :-1])
    changed = dropped != tokens[:, :-1]
    assert (dropped[changed] == tok.unk_id).all()  # replaced by <unk>, nothing else
    assert not changed[:, 0].any() and not changed[:, 5:].any()  # <bos> and padding never
    rate = changed[:, 1:5].float().mean().item()  # words and <eos> as an input
    assert 0.45 < rate < 0.55, rate
    images = torch.randn(4, 3, 32, 32)
    task.eval()  # evaluation: no dropout, the same loss as without the option
    plain = _task(vocab=vocab)
    plain.load_state_dict(task.state_dict())
    plain.eval()
    assert torch.equal(task._loss(images, tokens[:4]), plain._loss(images, tokens[:4]))
    task.train()
    torch.manual_seed(2)
    assert not torch.equal(task._loss(images, tokens[:4]), plain._loss(images, tokens[:4]))
    with pytest.raises(ValueError, match="word_dropout"):
        _task(vocab=vocab, training=CaptionTraining(word_dropout=1.0))


def test_patch_targets_by_hand():
    from vision_attn.tasks.captioning import patch_targets

    # 2 x 2 patches, centres at 0.25 / 0.75: the whole image is category 0, the top-left quarter 2
    boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.5, 0.5]])
    assert patch_targets(boxes, torch.tensor([0, 2]), (2, 2)).tolist() == [3, 1, 1, 1]  # smallest box wins
    # a box holding only the bottom-right centre; the others are background
    assert patch_targets(torch.tensor([[0.6, 0.6, 1.0, 1.0]]), torch.tensor([1]), (2, 2)).tolist() == [0, 0, 0, 2]
    # rows before columns: a box over the right column of a 2 x 3 grid
    assert patch_targets(torch.tensor([[0.7, 0.0, 1.0, 1.0]]), torch.tensor([4]), (2, 3)).tolist() == [0, 0, 5, 0, 0, 5]
    assert patch_targets(torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64), (2, 2)).tolist() == [0, 0, 0, 0]



def test_balanced_grounding_weighs_every_object_alike_by_hand():
    import torch.nn.functional as F

    from vision_attn.tasks.captioning import grounding_weights, patch_objects

    # 2 x 2 grid: a big box owning three patches, a small one owning the bottom-right patch
    boxes = torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.6, 0.6, 1.0, 1.0]])
    assert patch_objects(boxes, (2, 2)).tolist() == [0, 0, 0, 1]
    assert patch_objects(torch.zeros(0, 4), (2, 2)).tolist() == [-1, -1, -1, -1]
    # batch of two images: 3 + 1 patches in image 0, one 1-patch object in image 1 (3 objects,
    # 5 object patches: mean 5/3 patches per object); background keeps its weight
    owners = torch.tensor([[0, 0, 0, 1], [-1, 0, -1, -1]])
    w = grounding_weights(owners, 0.2)
    m = 5 / 3
    expected = torch.tensor([[m / 3, m / 3, m / 3, m], [0.2, m, 0.2, 0.2]])
    assert torch.allclose(w, expected)
    # each object's patches sum to the same weight; all objects together keep their unbalanced total
    assert torch.isclose(w[0, :3].sum(), w[0, 3]) and torch.isclose(w[0, 3], w[1, 1])
    assert torch.isclose(w[owners >= 0].sum(), torch.tensor(5.0))
    assert torch.equal(grounding_weights(torch.full((1, 4), -1), 0.2), torch.full((1, 4), 0.2))

    # the task's balanced loss is that weighted mean of the per-patch cross-entropies
    vocab = ["<pad>", "<bos>", "<eos>", "<unk>", "a", "circle"]
    task = _task(vocab=vocab, training=CaptionTraining(grounding_weight=1.0, grounding_classes=["a", "b", "c"],
                                                       grounding_balance=True))
    enc = task.encode(torch.randn(2, 3, 32, 32))
    rows, cols = enc.grid
    tiny = [(torch.tensor([[0.0, 0.0, 1.0, 1.0], [0.0, 0.0, 1.0 / cols, 1.0 / rows]]), torch.tensor([0, 2])),
            (torch.zeros(0, 4), torch.zeros(0, dtype=torch.int64))]
    logits = task.grounding_head(enc.tokens[:, enc.num_prefix_tokens:]).float().reshape(-1, 4)
    owners = torch.stack([patch_objects(b, enc.grid) for b, _ in tiny])
    targets = torch.stack([torch.where(o >= 0, torch.tensor([1, 3])[o.clamp(min=0)], 0) for o in owners]).reshape(-1)
    weights = grounding_weights(owners, 0.2).reshape(-1)
    ce = F.cross_entropy(logits, targets, reduction="none")
    assert torch.allclose(task._grounding_loss(enc, tiny), (weights * ce).sum() / weights.sum())
    # the one-patch object weighs as much as the whole-image one: not the unbalanced loss
    task.training_config = replace(task.training_config, grounding_balance=False)
    assert not torch.allclose(task._grounding_loss(enc, tiny), (weights * ce).sum() / weights.sum())


def _grounding_data(tmp_path, **kw) -> CaptioningDataModule:
    return CaptioningDataModule(synthetic=TINY_DATA, cache_dir=str(tmp_path / "data"),
                                batching=Batching(batch_size=8, num_workers=0),
                                captions=CaptionOptions(max_length=24, **kw))


def test_grounding_supervises_the_encoder_and_survives_checkpoints(tmp_path):
    """With ``grounding_weight`` the patch tokens learn the boxes' categories: the loss falls far
    below what predicting the class frequencies gives (it does not when the encoder gets no
    gradient from it), and the head and its classes come back from the checkpoint."""
    dm = _grounding_data(tmp_path)
    L.seed_everything(0)
    task = _task(optim=Optimization(lr=3e-3), training=CaptionTraining(grounding_weight=1.0))
    trainer = _trainer(tmp_path, max_epochs=25, enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(task, datamodule=dm)
    classes = task.hparams["training"]["grounding_classes"]
    assert classes == ["circle", "square", "triangle", "star", "cross"] and task.grounding_head.out_features == 6
    from vision_attn.tasks.captioning import GROUNDING_BACKGROUND_WEIGHT, patch_targets

    ds = dm.datasets["train"]
    items = [ds[i] for i in range(len(ds))]
    targets = torch.cat([patch_targets(b, c, (4, 4)) for *_, (b, c) in items])
    weight = torch.ones(6)
    weight[0] = GROUNDING_BACKGROUND_WEIGHT
    share = torch.bincount(targets, minlength=6).float() + 1e-3
    # the weighted cross-entropy of always predicting the classes' frequencies
    constant = F.cross_entropy(share.log().expand(len(targets), 6), targets, weight=weight)
    task.eval()
    images = torch.stack([it[0] for it in items])
    with torch.no_grad():
        loss = task._grounding_loss(task.encode(images), [it[3] for it in items])
    assert loss < 0.5 * constant, (float(loss), float(constant))
    ckpt = tmp_path / "ground.ckpt"
    trainer.save_checkpoint(ckpt)
    loaded = load_task(ckpt, expected_task="captioning")
    assert loaded.hparams["training"]["grounding_classes"] == classes
    assert torch.equal(loaded.grounding_head.weight, task.grounding_head.weight)
    # a self-critical phase from it keeps the head but trains it no more (DDP: no unused trained parameters)
    scst = _task(training=CaptionTraining(init_from=str(ckpt)), scst=SCSTConfig(enabled=True, samples=2))
    assert scst.grounding_head is not None and not any(p.requires_grad for p in scst.grounding_head.parameters())



def test_word_attention_targets_and_regions_by_hand():
    from vision_attn.tasks.captioning import (
        class_regions,
        word_attention_loss,
        word_attention_targets,
        word_kinds,
    )

    vocab = ["<pad>", "<bos>", "<eos>", "<unk>", "a", "small", "red", "circle", "circles", "and", "two", "there",
             "are", "square", "large", "to", "the", "left", "of", "crosses"]
    kinds = word_kinds(vocab, ["circle", "square", "triangle", "star", "cross"])
    named = {w: int(k) for w, k in zip(vocab, kinds, strict=True)}
    assert named["circle"] == named["circles"] == 0 and named["square"] == 1 and named["crosses"] == 4
    assert named["small"] == named["red"] == named["large"] == -2  # describe, do not name
    assert all(named[w] == -1 for w in ("<pad>", "<eos>", "a", "and", "two", "there", "left", "of"))
    words = "there are a small red circle and two large crosses to the left of a square <eos>".split()
    targets = word_attention_targets(torch.tensor([[vocab.index(w) for w in words]]), kinds)
    expected = [-1, -1, -1, 0, 0, 0, -1, -1, 4, 4, -1, -1, -1, -1, -1, 1, -1]
    assert targets[0].tolist() == expected
    # a describing word four words before its kind word is beyond the window; one after a kind names nothing
    far = "a red small large circle red".split()
    vocab2 = vocab + ["a"]
    assert word_attention_targets(torch.tensor([[vocab2.index(w) for w in far]]), kinds)[0].tolist() == \
        [-1, -1, 0, 0, 0, -1]

    # 2 x 2 grid (centres 0.25 / 0.75): a circle over the left column, a tiny square holding no
    # centre (its own centre lies in the bottom-right patch)
    boxes = torch.tensor([[0.0, 0.0, 0.5, 1.0], [0.8, 0.8, 0.9, 0.9]])
    regions = class_regions(boxes, torch.tensor([0, 1]), (2, 2), 3)
    assert regions.int().tolist() == [[1, 0, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0]]
    # uniform attention puts half of its mass on the circle, a quarter on the square: -log of each, averaged
    attention = torch.full((1, 3, 4), 0.25)
    loss = word_attention_loss(attention, torch.tensor([[0, 1, -1]]), regions[None])
    assert torch.isclose(loss, -(torch.log(torch.tensor(0.5)) + torch.log(torch.tensor(0.25))) / 2)
    # a step whose category has no box in the image is skipped; nothing left: None
    assert word_attention_loss(attention, torch.tensor([[2, -1, -1]]), regions[None]) is None


def test_word_attention_makes_the_decoder_look_at_the_object_it_names(tmp_path):
    """``word_attention_weight``: after training, the last layer's cross-attention of the steps that
    name (or describe) an object puts more of its mass on that object's patches than the same model trained
    without the loss, and far more than a uniform look at the image would."""
    from vision_attn.tasks.captioning import class_regions, word_attention_targets, word_kinds

    dm = _grounding_data(tmp_path)
    masses = {}
    for weight in (0.0, 1.0):
        L.seed_everything(0)
        task = _task(optim=Optimization(lr=3e-3), training=CaptionTraining(grounding_weight=0.3,
                                                                           word_attention_weight=weight))
        _trainer(tmp_path, max_epochs=12, enable_checkpointing=False, limit_val_batches=0).fit(task, datamodule=dm)
        ds = dm.datasets["train"]
        items = [ds[i] for i in range(len(ds))]
        images = torch.stack([it[0] for it in items])
        tokens = torch.nn.utils.rnn.pad_sequence([it[1] for it in items], batch_first=True,
                                                 padding_value=task.tokenizer.pad_id)
        kinds = word_kinds(task.tokenizer.vocab, task.hparams["training"]["grounding_classes"])
        task.eval()
        with torch.no_grad():
            enc = task.encode(images)
            attention = task.head(enc, tokens[:, :-1], need_weights=True)[1][-1].mean(dim=1)  # last layer
        classes = word_attention_targets(tokens[:, 1:], kinds)
        regions = torch.stack([class_regions(b, c, enc.grid, 5) for *_, (b, c) in items])
        mask = torch.gather(regions, 1, classes.clamp(min=0)[:, :, None].expand(*classes.shape, regions.shape[-1]))
        valid = (classes >= 0) & mask.any(-1)
        masses[weight] = float((attention * mask).sum(-1)[valid].mean())
        uniform = float(mask.float().mean(-1)[valid].mean())
    assert masses[1.0] > 2 * uniform and masses[1.0] > masses[0.0] + 0.1, (masses, uniform)
    with pytest.raises(ConfigError, match="grounding_weight"):
        _task(training=CaptionTraining(word_attention_weight=0.5))


def test_captions_per_image_pair_each_caption_with_its_own_image(tmp_path):
    """``data.captions_per_image K``: the image is encoded once and its tokens repeated for its
    K captions, which gives the loss of encoding every image K times; a batch whose images were
    tiled instead (captions paired with the wrong images) gives another loss. Training runs."""
    from vision_attn.tasks.captioning import repeat_images

    vocab = ["<pad>", "<bos>", "<eos>", "<unk>", "a", "red", "circle", "square"]
    task = _task(vocab=vocab, decoder=replace(TINY_DECODER, embedding_memory=True)).eval()
    torch.manual_seed(0)
    images = torch.randn(2, 3, 32, 32)
    tokens = torch.tensor([[1, 4, 5, 6, 2], [1, 4, 7, 2, 0], [1, 4, 5, 7, 2], [1, 6, 2, 0, 0]])
    with torch.no_grad():
        enc = task.encode(images)
        repeated = repeat_images(enc, 2)
        assert repeated.tokens.shape[0] == 4 and repeated.embedding_tokens.shape[0] == 4
        once = task._caption_loss(repeated, tokens)
        each = task._caption_loss(task.encode(images.repeat_interleave(2, dim=0)), tokens)
        tiled = task._caption_loss(task.encode(images.repeat(2, 1, 1, 1)), tokens)
    assert torch.allclose(once, each, atol=1e-6) and not torch.allclose(once, tiled, atol=1e-4)
    assert repeat_images(enc, 1) is enc

    dm = _grounding_data(tmp_path, per_image=3)
    task = _task(training=CaptionTraining(grounding_weight=0.3))
    _trainer(tmp_path, max_steps=3, enable_checkpointing=False, limit_val_batches=0).fit(task, datamodule=dm)
    assert torch.isfinite(task.trainer.callback_metrics["train/loss"])

def test_grounding_without_instances_trains_on_captions(tmp_path, caplog):
    dm = _grounding_data(tmp_path)  # written here
    for path in (tmp_path / "data").glob("*/annotations/instances_train.json"):
        path.unlink()
    task = _task(training=CaptionTraining(grounding_weight=0.5))
    with caplog.at_level(logging.WARNING, logger="vision_attn"):
        _trainer(tmp_path, max_steps=2, enable_checkpointing=False, limit_val_batches=0).fit(task, datamodule=dm)
    assert task.grounding_head is None and "learns from the captions alone" in caplog.text
    with pytest.raises(ConfigError, match="grounding_weight"):
        _task(training=CaptionTraining(grounding_weight=-1.0))


def test_concept_vocabulary_and_targets_by_hand():
    from vision_attn.tasks.captioning import concept_targets, concept_vocabulary

    refs = [["a two above a zero", "a zero and a two"], ["a seven and a two"], ["a seven", "a seven and a one"],
            ["a one below a zero"]]
    # "a" is in all 4 images, "and" in 3: over half; "two", "zero", "seven", "one" in 2; "above"/"below" in 1
    assert concept_vocabulary(refs, 0.5) == ["above", "below", "one", "seven", "two", "zero"]
    assert concept_vocabulary(refs, 1.0) == ["a", "above", "and", "below", "one", "seven", "two", "zero"]
    table = concept_targets(refs, ["above", "one", "seven", "two", "zero"])
    expected = torch.tensor([[0.5, 0.0, 0.0, 1.0, 1.0],   # "above" in one of two captions; a word twice counts once
                             [0.0, 0.0, 1.0, 1.0, 0.0],
                             [0.0, 0.5, 1.0, 0.0, 0.0],
                             [0.0, 1.0, 0.0, 0.0, 1.0]])
    assert torch.allclose(table, expected)


def test_concept_loss_teaches_the_encoder_the_named_objects_without_boxes(tmp_path):
    """``concept_weight`` with captions alone (no instances file): the head learns from the
    images which caption words they show — its loss falls below that of predicting each word's
    frequency (the best an image-blind head can do), and far below it for some object word —
    and the head and its words come back from the checkpoint; a self-critical phase freezes it."""
    dm = _grounding_data(tmp_path)
    for path in (tmp_path / "data").glob("*/annotations/instances_*.json"):
        path.unlink()
    L.seed_everything(0)
    task = _task(optim=Optimization(lr=1e-2), training=CaptionTraining(concept_weight=1.0))
    trainer = _trainer(tmp_path, max_epochs=25, enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(task, datamodule=dm)
    words = task.hparams["training"]["concept_words"]
    assert {"circle", "square", "red", "blue"} <= set(words) and "a" not in words and "and" not in words
    assert task.concept_head.out_features == len(words) and task.grounding_head is None
    ds = dm.datasets["train"]
    items = [ds[i] for i in range(len(ds))]
    images = torch.stack([it[0] for it in items])
    indices = torch.tensor([it[2] for it in items])
    table = task.concept_table[indices]
    share = table.mean(0).clamp(1e-4, 1 - 1e-4)
    blind = F.binary_cross_entropy_with_logits(torch.logit(share).expand_as(table), table, reduction="none").mean(0)
    task.eval()
    with torch.no_grad():
        enc = task.encode(images)
        loss = task._concept_loss(enc, indices)
        patches = enc.tokens[:, enc.num_prefix_tokens:]
        scores = torch.logsumexp(task.concept_head(patches), 1) - math.log(patches.shape[1])
    per_word = F.binary_cross_entropy_with_logits(scores, table, reduction="none").mean(0)
    assert torch.isclose(per_word.mean(), loss)
    assert loss < blind.mean(), (float(loss), float(blind.mean()))
    kinds = [words.index(k) for k in ("circle", "square", "triangle", "star", "cross") if k in words]
    assert (per_word[kinds] / blind[kinds]).min() < 0.2, dict(zip(words, per_word.tolist(), strict=True))
    ckpt = tmp_path / "concept.ckpt"
    trainer.save_checkpoint(ckpt)
    loaded = load_task(ckpt, expected_task="captioning")
    assert loaded.hparams["training"]["concept_words"] == words
    assert torch.equal(loaded.concept_head.weight, task.concept_head.weight)
    scst = _task(training=CaptionTraining(init_from=str(ckpt)), scst=SCSTConfig(enabled=True, samples=2))
    assert scst.concept_head is not None and not any(p.requires_grad for p in scst.concept_head.parameters())
    with pytest.raises(ConfigError, match="concept_weight"):
        _task(training=CaptionTraining(concept_weight=float("nan")))
    with pytest.raises(ConfigError, match="concept_max_share"):
        _task(training=CaptionTraining(concept_max_share=0.0))


@pytest.mark.parametrize("switch", ["embedding_memory", "pixel_memory"])
def test_memory_extras_train_survive_checkpoints_and_are_explained(tmp_path, switch):
    """``embedding_memory`` / ``pixel_memory``: the encoder hands its embedding (pixel) tokens to
    the decoder; a checkpoint restores the switch (same captions), and the per-word relevance
    maps still come out."""
    from vision_attn.explain.decoder_relevance import caption_relevance

    dm = CaptioningDataModule(synthetic=TINY_DATA, cache_dir=str(tmp_path / "data"),
                              batching=Batching(batch_size=8, num_workers=0), captions=CaptionOptions(max_length=24))
    L.seed_everything(0)
    task = _task(optim=Optimization(lr=3e-3), decoder=replace(TINY_DECODER, **{switch: True}))
    trainer = _trainer(tmp_path, max_steps=6, enable_checkpointing=False, limit_val_batches=0)
    trainer.fit(task, datamodule=dm)
    flag, proj = {"embedding_memory": ("keep_embedding", "embedding_proj"),
                  "pixel_memory": ("keep_pixels", "pixel_proj")}[switch]
    assert getattr(task.encoder, flag) and getattr(task.head, proj) is not None
    assert getattr(task.head, proj)[0].weight.grad is not None  # trained
    ckpt = tmp_path / "em.ckpt"
    trainer.save_checkpoint(ckpt)
    loaded = load_task(ckpt, expected_task="captioning")
    assert getattr(loaded.encoder, flag) and loaded.hparams["decoder"][switch]
    images = torch.stack([dm.datasets["train"][i][0] for i in range(3)])
    task.eval()
    a, b = task.generate(images), loaded.generate(images)
    assert torch.equal(a.tokens, b.tokens)
    maps = caption_relevance(loaded, images, [t[:3] for t in b.tokens])
    assert [m.shape for m in maps] == [(3, 4, 4)] * 3 and all(torch.isfinite(m).all() for m in maps)


def test_idf_token_weights_by_hand():
    from vision_attn.tasks.captioning import idf_token_weights

    vocab = ["<pad>", "<bos>", "<eos>", "<unk>", "a", "two", "zero", "seven", "never"]
    refs = [["a two", "a zero"], ["a seven"], ["a two"], ["a seven a seven"]]
    # document frequency over the 4 images: a 4, two 2, zero 1, seven 2
    idf = {"a": 0.0, "two": math.log(2), "zero": math.log(4), "seven": math.log(2)}
    counts = {"a": 6, "two": 2, "zero": 1, "seven": 3}
    mean = sum(idf[w] * n for w, n in counts.items()) / sum(counts.values())
    w = idf_token_weights(refs, vocab, {2, 3}, 1.0)
    assert w[4].item() == pytest.approx(0.0)  # in every image's references: no weight at full strength
    assert w[5].item() == pytest.approx(math.log(2) / mean) and w[6].item() == pytest.approx(math.log(4) / mean)
    assert w[2].item() == 1.0 and w[3].item() == 1.0 and w[8].item() == 1.0  # special ids, unused words
    # the average target word keeps weight 1
    assert sum(w[vocab.index(t)].item() * n for t, n in counts.items()) / sum(counts.values()) == pytest.approx(1.0)
    half = idf_token_weights(refs, vocab, {2, 3}, 0.5)
    assert half[4].item() == pytest.approx(0.5) and half[6].item() == pytest.approx(0.5 + 0.5 * w[6].item())
    assert torch.equal(idf_token_weights(refs, vocab, {2, 3}, 0.0), torch.ones(len(vocab)))


def test_idf_weight_is_checked():
    with pytest.raises(ConfigError, match="idf_weight"):
        CaptionTraining(idf_weight=1.5)


def test_concept_loss_on_the_embedding_tokens_teaches_the_stem_only():
    """``concept_tokens='embedding'``: the concept head reads the tokens entering the first
    block, so its loss reaches the stem and not the blocks (``output``: both); a wrong value
    is refused."""
    refs = [["a red circle"], ["a blue square"]]
    grads = {}
    for where in ("embedding", "output"):
        task = _task(training=CaptionTraining(concept_weight=1.0, concept_tokens=where))
        task._build(["<pad>", "<bos>", "<eos>", "<unk>", "a", "red", "blue", "circle", "square"])
        words = concept_vocabulary(refs, 0.5)
        task.concept_head = task._concept_head(words)
        task.concept_table = concept_targets(refs, words)
        assert task.encoder.keep_embedding is (where == "embedding")
        task.encoder.keep_embedding = True  # the output variant ignores it
        loss = task._concept_loss(task.encode(torch.randn(2, 3, 32, 32)), torch.tensor([0, 1]))
        loss.backward()
        grads[where] = {name: p.grad is not None and bool(p.grad.abs().sum() > 0)
                        for name, p in task.encoder.named_parameters()}
    stem = [n for n in grads["embedding"] if "patch_embed" in n]
    blocks = [n for n in grads["embedding"] if ".blocks." in n]
    assert stem and blocks
    assert all(grads["embedding"][n] for n in stem) and not any(grads["embedding"][n] for n in blocks)
    assert all(grads["output"][n] for n in stem) and any(grads["output"][n] for n in blocks)
    with pytest.raises(ConfigError, match="concept_tokens"):
        CaptionTraining(concept_tokens="stem")
