"""Captioning explanations at evaluation time: localisation in original pixels, word
faithfulness curves (against the classifier's per-image reference), saved maps."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from vision_attn import create_encoder
from vision_attn.data.captioning import CaptioningDataModule, CaptionOptions
from vision_attn.data.imageio import read_image
from vision_attn.data.loading import Batching
from vision_attn.data.synthetic import SceneSetConfig
from vision_attn.explain.captioning import (
    _split_boxes,
    teacher_forced_word_maps,
    word_probability_curves,
    write_caption_overlays,
)
from vision_attn.explain.evaluate import ExplainOptions
from vision_attn.explain.faithfulness import deletion_insertion_curve
from vision_attn.explain.sanity import model_cascade, spearman
from vision_attn.models.captioner import DecoderConfig, GenerationOptions
from vision_attn.tasks import CaptioningTask

TINY_DATA = SceneSetConfig(image_size=32, num_train=24, num_val=4)


@pytest.fixture(scope="module")
def captioner(tmp_path_factory):
    """An untrained tiny captioner on the embedded scenes' validation split, whose boxes are
    renamed after each image's generated caption (its last word), so the captions name objects
    without a slow training; returns ``(task, val dataset, {image id: caption words})``."""
    tmp = tmp_path_factory.mktemp("capexplain")
    dm = CaptioningDataModule(synthetic=TINY_DATA, cache_dir=str(tmp / "data"),
                              batching=Batching(batch_size=8, num_workers=0), captions=CaptionOptions(max_length=8))
    torch.manual_seed(0)
    enc = create_encoder("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    task = CaptioningTask(enc, decoder=DecoderConfig(hidden_dim=32, num_layers=2, num_heads=2, mlp_ratio=2.0,
                                                     dropout=0.0, max_length=8),
                          generate=GenerationOptions(beam_size=1))
    dm.prepare_data()
    task.build_from_data(dm)
    task.configure_datamodule(dm)
    dm.setup("validate")
    task.eval()
    val = dm.datasets["val"]
    with torch.no_grad():
        tokens = task.generate(torch.stack([val[i][0] for i in range(len(val))])).tokens
    words = {im["id"]: task.tokenizer.decode_words(row.tolist()) for im, row in zip(val.images, tokens, strict=True)}
    path = val.root / "annotations" / f"instances_{val.split}.json"
    data = json.loads(path.read_text())
    names = sorted({w[-1] for w in words.values() if w})
    data["categories"] = [{"id": k + 1, "name": name} for k, name in enumerate(names)]
    for a in data["annotations"]:
        a.pop("colour", None)
        a["category_id"] = names.index(words[a["image_id"]][-1]) + 1 if words[a["image_id"]] else 0
    path.write_text(json.dumps(data))
    return task, val, words


def _options(**kw) -> ExplainOptions:
    return ExplainOptions(methods=["relevance", "attention"], num_overlays=1, steps=4, batch_size=3, report=False,
                          **kw)


def test_eval_metrics_and_saved_maps(captioner, tmp_path):
    task, val, words = captioner
    metrics = write_caption_overlays(task, val, _options(save_maps=True), tmp_path)
    methods = ("relevance", "attention", "random")
    keys = {f"{k}_{m}" for m in methods for k in ("pointing", "energy", "deletion_auc", "insertion_auc")}
    assert keys <= set(metrics)
    assert {"pointing_acc", "pointing_acc_random", "pointing_words", "deletion_auc", "insertion_auc",
            "explain_words", "explain_images"} <= set(metrics)
    assert metrics["explain_images"] == len(val)
    assert metrics["pointing_words"] == sum(w.count(w[-1]) for w in words.values() if w) > 0  # the object words
    assert metrics["pointing_acc"] == metrics["pointing_attention"]  # the old names, one more version
    assert metrics["pointing_acc_random"] == metrics["pointing_random"]
    assert metrics["deletion_auc"] == metrics["deletion_auc_relevance"]  # the first method asked for
    assert all(0.0 <= metrics[k] <= 1.0 for k in keys)  # probabilities, not log-probabilities
    # the same words are measured and saved (boxes known: the object words)
    assert metrics["explain_words"] == metrics["pointing_words"]
    index = json.loads((tmp_path / "maps" / "index.json").read_text())
    assert len(index) == metrics["pointing_words"]
    assert [e["index"] for e in index] == list(range(len(index)))
    boxes = _split_boxes(val)
    ids = [im["id"] for im in val.images]
    for entry in index:
        i = ids.index(entry["file"])  # "file": the image_id, as in predictions.json
        assert entry["image_index"] == i
        assert any(entry["word"] in names for names, _ in boxes[entry["file"]])  # a word naming an object
        h, w = read_image(val.image_path(i)).shape[:2]
        for m in methods:
            arr = np.load(tmp_path / "maps" / m / f"{entry['index']:05d}.npy")
            assert arr.dtype == np.float32 and arr.shape == (h, w)
    assert len(list((tmp_path / "overlays").glob("*.png"))) == 1


def test_without_faithfulness_only_localisation(captioner, tmp_path):
    task, val, _ = captioner
    metrics = write_caption_overlays(task, val, _options(faithfulness=False, faithfulness_images=2), tmp_path)
    assert "pointing_relevance" in metrics and "energy_random" in metrics
    assert not any(k.startswith(("deletion", "insertion")) for k in metrics)
    assert metrics["explain_images"] == 2
    assert not (tmp_path / "maps").exists()


@pytest.mark.parametrize("mode", ["deletion", "insertion"])
def test_word_curves_match_a_per_word_reference(captioner, mode):
    """The batched word curves equal, word by word, the classifier's curve function fed the
    word's probability distribution (teacher-forced on the caption) as its 'class' scores."""
    task, val, _ = captioner
    images = torch.stack([val[i][0] for i in range(2)])
    tokens = [torch.tensor([5, 7, 9]), torch.tensor([6, 8])]
    items = [(0, 0), (0, 2), (1, 1)]
    sal = torch.rand(len(items), 4, 4, generator=torch.Generator().manual_seed(1))
    got = word_probability_curves(task, images, tokens, items, sal, mode, steps=4, chunk=5)
    assert got.shape == (3, 5)
    bos = task.tokenizer.bos_id
    for r, (b, t) in enumerate(items):
        prefix = torch.cat([torch.tensor([bos]), tokens[b][:t]])[None]  # (1, t + 1)

        def proba(x, prefix=prefix, t=t):
            return task(x, prefix.expand(len(x), -1))[:, t].float().softmax(-1)

        ref = deletion_insertion_curve(proba, images[b : b + 1], sal[r : r + 1], tokens[b][t : t + 1], mode, 4)
        torch.testing.assert_close(got[r], ref[0], rtol=1e-5, atol=1e-6)
    # the shared first and last points give the same curves with two model calls fewer per row
    from vision_attn.explain.captioning import word_end_probabilities
    from vision_attn.explain.faithfulness import order_ends

    shared = word_end_probabilities(task, images, tokens, items, chunk=2)
    assert set(shared) == {"image", "zero", "blur"} and shared["image"].shape == (3,)
    calls = []
    hook = task.register_forward_pre_hook(lambda module, args: calls.append(len(args[0])))
    try:
        inner = word_probability_curves(task, images, tokens, items, sal, mode, steps=4, chunk=5,
                                        ends=order_ends(shared, mode))
    finally:
        hook.remove()
    assert sum(calls) == 3 * 3  # 3 words x the 3 inner points
    torch.testing.assert_close(inner, got, rtol=1e-5, atol=1e-6)
    assert word_end_probabilities(task, images, tokens, [])["image"].shape == (0,)


