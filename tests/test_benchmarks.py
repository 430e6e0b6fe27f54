"""The benchmarks run (on tiny sizes); their numbers are reported, not asserted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from benchmarks.explain_overhead import run
from benchmarks.results_json import column_name, validate
from vision_attn.data.loading import Batching
from vision_attn.models.captioner import DecoderConfig

PAIR_COLUMNS = ["pair", "ratio", "goal", "met", "detail"]
"""The columns of the performance tables of pairs (suite, predict loop)."""


def results_file(path: Path, columns: list[str]) -> dict:
    """The content of the results file a benchmark wrote at ``path``, checked: it follows the
    schema of the documentation's results pages and has ``columns``."""
    data = json.loads(path.read_text(encoding="utf-8"))
    assert validate(data) == []
    assert [column_name(c) for c in data["columns"]] == columns
    return data


def test_explain_overhead_runs_tiny():
    r = run("vit_tiny_patch16_224", img=32, batch=2, repeats=1, patch_size=8, depth=2, embed_dim=32, num_heads=2)
    assert set(r["median_s"]) == {"forward", "forward_capture", "rollout"}
    assert r["capture_over_forward"] > 0 and r["rollout_over_forward"] > 0


def test_caption_kv_cache_runs_tiny():
    from benchmarks.caption_kv_cache import run as run_cache

    r = run_cache(tokens=6, batch=2, beam=2, hidden=16, layers=1, heads=2, vocab=20, grid=2, in_dim=8, repeats=1)
    assert r["same_tokens"] and r["speedup"] > 0 and set(r["median_s"]) == {"cached", "uncached"}


def test_benchmark_suite_runs_tiny_and_reports_every_pair(tmp_path):
    from benchmarks.suite import format_table, run_all, write_json

    result = run_all(quick=True)
    pairs = [r["pair"] for r in result["rows"]]
    assert len(pairs) == 12 and len(set(pairs)) == 12
    assert all(r["ratio"] > 0 and isinstance(r["met"], bool) for r in result["rows"])
    assert format_table(result).count("\n") == 13
    command = "python -m benchmarks.suite --json docs/results/performance_suite.json"
    data = results_file(write_json(tmp_path / "suite.json", result, command), PAIR_COLUMNS)
    assert data["page"] == "performance" and data["command"] == command
    assert [row[0] for row in data["rows"]] == pairs and all(isinstance(row[3], bool) for row in data["rows"])


def test_cpu_paths_switches_really_switch(monkeypatch):
    """Each side of a row runs what it names: the explicit path never calls the fused kernel and
    the fused side always does; PyTorch's defaults hand the stem's first convolution a plain
    (not channels-last) tensor."""
    import torch.nn.functional as F

    import benchmarks.cpu_paths as cp

    calls = []
    fused = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or fused(*a, **k))
    attend = cp.attention_call(2, 2, 12, 12, 8)  # short: the suite's own choice is the explicit path
    for explicit, expected in ((True, 0), (False, 1)):
        calls.clear()
        with cp.attention_path(explicit):
            attend()
        assert len(calls) == expected
    calls.clear()
    attend()
    assert calls == []  # restored on exit: the shipped choice again
    enc = cp.create_encoder("vit_tiny_patch16_224", **dict(cp.CAPTIONER_ENCODER, img_size=32, embed_dim=32, depth=1,
                                                            num_heads=2))
    stem = next(m for m in enc.modules() if isinstance(m, cp.ConvStem))
    layouts = []
    stem.layers[0].register_forward_pre_hook(
        lambda m, args: layouts.append(args[0].is_contiguous(memory_format=torch.channels_last)))
    x = torch.randn(2, 3, 32, 32)
    stem(x)
    with cp.pytorch_defaults():
        stem(x)
    stem(x)
    assert layouts == [True, False, True]


def test_cpu_paths_table_runs_tiny(tmp_path):
    from benchmarks.cpu_paths import ATTENTION_SHAPES, run, write_json

    result = run(quick=True, compile_encoder=False)
    changes = [r["change"] for r in result["rows"]]
    assert len(changes) == len(set(changes)) == len(ATTENTION_SHAPES) + 13
    for r in result["rows"]:
        assert r["with"] > 0 and r["without"] > 0 and r["ratio"] == pytest.approx(r["with"] / r["without"])
    command = "python -m benchmarks.cpu_paths --json docs/results/performance_cpu.json"
    data = results_file(write_json(tmp_path / "cpu.json", result, command),
                        ["change", "unit", "with", "without", "with / without", "used"])
    assert data["page"] == "performance" and [row[0] for row in data["rows"]] == changes
    assert data["machine"]["cpu"] and data["machine"]["cpu"] != "not recorded"


def test_explanations_table_of_tiny_checkpoints(tmp_path, shapes_root, capsys, monkeypatch):
    """``python -m benchmarks.explanations`` on a classifier, a detector and a captioner trained
    here for one or two epochs: one table with a row per task and method, the metrics of
    eval.py, ``—`` where a task has none, the best method per column, and the results file."""
    from benchmarks.explanations import COLUMNS, main, task_methods
    from vision_attn.commands.train import train_main

    from .conftest import REPO

    enc = "--model.init_args.encoder.init_args."
    quiet = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    small = [f"{enc}embed_dim", "32", f"{enc}depth", "1", f"{enc}num_heads", "2"]
    def decoder(group: str) -> list[str]:
        return [f"--model.init_args.{group}.hidden_dim", "32", f"--model.init_args.{group}.num_layers", "1",
                f"--model.init_args.{group}.num_heads", "2"]

    ckpts = {}
    train_main(["--config", str(REPO / "configs" / "classification" / "shapes.yaml"),
                "--data.init_args.root", str(shapes_root), "--data.init_args.batching.num_workers", "0",
                "--data.init_args.batching.batch_size", "16", *small, f"{enc}patch_size", "8",
                "--trainer.max_epochs", "1",
                *quiet, "--trainer.default_root_dir", str(tmp_path / "cls")])
    ckpts["classification"] = tmp_path / "cls" / "checkpoints" / "last.ckpt"
    # the captioner gets a few steps: pointing needs captions that name an object of the image
    for task, n_train, extra, epochs in (("detection", 8, [*decoder("head"), "--model.init_args.head.num_queries",
                                                           "4"], 1),
                                         ("captioning", 8, [*decoder("decoder"),
                                                            "--data.init_args.batching.batch_size", "4",
                                                            "--model.init_args.optim.lr", "0.003",
                                                            # 50 steps of a width-32 model: the plain MLP
                                                            # names objects sooner than the local one
                                                            f"{enc}local_mlp", "false"], 25)):
        train_main(["--config", str(REPO / "configs" / task / "shapes.yaml"),
                    "--data.init_args.synthetic.num_train", str(n_train), "--data.init_args.synthetic.num_val", "3",
                    "--data.init_args.synthetic.image_size", "32", "--data.init_args.batching.num_workers", "0",
                    "--data.init_args.cache_dir", str(tmp_path / "data"), f"{enc}img_size", "32", *small,
                    *extra, "--trainer.max_epochs", str(epochs), *quiet,
                    "--trainer.default_root_dir", str(tmp_path / task)])
        ckpts[task] = tmp_path / task / "checkpoints" / "last.ckpt"
    out = tmp_path / "explanations.json"
    args = [a for task, c in ckpts.items() for a in (f"--{task}", str(c))]
    import vision_attn.commands.evaluate as evaluate_command

    calls, real_eval = [], evaluate_command.eval_main
    monkeypatch.setattr(evaluate_command, "eval_main", lambda argv: calls.append(argv) or real_eval(argv))
    capsys.readouterr()
    result = main([*args, "--images", "2", "--score_threshold", "0", "--json", str(out),
                   "--work_dir", str(tmp_path / "eval"), "--heldout", "detection", str(ckpts["detection"])])
    table = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("|")]
    assert table[0] == ("| task | method | pointing ↑ | energy ↑ | miou ↑ | deletion ↓ | insertion ↑ | road ↑ | saco ↑ "
                        "| sanity →0 |")
    assert len(table) == 2 + (7 + 1) + 3 * (5 + 1)  # header, rule, methods and a best row per task
    assert table[2].startswith("| classification | rollout | ")
    assert table[-1].startswith("| detection, held out | **best** |")
    data = results_file(out, ["task", "method", "pointing", "energy", "mIoU", "deletion AUC", "insertion AUC", "ROAD",
                              "SaCo", "sanity (Spearman)"])
    assert data["page"] == "explanations" and data["command"].startswith("python -m benchmarks.explanations --")
    assert [row[:2] for row in data["rows"]] == [[task, method] for task, entry in result["tasks"].items()
                                                 for method in entry["methods"]]
    assert list(result["tasks"]) == ["classification", "detection", "captioning", "detection, held out"]
    # curves of 9 points (--steps 8, the default) and the sanity check's fully randomised model only
    assert len(calls) == 4 and result["steps"] == 8 and "curves of 9 points" in data["description"]
    for argv in (f" {' '.join(a)} " for a in calls):
        assert " --explain.steps 8 " in argv and " --explain.sanity_cascade false " in argv
    for folder in (tmp_path / "eval").iterdir():
        assert json.loads((folder / "sanity.json").read_text())["steps"] == ["all"], folder
    # the decoder's AttnLRP at other resolutions: the shipped setting's row equals the table's lrp
    from benchmarks import lrp_cells
    from vision_attn.explain import lrp_decoder

    cells = lrp_cells.main([str(ckpts["detection"]), "--images", "2", "--cells", "1", "4", "--score_threshold", "0",
                            "--own_query", "--steps", "8", "--json", str(tmp_path / "cells.json")])
    assert [row[:3] for row in cells] == [[1, False, False], [1, True, False], [1, True, True], [4, False, False],
                                          [4, True, False], [4, True, True]]
    shipped = result["tasks"]["detection"]["methods"]["lrp"]
    assert cells[4][3:8] == [shipped[c] for c in ("pointing", "energy", "miou", "deletion", "insertion")]
    assert cells[0][3:8] != cells[4][3:8] and lrp_decoder.CELLS == 4  # another map; the setting put back
    # (the tiny one-layer head's other queries read no pixels: the own-query row may equal the shipped
    # one here; tests/test_lrp_decoder.py checks what the option changes)
    assert all(v is not None for v in cells[5][3:8]) and not lrp_decoder.OWN_QUERY
    results_file(tmp_path / "cells.json", [c if isinstance(c, str) else c["name"] for c in lrp_cells.COLUMNS])
    # the same checkpoint on the same data: the held-out rows repeat the detection rows
    assert result["tasks"]["detection, held out"]["methods"] == result["tasks"]["detection"]["methods"]
    assert task_methods("classification") == ["rollout", "relevance", "attention", "gradcam", "lrp", "lrp_attention",
                                              "random"]
    assert task_methods("detection") == task_methods("captioning") == ["attention", "relevance", "lrp",
                                                                        "lrp_attention", "random"]
    for entry in result["tasks"].values():
        task = entry["task"]
        assert list(entry["methods"]) == task_methods(task)
        for method, values in entry["methods"].items():
            for col, (prefix, _) in COLUMNS.items():  # exactly what eval returned, None where it has no key
                assert values[col] == entry["metrics"].get(f"{prefix}_{method}")
    cls = result["tasks"]["classification"]
    # the embedded shapes data has boxes and outlines: every column is measured for the classifier
    assert all(v is not None for values in cls["methods"].values() for v in values.values())
    # the decoder heads have no ROAD or SaCo
    assert all(v["road"] is None and v["saco"] is None for v in result["tasks"]["detection"]["methods"].values())
    # the rank agreement of each pair of measures, from the rows
    from benchmarks.explanations import rank_agreement
    assert cls["agreement"] == rank_agreement(cls["methods"]) and cls["agreement"]["pointing"]["energy"] is not None
    assert "Kendall's tau" in " ".join(data["notes"])
    assert cls["methods"]["random"]["sanity"] == pytest.approx(1.0)  # the baseline ignores the model
    pointing = {m: round(v["pointing"], 3) for m, v in cls["methods"].items()}
    assert cls["best"]["pointing"] == [m for m, v in pointing.items() if v == max(pointing.values())]
    deletion = {m: round(v["deletion"], 3) for m, v in cls["methods"].items()}
    assert cls["best"]["deletion"] == [m for m, v in deletion.items() if v == min(deletion.values())]
    assert result["tasks"]["detection"]["methods"]["relevance"]["deletion"] is not None
    assert result["tasks"]["captioning"]["methods"]["attention"]["pointing"] is not None


