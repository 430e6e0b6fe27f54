"""Optimisation settings: layer-wise learning-rate decay, the optimiser and scheduler a config
chooses (``--optimizer``, ``--lr_scheduler``), the EMA of the weights, and format-1 checkpoints
(optimisation settings among the task's arguments) that still load."""

from __future__ import annotations

import logging

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from vision_attn import create_encoder, load_task
from vision_attn.checkpoint_io import SafeCheckpointIO, load_checkpoint_file
from vision_attn.data.classification import ImageFolderDataModule
from vision_attn.data.loading import Batching
from vision_attn.errors import ConfigError
from vision_attn.models.classifier import ClassifierConfig
from vision_attn.models.detr import DETRConfig
from vision_attn.tasks import ClassificationTask, DetectionTask
from vision_attn.tasks.optim import (
    EMAWeights,
    Optimization,
    WarmupCosineSchedule,
    build_optimizers,
    ema_callbacks,
    no_weight_decay_names,
    param_groups,
)

from .conftest import TINY_VIT


def _classifier(class_names: list[str] | None = ("a", "b", "c"), **optim) -> ClassificationTask:
    torch.manual_seed(0)
    return ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT),
                              class_names=None if class_names is None else list(class_names),
                              optim=Optimization(**optim))


def _lr_and_decay_by_name(task, groups, lr: str = "lr") -> dict[str, tuple[float, float]]:
    names = {id(p): n for n, p in task.named_parameters()}
    out = {names[id(p)]: (g[lr], g["weight_decay"]) for g in groups for p in g["params"]}
    assert len(out) == len(names) == sum(len(g["params"]) for g in groups)  # each parameter once
    return out


# ---------------------------------------------------------------------- layer-wise decay
def test_layer_decay_scales_each_encoder_layer_by_hand():
    task = _classifier(lr=1e-3, encoder_lr=1e-4, weight_decay=0.1, layer_decay=0.5)
    got = _lr_and_decay_by_name(task, param_groups(task, task.optim))
    # depth 2: layer 0 = embeddings (0.5 ** 3), blocks.0 = 1 (0.5 ** 2), blocks.1 = 2 (0.5),
    # final norm = 3 (1); the head keeps lr
    def expected_lr(name: str) -> float:
        if name.startswith("head."):
            return 1e-3
        rest = name.removeprefix("encoder.model.")
        if rest.startswith(("cls_token", "pos_embed", "patch_embed.")):
            return 1e-4 * 0.125
        if rest.startswith("blocks.0."):
            return 1e-4 * 0.25
        if rest.startswith("blocks.1."):
            return 1e-4 * 0.5
        assert rest.startswith("norm."), name
        return 1e-4

    no_decay = no_weight_decay_names(task)
    for name, (lr, wd) in got.items():
        assert lr == pytest.approx(expected_lr(name)), name
        assert wd == (0.0 if name in no_decay else 0.1), name


@pytest.mark.parametrize(("name", "classifiers"), [
    ("vit_tiny_patch16_224", ("head",)),
    ("deit_tiny_distilled_patch16_224", ("head", "head_dist")),
    ("vit_little_patch16_reg4_gap_256", ("head",)),  # with fc_norm: the encoder's (pooled features' norm)
])
@pytest.mark.parametrize("layer_decay", [None, 0.5])
def test_timm_head_classifier_learns_at_the_head_lr(name, classifiers, layer_decay):
    """``head='timm'``: the classifier lives in the encoder (``encoder.model.head``, and
    ``head_dist`` of a distilled DeiT) but is a head: ``lr``, not ``encoder_lr``, and no layer
    decay; everything else of the encoder (``fc_norm`` included) gets ``encoder_lr``."""
    torch.manual_seed(0)
    encoder = create_encoder(name, **TINY_VIT, num_classes=3)
    optim = Optimization(lr=1e-3, encoder_lr=1e-4, weight_decay=0.1, layer_decay=layer_decay)
    task = ClassificationTask(encoder, num_classes=3, optim=optim, head=ClassifierConfig(kind="timm"))
    got = _lr_and_decay_by_name(task, param_groups(task, task.optim))
    heads = [n for n in got if n.startswith(tuple(f"encoder.model.{c}." for c in classifiers))]
    assert len(heads) == 2 * len(classifiers)  # weight and bias of each classifier
    assert (name == "vit_little_patch16_reg4_gap_256") == any(n.startswith("encoder.model.fc_norm.") for n in got)
    for n, (lr, wd) in got.items():
        if n in heads:
            assert lr == pytest.approx(1e-3), n
            assert wd == (0.1 if n.endswith(".weight") else 0.0), n
        elif layer_decay is None:
            assert lr == pytest.approx(1e-4), n
        else:  # depth 2: at most 1e-4 (final norm, fc_norm: layer 3, factor 1), down to 1e-4 * 0.5 ** 3
            assert 1e-4 * 0.125 * (1 - 1e-9) <= lr <= 1e-4 * (1 + 1e-9), n


