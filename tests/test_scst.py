"""Self-critical sequence training (vision_attn.losses.scst, CaptioningTask(scst=True), init_from):
rewards, baselines and document frequencies computed by hand, the loss's sign and masking,
sampling from the decoder's softmax, starting from a cross-entropy checkpoint."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import lightning as L
import pytest
import torch

from vision_attn import create_encoder, load_task
from vision_attn.data.captioning import CaptioningDataModule, CaptionOptions
from vision_attn.data.loading import Batching
from vision_attn.data.synthetic import SceneSetConfig
from vision_attn.data.tokenizer import WordTokenizer, normalize_caption
from vision_attn.errors import CheckpointError, ConfigError
from vision_attn.losses.scst import baselines, sample_rewards, scst_loss, sequence_mask
from vision_attn.metrics.caption import CiderD, cider_d
from vision_attn.models.captioner import CaptionDecoder, DecoderConfig, GenerationOptions
from vision_attn.models.encoder import EncoderOutput
from vision_attn.tasks import CaptioningTask, ClassificationTask
from vision_attn.tasks.captioning import CaptionTraining, SCSTConfig

from .conftest import TINY_VIT

TINY_DATA = SceneSetConfig(image_size=32, num_train=16, num_val=4)
LOG2 = math.log(2.0)


# ---------------------------------------------------------------------- rewards, baselines, statistics
# Two images: image 0 has the references "a b" and "c d", image 1 has "c d".
TOY_REFS = [["a b", "c d"], ["c d"]]


def test_document_frequencies_by_hand():
    scorer = CiderD(TOY_REFS)
    # per n-gram, the number of *images* whose references hold it ("c d" is in both images)
    assert scorer.df == Counter({("a",): 1, ("b",): 1, ("a", "b"): 1, ("c",): 2, ("d",): 2, ("c", "d"): 2})
    assert scorer.log_images == pytest.approx(LOG2)
    # an n-gram in two references of one image counts once
    assert CiderD([["a a b", "a b"], ["b"]]).df == Counter({("a",): 1, ("b",): 2, ("a", "a"): 1, ("a", "b"): 1,
                                                          ("a", "a", "b"): 1})


def test_reward_and_baseline_of_two_captions_by_hand():
    """Image 0's sample "a b" and greedy caption "a": CIDEr-D against both of its references.

    IDF: a, b, (a b) -> log 2 - log 1 = log 2; c, d, (c d) -> log 2 - log 2 = 0 (in both
    images), so the reference "c d" has zero vectors and scores 0 for any caption.
    - "a b" vs "a b": unigram and bigram cosines 1, no 3- or 4-grams, equal lengths:
      mean over n = (1 + 1 + 0 + 0) / 4; over the two references (0.5 + 0) / 2; x 10 = 2.5.
    - "a" vs "a b": unigram cosine log2^2 / (log2 * sqrt(2) log2) = 1/sqrt(2), no bigram;
      length penalty exp(-(0 - 1)^2 / 72) (lengths in bigrams); 10 * (1/sqrt(2) e^(-1/72) / 4) / 2.
    """
    scorer = CiderD(TOY_REFS)
    sample, greedy_caption = "a b", "a"
    rewards = sample_rewards(scorer, [sample], TOY_REFS[:1])  # (1 image, 1 sample)
    assert rewards.shape == (1, 1)
    assert float(rewards[0, 0]) == pytest.approx(2.5, rel=1e-6)
    greedy_reward = 10 * (math.exp(-1 / 72) / math.sqrt(2) / 4) / 2
    greedy = sample_rewards(scorer, [greedy_caption], TOY_REFS[:1])[:, 0]
    assert float(greedy[0]) == pytest.approx(greedy_reward, rel=1e-6)
    base = baselines(rewards, "greedy", greedy)
    assert float(base[0, 0]) == pytest.approx(greedy_reward, rel=1e-6)
    # the sample beats the greedy caption: a positive advantage
    assert float(rewards[0, 0] - base[0, 0]) == pytest.approx(2.5 - greedy_reward, rel=1e-6)


def test_rewards_are_image_major_and_use_each_images_references():
    scorer = CiderD(TOY_REFS)
    # image 0: "a b", "a c"; image 1: "c d", "a b"
    rewards = sample_rewards(scorer, ["a b", "a c", "c d", "a b"], TOY_REFS)
    # "a c" vs "a b": unigram cosine (log2 * log2) / (log2 * sqrt(2) log2) (c's IDF is 0); vs "c d": 0
    assert rewards[0].tolist() == pytest.approx([2.5, 10 * (1 / math.sqrt(2) / 4) / 2], rel=1e-6)
    assert rewards[1].tolist() == pytest.approx([0.0, 0.0], abs=1e-9)  # IDF 0 for c, d; "a b" not in image 1
    with pytest.raises(ValueError, match="do not split evenly"):
        sample_rewards(scorer, ["a", "b", "c"], TOY_REFS)


def test_mean_baseline_leaves_the_sample_out():
    rewards = torch.tensor([[1.0, 2.0, 6.0], [0.0, 3.0, 3.0]])
    assert torch.allclose(baselines(rewards, "mean"), torch.tensor([[4.0, 3.5, 1.5], [3.0, 1.5, 1.5]]))
    with pytest.raises(ValueError, match="at least 2 samples"):
        baselines(rewards[:, :1], "mean")
    with pytest.raises(ValueError, match="unknown SCST baseline"):
        baselines(rewards, "beam")


def test_cider_scorer_equals_corpus_cider_d_with_the_same_references():
    hyps = {0: "a red circle", 1: "a blue square on the left", 2: "two red circles"}
    refs = {0: ["a red circle", "one red circle"], 1: ["a blue square left of a circle"],
            2: ["two circles both red", "two red circles", "a pair of red circles"]}
    _, per_image = cider_d(hyps, refs)
    scorer = CiderD(list(refs.values()))
    assert [scorer.score(hyps[i], refs[i]) for i in hyps] == [per_image[i] for i in hyps]


# ---------------------------------------------------------------------- the loss
def test_loss_masks_after_eos_and_does_not_differentiate_the_reward():
    logp = torch.tensor([[-1.0, -2.0, float("-inf")], [-0.5, -0.5, -0.5]], requires_grad=True)
    lengths = torch.tensor([2, 3])
    rewards = torch.tensor([3.0, 1.0], requires_grad=True)
    base = torch.tensor([1.0, 2.0])
    loss = scst_loss(logp, lengths, rewards, base)
    # -(mean of (r - b) * sum of the log-probs up to eos): -((2 * -3) + (-1 * -1.5)) / 2
    assert float(loss.detach()) == pytest.approx(-((2 * -3.0) + (-1 * -1.5)) / 2)
    loss.backward()
    assert torch.equal(sequence_mask(lengths, 3), torch.tensor([[True, True, False], [True, True, True]]))
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -1.0, 0.0], [0.5, 0.5, 0.5]]))
    assert rewards.grad is None  # detached: no gradient through the reward


def _toy_decoder(dropout: float = 0.0) -> tuple[CaptionDecoder, EncoderOutput]:
    torch.manual_seed(0)
    decoder = CaptionDecoder(vocab_size=9, in_dim=8, pad_id=0, config=DecoderConfig(hidden_dim=16, num_layers=2,
                                                                                    num_heads=2, mlp_ratio=2.0,
                                                                                    dropout=dropout, max_length=8))
    enc = EncoderOutput(torch.randn(2, 1 + 4, 8), 1, (2, 2))  # 2 images, a prefix token, 2x2 patches
    return decoder, enc


BOS, EOS = 1, 2


@pytest.mark.parametrize("better", [True, False])
def test_one_step_moves_the_samples_probability_with_the_advantage(better):
    """A sample better than the baseline gets its log-probability pushed up by one optimizer
    step on the SCST loss; a worse one gets it pushed down."""
    decoder, enc = _toy_decoder()
    sample = torch.tensor([[5, 6, EOS, 0], [7, EOS, 0, 0]])
    lengths = torch.tensor([3, 2])
    rewards = torch.tensor([2.0, 2.0]) if better else torch.tensor([0.0, 0.0])
    base = torch.tensor([1.0, 1.0])

    def sequence_logp() -> torch.Tensor:
        logp = decoder.token_logprobs(enc, sample, BOS)
        return torch.where(sequence_mask(lengths, 4), logp, 0.0).sum(1)

    before = sequence_logp().detach()
    opt = torch.optim.SGD(decoder.parameters(), lr=0.05)
    scst_loss(decoder.token_logprobs(enc, sample, BOS), lengths, rewards, base).backward()
    opt.step()
    after = sequence_logp().detach()
    assert ((after > before) if better else (after < before)).all(), (before, after)


def test_token_logprobs_ignore_what_follows_eos():
    decoder, enc = _toy_decoder()
    a = torch.tensor([[5, EOS, 0, 0]])
    b = torch.tensor([[5, EOS, 0, 0], [5, EOS, 0, 0]])
    la = decoder.token_logprobs(EncoderOutput(enc.tokens[:1], 1, (2, 2)), a, BOS)
    lb = decoder.token_logprobs(enc, b, BOS)
    assert torch.isfinite(la).all()  # padded positions read a finite entry (masked by the caller)
    assert torch.allclose(la[0, :2], lb[0, :2])  # causal: the prefix does not see what follows


# ---------------------------------------------------------------------- sampling
def test_samples_follow_the_softmax_and_their_scores_are_the_teacher_forced_logprobs():
    decoder, enc = _toy_decoder()
    decoder.eval()
    # the first token's empirical frequencies = the softmax without <bos> / <pad>
    gen = torch.Generator().manual_seed(0)
    n = 3000
    first = decoder.sample(EncoderOutput(enc.tokens[:1], 1, (2, 2)), BOS, EOS, num_samples=n, max_length=1,
                           generator=gen).tokens[:, 0]
    with torch.no_grad():
        logits = decoder(EncoderOutput(enc.tokens[:1], 1, (2, 2)), torch.tensor([[BOS]]))[0][0, 0]
    logits[[BOS, 0]] = float("-inf")
    expected = logits.softmax(-1)
    freq = torch.bincount(first, minlength=9).float() / n
    assert freq[[0, BOS]].sum() == 0
    assert torch.allclose(freq, expected, atol=0.03), (freq, expected)
    # batched rows, image-major; the cache changes nothing; scores = masked teacher-forced sums
    s = 4
    out = decoder.sample(enc, BOS, EOS, num_samples=s, max_length=6, generator=torch.Generator().manual_seed(1))
    slow = decoder.sample(enc, BOS, EOS, num_samples=s, max_length=6, use_cache=False,
                          generator=torch.Generator().manual_seed(1))
    assert out.tokens.shape[0] == 2 * s and torch.equal(out.tokens, slow.tokens)
    logp = decoder.token_logprobs(enc, out.tokens, BOS, repeats=s)
    mask = sequence_mask(out.lengths, out.tokens.shape[1])
    assert torch.allclose(torch.where(mask, logp, 0.0).sum(1), out.scores, atol=1e-5)
    ended = (out.tokens == EOS).any(1)
    assert torch.equal(out.lengths[ended], (out.tokens == EOS).float().argmax(1)[ended] + 1)
    assert (out.tokens[~mask] == 0).all()  # <pad> after <eos>


@pytest.mark.parametrize("temperature", [0.05, 0.1])  # the toy logits lie within +-0.1
def test_tempered_samples_follow_the_tempered_softmax(temperature):
    """``temperature`` T: first tokens drawn from softmax(logits / T) without <bos> / <pad>, and
    ``token_logprobs`` with the same T gives back the sampled captions' scores."""
    decoder, enc = _toy_decoder()
    decoder.eval()
    one = EncoderOutput(enc.tokens[:1], 1, (2, 2))
    n = 3000
    first = decoder.sample(one, BOS, EOS, num_samples=n, max_length=1, generator=torch.Generator().manual_seed(0),
                           temperature=temperature).tokens[:, 0]
    with torch.no_grad():
        logits = decoder(one, torch.tensor([[BOS]]))[0][0, 0]
    logits[[BOS, 0]] = float("-inf")
    expected = (logits / temperature).softmax(-1)
    assert not torch.allclose(expected, logits.softmax(-1), atol=0.03)  # the toy case tells them apart
    freq = torch.bincount(first, minlength=9).float() / n
    assert torch.allclose(freq, expected, atol=0.03), (freq, expected)
    out = decoder.sample(enc, BOS, EOS, num_samples=3, max_length=6, generator=torch.Generator().manual_seed(2),
                         temperature=temperature)
    logp = decoder.token_logprobs(enc, out.tokens, BOS, repeats=3, temperature=temperature)
    mask = sequence_mask(out.lengths, out.tokens.shape[1])
    assert torch.allclose(torch.where(mask, logp, 0.0).sum(1), out.scores, atol=1e-5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        decoder.sample(one, BOS, EOS, temperature=0.0)


# ---------------------------------------------------------------------- init_from
TINY_DECODER = DecoderConfig(hidden_dim=32, num_layers=2, num_heads=2, mlp_ratio=2.0, dropout=0.0, max_length=24)


def _task(vocab=None, **kw) -> CaptioningTask:
    torch.manual_seed(0)
    enc = create_encoder("vit_tiny_patch16_224", **TINY_VIT)
    return CaptioningTask(enc, vocab=vocab, **{"decoder": TINY_DECODER, **kw})


def _save(task, path) -> str:
    """A checkpoint as train.py writes it (weights and the vision_attn entry)."""
    torch.save({"state_dict": task.state_dict(), "vision_attn": task.checkpoint_meta()}, path)
    return str(path)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    dm = CaptioningDataModule(synthetic=TINY_DATA, cache_dir=str(tmp_path_factory.mktemp("scst") / "data"),
                              batching=Batching(batch_size=4, num_workers=0), captions=CaptionOptions(max_length=24))
    return dm


def test_init_from_loads_only_the_weights(data, tmp_path):
    source = _task(data.tokenizer.to_json())
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.01 * torch.randn_like(p))
    ckpt = _save(source, tmp_path / "ce.ckpt")
    # no vocab given: the checkpoint's
    task = _task(training=CaptionTraining(init_from=ckpt), scst=SCSTConfig(enabled=True))
    assert task.tokenizer.vocab == source.tokenizer.vocab and task.training
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), task.state_dict().values(),
                                                 strict=True))
    assert "init_from" not in task.checkpoint_meta()["model"]["init_args"]["training"]  # where a run started is not
    # the model