def test_explanations_best_per_column_as_printed_and_dashes_for_missing_metrics():
    from benchmarks.explanations import best_methods, format_table, task_rows

    metrics = {"pointing_attention": 0.5, "pointing_relevance": 0.9, "pointing_random": 0.90004,
               "deletion_auc_attention": 0.2, "deletion_auc_relevance": 0.1, "deletion_auc_random": 0.3,
               "sanity_attention": 0.7, "sanity_relevance": -0.2, "sanity_random": 1.0, "bleu4": 0.3}
    rows = task_rows("detection", metrics)
    assert rows["relevance"] == {"pointing": 0.9, "energy": None, "miou": None, "deletion": 0.1, "insertion": None,
                                 "road": None, "saco": None, "sanity": -0.2}
    best = best_methods(rows)
    # a tie as printed (3 decimals) names both; deletion: lowest; sanity: closest to 0; no value: none
    assert best == {"pointing": ["relevance", "random"], "energy": [], "miou": [], "deletion": ["relevance"],
                    "insertion": [], "road": [], "saco": [], "sanity": ["relevance"]}
    table = format_table({"tasks": {"detection": {"methods": rows, "best": best}}}).splitlines()
    assert table[3] == "| detection | relevance | 0.900 | — | — | 0.100 | — | — | — | -0.200 |"
    assert table[-1] == "| detection | **best** | relevance / random | — | — | relevance | — | — | — | relevance |"


def test_rank_agreement_orients_each_measure_and_counts_pairs_by_hand():
    from benchmarks.explanations import AGREEMENT, rank_agreement

    rows = {  # four methods; deletion is lower-is-better, so its order agrees with pointing's
        "a": {"pointing": 0.9, "energy": 0.5, "deletion": 0.1, "road": 0.30},
        "b": {"pointing": 0.7, "energy": 0.6, "deletion": 0.2, "road": 0.20},
        "c": {"pointing": 0.5, "energy": 0.4, "deletion": 0.3, "road": 0.25},
        "random": {"pointing": 0.1, "energy": 0.1, "deletion": 0.4, "road": 0.00},
    }
    tau = rank_agreement(rows)
    assert list(tau) == list(AGREEMENT[:-1])
    assert tau["pointing"]["deletion"] == pytest.approx(1.0)  # the same order once deletion is turned round
    # pointing a > b > c > random, energy b > a > c > random: 5 concordant, 1 discordant pair of 6
    assert tau["pointing"]["energy"] == pytest.approx((5 - 1) / 6)
    # road a > c > b > random against pointing: one discordant pair (b, c)
    assert tau["pointing"]["road"] == pytest.approx((5 - 1) / 6)
    assert tau["pointing"]["miou"] is None  # no values: no agreement


def test_recipes_reads_runs_and_prints_tables(tmp_path):
    """benchmarks.recipes: the last logged top-1 of the newest CSV version, a grey copy with
    one channel, and a row per run in each table (the trainings themselves are not run here)."""
    import cv2

    from benchmarks.recipes import glyph_root, last_metric, markdown

    run = tmp_path / "run"
    for version, rows in ((0, ["0,,0.5", "1,2.0,"]), (1, ["0,,0.25", "1,1.5,0.75", "2,1.2,"])):
        f = run / "csv" / f"version_{version}" / "metrics.csv"
        f.parent.mkdir(parents=True)
        f.write_text("epoch,train/loss,val/acc_top1\n" + "\n".join(rows) + "\n")
    assert last_metric(run) == 0.75
    assert last_metric(tmp_path / "nothing") is None
    grey = glyph_root(tmp_path, 20, 32, "grey")
    png = next(grey.glob("train/*/*.png"))
    assert cv2.imread(str(png), cv2.IMREAD_UNCHANGED).ndim == 2  # single channel, as many real sets
    assert len(list(grey.glob("*/*/*.png"))) == 20 + 1000
    sweep = markdown("sweep", [{"train_images": 500, "colour": "grey", "image_size": 32, "top1": 0.9, "seconds": 12.0},
                               {"train_images": 1000, "colour": "colour", "image_size": 32, "top1": None,
                                "seconds": 3.0}])
    assert sweep.count("\n") == 3 and "0.900" in sweep and "—" in sweep
    gain = markdown("finetune", [{"train_images": 200, "scratch": {"top1": 0.5}, "finetune": {"top1": 0.75}}])
    assert "+25.0 pts" in gain


def test_recipes_ablation_writes_its_results_table(tmp_path, monkeypatch):
    """benchmarks.recipes ablation --results: one row per change with its overrides, the mean
    top-1 over the seeds, each seed's, and the difference to the recipe's row; rewritten after
    every row; a finished run read back instead of trained again; an unfinished or other run's
    folder refused before any training (the trainings are replaced by a stand-in here)."""
    import benchmarks.recipes as recipes

    trained = []
    scores = {(): 0.9, ("--model.encoder.init_args.stem", "patch"): 0.7}

    def fake_train(config, root, epochs, run_dir, overrides):
        seed = int(overrides[overrides.index("--seed_everything") + 1])
        trained.append((run_dir, seed))
        (run_dir / "checkpoints").mkdir(parents=True)
        (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"x")
        return {"top1": scores.get(tuple(overrides[:-2]), 0.5) + seed / 100, "seconds": 10.0 + seed}

    monkeypatch.setattr(recipes, "train", fake_train)
    monkeypatch.setattr(recipes, "glyph_root", lambda work, size, image_size, colour: work / "data")
    out = tmp_path / "docs" / "classification_ablation.json"
    rows = ["recipe (small.yaml)", "linear patch stem (timm's patch embedding)", "mixup 0.8 / cutmix 1.0 (timm)"]
    work = tmp_path / "w"
    argv = ["ablation", "--work", str(work), "--results", str(out), "--rows", *rows]
    assert recipes.main([*argv, "--seeds", "0", "2"]) == 0
    data = json.loads(out.read_text())
    assert data["page"] == "classification" and data["command"].startswith("python -m benchmarks.recipes ablation")
    assert data["machine"]["cpu"] and data["machine"]["cores"] >= 1 and "seeds 0, 2" in data["description"]
    assert data["notes"] == ["The recipe's own seeds lie 2.0 points apart (lowest to highest): a difference of "
                             "that size is within what a seed changes."]
    table = {r[0]: r for r in data["rows"]}
    assert list(table) == rows
    assert table[rows[0]][1:] == ["none", pytest.approx(0.91), "0.900 / 0.920", None, 11.0]
    assert table[rows[1]][1:4] == ["--model.encoder.init_args.stem patch", pytest.approx(0.71), "0.700 / 0.720"]
    assert table[rows[1]][4] == pytest.approx(-20.0) and table[rows[2]][4] == pytest.approx(-40.0)
    ablation = work / "runs" / "ablation"
    assert [(d.relative_to(ablation).as_posix(), s) for d, s in trained] == [
        ("recipe_small.yaml", 0), ("recipe_small.yaml_seed_2", 2),
        ("linear_patch_stem_timm_s_patch_embedding", 0), ("linear_patch_stem_timm_s_patch_embedding_seed_2", 2),
        ("mixup_0.8_cutmix_1.0_timm", 0), ("mixup_0.8_cutmix_1.0_timm_seed_2", 2)]
    # again with one more seed: the finished runs are read back, only seed 1 trains
    assert recipes.main([*argv, "--seeds", "0", "1", "2"]) == 0
    assert [s for _, s in trained[6:]] == [1, 1, 1]
    assert json.loads(out.read_text())["rows"][0][3] == "0.900 / 0.910 / 0.920"
    # a run that did not finish (checkpoints, no result) and a run of other settings: refused
    # before the first training, the results file untouched
    before = out.read_bytes()
    (work / "runs" / "ablation" / "recipe_small.yaml_seed_1" / recipes.RUN_RESULT).unlink()
    with pytest.raises(SystemExit):
        recipes.main([*argv, "--seeds", "0", "1"])
    with pytest.raises(SystemExit):
        recipes.main([*argv[:-2], "--seeds", "2", "--epochs", "5"])
    with pytest.raises(SystemExit):  # a row that does not exist is named
        recipes.main(["ablation", "--work", str(tmp_path / "v"), "--rows", "no such row"])
    record = work / "runs" / "ablation" / "recipe_small.yaml" / recipes.RUN_RESULT
    for broken in ("{not json", '{"top1": "0.9", "seconds": 1}'):  # a damaged record is named, nothing trains
        record.write_text(broken)
        with pytest.raises(ValueError, match="recipe_small.yaml"):
            recipes.run_ablation(recipes.argparse.Namespace(rows=[rows[0]], seeds=[0], config="c", epochs=30,
                                                            size=1000, colour="colour"), work)
    assert len(trained) == 9 and out.read_bytes() == before
    for name, overrides in recipes.ABLATION.items():  # every change is train.py options, in pairs
        assert len(overrides) % 2 == 0 and all(o.startswith("--") for o in overrides[::2]), name
    sweep = tmp_path / "docs" / "classification_sweep.json"
    monkeypatch.setattr(recipes, "train", lambda config, root, epochs, run_dir, overrides: {"top1": 0.9,
                                                                                          "seconds": 14.0})
    assert recipes.main(["sweep", "--sizes", "500", "--colours", "grey", "colour", "--image_sizes", "32",
                         "--work", str(tmp_path / "s"), "--results", str(sweep)]) == 0
    assert json.loads(sweep.read_text())["rows"] == [[500, "grey", 32, 0.9, 14.0], [500, "colour", 32, 0.9, 14.0]]