def _todays_groups(task, optim):
    """The grouping before layer decay existed: (encoder?, decayed?) in order of first appearance."""
    no_decay = no_weight_decay_names(task)
    groups: dict[tuple[bool, bool], list] = {}
    for name, p in task.named_parameters():
        if p.requires_grad:
            groups.setdefault((name.startswith("encoder."), name not in no_decay), []).append(p)
    return [([id(p) for p in ps], optim.encoder_lr if (enc and optim.encoder_lr is not None) else optim.lr,
             optim.weight_decay if dec else 0.0) for (enc, dec), ps in groups.items()]


@pytest.mark.parametrize("optim", [dict(lr=2e-3), dict(lr=2e-3, encoder_lr=3e-4, weight_decay=0.2)])
def test_no_layer_decay_gives_exactly_the_old_groups(optim):
    for task in (_classifier(**optim),
                 DetectionTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), class_names=["a", "b"],
                               optim=Optimization(**optim), head=DETRConfig(hidden_dim=16, num_layers=1, num_heads=2,
                                                                            num_queries=4))):
        groups = param_groups(task, task.optim)
        assert [([id(p) for p in g["params"]], g["lr"], g["weight_decay"]) for g in groups] == \
            _todays_groups(task, task.optim)
        assert all(set(g) == {"params", "lr", "weight_decay"} for g in groups)
        # layer_decay 1 splits the encoder by layer but changes no parameter's lr or decay
        same = param_groups(task, Optimization(**optim, layer_decay=1.0))
        assert _lr_and_decay_by_name(task, same) == _lr_and_decay_by_name(task, groups)


def test_layer_decay_needs_a_vit_with_blocks_and_settings_are_checked():
    task = _classifier(layer_decay=0.7)
    task.encoder.model = torch.nn.Linear(2, 2)  # an encoder without transformer blocks
    with pytest.raises(ConfigError, match="layer_decay"):
        param_groups(task, task.optim)
    for bad in (dict(layer_decay=0.0), dict(layer_decay=1.5), dict(ema_decay=1.0), dict(ema_start_step=-1)):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            Optimization(**bad)


# ---------------------------------------------------------------------- --optimizer / --lr_scheduler
def test_default_is_adamw_with_the_per_step_warmup_cosine():
    task = _classifier(lr=1e-3, encoder_lr=1e-4)
    out = build_optimizers(task, task.optim, 100)
    assert type(out["optimizer"]) is torch.optim.AdamW
    assert isinstance(out["lr_scheduler"]["scheduler"], WarmupCosineSchedule)
    assert out["lr_scheduler"]["interval"] == "step"
    peaks = [g["initial_lr"] for g in out["optimizer"].param_groups]  # before the warmup factor
    assert peaks == [g["lr"] for g in param_groups(task, task.optim)]


def test_fused_adamw_takes_the_same_steps_as_the_loop_up_to_rounding():
    """``optim.fused``: torch's fused AdamW, the same groups and the same update (to rounding)
    as the default per-parameter loop, which stays the default. One step: after it the weights
    differ by rounding, and Adam's normalised update turns the rounding noise of gradients
    that are zero in exact arithmetic (the key bias) into full-size steps."""
    assert Optimization().fused is False
    loop, fused = _classifier(lr=1e-2), _classifier(lr=1e-2, fused=True)  # the same seed
    opts = [build_optimizers(t, t.optim, 100)["optimizer"] for t in (loop, fused)]
    assert not opts[0].param_groups[0]["fused"] and opts[1].param_groups[0]["fused"]
    start = {n: p.detach().clone() for n, p in loop.named_parameters()}
    x = torch.randn(4, 3, 32, 32)
    for task, opt in zip((loop, fused), opts, strict=True):
        task(x).logsumexp(-1).sum().backward()
        opt.step()
    for (name, a), b in zip(loop.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=name)
    assert max(float((p - start[n]).abs().max()) for n, p in loop.named_parameters()) > 1e-5  # it moved