def test_init_from_refuses_another_task_vocabulary_or_architecture(data, tmp_path):
    enc = create_encoder("vit_tiny_patch16_224", **TINY_VIT)
    classifier = ClassificationTask(enc, class_names=["a", "b"])
    other_task = _save(classifier, tmp_path / "cls.ckpt")
    with pytest.raises(CheckpointError, match=r"holds a 'classification' model, not a captioning one"):
        _task(training=CaptionTraining(init_from=other_task))
    ckpt = _save(_task(data.tokenizer.to_json()), tmp_path / "ce.ckpt")
    other_vocab = WordTokenizer.train(["a completely different set of words"]).to_json()
    with pytest.raises(CheckpointError, match=r"not the one given in --model.vocab"):
        _task(other_vocab, training=CaptionTraining(init_from=ckpt))
    with pytest.raises(CheckpointError, match=r"model\.decoder\.hidden_dim=32, this model has 64"):
        _task(training=CaptionTraining(init_from=ckpt), decoder=replace(TINY_DECODER, hidden_dim=64))
    with pytest.raises(CheckpointError, match=r"model\.decoder\.pixel_memory=False, this model has True"):
        _task(training=CaptionTraining(init_from=ckpt), decoder=replace(TINY_DECODER, pixel_memory=True))
    with pytest.raises(CheckpointError, match=r"model\.encoder\.depth=2, this model has 3"):
        CaptioningTask(create_encoder("vit_tiny_patch16_224", **{**TINY_VIT, "depth": 3}),
                       decoder=DecoderConfig(hidden_dim=32, num_layers=2, num_heads=2, mlp_ratio=2.0, max_length=24),
                       training=CaptionTraining(init_from=ckpt))
    # a checkpoint trained on other captions: refused when training starts on these
    foreign = _save(_task(other_vocab), tmp_path / "foreign.ckpt")
    task = _task(training=CaptionTraining(init_from=foreign), scst=SCSTConfig(enabled=True))
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                        max_steps=1, default_root_dir=tmp_path, enable_checkpointing=False)
    with pytest.raises(CheckpointError, match=r"not the one the training captions give"):
        trainer.fit(task, datamodule=data)