def test_token_merging_benchmark_rows(tmp_path):
    from benchmarks.merging import run, write_json

    res = run("vit_tiny_patch16_224", 2, 1)
    rows = {row["r"]: row for row in res["rows"]}
    assert sorted(rows) == [0, 4, 8, 16]
    assert rows[0]["top1_agreement"] == 1.0 and rows[0]["rollout_spearman_min"] == pytest.approx(1.0)
    assert rows[16]["tokens_last_block"] < rows[8]["tokens_last_block"] < rows[4]["tokens_last_block"]
    assert all(row["images_per_s"] > 0 for row in rows.values())
    data = results_file(write_json(tmp_path / "merging.json", res, "python -m benchmarks.merging"),
                        ["r", "images/s", "speed-up", "top-1 agreement", "rollout Spearman, median",
                         "rollout Spearman, min", "tokens after the last block"])
    assert [row[0] for row in data["rows"]] == [0, 4, 8, 16] and data["page"] == "performance"


def test_streaming_benchmark_writes_a_results_file_tiny(tmp_path, monkeypatch):
    """benchmarks.streaming on a tiny encoder, one repeat: a row per configuration, the streaming
    maps equal to the stored ones."""
    from benchmarks import streaming

    monkeypatch.setattr(streaming, "CONFIGS", {"tiny": ("vit_tiny_patch16_224", {
        "img_size": 32, "patch_size": 8, "embed_dim": 32, "depth": 2, "num_heads": 2})})
    out = tmp_path / "streaming.json"
    argv = ["--repeats", "1", "--device", "cpu", "--json", str(out)]
    streaming.main(argv)
    data = results_file(out, ["configuration", "L", "T", "max diff", "peak MB, stored", "peak MB, streaming",
                              "extra MB, stored", "extra MB, streaming", "extra / stored attention", "time ratio",
                              "goal", "met"])
    assert data["command"] == "python -m benchmarks.streaming " + " ".join(argv)
    (row,) = data["rows"]
    assert row[0].startswith("tiny: ") and row[1:3] == [2, 17] and row[3] < 1e-5 and isinstance(row[-1], bool)


def test_gpu_benchmark_without_a_gpu_says_so_and_writes_nothing(tmp_path, monkeypatch, capsys):
    import torch

    from benchmarks.gpu import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu.json"
    result = main(["--json", str(out)])  # returns: no SystemExit, status 0 as a command
    printed = capsys.readouterr().out
    assert "no CUDA GPU found" in printed and "nothing measured" in printed and f"{out} not written" in printed
    assert result["gpu"] is None and "no CUDA GPU found" in result["reason"] and not out.exists()


def test_gpu_benchmark_results_file_of_a_measurement(tmp_path):
    """The results file of a GPU run (a measurement written by hand here): a row per set-up, MFU
    in per cent, empty cells for a device without a known peak and for a set-up out of memory."""
    from benchmarks.gpu import write_json

    rows = [{"setup": "bf16 + SDPA + compile", "batch": 256, "step_s": 0.5, "images_per_s": 512.0, "tflops": 400.0,
             "peak_tflops": 989.0, "mfu": 400 / 989, "max_memory_gib": 30.0},
            {"setup": "bf16 + SDPA, eager", "batch": 256, "step_s": 0.8, "images_per_s": 320.0, "tflops": 250.0,
             "peak_tflops": None, "mfu": None, "max_memory_gib": 40.0},
            {"setup": "fp32 eager", "batch": 256, "error": "out of memory at batch 256: CUDA out of memory"}]
    result = {"gpu": "NVIDIA H100 80GB HBM3", "model": "vit_base_patch16_224", "batch": 256, "steps": 20,
              "warmup": 5, "rows": rows, "met": True}
    data = results_file(write_json(tmp_path / "gpu.json", result, "python -m benchmarks.gpu"),
                        ["set-up", "batch", "images/s", "step ms", "model TFLOP/s", "peak TFLOP/s", "MFU %",
                         "peak memory GiB"])
    assert data["rows"][0] == ["bf16 + SDPA + compile", 256, 512.0, 500.0, 400.0, 989.0, 40.44, 30.0]
    assert data["rows"][1][5:7] == [None, None] and data["rows"][2][2:] == [None] * 6
    assert data["notes"] == ["Goal: bf16 + SDPA + compile ≥ 40 % MFU: met.", "fp32 eager: out of memory at batch 256."]
    with pytest.raises(ValueError, match="no GPU"):
        write_json(tmp_path / "none.json", {"gpu": None, "reason": "no GPU"}, "python -m benchmarks.gpu")
    assert not (tmp_path / "none.json").exists()


def test_gpu_benchmark_flop_count_equals_torch_flop_counter():
    """The analytic ViT FLOPs (forward, and forward + backward of a training step) are what
    torch.utils.flop_counter counts on a tiny timm ViT (explicit attention path: the CPU flash
    kernel has no FLOP formula there)."""
    import timm
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.gpu import peak_flops, vit_forward_flops, vit_shape, vit_train_flops

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=48,
                              depth=2, num_heads=3, mlp_ratio=3.0, num_classes=7)
    for blk in model.blocks:
        blk.attn.fused_attn = False
    shape = vit_shape(model)
    assert shape == {"patches": 16, "patch_dim": 192, "dim": 48, "depth": 2, "mlp_hidden": 144, "prefix": 1,
                     "classes": 7}
    x = torch.randn(3, 3, 32, 32)
    with FlopCounterMode(display=False) as fwd:
        model(x)
    assert fwd.get_total_flops() == 3 * vit_forward_flops(**shape)
    with FlopCounterMode(display=False) as train:
        torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2])).backward()
    assert train.get_total_flops() == 3 * vit_train_flops(**shape)
    assert vit_forward_flops(**vit_shape(timm.create_model("vit_base_patch16_224"))) == pytest.approx(35.1e9, rel=0.01)
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12 and peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12 and peak_flops("Tesla K80", "bf16") is None


def test_predict_loop_benchmark_rows_tiny(tmp_path):
    """benchmarks.predict_loop on 4 images and a ViT-Ti, one repeat: the three rows, each side
    predicting the same (the folder command's records and the plain timm loop's / script's)."""
    from benchmarks.predict_loop import GOALS, run, write_json

    res = run(images=4, model="vit_tiny_patch16_224", repeats=1, batch=2, num_workers=0, work_dir=tmp_path)
    rows = res["rows"]
    assert [r["pair"].split(":")[0].split(" (")[0] for r in rows] == [
        "folder predictions only vs plain timm loop", "folder command", "whole process"]
    assert all(r["ratio"] > 0 and isinstance(r["met"], bool) for r in rows)
    assert all("same predictions: True" in r["detail"] for r in rows)
    assert rows[0]["met"] == (rows[0]["ratio"] >= GOALS["predictions_only"])
    assert list(tmp_path.iterdir()) == []  # the temporary images, weights and outputs are removed
    data = results_file(write_json(tmp_path / "predict_loop.json", res, "python -m benchmarks.predict_loop"),
                        PAIR_COLUMNS)
    assert [row[0] for row in data["rows"]] == [r["pair"] for r in rows] and data["page"] == "performance"