@pytest.mark.parametrize("beam_size", [1, 3])
def test_teacher_forced_maps_equal_the_generation_maps(captioner, beam_size):
    """The sanity check's teacher-forced maps of the trained model are the maps the overlays
    drew from the generation (greedy and beam search), so only the weights can change them."""
    task, val, _ = captioner
    images = torch.stack([val[i][0] for i in range(3)])
    task.beam_size = beam_size
    try:
        explained = task.explain_batch(images, [np.zeros((32, 32, 3), np.uint8)] * 3, _options())
    finally:
        task.beam_size = 1
    tokens = [e.extras["tokens"] for e in explained]
    assert sum(len(t) for t in tokens) > 0
    from vision_attn.explain.captioning import CAPTION_RULE

    maps = teacher_forced_word_maps(task, images, tokens, ["attention", "relevance"], rule=CAPTION_RULE)
    for b, e in enumerate(explained):
        for m in ("attention", "relevance"):
            torch.testing.assert_close(maps[m][b], e.extras["maps"][m].float(), rtol=1e-5, atol=1e-5)
    full = teacher_forced_word_maps(task, images, tokens, ["relevance"], rule="full")["relevance"]
    same = all(torch.allclose(a, b) for a, b in zip(full, maps["relevance"], strict=True))
    assert CAPTION_RULE != "full" and not same