def test_scst_options_are_checked():
    with pytest.raises(ConfigError, match=r"--model.scst.samples must be at least 2 with the mean baseline"):
        _task(scst=SCSTConfig(enabled=True, baseline="mean", samples=1))
    with pytest.raises(ConfigError, match=r"--model.scst.baseline must be greedy or mean"):
        _task(scst=SCSTConfig(enabled=True, baseline="beam"))
    with pytest.raises(ConfigError, match=r"--model.scst.max_length must be between 1 and decoder.max_length - 1 = 23"):
        _task(scst=SCSTConfig(enabled=True, max_length=24))
    with pytest.raises(ConfigError, match=r"--model.scst.temperature must be a number > 0"):
        _task(scst=SCSTConfig(enabled=True, temperature=0))


# ---------------------------------------------------------------------- a Lightning fit
def test_two_step_scst_fit_logs_reward_and_baseline(data, tmp_path):
    L.seed_everything(0)
    ce = _save(_task(data.tokenizer.to_json()), tmp_path / "ce.ckpt")
    task = _task(training=CaptionTraining(init_from=ce), scst=SCSTConfig(enabled=True, samples=3, max_length=12))
    before = {k: v.clone() for k, v in task.state_dict().items()}
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                        max_steps=2, limit_val_batches=0, default_root_dir=tmp_path, enable_checkpointing=False,
                        log_every_n_steps=1)
    trainer.fit(task, datamodule=data)
    metrics = trainer.callback_metrics
    assert {"train/reward_step", "train/baseline_step", "train/loss_step"} <= set(metrics)
    assert float(metrics["train/reward_step"]) >= 0.0 and math.isfinite(float(metrics["train/loss_step"]))
    assert any(not torch.equal(before[k], v) for k, v in task.state_dict().items())  # it trained
    # the statistics: once, from every reference of the training split, counted per image
    refs = [[normalize_caption(c) for c in caps] for caps in data.datasets["train"].references]
    df = Counter()
    for caps in refs:
        grams = set()
        for c in caps:
            w = c.split()
            grams |= {tuple(w[i : i + n]) for n in range(1, 5) for i in range(len(w) - n + 1)}
        df.update(grams)
    assert task.scst_cider.df == df and task.scst_cider.log_images == pytest.approx(math.log(len(refs)))
    # its checkpoint loads as an ordinary captioning model
    path = tmp_path / "scst.ckpt"
    trainer.save_checkpoint(path)
    assert load_task(path, expected_task="captioning").tokenizer.vocab == task.tokenizer.vocab