def test_caption_grounding_counts_object_words_against_oracle_and_constant_decoders(tmp_path):
    """``benchmarks.caption_grounding``: a decoder that always predicts the right next word scores
    1 on every group; one that always says the same kind word scores that kind's share of the
    kind words and 0 on colours; the numbers count only the words naming the split's objects."""
    import torch

    from benchmarks.caption_grounding import object_word_ids, split_accuracy, write_json
    from vision_attn import create_encoder
    from vision_attn.data.captioning import CaptioningDataModule
    from vision_attn.data.synthetic import SceneSetConfig
    from vision_attn.tasks import CaptioningTask

    dm = CaptioningDataModule(synthetic=SceneSetConfig(image_size=32, num_train=8, num_val=6),
                              cache_dir=str(tmp_path / "data"), batching=Batching(batch_size=4, num_workers=0))
    enc = create_encoder("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    decoder = DecoderConfig(hidden_dim=32, num_layers=1, num_heads=2)
    task = CaptioningTask(enc, dm.tokenizer.to_json(), decoder=decoder).eval()
    task.configure_datamodule(dm)
    val = dm.dataset("val")
    tok = task.tokenizer
    groups = object_word_ids(val, tok)
    assert {tok.vocab[i] for i in groups["kind"]} <= {"circle", "square", "triangle", "star", "cross"}
    assert "red" in {tok.vocab[i] for i in groups["colour"]} or len(groups["colour"]) >= 3
    v = len(tok)
    kinds = [val.references[i][0].split() for i in range(len(val))]
    circle = tok.index["circle"]

    def oracle(images, inputs):  # logits peaked on the true next token of the same rows
        full = {tuple(val[i][1].tolist()) for i in range(len(val))}
        out = torch.zeros(*inputs.shape, v)
        for b, seq in enumerate(inputs.tolist()):
            trimmed = tuple(t for t in seq if t != tok.pad_id)
            whole = trimmed if trimmed in full else (*trimmed, tok.eos_id)  # the longest row lost its <eos>
            assert whole in full
            nxt = torch.tensor(whole[1:])
            out[b, torch.arange(len(nxt)), nxt] = 10.0
        return out

    task.forward = oracle
    perfect = split_accuracy(task, val, images=6, batch_size=4)
    assert perfect["kind"] == perfect["colour"] == perfect["all"] == 1.0
    task.forward = lambda images, inputs: torch.zeros(*inputs.shape, v).index_fill_(-1, torch.tensor([circle]), 1.0)
    constant = split_accuracy(task, val, images=6, batch_size=4)
    words = [w for caption in kinds for w in caption if tok.index.get(w) in groups["kind"]]
    assert constant["kind_words"] == len(words) == perfect["kind_words"]
    assert constant["kind"] == pytest.approx(words.count("circle") / len(words))
    assert constant["colour"] == 0.0
    no_colour = {**constant, "colour": float("nan"), "colour_words": 0}  # a split without colour words
    command = "python -m benchmarks.caption_grounding last.ckpt --json docs/results/captioning_grounding.json"
    data = results_file(write_json(tmp_path / "grounding.json", {"train": perfect, "val": no_colour}, "last.ckpt",
                                   command),
                        ["split", "images", "kind", "colour", "all words", "kind words", "colour words"])
    assert data["page"] == "captioning" and data["command"] == command
    assert data["rows"][0][:5] == ["train", 6, 1.0, 1.0, 1.0] and data["rows"][1][3] is None


def test_holdout_scores_predictions_files_against_references(tmp_path):
    """``benchmarks.holdout`` scores eval.py's files with the standard scorers: pycocotools map_50 is
    1 for the true boxes and falls for shifted ones; captions equal to a reference score far
    above captions of another image."""
    from benchmarks.holdout import digit_root, score_captioning, score_detection

    root = digit_root("detection", tmp_path, 64, 4, 6)
    annotations = root / "annotations" / "instances_val.json"
    truth = json.loads(annotations.read_text())["annotations"]
    perfect = [{"image_id": a["image_id"], "category_id": a["category_id"], "bbox": a["bbox"], "score": 0.9}
               for a in truth]
    shifted = [{**p, "bbox": [p["bbox"][0] + p["bbox"][2] * 0.6, *p["bbox"][1:]]} for p in perfect]
    (tmp_path / "perfect.json").write_text(json.dumps(perfect))
    (tmp_path / "shifted.json").write_text(json.dumps(shifted))
    assert score_detection(tmp_path / "perfect.json", annotations)["map_50"] == pytest.approx(1.0)
    assert score_detection(tmp_path / "shifted.json", annotations)["map_50"] < 0.2

    root = digit_root("captioning", tmp_path, 64, 4, 6)
    captions = json.loads((root / "annotations" / "captions_val.json").read_text())["annotations"]
    first = {}
    for c in captions:
        first.setdefault(c["image_id"], c["caption"])
    ids = sorted(first)
    (tmp_path / "right.json").write_text(json.dumps([{"image_id": i, "caption": first[i]} for i in ids]))
    rolled = ids[1:] + ids[:1]
    wrong_rows = [{"image_id": i, "caption": first[j]} for i, j in zip(ids, rolled, strict=True)]
    (tmp_path / "wrong.json").write_text(json.dumps(wrong_rows))
    right = score_captioning(tmp_path / "right.json", root / "annotations" / "captions_val.json")
    wrong = score_captioning(tmp_path / "wrong.json", root / "annotations" / "captions_val.json")
    assert right["bleu4"] > 0.9 and right["cider"] > wrong["cider"] + 1.0 and wrong["bleu4"] < right["bleu4"]


def test_results_commit_is_dirty_for_changed_code_not_for_the_results_being_written(tmp_path):
    """A results file records ``<commit>+dirty`` when tracked code differs from the commit; the
    results files and pages a benchmark rewrites as it goes do not make it dirty."""
    import subprocess

    from benchmarks.results_json import git_commit

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True, text=True,
                              env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                                   "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}).stdout.strip()

    assert git_commit(tmp_path) == "unknown"
    (tmp_path / "docs" / "results").mkdir(parents=True)
    files = {"code.py": "x = 1\n", "docs/results/t.json": "{}\n", "docs/results/page.html": "a\n", "README.md": "r\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    git("init", "-q")
    git("add", ".")
    git("-c", "commit.gpgsign=false", "commit", "-qm", "c")
    head = git("rev-parse", "--short", "HEAD")
    (tmp_path / "untracked.py").write_text("y = 2\n")
    for name in ("docs/results/t.json", "docs/results/page.html", "README.md"):
        (tmp_path / name).write_text("changed\n")
    assert git_commit(tmp_path) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_commit(tmp_path) == head + "+dirty"


def test_holdout_stroke_scenes_captions_only_and_its_results_row(tmp_path):
    """``--scenes strokes`` writes the stroke scenes; ``--captions_only`` hides their instances; a run
    becomes one validated results row with the content scores."""
    from types import SimpleNamespace

    from benchmarks.holdout import digit_root, write_holdout_results
    from benchmarks.results_json import validate

    root = digit_root("captioning", tmp_path, 64, 3, 2, captions_only=True, scenes="strokes")
    assert (root / "annotations" / "captions_val.json").is_file()
    assert not list((root / "annotations").glob("instances_*.json"))
    caps = json.loads((root / "annotations" / "captions_val.json").read_text())["annotations"]
    assert "handwritten" in " ".join(c["caption"] for c in caps) or "written" in " ".join(c["caption"] for c in caps)
    args = SimpleNamespace(scenes="strokes", img_size=64, train_images=3, val_images=2, captions_only=True, epochs=1)
    result = {"task": "captioning", "name": "tiny", "train_seconds": 1.0, "eval_seconds": 2.0, "overrides": [],
              "scores": {"bleu4": 0.5, "cider": 1.0}, "metrics": {"objects_exact": 0.25, "relations_exact": 0.2,
                                                                  "hallucination_rate": 0.4}}
    out = tmp_path / "r.json"
    write_holdout_results(str(out), result, args, "python -m benchmarks.holdout captioning --scenes strokes")
    data = json.loads(out.read_text())
    assert not validate(data) and data["page"] == "captioning"
    assert data["rows"][0][-4:] == [0.25, 0.2, 0.4, "none"] and "captions only" in data["rows"][0][1]
    # a second run joins the table; the same run name again replaces its row
    other = {**result, "name": "cnn", "overrides": ["--model.encoder.init_args.stem", "cnn"]}
    write_holdout_results(str(out), other, args, "python -m benchmarks.holdout captioning --scenes strokes")
    write_holdout_results(str(out), {**result, "eval_seconds": 3.0}, args, "python -m benchmarks.holdout captioning")
    rows = json.loads(out.read_text())["rows"]
    assert [r[0] for r in rows] == ["cnn", "tiny"] and rows[1][4] == 3.0
    assert rows[0][-1] == "--model.encoder.init_args.stem cnn"
    # --glance: the run becomes the README's summary row, and stays when other rows join
    args.glance = True
    write_holdout_results(str(out), result, args, "python -m benchmarks.holdout captioning")
    args.glance = False
    write_holdout_results(str(out), other, args, "python -m benchmarks.holdout captioning")
    data = json.loads(out.read_text())
    assert not validate(data) and len(data["glance"]) == 1
    assert "objects_exact 0.250" in data["glance"][0]["metric"] and data["glance"][0]["time"] == "1 s training"
    assert data["glance"][0]["command"] == "python -m benchmarks.holdout captioning"  # the glance run's own
    assert "--name RUN" in data["command"] and "-- OVERRIDES" in data["command"]  # the table's: every row's
    assert data["title"] == "small.yaml on data it was not tuned on (captioning)"
    args.title = "small.yaml with one encoder option"  # --title: a table of its own
    write_holdout_results(str(out), other, args, "python -m benchmarks.holdout captioning")
    assert json.loads(out.read_text())["title"] == "small.yaml with one encoder option"
    assert " --captions_only --name RUN" in json.loads(out.read_text())["command"]  # every row: captions only
    args.captions_only = False  # a row with the instance files joins: the flag is optional in the command
    write_holdout_results(str(out), {**result, "name": "boxes"}, args, "python -m benchmarks.holdout captioning")
    data = json.loads(out.read_text())
    assert " [--captions_only] --name RUN" in data["command"] and data["rows"][-1][1] == "strokes, 64 px, 3 / 2 images"


def test_holdout_detection_rows_gain_columns_from_their_runs(tmp_path):
    """A detection run's row has map_75 and the epochs to map_50 0.80 (read from the run's CSV
    log); an earlier row without those columns is kept, filled from its run's folder."""
    from types import SimpleNamespace

    from benchmarks.holdout import EPOCHS_TO, epochs_to, validation_curve, write_holdout_results
    from benchmarks.results_json import results, validate

    run = tmp_path / "runs" / "detection-old"
    (run / "csv" / "version_0").mkdir(parents=True)
    (run / "csv" / "version_0" / "metrics.csv").write_text(
        "epoch,step,train/loss,val/map_50\n0,10,1.0,\n9,100,,0.41\n19,200,,0.83\n29,300,,0.9\n", encoding="utf-8")
    (run / "eval").mkdir()
    (run / "eval" / "metrics.json").write_text(json.dumps({"map_75": 0.512345}), encoding="utf-8")
    assert validation_curve(run) == [(10, 0.41), (20, 0.83), (30, 0.9)]
    assert epochs_to(validation_curve(run), 0.80) == 20 and epochs_to(validation_curve(run), 0.95) is None
    out = tmp_path / "d.json"
    old = results("detection", "small.yaml", "python -m benchmarks.holdout detection",
                  ["run", "data", "epochs", "train s", "eval s", "map", "map_50", "train.py overrides"],
                  [["old", "strokes", 40, 1.0, 2.0, 0.3, 0.6, "none"],
                   ["gone", "strokes", 40, 1.0, 2.0, 0.1, 0.2, "x"]])
    out.write_text(json.dumps(old), encoding="utf-8")
    args = SimpleNamespace(scenes="strokes", img_size=96, train_images=300, val_images=300, captions_only=False,
                           epochs=40, work=str(tmp_path))
    result = {"task": "detection", "name": "new", "train_seconds": 3.0, "eval_seconds": 4.0, "overrides": [],
              "scores": {"map": 0.5, "map_50": 0.9, "map_75": 0.55, EPOCHS_TO: 10}, "metrics": {}}
    write_holdout_results(str(out), result, args, "python -m benchmarks.holdout detection")
    data = json.loads(out.read_text())
    assert not validate(data)
    assert data["columns"][5:9] == ["map", "map_50", "map_75", EPOCHS_TO]
    assert data["rows"] == [["old", "strokes", 40, 1.0, 2.0, 0.3, 0.6, 0.5123, 20, "none"],
                            ["gone", "strokes", 40, 1.0, 2.0, 0.1, 0.2, None, None, "x"],
                            ["new", "strokes, 96 px, 300 / 300 images", 40, 3.0, 4.0, 0.5, 0.9, 0.55, 10, "none"]]


def test_holdout_explanation_table_has_a_row_per_method_of_eval_metrics(tmp_path):
    """``--explanations``: one row per method named in ``metrics.json`` (keys such as
    ``pointing_words`` or the unsuffixed ``deletion_auc`` are no method), a measure no method has
    left out, the values as written; a run without explanation measures is refused."""
    from types import SimpleNamespace

    from benchmarks.holdout import write_explanation_results
    from benchmarks.results_json import column_name, validate

    metrics = {"pointing_acc": 0.9, "pointing_words": 12.0, "deletion_auc": 0.25, "bleu4": 0.8,
               "deletion_auc_relevance": 0.25, "insertion_auc_relevance": 0.61234, "sanity_relevance": 0.1,
               "deletion_auc_random": 0.42, "insertion_auc_random": 0.48, "sanity_random": 1.0,
               "deletion_auc_attention": 0.3, "explain_words": 570.0}
    args = SimpleNamespace(scenes="digits", img_size=64, train_images=1500, val_images=300, captions_only=True,
                           epochs=40)
    result = {"task": "captioning", "name": "small.yaml", "eval_seconds": 153.4, "overrides": [], "metrics": metrics}
    out = tmp_path / "e.json"
    write_explanation_results(str(out), result, args, "python -m benchmarks.holdout captioning --captions_only")
    data = json.loads(out.read_text())
    assert not validate(data) and data["page"] == "explanations"
    assert [column_name(c) for c in data["columns"]] == ["method", "deletion AUC", "insertion AUC",
                                                         "sanity (Spearman)", "items explained", "eval.py s"]
    assert data["rows"] == [["relevance", 0.25, 0.6123, 0.1, 570, 153.4], ["random", 0.42, 0.48, 1.0, 570, 153.4],
                            ["attention", 0.3, None, None, 570, 153.4]]
    assert "captions only" in data["title"] and data["command"].endswith("--captions_only")
    assert "Without boxes" in data["description"] and data["notes"] == [
        "The run: small.yaml, 40 epochs, train.py overrides: none."]
    with pytest.raises(ValueError, match="small.yaml: eval.py wrote no explanation measures"):
        write_explanation_results(str(tmp_path / "none.json"), {**result, "metrics": {"bleu4": 0.8}}, args, "x")
    assert not (tmp_path / "none.json").exists()


def test_shapes_ablation_changes_are_options_of_the_shipped_configs():
    """Every row of ``benchmarks.shapes_ablation`` is ``train.py`` options that the task's
    ``shapes.yaml`` accepts (parsed and validated, nothing built), each changing what it names."""
    from benchmarks.shapes_ablation import CHANGES, RECIPE
    from vision_attn.commands.train import TrainCLI

    from .conftest import REPO

    class ParseOnly(TrainCLI):
        def instantiate_classes(self) -> None:
            pass

    for task, rows in CHANGES.items():
        config = ["--config", str(REPO / "configs" / task / "shapes.yaml")]
        recipe = ParseOnly(args=config).config
        assert list(rows)[0] == RECIPE and rows[RECIPE] == []
        for name, overrides in list(rows.items())[1:]:
            assert len(overrides) % 2 == 0 and all(o.startswith("--") for o in overrides[::2]), name
            parsed = ParseOnly(args=[*config, *overrides]).config
            changed = [key for key in overrides[::2] if parsed.get(key[2:]) != recipe.get(key[2:])]
            assert changed, f"{task}: {name} changes nothing"


def test_shapes_ablation_rows_means_differences_and_resume(tmp_path, monkeypatch):
    """The ablation's table from stand-in runs: a row per change in order, each metric's mean over
    the seeds, the headline per seed and its difference to the recipe; finished runs are read
    back, an unfinished or damaged run is refused before any training."""
    from benchmarks import shapes_ablation as sa
    from benchmarks.results_json import column_name, validate

    trained = []
    content = {(): 0.80, ("--model.init_args.decoder.dropout", "0.1"): 0.70}

    def fake_run(task, seed, work, overrides, run_dir, eval_options):
        assert eval_options == sa.EVAL_OPTIONS
        trained.append((run_dir.name, seed))
        (run_dir / "checkpoints").mkdir(parents=True)
        (run_dir / "checkpoints" / "last.ckpt").write_bytes(b"x")
        value = content[tuple(overrides)] + seed / 100
        return {"seed": seed, "train_seconds": 100.0 + seed, "eval_seconds": 5.0,
                "metrics": {"bleu4": 0.9, "cider": 5.0 + seed, "kinds_exact": 0.5, "content_exact": value}}

    monkeypatch.setattr(sa, "run_seed", fake_run)
    rows = [sa.RECIPE, "decoder dropout 0.1"]
    out = tmp_path / "c.json"
    argv = ["captioning", "--seeds", "0", "2", "--work", str(tmp_path / "w"), "--results", str(out), "--rows", *rows]
    assert sa.main(argv) == 0
    data = json.loads(out.read_text())
    assert not validate(data) and data["page"] == "captioning" and data["machine"]["cores"] >= 1
    assert [column_name(c) for c in data["columns"]][:8] == [
        "change", "seeds", "BLEU-4", "CIDEr-D", "kinds_exact", "content_exact", "content_exact per seed",
        "content_exact difference (points)"]
    assert data["rows"][0] == [sa.RECIPE, "0, 2", 0.9, 6.0, 0.5, 0.81, "0.800 / 0.820", None, 101.0, "none"]
    assert data["rows"][1][:8] == ["decoder dropout 0.1", "0, 2", 0.9, 6.0, 0.5, 0.71, "0.700 / 0.720",
                                   pytest.approx(-10.0)]
    assert data["notes"] == ["The recipe's own seeds lie 2.0 points of content_exact apart: a difference of that "
                             "size is within what a seed changes."]
    assert [s for _, s in trained] == [0, 2, 0, 2] and trained[0][0] == "captioning-recipe (shapes.yaml) seed 0"
    assert sa.main([*argv[:1], "--seeds", "0", "1", "2", *argv[4:]]) == 0  # only seed 1 trains
    assert [s for _, s in trained[4:]] == [1, 1]
    assert json.loads(out.read_text())["rows"][0][6] == "0.800 / 0.810 / 0.820"
    before = out.read_bytes()
    runs = tmp_path / "w" / "runs"
    (runs / "captioning-decoder dropout 0.1 seed 1" / sa.RUN_RESULT).unlink()  # unfinished: refused
    with pytest.raises(SystemExit):
        sa.main([*argv[:1], "--seeds", "0", "1", *argv[4:]])
    (runs / "captioning-recipe (shapes.yaml) seed 0" / sa.RUN_RESULT).write_text('{"metrics": 1}')
    with pytest.raises(ValueError, match="recipe .shapes.yaml. seed 0"):  # damaged: named
        sa.run_ablation("captioning", [sa.RECIPE], [0], tmp_path / "w", train=fake_run)
    with pytest.raises(SystemExit):  # a row that does not exist
        sa.main(["detection", "--rows", "no such row", "--work", str(tmp_path / "v")])
    assert len(trained) == 6 and out.read_bytes() == before
    metrics = {"bleu4": 0.9, "cider": 5.0, "kinds_exact": 0.5, "content_exact": 0.8}
    one = [{"row": sa.RECIPE, "overrides": "", "runs": [{"seed": 0, "train_seconds": 1.0, "metrics": metrics}]}]
    seeds = {"command": "python -m benchmarks.shapes_seeds captioning", "columns": ["seed", {"name": "content_exact"}],
             "rows": [["0", 0.80], ["1", 0.85], ["3", 0.83], ["mean of seeds 0, 1, 3", 0.826]]}
    assert sa.table("captioning", one, seeds)[2] == [
        "One seed per row. The unchanged recipe's seeds 0, 1, 3 lie 5.0 points of content_exact apart "
        "(`python -m benchmarks.shapes_seeds captioning`): a difference of that size is within what a seed changes."]
    seeds["rows"][1][1] = None  # a seed without the value: no spread
    assert sa.table("captioning", one, seeds)[2] == [] == sa.table("captioning", one)[2]
    assert sa.seed_spread({"columns": ["seed", "map"], "rows": [["0", 0.5], ["1", 0.6]]}, "map_75") is None


def test_scst_benchmark_clock_rows_and_refusals(tmp_path, monkeypatch):
    """``benchmarks.scst``: the clock in Lightning's format, the table's rows (the references' own,
    then each run scored against all references and with one held out, its eval metrics), and a
    folder that holds a training refused before anything runs."""
    from benchmarks import scst
    from benchmarks.caption_ceiling import prediction_row, reference_rows

    assert scst.max_time(4.5) == "00:00:04:30" and scst.max_time(61) == "00:01:01:00"
    assert scst.max_time(1500) == "01:01:00:00"
    with pytest.raises(ValueError, match="at least a second"):
        scst.max_time(0)
    references = {1: ["a red circle", "a red circle left", "one red circle"],
                  2: ["a blue square", "the blue square", "a square that is blue"]}
    run = tmp_path / "run"
    (run / "eval").mkdir(parents=True)
    (run / "eval" / "predictions.json").write_text(json.dumps([{"image_id": 1, "caption": "a red circle"},
                                                               {"image_id": 2, "caption": "a blue circle"}]))
    rows = scst.table(references, {"ce": {"run": str(run), "train_seconds": 12.5,
                                          "metrics": {"bleu4": 0.5, "kinds_exact": 0.25, "content_exact": 0.125}}})
    ref = reference_rows(references)
    pred = prediction_row({1: "a red circle", 2: "a blue circle"}, references)
    assert rows[0][1:3] == [ref["reference"], ref["held-out reference"]] and rows[1][1] == ref["best reference"]
    assert rows[2] == ["ce", round(pred["all references"], 4), round(pred["held-out"], 4), 0.5, 0.25, 0.125, 12.5]
    assert 0 < rows[2][1] < ref["best reference"] + 1e-9  # one wrong word scores below the oracle
    ran = []
    monkeypatch.setattr(scst, "timed", lambda cmd, log: ran.append(cmd) or 1.0)
    (tmp_path / "w" / "scst" / "checkpoints").mkdir(parents=True)
    (tmp_path / "w" / "scst" / "checkpoints" / "last.ckpt").write_bytes(b"x")
    with pytest.raises(SystemExit):
        scst.main(["--work", str(tmp_path / "w")])
    with pytest.raises(SystemExit):
        scst.main(["--work", str(tmp_path / "v"), "--ckpt", str(tmp_path / "missing.ckpt")])
    assert ran == []


def test_caption_ceiling_rows_against_direct_cider_d(tmp_path):
    """The reference rows equal CIDEr-D computed by hand from the same references: the verbatim
    reference averaged over which one is used, the per-image best of them (which a prediction
    equal to each image's best reference reaches exactly, and no reference exceeds), and the
    held-out reference against the others."""
    import numpy as np

    from benchmarks.caption_ceiling import prediction_row, read_predictions, reference_rows
    from vision_attn.metrics.caption import cider_d

    refs = {1: ["a red circle", "a red circle on the left", "one red circle"],
            2: ["two blue squares", "a pair of blue squares", "two squares in blue"],
            3: ["a green triangle above a circle", "a triangle over a circle", "a green triangle and a circle"]}
    rows = reference_rows(refs)
    per = np.array([[cider_d({i: refs[i][j] for i in refs}, refs)[1][i] for i in refs] for j in range(3)])
    assert rows["reference"] == pytest.approx(per.mean())
    assert rows["best reference"] == pytest.approx(per.max(0).mean()) and rows["best reference"] > rows["reference"]
    held = [cider_d({i: refs[i][j] for i in refs},
                    {i: [c for n, c in enumerate(r) if n != j] for i, r in refs.items()})[0]
            for j in range(3)]
    assert rows["held-out reference"] == pytest.approx(np.mean(held)) and rows["held-out reference"] < rows["reference"]

    best = {i: refs[i][int(per[:, n].argmax())] for n, i in enumerate(refs)}
    assert prediction_row(best, refs)["all references"] == pytest.approx(rows["best reference"])
    wrong = {i: "a yellow star" for i in refs}
    assert prediction_row(wrong, refs)["all references"] < 0.1 * rows["reference"]

    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "predictions.json").write_text(json.dumps(
        [{"image_id": i, "caption": c.upper() + "."} for i, c in best.items()]))
    assert read_predictions(tmp_path, refs) == best  # normalised as eval.py does
    (tmp_path / "eval" / "predictions.json").write_text(json.dumps([{"image_id": 1, "caption": "a red circle"}]))
    with pytest.raises(SystemExit, match="no caption for 2 of the 3 images"):
        read_predictions(Path(tmp_path), refs)
    with pytest.raises(ValueError, match="image id 2 has fewer"):
        reference_rows({1: ["a b", "c d"], 2: ["e f"]})
    dup = tmp_path / "dup.json"
    dup.write_text(json.dumps([{"image_id": 1, "caption": "a"}, {"image_id": 1, "caption": "b"}]))
    with pytest.raises(SystemExit, match="appears twice"):
        read_predictions(dup, refs)

    # By hand: an image whose references all say the same (at least four words, none shared with
    # another image) scores CIDEr-D 10 with any of them: every n-gram vector is its reference's,
    # cosine 1 for n = 1..4, no length penalty; the same against the other references. The
    # images may have different numbers of references (COCO: 5-7).
    same = {1: ["a red circle on the left"] * 3, 2: ["two blue squares in a row"] * 2, 3: ["one green star up top"] * 4}
    assert reference_rows(same) == pytest.approx({"reference": 10.0, "best reference": 10.0,
                                                  "held-out reference": 10.0})
    assert prediction_row({i: r[0] for i, r in same.items()}, same) == pytest.approx({"all references": 10.0,
                                                                                    "held-out": 10.0})


def test_startup_benchmark_writes_a_results_file(tmp_path, monkeypatch):
    from benchmarks import startup

    monkeypatch.setattr(startup, "COMMANDS", startup.COMMANDS[:2])  # the interpreter and the listing
    out = tmp_path / "startup.json"
    startup.main(["--repeats", "2", "--json", str(out)])
    data = json.loads(out.read_text())
    assert not validate(data) and [r[0] for r in data["rows"]] == ["python -c pass", "vision-attn --help"]
    assert all(0 < r[2] <= r[1] <= r[3] for r in data["rows"])


def test_classification_holdout_data_and_its_results_rows(tmp_path):
    import cv2

    from benchmarks.classification_holdout import last_val_top1, sklearn_digits, stroke_digits, write_row

    root = stroke_digits(tmp_path, train_images=20, val_images=10)
    assert sorted(p.name for p in (root / "train").iterdir()) == [str(d) for d in range(10)]
    assert len(list((root / "val").rglob("*.png"))) == 10
    img = cv2.imread(str(next((root / "train" / "3").glob("*.png"))))
    assert img.shape == (32, 32, 3) and img.std() > 5  # a picture, not a blank
    assert stroke_digits(tmp_path, train_images=20, val_images=10) == root  # written once
    from vision_attn.explain.localisation import load_image_objects

    objects = load_image_objects(root / "annotations" / "instances_val.json")
    assert len(objects) == 10 and all(len(v) == 1 for v in objects.values())
    name, (x0, y0, x1, y1), mask = objects["val/3/00003.png"][0]
    pixels = mask.decode()
    assert name == "3" and 4 < pixels.sum() < 32 * 32 / 2
    ys, xs = np.nonzero(pixels)
    assert (x0, y0, x1, y1) == (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)
    digits = sklearn_digits(tmp_path, train_images=1000)
    assert len(list((digits / "train").rglob("*.png"))) == 1000 and len(list((digits / "val").rglob("*.png"))) == 797
    run = tmp_path / "run"
    (run / "csv" / "version_0").mkdir(parents=True)
    (run / "csv" / "version_0" / "metrics.csv").write_text(
        "epoch,train/loss,val/acc_top1\n0,1.0,\n0,,0.5\n1,0.5,\n1,,0.75\n1,0.4,\n")
    assert last_val_top1(run) == 0.75  # the last validation, not a training row
    results = tmp_path / "table.json"
    for name, acc in (("a", 0.5), ("b", 0.9), ("a", 0.6)):
        write_row(str(results), {"name": name, "data": "strokes", "epochs": 30, "train_seconds": 10.0,
                                 "overrides": ["--x", "1"] if name == "b" else [], "acc_top1": acc}, "cmd")
    table = json.loads(results.read_text())
    validate(table)
    assert [(r[0], r[4], r[5]) for r in table["rows"]] == [("b", 0.9, "--x 1"), ("a", 0.6, "none")]


def test_timm_predict_table_runs_the_folder_command_and_records_refusals(tmp_path, capsys):
    """benchmarks.timm_predict on a small headless tower (registered by tests/test_headless.py) and a
    model the suite refuses (PiT's pooling attention): a row each, the command's exit status, the
    methods drawn, the refusal's one line."""
    from benchmarks.timm_predict import main

    from . import test_headless  # noqa: F401  (registers the small timm models)

    out = tmp_path / "timm_predict.json"
    rows = main(["headless_tiny_siglip", "pit_ti_224", "--json", str(out)])
    ok, refused = rows
    assert ok["status"] == 0 and ok["class"] == "VisionTransformer" and ok["head"] == "embedding"
    assert ok["methods"] == ["rollout", "relevance", "attention", "gradcam", "tokens", "random"]  # no lrp: the pool
    assert "embedding_norm" in ok["note"]
    assert refused["status"] == 2 and refused["class"] == "PoolingVisionTransformer" and refused["methods"] == []
    assert "pit_ti_224" in refused["note"] and "pooling" in refused["note"]
    data = results_file(out, ["model", "timm class", "explained as", "exit status", "methods drawn", "seconds", "note"])
    assert [row[0] for row in data["rows"]] == ["headless_tiny_siglip", "pit_ti_224"]


def test_holdout_run_names_stay_one_folder_inside_the_runs_folder(tmp_path):
    from benchmarks.holdout import run_folder

    runs = tmp_path / "runs"
    assert run_folder(runs, "detection", "small.yaml + copy-paste 0.5, seed 1") == \
        runs / "detection-small.yaml + copy-paste 0.5, seed 1"
    for hostile in ("../../etc", "a/b", "..", "/abs", "x\\..\\y", "", "a\x00b"):
        folder = run_folder(runs, "detection", hostile)
        assert folder.parent == runs and folder.resolve().is_relative_to(runs.resolve()), hostile
        assert "/" not in folder.name and "\\" not in folder.name and "\x00" not in folder.name


def test_holdout_run_refuses_a_folder_that_holds_a_training(tmp_path, capsys):
    """A run named like an earlier one would train beside its checkpoints, and eval.py could score
    the earlier model: it stops before making data or training, and the earlier run is untouched."""
    from benchmarks import holdout, small_data_ablation

    run_dir = holdout.run_folder(tmp_path / "runs", "detection", "ablation shipped 300 seed 0")
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"earlier run")
    with pytest.raises(SystemExit):
        holdout.main(["detection", "--work", str(tmp_path), "--name", "ablation shipped 300 seed 0"])
    assert "already holds a training (last.ckpt)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the ablation names its runs so, and says the same
        small_data_ablation.main(["--sizes", "300", "--seeds", "0", "--variants", "shipped", "--work", str(tmp_path)])
    assert "move that folder away" in capsys.readouterr().err
    assert ckpt.read_bytes() == b"earlier run" and not (tmp_path / "data").exists()
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["detection-ablation shipped 300 seed 0"]


