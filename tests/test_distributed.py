"""Distributed runs on CPU (2 processes, gloo) give the answers of one process.

Each task: a tiny checkpoint, then ``eval.py`` of it on 1 process (called in the test's own
process) and on 2 processes over a validation split whose size is odd (not divisible by the
process count): metrics equal, predictions equal, and equal to the validation metrics the training
logged; outputs written once, by rank 0. The classifier is trained by a 2-process DDP ``train.py``
run, as a user starts it (Lightning starts the second process); its run folder is written once,
and resuming continues the step count on 2 processes and then on 1. Training under DDP is the
tasks' shared base, so the detector and the captioner train in this process, with the batch of the
two processes together. The other 2-process runs start as ``torchrun`` starts them (every rank
launched from outside with its rank in the environment, the launch of several nodes): forked
from the test's process, so they pay no start-up.
"""

from __future__ import annotations

import csv
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from vision_attn.commands.evaluate import eval_main
from vision_attn.commands.train import train_main
from vision_attn.data.loading import UnpaddedDistributedSampler

from .conftest import REPO

DDP = ["--trainer.accelerator", "cpu", "--trainer.strategy", "ddp", "--trainer.enable_progress_bar", "false"]
ONE = ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.enable_progress_bar", "false"]
ENC = "--model.init_args.encoder.init_args."


@pytest.mark.parametrize(("size", "world"), [(5, 2), (6, 2), (7, 3), (1, 2)])
def test_unpadded_sampler_gives_every_index_once(size, world):
    parts = [list(UnpaddedDistributedSampler(range(size), num_replicas=world, rank=r)) for r in range(world)]
    assert sorted(i for p in parts for i in p) == list(range(size))
    lengths = [len(UnpaddedDistributedSampler(range(size), num_replicas=world, rank=r)) for r in range(world)]
    assert lengths == [len(p) for p in parts]


def _collectives(rank: int, world: int, init: str, out: str) -> None:
    from vision_attn.data.loading import make_loader
    from vision_attn.distributed import gather_objects, mean_across_processes

    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        mean = float(mean_across_processes(torch.tensor(float(rank + 1))))
        gathered = gather_objects([f"r{rank}"])
        loader = make_loader(list(range(5)), batch_size=2, train=False, num_workers=0)
        seen = gather_objects([int(i) for b in loader for i in b])
        Path(out, f"{rank}.json").write_text(json.dumps({"mean": mean, "gathered": gathered, "seen": seen}))
    finally:
        torch.distributed.destroy_process_group()


def test_collectives_and_eval_loader_under_two_processes(tmp_path):
    init = f"file://{tmp_path / 'store'}"
    # forked, not spawned: the children start with this process's imports
    mp.start_processes(_collectives, args=(2, init, str(tmp_path)), nprocs=2, join=True, start_method="fork")
    for rank in (0, 1):
        r = json.loads((tmp_path / f"{rank}.json").read_text())
        assert r["mean"] == 1.5 and r["gathered"] == ["r0", "r1"]
        assert sorted(r["seen"]) == [0, 1, 2, 3, 4]  # every image once, none repeated