def test_sgd_from_optimizer_init_gets_the_groups_of_optim(caplog):
    task = _classifier(lr=1e-2, encoder_lr=1e-3, weight_decay=0.1)
    spec = {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.5, "momentum": 0.9, "nesterov": True}}
    with caplog.at_level(logging.WARNING, logger="vision_attn.tasks.optim"):
        out = build_optimizers(task, task.optim, 100, optimizer_init=spec)
    assert "--optimizer.lr=0.5 is not used" in caplog.text
    opt = out["optimizer"]
    assert type(opt) is torch.optim.SGD
    peaks = _lr_and_decay_by_name(task, opt.param_groups, lr="initial_lr")  # before the warmup factor
    assert peaks == _lr_and_decay_by_name(task, param_groups(task, task.optim))
    assert all(g["momentum"] == 0.9 and g["nesterov"] for g in opt.param_groups)
    caplog.clear()  # SGD's own defaults, as LightningCLI's parser fills them in, are no request
    with caplog.at_level(logging.WARNING, logger="vision_attn.tasks.optim"):
        build_optimizers(task, task.optim, 100, optimizer_init={"class_path": "torch.optim.SGD",
                                                                "init_args": {"lr": 1e-3, "weight_decay": 0.0}})
    assert "is not used" not in caplog.text
    sched = out["lr_scheduler"]  # no --lr_scheduler: the warmup-cosine of optim, per step
    assert isinstance(sched["scheduler"], WarmupCosineSchedule) and sched["interval"] == "step"


def test_reduce_on_plateau_watches_the_monitor():
    task = _classifier()
    # a metric of the user's choice, with its mode (torch's class has no monitor argument)
    plateau = {"class_path": "torch.optim.lr_scheduler.ReduceLROnPlateau",
               "init_args": {"factor": 0.5, "monitor": "val/acc_top5", "mode": "max"}}
    out = build_optimizers(task, task.optim, 10, lr_scheduler_init=plateau, monitor="val/loss", monitor_mode="min")
    config = out["lr_scheduler"]
    assert type(out["optimizer"]) is torch.optim.AdamW
    assert config["monitor"] == "val/acc_top5" and config["interval"] == "epoch"
    assert config["scheduler"].mode == "max" and config["scheduler"].factor == 0.5
    # LightningCLI's own ReduceLROnPlateau takes the monitor as an argument
    cli = {"class_path": "lightning.pytorch.cli.ReduceLROnPlateau", "init_args": {"monitor": "val/loss"}}
    config = build_optimizers(task, task.optim, 10, lr_scheduler_init=cli)["lr_scheduler"]
    assert config["monitor"] == "val/loss" and config["scheduler"].monitor == "val/loss"
    # the task's own metric (accuracy: larger is better) with the parser's default mode "min"
    parsed = {"class_path": "torch.optim.lr_scheduler.ReduceLROnPlateau", "init_args": {"mode": "min"}}
    config = build_optimizers(task, task.optim, 10, lr_scheduler_init=parsed, monitor="val/acc_top1",
                              monitor_mode="max")["lr_scheduler"]
    assert config["monitor"] == "val/acc_top1" and config["scheduler"].mode == "max"


class _RecordLR(Callback):
    def __init__(self) -> None:
        self.lrs: list[tuple[int, list[float]]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.lrs.append((trainer.current_epoch, [g["lr"] for g in optimizer.param_groups]))


def test_step_lr_from_lr_scheduler_init_steps_per_epoch(shapes_root, tmp_path):
    task = _classifier(class_names=None, lr=0.1, encoder_lr=0.01)  # the head is built from the data
    task.optimizer_init = {"class_path": "torch.optim.SGD", "init_args": {"momentum": 0.9}}
    task.lr_scheduler_init = {"class_path": "torch.optim.lr_scheduler.StepLR",
                              "init_args": {"step_size": 1, "gamma": 0.5}}
    record = _RecordLR()
    trainer = L.Trainer(max_epochs=3, limit_train_batches=2, limit_val_batches=0, num_sanity_val_steps=0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[record])
    trainer.fit(task, datamodule=ImageFolderDataModule(root=str(shapes_root), batching=Batching(batch_size=8,
                                                                                                num_workers=0)))
    assert isinstance(trainer.optimizers[0], torch.optim.SGD)
    assert len(record.lrs) == 6
    for epoch, lrs in record.lrs:  # constant within an epoch, halved at each epoch's end
        assert sorted(set(lrs)) == pytest.approx([0.01 * 0.5 ** epoch, 0.1 * 0.5 ** epoch])


# ---------------------------------------------------------------------- EMA of the weights
def _weights(module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


class _RecordWeights(Callback):
    """The raw weights after each optimizer step, at the first batch of each fit and in validation."""

    def __init__(self) -> None:
        self.after_step: list[dict[str, torch.Tensor]] = []
        self.at_start: dict[str, torch.Tensor] | None = None
        self.in_validation: dict[str, torch.Tensor] | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.at_start is None:
            self.at_start = _weights(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.after_step.append(_weights(pl_module))

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.in_validation = _weights(pl_module)


def _ema(trajectory: list[dict[str, torch.Tensor]], decay: float, start: int) -> dict[str, torch.Tensor]:
    avg = None
    for step, w in enumerate(trajectory, start=1):
        avg = dict(w) if avg is None or step <= start else {k: decay * avg[k] + (1 - decay) * w[k] for k in w}
    return avg


def _ema_fit(root, tmp, decay, start, max_epochs=1, ckpt=None):
    torch.manual_seed(0)
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT),
                              optim=Optimization(lr=5e-3, warmup_fraction=0.0, ema_decay=decay, ema_start_step=start))
    record = _RecordWeights()
    every = ModelCheckpoint(dirpath=tmp / "ck", filename="{epoch}", save_top_k=-1, every_n_epochs=1)
    trainer = L.Trainer(max_epochs=max_epochs, limit_train_batches=3, limit_val_batches=1, num_sanity_val_steps=0,
                        logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp,
                        callbacks=[record, every], plugins=[SafeCheckpointIO()])
    trainer.fit(task, datamodule=ImageFolderDataModule(root=str(root), batching=Batching(batch_size=8, num_workers=0)),
                ckpt_path=ckpt)
    return task, record, tmp / "ck" / f"epoch={max_epochs - 1}.ckpt"


def _assert_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=k)