def test_seed_and_classification_benchmarks_refuse_an_earlier_training_too(tmp_path, capsys, monkeypatch):
    """shapes_seeds checks every seed's folder before its first training; classification_holdout
    keeps the earlier run instead of deleting it."""
    from benchmarks import classification_holdout, holdout, shapes_seeds

    trained = []
    monkeypatch.setattr(shapes_seeds, "run_seed", lambda *a: trained.append(a))
    second = holdout.run_folder(tmp_path / "runs", "detection", "seed1") / "checkpoints" / "last.ckpt"
    second.parent.mkdir(parents=True)
    second.write_bytes(b"seed 1")
    with pytest.raises(SystemExit):
        shapes_seeds.main(["detection", "--seeds", "0", "1", "--work", str(tmp_path)])
    err = capsys.readouterr().err
    assert "seed1 already holds a training" in err and "another --work" in err and trained == []
    kept = tmp_path / "runs" / "strokes-small" / "checkpoints" / "best-019-1240.ckpt"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"earlier")
    monkeypatch.setitem(classification_holdout.DATASETS, "strokes",
                        (classification_holdout.DATASETS["strokes"][0], lambda work: trained.append(work)))
    with pytest.raises(SystemExit):
        classification_holdout.main(["strokes", "--work", str(tmp_path)])
    assert "best-019-1240.ckpt" in capsys.readouterr().err and kept.read_bytes() == b"earlier"
    assert trained == []  # no data made either