def _run(args: list[str], cwd: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def _rank(rank: int, world: int, port: int, command: str, argv: list[str], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NODE_RANK="0", LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)  # as one process evaluated with one thread: the same sums, bit for bit
    {"train": train_main, "eval": eval_main}[command](argv)
    joined = torch.distributed.is_initialized()
    Path(out, f"rank{rank}.json").write_text(json.dumps(
        [torch.distributed.get_rank(), torch.distributed.get_world_size()] if joined else None))


def _launched_ranks(command: str, argv: list[str], tmp_path: Path, world: int = 2) -> None:
    """``train.py`` / ``eval.py`` with ``argv`` on ``world`` processes started from outside, as
    ``torchrun`` (or a cluster's scheduler) starts them: each rank forked from this process, its
    rank, the world size and the address of rank 0 in its environment."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / f"ranks-{port}"
    out.mkdir()
    mp.start_processes(_rank, args=(world, port, command, [*argv, "--trainer.devices", str(world)], str(out)),
                       nprocs=world, join=True, start_method="fork")
    # one process group of ``world`` ranks, not ``world`` runs of one process each
    assert [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)] == [[r, world] for r in range(world)]


def _last_val(run: Path, key: str) -> float:
    rows = [r for r in csv.DictReader((run / "csv" / "version_0" / "metrics.csv").open()) if r.get(key)]
    return float(rows[-1][key])


def _step(ckpt: Path) -> int:
    return int(torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"])


def _task_args(task: str, data: Path) -> tuple[str, list[str], list[str]]:
    """(config, data + model overrides for tiny runs, eval-only overrides)."""
    if task == "classification":
        from vision_attn.data.synthetic import ShapesConfig, ensure_shapes_classification

        root = ensure_shapes_classification(ShapesConfig(image_size=32, num_train=48, num_val=25, seed=5), data)
        common = ["--data.init_args.root", str(root), "--data.init_args.batching.batch_size", "4"]
        model = [f"{ENC}embed_dim", "32", f"{ENC}depth", "1", f"{ENC}num_heads", "2", f"{ENC}patch_size", "8"]
        return "classification/shapes.yaml", [*common, *model], ["--explain.faithfulness_images", "6"]
    synth = ["--data.init_args.synthetic.num_train", "24", "--data.init_args.synthetic.num_val", "9",
             "--data.init_args.synthetic.image_size", "32", "--data.init_args.cache_dir", str(data),
             "--data.init_args.batching.batch_size", "2"]
    group = "--model.init_args." + ("head" if task == "detection" else "decoder")
    model = [f"{ENC}img_size", "32", f"{ENC}embed_dim", "32", f"{ENC}depth", "1", f"{ENC}num_heads", "2",
             f"{group}.hidden_dim", "32", f"{group}.num_layers", "1", f"{group}.num_heads", "2"]
    if task == "detection":
        # one large object per scene and a higher learning rate, so that the checkpoint detects
        # (metrics compared across process counts must not all be near 0)
        easy = ["--data.init_args.synthetic.max_objects", "1", "--data.init_args.synthetic.min_size", "0.5",
                "--data.init_args.synthetic.max_size", "0.8", "--data.init_args.synthetic.noise", "0",
                "--data.init_args.synthetic.clutter", "0", "--model.init_args.head.num_queries", "4",
                "--model.init_args.optim.lr", "0.002"]
        return "detection/shapes.yaml", [*synth, *easy, *model], ["--explain.score_threshold", "0.0"]
    return "captioning/shapes.yaml", [*synth, *model], ["--generate.beam_size", "1"]


# the validation metric that training logs, and the eval.py metric it must equal
VAL_KEY = {"classification": ("val/acc_top1", "acc_top1"), "detection": ("val/map", "map"),
           "captioning": ("val/cider", "cider")}
# (validation images, batch size, training epochs) of each task's tiny run: rank 0 runs one more
# evaluation batch than rank 1, the case the unpadded sampler exists for
SIZES = {"classification": (25, 4, 2), "detection": (9, 2, 12), "captioning": (9, 2, 2)}


@pytest.mark.parametrize("task", sorted(SIZES))
def test_the_ranks_run_an_unequal_number_of_evaluation_batches(task):
    n, batch, _ = SIZES[task]
    batches = [math.ceil(len(UnpaddedDistributedSampler(range(n), num_replicas=2, rank=r)) / batch) for r in (0, 1)]
    assert batches[0] == batches[1] + 1


@pytest.mark.parametrize("task", ["classification", "detection", "captioning"])
def test_two_process_training_and_evaluation_match_one_process(task, tmp_path):
    config, tiny, eval_only = _task_args(task, tmp_path / "data")
    common = ["--config", str(REPO / "configs" / config), "--data.init_args.batching.num_workers", "0", *tiny]
    run = tmp_path / "run"
    epochs = SIZES[task][2]
    schedule = ["--trainer.max_epochs", str(epochs), "--trainer.check_val_every_n_epoch", str(epochs),
                "--trainer.default_root_dir", str(run)]
    if task == "classification":
        _run([str(REPO / "train.py"), *common, *DDP, "--trainer.devices", "2", *schedule], tmp_path)
    else:  # one process, the batch of two (the same steps)
        train_main([*common, *ONE, *schedule, "--data.init_args.batching.batch_size", str(2 * SIZES[task][1])])

    # one config, one log version, one last checkpoint (under DDP: written by rank 0 alone)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml", "csv", "tensorboard"]
    assert [p.name for p in (run / "csv").iterdir()] == ["version_0"]
    assert [p.name for p in (run / "tensorboard").iterdir()] == ["version_0"]
    ckpt = run / "checkpoints" / "last.ckpt"
    steps = _step(ckpt)
    logged = [int(r["step"]) for r in csv.DictReader((run / "csv" / "version_0" / "metrics.csv").open())]
    assert steps > 0 and steps == max(logged) + 1  # last.ckpt is the final state, not the best epoch's

    from vision_attn.tasks.base import TASKS

    task_files = sorted(TASKS[task].eval_file_names)  # per_class.json etc., next to metrics.json
    results = {}
    for n in (1, 2):
        out = tmp_path / f"eval{n}"
        args = [*common, "--ckpt_path", str(ckpt), "--output_dir", str(out), "--explain.num_overlays", "3",
                "--explain.mistakes", "0", *eval_only]
        if n == 1:  # one process, as a user without DDP runs it: in this process (no start-up to pay)
            threads = torch.get_num_threads()
            torch.set_num_threads(1)  # as each of the two ranks: the same sums, bit for bit
            try:
                eval_main([*args, *ONE])
            finally:
                torch.set_num_threads(threads)
        else:
            _launched_ranks("eval", [*args, *DDP], tmp_path)
        files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
        browser = ["mistakes.html"]  # every mistake, with its map
        assert [f for f in files if not f.startswith("overlays/")] == sorted(
            ["metrics.json", "predictions.json", "report.html", *browser, *task_files])
        assert len([f for f in files if f.startswith("overlays/")]) == 3  # written once, by rank 0
        results[n] = (json.loads((out / "metrics.json").read_text()),
                      json.loads((out / "predictions.json").read_text()),
                      {name: json.loads((out / name).read_text()) if name.endswith(".json") else
                       (out / name).read_text() for name in task_files})

    (m1, p1, f1), (m2, p2, f2) = results[1], results[2]
    if task == "classification":  # per image: the same predictions, scores up to float32 noise
        r1, r2 = f1.pop("results_per_image.json"), f2.pop("results_per_image.json")
        del f1["results_per_image.csv"], f2["results_per_image.csv"]
        assert [{k: v for k, v in r.items() if "score" not in k} for r in r1] == [
            {k: v for k, v in r.items() if "score" not in k} for r in r2]
        assert [r["score"] for r in r1] == pytest.approx([r["score"] for r in r2], abs=1e-5)
    if task == "detection":  # per image the same matches (the detections' order and last digits may differ)
        r1, r2 = f1.pop("results_per_image.json"), f2.pop("results_per_image.json")
        del f1["results_per_image.csv"], f2["results_per_image.csv"]

        def outcomes(entry: dict) -> tuple:
            return (entry["image_id"], sorted(t["outcome"] for t in entry["truths"]),
                    sorted(d["outcome"] for d in entry["detections"]))

        assert [outcomes(e) for e in r1] == [outcomes(e) for e in r2]
    assert f1 == f2  # per-class (and per-image) results do not depend on the process count
    assert m1.keys() == m2.keys()
    exact = task != "captioning"
    for k in m1:
        assert m2[k] == (m1[k] if exact else pytest.approx(m1[k], abs=1e-6)), k
    if task == "classification":  # labels equal; scores up to float32 batch-composition noise
        assert [(p["file"], p["pred"]) for p in p1] == [(p["file"], p["pred"]) for p in p2]
        assert [p["score"] for p in p1] == pytest.approx([p["score"] for p in p2], abs=1e-5)
    elif task == "captioning":
        assert p1 == p2
    else:
        assert len(p1) == len(p2) and {p["image_id"] for p in p1} == {p["image_id"] for p in p2}
    if task == "detection":
        assert m1["map_50"] > 0.1, m1  # a checkpoint that detects: equal metrics are not both ~0
    val_key, eval_key = VAL_KEY[task]
    assert _last_val(run, val_key) == pytest.approx(m1[eval_key], abs=1e-6)  # validation in training == eval.py

    if task != "classification":
        return  # training and resuming under DDP are the tasks' shared base (VisionTask + the CLI): proved once
    # resume: on 2 processes, then on 1; the step count, optimizer and schedule continue
    _launched_ranks("train", [*common, *DDP, "--trainer.max_epochs", str(epochs * 3 // 2),
                              "--trainer.default_root_dir", str(run), "--ckpt_path", "last"], tmp_path)
    assert _step(ckpt) == steps * 3 // 2
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert state["lr_schedulers"][0]["last_epoch"] == steps * 3 // 2
    assert state["optimizer_states"][0]["state"]  # Adam moments carried over
    train_main([*common, *ONE, "--trainer.max_epochs", "4", "--trainer.default_root_dir", str(run),
                "--ckpt_path", "last"])
    assert _step(ckpt) > steps * 3 // 2  # one process: twice the steps per epoch from here on
    assert (run / "config.resume-1.yaml").is_file()


def test_bf16_trainer_config_composes_and_trains(tmp_path):
    """``--config configs/trainer/bf16.yaml`` on top of a task config (CPU autocast here)."""
    from vision_attn.data.synthetic import ShapesConfig, ensure_shapes_classification

    root = ensure_shapes_classification(ShapesConfig(image_size=32, num_train=32, num_val=8, seed=5), tmp_path / "data")
    cli = train_main(["--config", str(REPO / "configs" / "classification" / "shapes.yaml"),
                      "--config", str(REPO / "configs" / "trainer" / "bf16.yaml"),
                      "--data.init_args.root", str(root), "--data.init_args.batching.num_workers", "0",
                      "--data.init_args.batching.batch_size", "16", f"{ENC}embed_dim", "32", f"{ENC}depth", "1",
                      f"{ENC}num_heads", "2", f"{ENC}patch_size", "8", "--trainer.max_epochs", "1",
                      "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
                      "--trainer.default_root_dir", str(tmp_path / "run")])
    assert cli.trainer.precision == "bf16-mixed"
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()