def test_sanity_correlations(captioner, tmp_path):
    """--explain.sanity: per method the mean Spearman correlation over the measured words between
    the trained and the fully randomised model's maps, equal to a per-word recomputation."""
    task, val, _ = captioner
    options = _options(sanity=True, faithfulness=False)
    metrics = write_caption_overlays(task, val, options, tmp_path)
    assert metrics["sanity_random"] == pytest.approx(1.0)  # the baseline ignores the model
    curves = json.loads((tmp_path / "sanity.json").read_text())
    assert curves["steps"] == ["head", "block0", "all"]  # the decoder, then the encoder (depth 1)
    # reference: the object words of every image, trained vs fully randomised model, one by one
    from vision_attn.explain.captioning import named_words
    from vision_attn.explain.sanity import StandIn

    boxes = _split_boxes(val)
    images = torch.stack([val[i][0] for i in range(len(val))])
    explained = task.explain_batch(images, [np.zeros((32, 32, 3), np.uint8)] * len(val), options)
    *_, (step, encoder, head) = model_cascade(task.encoder, task.head, seed=options.seed)
    from vision_attn.explain.captioning import CAPTION_RULE

    randomised = teacher_forced_word_maps(StandIn(encoder, head, tokenizer=task.tokenizer), images,
                                          [e.extras["tokens"] for e in explained], ["attention", "relevance"],
                                          rule=CAPTION_RULE)
    for m in ("attention", "relevance"):
        rhos = []
        for b, e in enumerate(explained):
            for t, _ in named_words(e.extras["words"], boxes.get(val.images[b]["id"], [])):
                rhos.append(float(spearman(e.extras["maps"][m][t][None].float(), randomised[m][b][t][None])))
        assert rhos and metrics[f"sanity_{m}"] == pytest.approx(sum(rhos) / len(rhos), abs=1e-5)
        assert metrics[f"sanity_{m}"] < 0.99  # the maps depend on the weights
    # --explain.sanity_cascade false: the fully randomised model only, the same numbers
    (tmp_path / "full").mkdir()
    alone = write_caption_overlays(task, val, _options(sanity=True, sanity_cascade=False, faithfulness=False),
                                   tmp_path / "full")
    assert json.loads((tmp_path / "full" / "sanity.json").read_text())["steps"] == ["all"]
    assert {k: v for k, v in alone.items() if k.startswith("sanity_")} == pytest.approx(
        {k: v for k, v in metrics.items() if k.startswith("sanity_")}, abs=1e-9)