def test_shapes_seeds_first_epoch_needs_both_thresholds_and_the_table_means_the_seeds(tmp_path):
    """The first epoch at map_50 >= 0.90 *and* map >= 0.60 comes from the run's CSV log; the table
    has one row per seed and the mean of each column (empty where a seed lacks the value)."""
    from benchmarks.results_json import results, validate
    from benchmarks.shapes_seeds import TARGET, first_epoch, table

    run = tmp_path / "run"
    (run / "csv" / "version_0").mkdir(parents=True)
    (run / "csv" / "version_0" / "metrics.csv").write_text(
        "epoch,step,val/map,val/map_50\n0,10,0.3,0.7\n1,20,0.55,0.92\n2,30,0.61,0.91\n3,40,0.7,0.95\n",
        encoding="utf-8")
    assert first_epoch(run) == 3  # epoch 2 passes map_50 alone
    assert first_epoch(run, 0.96) is None
    runs = [{"seed": 0, "train_seconds": 10.0, "eval_seconds": 2.0, "first_epoch": 3,
             "metrics": {"map": 0.7, "map_50": 0.95, "map_75": 0.8}},
            {"seed": 1, "train_seconds": 12.0, "eval_seconds": 4.0, "first_epoch": None,
             "metrics": {"map": 0.5, "map_50": 0.85, "map_75": 0.6, "pointing_lrp_attention": 0.9}}]
    columns, rows = table("detection", runs)
    names = [c if isinstance(c, str) else c["name"] for c in columns]
    assert names[:4] == ["seed", "map", "map_50", "map_75"] and TARGET in names
    mean = dict(zip(names, rows[-1], strict=True))
    assert rows[-1][0] == "mean of seeds 0, 1"
    assert mean["map"] == 0.6 and mean["train.py s"] == 11.0 and mean["eval.py s"] == 3.0
    assert mean["pointing lrp_attention"] is None and mean[TARGET] is None  # one seed lacks it
    assert not validate(results("detection", "t", "c", columns, rows))
    assert len(table("captioning", runs[:1])[1]) == 1  # one seed: no mean row