@pytest.mark.parametrize("kind", ["greedy", "mean"])
def test_training_step_rewards_samples_against_the_greedy_caption(data, kind):
    """The step's logged baseline is the reward of the greedy captions (decoded in eval mode,
    without constraints) against each image's training references, or the samples' mean."""
    task = _task(data.tokenizer.to_json(), scst=SCSTConfig(enabled=True, samples=3, max_length=10, baseline=kind),
                 # evaluation's constraints: not the baseline's
                 generate=GenerationOptions(min_length=3, repetition_penalty=2.0))
    data.setup("fit")
    task.scst_references = data.train_references()
    task.scst_cider = CiderD(task.scst_references)
    logged = {}
    task.log = lambda name, value, **kw: logged.__setitem__(name, float(torch.as_tensor(value).detach()))
    images, tokens, indices = next(iter(data.train_dataloader()))
    task.train()
    loss = task.training_step((images, tokens, indices), 0)
    assert loss.requires_grad and task.training and task.encoder.training  # modes restored after the greedy decode
    task.eval()
    with torch.no_grad():
        greedy = task.head.generate(task.encoder(images), task.tokenizer.bos_id, task.tokenizer.eos_id, 10, 1).tokens
    refs = [task.scst_references[i] for i in indices.tolist()]
    greedy_rewards = sample_rewards(task.scst_cider, task.decode(greedy), refs)
    if kind == "greedy":
        assert logged["train/baseline"] == pytest.approx(float(greedy_rewards.mean()), rel=1e-5)
    else:  # the leave-one-out means average to the mean reward
        assert logged["train/baseline"] == pytest.approx(logged["train/reward"], rel=1e-5)
    assert refs[0] == [normalize_caption(c) for c in data.datasets["train"].references[int(indices[0])]]