PINNED = {  # the default relevance rule of the caption head (CAPTION_RULE, "decoder")
    "sanity_relevance": -0.0656035173607664, "sanity_attention": 0.18314479638009046, "sanity_random": 1.0,
    "pointing_relevance": 0.15384615384615385, "energy_relevance": 0.1722763162081441,
    "pointing_attention": 0.23076923076923078, "energy_attention": 0.17141144710302514,
    "pointing_random": 0.13942307692307693, "energy_random": 0.1808644229840219, "pointing_acc": 0.23076923076923078,
    "pointing_acc_random": 0.13942307692307693, "pointing_words": 26.0,
    "deletion_auc_relevance": 0.028298219236043785, "insertion_auc_relevance": 0.03071497667294282,
    "deletion_auc_attention": 0.028466310638647813, "insertion_auc_attention": 0.03064876450942113,
    "deletion_auc_random": 0.028749425823871907, "insertion_auc_random": 0.030596761749340937,
    "deletion_auc": 0.028298219236043785, "insertion_auc": 0.03071497667294282, "explain_words": 26.0,
    "explain_images": 4.0,
}
PINNED_OUTPUTS = {
    "sanity": {"relevance/head": 0.0031674208144796354, "relevance/block0": 0.0049773755656108715,
               "relevance/all": -0.0656035173607664, "attention/head": 0.03484162895927601,
               "attention/block0": 0.03540723981900452, "attention/all": 0.18314479638009046, "random/head": 1.0,
               "random/block0": 1.0, "random/all": 1.0},
    "maps": {"attention": 20654.92862200737, "random": 13235.859479511157, "relevance": 16244.541163735092},
}


def test_explanation_numbers_are_pinned(captioner, tmp_path):
    """Localisation (random: the mean of its draws), faithfulness, sanity and saved maps of the
    object words, in two batches: every number in its order, the sanity curves and the saved
    maps keep their values."""
    from .test_measures import assert_pinned, explanation_outputs

    task, val, _ = captioner
    metrics = write_caption_overlays(task, val, _options(save_maps=True, sanity=True), tmp_path)
    assert_pinned(metrics, PINNED)
    outputs = explanation_outputs(tmp_path)
    assert [e["index"] for e in outputs["index"]] == list(range(26))
    assert_pinned(outputs["sanity"], PINNED_OUTPUTS["sanity"])
    assert outputs["maps"] == pytest.approx(PINNED_OUTPUTS["maps"], rel=1e-5)


def test_each_head_has_its_measured_default_and_a_given_order_wins():
    from vision_attn.explain.captioning import CAPTION_DEFAULTS
    from vision_attn.explain.detection import DETECTION_DEFAULTS, decoder_methods
    from vision_attn.explain.evaluate import DEFAULT_METHODS

    default = ExplainOptions()
    assert default.methods == list(DEFAULT_METHODS) and default.methods_default
    assert decoder_methods(default) == ["lrp_attention", "attention"] == list(DETECTION_DEFAULTS)
    assert decoder_methods(default, CAPTION_DEFAULTS) == ["lrp_attention", "attention"] == list(CAPTION_DEFAULTS)

    class Pool(torch.nn.Module):  # an attention module AttnLRP has no rule for
        fused_attn = True

    assert decoder_methods(default, model=torch.nn.Sequential(torch.nn.Linear(2, 2))) == ["lrp_attention",
                                                                                          "attention"]
    assert decoder_methods(default, model=torch.nn.Sequential(Pool())) == ["relevance", "attention"]
    both = ExplainOptions()
    both.methods_default, both.methods = True, ["lrp", "lrp_attention", "attention"]
    assert decoder_methods(both, ("lrp", "lrp_attention", "attention"),
                           model=torch.nn.Sequential(Pool())) == ["relevance", "attention"]
    given = ExplainOptions(methods=["rollout", "attention", "relevance"])
    assert not given.methods_default
    assert decoder_methods(given) == decoder_methods(given, CAPTION_DEFAULTS) == ["attention", "relevance"]
    assert decoder_methods(ExplainOptions(methods=["rollout"]), CAPTION_DEFAULTS) == ["attention"]