def test_small_data_ablation_variants_add_one_option_and_rows_aggregate_the_seeds(tmp_path):
    from benchmarks.holdout import EPOCHS_TO
    from benchmarks.small_data_ablation import VARIANTS, record, table_rows, write_table

    def pairs(overrides):
        return dict(zip(overrides[::2], overrides[1::2], strict=True))

    base = pairs(VARIANTS["base"][1])
    assert VARIANTS["shipped"][1] == []
    # the options are measured at lr 5e-4, next to small.yaml at that rate; small.yaml itself trains at another
    assert pairs(VARIANTS["lr5e-4"][1]) == {"--model.optim.lr": base["--model.optim.lr"]}
    from .conftest import REPO

    config = yaml.safe_load((REPO / "configs" / "detection" / "small.yaml").read_text())
    shipped_lr = config["model"]["init_args"]["optim"]["lr"]
    assert float(base["--model.optim.lr"]) == 5e-4 != float(shipped_lr)
    for name, (_, overrides) in VARIANTS.items():
        if name in ("base", "shipped", "lr5e-4"):
            continue
        changed = {k for k, v in pairs(overrides).items() if base.get(k) != v} | (base.keys() - pairs(overrides).keys())
        # each variant is the base recipe with its own option switched on, nothing else
        expected = {"fill_epoch": {"--data.batching.fill_epoch"}, "copy_paste": {"--data.copy_paste.prob"},
                    "mosaic": {"--data.mosaic.prob", "--data.mosaic.scale"}, "mal": {"--model.loss.mal_gamma"},
                    "fdr": {"--model.head.fdr", "--model.head.look_forward_twice"},
                    "local_mlp": {"--model.encoder.local_mlp"}}[name]
        assert changed == expected, name

    def result(variant, seed, map_, reached, non_finite=False, cpu="cpu A"):
        return {"variant": variant, "size": 300, "seed": seed, "scenes": "digits", "train_seconds": 100.0 + seed,
                "non_finite": non_finite, "cpu": cpu,
                "scores": {"map": map_, "map_50": 0.9, "map_75": 0.5, EPOCHS_TO: reached}}

    runs = [result("shipped", 1, 0.6, 10), result("base", 0, 0.2, None), result("shipped", 0, 0.4, 20),
            result("base", 1, 0.4, 30, non_finite=True), result("shipped", 2, 0.8, 15)]
    rows = table_rows([record(r) for r in runs])
    assert [r[0] for r in rows] == [VARIANTS["base"][0], VARIANTS["shipped"][0]]  # the variants' order
    base_row, shipped = rows
    assert shipped[2] == "0, 1, 2" and shipped[3] == pytest.approx(0.6) and shipped[4] == pytest.approx(0.2)
    assert shipped[7] == 15 and shipped[8] == pytest.approx(101.0) and shipped[9] == 0 and shipped[10] == "cpu A"
    assert base_row[3] == pytest.approx(0.3) and base_row[7] is None and base_row[9] == 1  # a seed never reached it
    (tmp_path / "ablation").mkdir()
    for r in [*runs, {**result("base", 2, 0.9, 5), "scenes": "strokes"}]:
        (tmp_path / "ablation" / f"{r['variant']}-{r['seed']}-{r['scenes']}.json").write_text(json.dumps(r))
    write_table(str(tmp_path / "table.json"), tmp_path, "digits")
    table = json.loads((tmp_path / "table.json").read_text())
    assert [r[2] for r in table["rows"]] == ["0, 1", "0, 1, 2"]  # the other scenes' run left out
    assert len(table["runs"]) == 5