@pytest.mark.parametrize("keep_dropout", [False, True])
def test_scst_step_samples_without_dropout_unless_asked(data, keep_dropout):
    """``scst_dropout`` false (default): sampling and the log-probabilities run with every module
    in eval mode; true: in training mode. Either way the modes are restored after the step."""
    task = _task(data.tokenizer.to_json(), scst=SCSTConfig(enabled=True, samples=2, max_length=6, dropout=keep_dropout),
                 decoder=replace(TINY_DECODER, dropout=0.3))
    data.setup("fit")
    task.scst_references = data.train_references()
    task.scst_cider = CiderD(task.scst_references)
    task.log = lambda *a, **kw: None
    seen = []
    for name in ("sample", "token_logprobs"):
        original = getattr(task.head, name)

        def spy(*args, _original=original, **kw):
            seen.append((task.head.training, task.encoder.training))
            return _original(*args, **kw)

        setattr(task.head, name, spy)
    task.train()
    loss = task.training_step(next(iter(data.train_dataloader())), 0)
    assert loss.requires_grad
    assert seen == [(keep_dropout, keep_dropout)] * 2
    assert task.training and task.head.training and task.encoder.training


def test_scst_config_starts_from_a_cross_entropy_run(tmp_path):
    """configs/captioning/scst.yaml composes with the cross-entropy run's config and starts from
    its last.ckpt (weights only: the SCST run's epochs count from 0)."""
    from vision_attn.commands.train import train_main

    from .conftest import REPO

    enc = "--model.init_args.encoder.init_args."
    common = ["--config", str(REPO / "configs" / "captioning" / "shapes.yaml"),
              "--data.init_args.synthetic.num_train", "8", "--data.init_args.synthetic.num_val", "4",
              "--data.init_args.synthetic.image_size", "32", "--data.init_args.batching.num_workers", "0",
              "--data.init_args.batching.batch_size", "4", "--data.init_args.cache_dir", str(tmp_path / "data"),
              f"{enc}img_size", "32", f"{enc}embed_dim", "32", f"{enc}depth", "1", f"{enc}num_heads", "2",
              "--model.init_args.decoder.hidden_dim", "32", "--model.init_args.decoder.num_layers", "1",
              "--model.init_args.decoder.num_heads", "2", "--trainer.enable_progress_bar", "false",
              "--trainer.limit_val_batches", "0"]
    train_main([*common, "--trainer.max_steps", "1", "--trainer.default_root_dir", str(tmp_path / "ce")])
    ce = tmp_path / "ce" / "checkpoints" / "last.ckpt"
    cli = train_main([*common, "--config", str(REPO / "configs" / "captioning" / "scst.yaml"),
                      "--model.training.init_from", str(ce), "--model.scst.samples", "2",
                      "--model.scst.max_length", "8",
                      "--trainer.max_steps", "2", "--trainer.log_every_n_steps", "1",
                      "--trainer.default_root_dir", str(tmp_path / "scst")])
    assert cli.model.hparams["scst"]["enabled"] and cli.trainer.global_step == 2
    assert cli.model.optim.lr == pytest.approx(1e-4)
    assert cli.model.optim.encoder_lr is None  # not shapes.yaml's faster encoder: the whole model at 1e-4
    assert cli.model.hparams["scst"]["baseline"] == "mean" and cli.model.hparams["scst"]["temperature"] == 0.5
    header = (tmp_path / "scst" / "csv" / "version_0" / "metrics.csv").read_text().splitlines()[0]
    assert "train/reward_step" in header and "train/baseline_step" in header