def test_grounded_positions_leave_out_words_that_name_nothing():
    from vision_attn.explain.captioning import grounded_positions

    words = "there are a red circle and two squares above the cross in a picture".split()
    assert [words[t] for t in grounded_positions(words)] == ["red", "circle", "two", "squares", "above", "cross", "in",
                                                             "picture"]
    frame = "a picture of a dog by a framed photo and a close up of a cat".split()  # only the frames go
    assert [frame[t] for t in grounded_positions(frame)] == ["dog", "by", "framed", "photo", "cat"]
    assert grounded_positions(["a", "the", "of"]) == [0, 1, 2]  # nothing else: every word
    assert grounded_positions([]) == []


def test_without_boxes_the_grounded_words_are_measured_and_saved(captioner, tmp_path, monkeypatch):
    """A split without an instances file: faithfulness and saved maps over every generated word
    that can name something (not "a", "the", "of", ...), no localisation numbers."""
    import vision_attn.explain.captioning as explain_captioning
    from vision_attn.explain.captioning import UNGROUNDED_WORDS, grounded_positions

    task, val, words = captioner
    monkeypatch.setattr(explain_captioning, "_split_boxes", lambda dataset, masks=None: None)
    metrics = write_caption_overlays(task, val, _options(save_maps=True), tmp_path)
    assert not any(k.startswith(("pointing", "energy")) for k in metrics)
    expected = [[w[t] for t in grounded_positions(w)] for w in words.values()]
    assert metrics["explain_words"] == sum(map(len, expected)) > 0
    assert metrics["explain_words"] < sum(map(len, words.values()))  # the untrained captions say "a" too
    index = json.loads((tmp_path / "maps" / "index.json").read_text())
    assert [e["word"] for e in index] == [w for ws in expected for w in ws]
    assert any(w in UNGROUNDED_WORDS for ws in words.values() for w in ws)  # there was something to leave out


def test_masks_of_the_named_objects_score_each_word(captioner, tmp_path, monkeypatch):
    """With masks in the instances file (here each box's rectangle), every measured word's maps
    are scored against the masks of the objects it names: the numbers equal a recomputation from
    the saved maps."""
    import vision_attn.explain.captioning as explain_captioning
    from vision_attn.data.masks import image_mask
    from vision_attn.explain.captioning import named_words
    from vision_attn.explain.segmentation import SegmentationScores

    task, val, _ = captioner
    plain = explain_captioning._split_boxes
    sizes = {im["id"]: (im["height"], im["width"]) for im in val.images}

    def with_masks(dataset, masks=None):
        boxes = plain(dataset)
        if masks is not None:
            for image_id, objects in boxes.items():
                h, w = sizes[image_id]
                masks[image_id] = [(box, image_mask([[box[0], box[1], box[2], box[1], box[2], box[3], box[0], box[3]]],
                                                    h, w)) for _, box in objects]
        return boxes

    monkeypatch.setattr(explain_captioning, "_split_boxes", with_masks)
    metrics = write_caption_overlays(task, val, _options(save_maps=True, faithfulness=False), tmp_path)
    boxes = plain(val)
    reference = SegmentationScores()
    for entry in json.loads((tmp_path / "maps" / "index.json").read_text()):
        own = named_words([entry["word"]], boxes[entry["file"]])[0][1]
        h, w = sizes[entry["file"]]
        masks = [image_mask([[b[0], b[1], b[2], b[1], b[2], b[3], b[0], b[3]]], h, w).decode() for b in own]
        reference.update({m: np.load(tmp_path / "maps" / m / f"{entry['index']:05d}.npy")
                          for m in ("relevance", "attention")}, masks)
    expected = reference.compute()
    assert expected and reference.count == metrics["pointing_words"]
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-6), key
    assert {"miou_random", "pixel_acc_random", "map_mask_random"} <= set(metrics)