def test_small_data_ablation_adds_to_the_runs_of_its_results_file(tmp_path, monkeypatch):
    """A results file written in another checkout (no run folders left) keeps its runs: they are
    not run again, new seeds join their variant's row (map pooled exactly with the earlier
    seeds' mean and deviation), and the seconds of each CPU stay apart."""
    import argparse

    from benchmarks import small_data_ablation as ablation
    from benchmarks.holdout import EPOCHS_TO

    earlier = [{"variant": "shipped", "size": 300, "scenes": "digits", "seeds": [0, 1, 2], "map": 0.8,
                "map_sd": 0.01, "map_50": 0.99, "map_75": 0.9, "epochs_to": 15, "train_seconds": 400.0,
                "non_finite": 0, "cpu": "cpu A"},
               {"variant": "base", "size": 300, "scenes": "digits", "seed": 0, "map": 0.3, "map_50": 0.5,
                "map_75": 0.2, "epochs_to": None, "train_seconds": 100.0, "non_finite": False, "cpu": "cpu A"}]
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"runs": earlier}))
    args = argparse.Namespace(scenes="digits", val_images=300, epochs=40)

    def must_not_run(*a, **k):
        raise AssertionError("a run the results file holds was run again")

    monkeypatch.setattr(ablation, "run", must_not_run)
    work = tmp_path / "work"
    assert ablation.one_run("shipped", 300, 1, args, work, ablation.known_runs(str(path))) is None
    assert ablation.one_run("base", 300, 0, args, work, ablation.known_runs(str(path))) is None
    monkeypatch.setattr(ablation, "cpu_model", lambda: "cpu B")
    monkeypatch.setattr(ablation, "git_commit", lambda: "abc1234")

    def fake_run(task, spec, w):
        folder = ablation.run_folder(w / "runs", task, spec.name)
        folder.mkdir(parents=True)
        (folder / "train.log").write_text("WARNING the training loss is nan at step 3" if "4" in spec.name else "")
        return {"train_seconds": 500.0, "scores": {"map": 0.9, "map_50": 1.0, "map_75": 0.95, EPOCHS_TO: 10}}

    monkeypatch.setattr(ablation, "run", fake_run)
    fresh = [ablation.one_run("shipped", 300, s, args, work, ablation.known_runs(str(path))) for s in (3, 4)]
    assert [r["cpu"] for r in fresh] == ["cpu B", "cpu B"] and [r["non_finite"] for r in fresh] == [False, True]
    ablation.write_table(str(path), work, "digits")
    table = json.loads(path.read_text())
    cells = [(r[0], r[2], r[8], r[9], r[10]) for r in table["rows"]]
    shipped = ablation.VARIANTS["shipped"][0]
    assert cells == [(ablation.VARIANTS["base"][0], "0", 100.0, 0, "cpu A"),
                     (shipped, "0, 1, 2, 3, 4", "400 / 500", 1, "cpu A / cpu B")]
    maps = [0.8 - 0.01, 0.8, 0.8 + 0.01, 0.9, 0.9]  # three seeds of mean 0.8 and deviation 0.01, then two of 0.9
    row = table["rows"][-1]
    assert row[3] == pytest.approx(sum(maps) / 5, abs=1e-4) and row[4] == pytest.approx(np.std(maps, ddof=1), abs=1e-4)
    assert row[5] == pytest.approx((3 * 0.99 + 2 * 1.0) / 5, abs=1e-4)
    assert row[7] == 15 and isinstance(row[7], int)  # median of 15, 15, 15, 10, 10: 15, not 15.0
    assert len(table["runs"]) == 4 and table["notes"][-1] == "6 runs in all, 1 of them with a non-finite training loss"
    ablation.write_table(str(path), work, "digits")  # written again: nothing doubled
    assert len(json.loads(path.read_text())["runs"]) == 4
    with pytest.raises(ValueError, match="digits scenes, not strokes"):  # the digits runs would be lost
        ablation.write_table(str(path), work, "strokes")
    assert len(json.loads(path.read_text())["runs"]) == 4


def test_relevance_variants_reduce_to_relevance_where_they_should(monkeypatch):
    from types import SimpleNamespace

    from benchmarks import relevance_variants as rv
    from vision_attn.explain import methods

    monkeypatch.setattr(methods, "METHODS", dict(methods.METHODS))  # the variants stay out of the real registry
    torch.manual_seed(0)
    attn = [torch.softmax(torch.randn(2, 3, 5, 5), dim=-1) for _ in range(3)]
    grads = [torch.randn(2, 3, 5, 5) for _ in range(3)]
    x = SimpleNamespace(attentions=attn, attention_grads=grads, grid=(2, 2), num_prefix_tokens=1, token_index=0,
                        start_layer=0, merges=None, head_fusion="mean", discard_ratio=0.0)
    measured = rv.register_variants()
    assert measured[0] == "relevance" and measured[-1] == "random" and set(rv.variants()) <= set(methods.METHODS)
    shipped = methods.METHODS["relevance"].fn(x)
    assert torch.allclose(rv._from_block(1)(x), shipped)  # from block 1: every block, as shipped
    assert not torch.allclose(rv.variants()["relevance_from_block_3"](x), shipped)
    assert not torch.allclose(rv._abs_grad(x), shipped)  # negative gradients count once their sign is dropped
    x_pos = SimpleNamespace(**{**vars(x), "attention_grads": [g.abs() for g in grads]})
    assert torch.allclose(rv._abs_grad(x_pos), methods.METHODS["relevance"].fn(x_pos))
    assert torch.allclose(rv._sqrt(x) ** 2, shipped.clamp(min=0), atol=1e-6)
    centre = torch.zeros(1, 3, 3)
    centre[0, 1, 1] = 1.0
    monkeypatch.setitem(methods.METHODS, "relevance", methods.MethodSpec(lambda _: centre))
    binomial = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]]) / 16
    assert torch.allclose(rv._smoothed(x)[0], binomial)
    rows = rv.rows_of("demo", {"miou_relevance": 0.5, "road_relevance": float("nan")}, ["relevance"])
    assert rows == [["demo", "relevance", None, None, 0.5, None, None, None, None, None]]


def test_attention_relevance_is_weights_times_gradient_and_the_rules_change_it():
    """Without the rules it is the attention weights times the plain gradient that
    ``capture_attention`` records; with AttnLRP's rules the gradient differs (the uniform rule of
    ``A V`` alone halves it)."""
    from benchmarks.relevance_variants import attention_relevance
    from vision_attn import create_encoder
    from vision_attn.explain.capture import capture_attention
    from vision_attn.models.classifier import ClassifierConfig
    from vision_attn.tasks import ClassificationTask

    from .conftest import TINY_VIT

    torch.manual_seed(0)
    task = ClassificationTask(create_encoder("vit_tiny_patch16_224", **TINY_VIT), num_classes=3,
                              head=ClassifierConfig(kind="linear")).eval().double()
    images = torch.randn(2, 3, TINY_VIT["img_size"], TINY_VIT["img_size"], dtype=torch.float64)
    target = torch.tensor([1, 2])
    with capture_attention(task, keep_grad=True) as attn:
        logits = task.head(task.encoder(images.clone().requires_grad_(True)))
    logits.gather(1, target.view(-1, 1)).sum().backward()
    plain = attention_relevance(task, images, target, len(attn), rules=False)
    ruled = attention_relevance(task, images, target, len(attn))
    assert len(plain) == len(ruled) == len(attn) >= 2
    for a, p, r in zip(attn, plain, ruled, strict=True):
        assert p.shape == r.shape == a.shape
        assert torch.allclose(p, a.detach() * a.grad, atol=1e-12)
        assert not torch.allclose(r, p, atol=1e-6)


def test_patch_ceiling_is_each_cells_share_of_the_mask_scored_as_the_maps_are(tmp_path):
    import json

    import numpy as np

    from benchmarks.relevance_variants import _cell_shares, patch_ceiling
    from vision_attn.explain.localisation import grid_to_image
    from vision_attn.explain.segmentation import SegmentationScores

    pre = {"input_size": (3, 8, 8), "crop_pct": 1.0, "crop_mode": "squash"}
    mask = np.zeros((8, 8), bool)
    mask[:4, :4] = True  # the top-left cell of a 2 x 2 grid
    mask[4:8, 4:6] = True  # half of the bottom-right cell
    assert np.array_equal(_cell_shares(mask, (2, 2), pre), [[1.0, 0.0], [0.0, 0.5]])
    # a 16 px image seen at 8 px: each cell holds 8 x 8 original pixels
    big = np.kron(mask, np.ones((2, 2), bool))
    assert np.array_equal(_cell_shares(big, (2, 2), pre), [[1.0, 0.0], [0.0, 0.5]])
    # the file: two objects in one image count as their union; an image without a mask is left out
    polygons = [[[0, 0, 4, 0, 4, 4, 0, 4]], [[4, 4, 6, 4, 6, 8, 4, 8]]]
    coco = {"images": [{"id": 1, "height": 8, "width": 8}, {"id": 2, "height": 8, "width": 8}],
            "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "segmentation": polygons[0]},
                            {"id": 2, "image_id": 1, "category_id": 1, "segmentation": polygons[1]},
                            {"id": 3, "image_id": 2, "category_id": 1, "bbox": [0, 0, 2, 2]}]}
    (tmp_path / "instances_val.json").write_text(json.dumps(coco))
    expected = SegmentationScores()
    expected.update({"m": grid_to_image(np.array([[1.0, 0.0], [0.0, 0.5]]), (8, 8), pre)}, [mask])
    got = patch_ceiling(tmp_path / "instances_val.json", (2, 2), pre)
    assert got["miou"] == pytest.approx(expected.compute()["miou_m"])
    assert got["map_mask"] == pytest.approx(expected.compute()["map_mask_m"]) and 0.5 < got["miou"] < 1.0