@pytest.fixture(scope="module")
def ema_run(shapes_root, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ema")
    return tmp, *_ema_fit(shapes_root, tmp, decay=0.5, start=0)


def test_ema_weights_are_validated_saved_and_loaded(ema_run):
    _, task, record, ckpt = ema_run
    assert [type(c) for c in ema_callbacks(task.optim)] == [EMAWeights] and ema_callbacks(Optimization()) == []
    raw = record.after_step
    assert len(raw) == 3
    expected = _ema(raw, 0.5, 0)  # by hand: a1 = w1, a2 = (a1 + w2) / 2, a3 = (a2 + w3) / 2
    _assert_close(expected, {k: (raw[0][k] + raw[1][k]) / 4 + raw[2][k] / 2 for k in raw[0]})
    assert any(not torch.equal(expected[k], raw[2][k]) for k in raw[2])  # the average is not the weights
    _assert_close(record.in_validation, expected)  # validation ran on the average
    _assert_close(_weights(task), expected)  # and the task holds it after fit
    saved = load_checkpoint_file(ckpt)  # weights_only
    _assert_close(saved["state_dict"], expected)
    _assert_close(saved["current_model_state"], raw[2])
    loaded = load_task(ckpt, expected_task="classification")
    _assert_close(_weights(loaded), expected)


def test_ema_resume_continues_the_raw_weights_and_the_average(ema_run, shapes_root):
    tmp, _, first, ckpt = ema_run
    _, record, _ = _ema_fit(shapes_root, tmp / "resumed", decay=0.5, start=0, max_epochs=2, ckpt=str(ckpt))
    _assert_close(record.at_start, first.after_step[-1])  # training goes on from the raw weights
    assert len(record.after_step) == 3
    _assert_close(record.in_validation, _ema(first.after_step + record.after_step, 0.5, 0))


def test_ema_start_step_keeps_the_weights_until_then(shapes_root, tmp_path):
    task, record, _ = _ema_fit(shapes_root, tmp_path, decay=0.25, start=2)
    expected = _ema(record.after_step, 0.25, 2)  # a1 = w1, a2 = w2, a3 = 0.25 a2 + 0.75 w3
    _assert_close(expected, {k: 0.25 * record.after_step[1][k] + 0.75 * record.after_step[2][k]
                             for k in expected})
    _assert_close(_weights(task), expected)


def test_ema_refuses_sharded_strategies():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    ema = EMAWeights(0.9)
    with pytest.raises(ConfigError, match="sharded strategy"):
        ema.setup(SimpleNamespace(strategy=FSDPStrategy()), _classifier(), "fit")
    ema.setup(SimpleNamespace(strategy=DDPStrategy()), _classifier(), "fit")  # replicated weights: fine


# ---------------------------------------------------------------------- format-1 checkpoints
def test_format_1_checkpoint_with_flat_optimisation_arguments_still_loads(ema_run, tmp_path):
    _, _, _, ckpt = ema_run
    current = load_task(ckpt)
    raw = load_checkpoint_file(ckpt)
    meta = raw["vision_attn"]
    assert meta["format"] == 3 and "optim" in meta
    old = {k: v for k, v in meta.items() if k != "optim"}
    old["format"] = 1
    old["model"] = {**meta["model"], "init_args": {**meta["model"]["init_args"], "lr": 5e-3, "encoder_lr": None,
                                                   "weight_decay": 0.05, "warmup_fraction": 0.0,
                                                   "min_lr_ratio": 0.01}}
    path = tmp_path / "format1.ckpt"
    torch.save({**raw, "vision_attn": old}, path)
    loaded = load_task(path, expected_task="classification")
    assert type(loaded) is ClassificationTask and loaded.class_names == current.class_names
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), current(x), rtol=0, atol=0)
