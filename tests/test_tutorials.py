"""The commands of the README's quickstart, of Getting started, of the tutorials and of the guides
run as written, on small generated data with tiny models, and the files they write are what
the output reference (docs/reference/outputs.md) documents.

A page marks each block a reader runs with ``<!-- runnable -->`` before its fence (shell or
Python), and a file the blocks need with ``<!-- file: NAME -->`` (written before the blocks after
it run). The blocks of a page run in order, in-process (``vision-attn`` and ``python train.py``
through :func:`vision_attn.commands.main`, Python blocks with ``exec``), in a working folder that
holds ``configs/`` and ``photos/``; pages that build on another page's run share its folder
(:data:`GROUPS`). The only changes to what a reader runs are the tiny sizes of
:func:`tiny_overrides` and the text substitutions of :data:`SUBSTITUTIONS` (no hub downloads).
"""

from __future__ import annotations

import contextlib
import fnmatch
import io
import json
import os
import re
import shlex
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"

GROUPS: dict[str, list[str]] = {
    # page files in run order; the pages of a group share one working folder
    "quickstart": ["docs/getting-started.md", "docs/tutorials/explain-timm.md"],
    "classification": ["docs/tutorials/classify.md", "docs/tutorials/report.md", "docs/tutorials/export.md",
                       "docs/guides/own-method.md", "docs/tutorials/multi-gpu.md", "docs/guides/configuration.md"],
    "detection": ["docs/tutorials/detect.md"],
    "captioning": ["docs/tutorials/caption.md"],
    "plugin": ["docs/guides/own-task.md"],
}
PARSE_ONLY = {"docs/tutorials/multi-gpu.md"}
"""Pages whose training commands need GPUs or datasets a test does not have: ``fit`` and
``validate`` are parsed and checked (``--print_config``) instead of run. A single block of
another page is marked ``<!-- runnable: parse only -->`` for the same reason (COCO itself,
pretrained weights from the hub)."""

SUBSTITUTIONS: dict[str, list[tuple[str, str]]] = {
    "*": [("vit_small_patch16_224.augreg_in21k_ft_in1k", "vit_tiny_patch16_224.augreg_in21k_ft_in1k"),  # ViT-Ti
          ("deit_small_distilled_patch16_224.fb_in1k", "deit_tiny_distilled_patch16_224.fb_in1k"),
          ("SceneSetConfig(num_train=1000, num_val=200)", "SceneSetConfig(num_train=24, num_val=8)")],
    "docs/tutorials/multi-gpu.md": [("runs/coco/checkpoints/last.ckpt", "runs/mine/checkpoints/last.ckpt")],
}

HUB_MODELS = ("vit_tiny_patch16_224.augreg_in21k_ft_in1k", "deit_tiny_distilled_patch16_224.fb_in1k")
"""The hub models the pages name (after :data:`SUBSTITUTIONS`): their weights (random, of the right
shapes) wait in a local hub cache, read as timm reads the hub offline, so ``pretrained=True`` and
``timm:NAME`` without a weights file run as written and nothing is downloaded."""

PHOTOS = ("cat.jpg", "dog.jpg")  # the pictures the pages call photos/*; photos/broken.jpg is not an image
MARKER = re.compile(r"<!-- (runnable(?P<parse>: parse only)?|file: (?P<file>[\w./-]+)) -->\n"
                    r"```(?P<lang>\w*)[^\n]*\n(?P<body>.*?)\n```", re.S)


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    body: str
    file: str | None = None  # a file block: written, not run
    parse_only: bool = False  # ``<!-- runnable: parse only -->``: its data or weights are not here

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str) -> list[Block]:
    """The marked blocks of ``page`` (a path relative to the repository), in order."""
    text = (REPO / page).read_text(encoding="utf-8")
    return [Block(page, text.count("\n", 0, m.start()) + 2, m.group("lang"), m.group("body"), m.group("file"),
                  bool(m.group("parse"))) for m in MARKER.finditer(text)]


def pages_with_blocks() -> list[str]:
    found = [str(p.relative_to(REPO)) for p in sorted(DOCS.rglob("*.md")) if blocks(str(p.relative_to(REPO)))]
    return found + (["README.md"] if blocks("README.md") else [])


# ---------------------------------------------------------------------------------------- tiny sizes

TRAINER = ["--trainer.max_steps", "2", "--trainer.max_epochs", "1", "--trainer.limit_val_batches", "1",
           "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
           "--trainer.enable_model_summary", "false", "--trainer.accelerator", "cpu", "--trainer.devices", "1"]
ENCODER = ["--model.encoder.depth", "1", "--model.encoder.embed_dim", "32", "--model.encoder.num_heads", "2"]
TASK_SIZES = {
    "classification": [*ENCODER, "--model.encoder.stem_channels", "8", "--data.batching.batch_size", "8",
                       "--data.batching.num_workers", "0"],
    "detection": [*ENCODER, "--model.encoder.stem_channels", "8", "--model.head.hidden_dim", "32",
                  "--model.head.num_layers", "1", "--model.head.num_heads", "2", "--model.head.num_queries", "6",
                  "--data.batching.batch_size", "8", "--data.batching.num_workers", "0"],
    "pretrain": [*ENCODER, "--model.encoder.stem_channels", "8", "--model.decoder.dim", "32",
                 "--model.decoder.num_heads", "2", "--data.batching.batch_size", "8",
                 "--data.batching.num_workers", "0"],
    "captioning": [*ENCODER, "--model.encoder.stem_channels", "8", "--model.decoder.hidden_dim", "32",
                   "--model.decoder.num_layers", "1", "--model.decoder.num_heads", "2", "--model.decoder.max_length",
                   "8", "--data.captions.max_length", "8", "--data.batching.batch_size", "8",
                   "--data.batching.num_workers", "0"],
}
EVALUATION = ["--explain.num_overlays", "2", "--explain.faithfulness_images", "2", "--explain.mistakes", "1",
              "--explain.steps", "3"]
FOLDER = ["--num_workers", "0", "--batch_size", "8"]


def tiny_overrides(argv: list[str], parse_only: bool) -> list[str]:
    """What the test appends to a ``vision-attn`` command line (the last value of an option wins)."""
    command, rest = argv[0], argv[1:]
    if any(a in ("-h", "--help", "--print_config") or a.endswith(".help") for a in rest):
        return []
    if parse_only and command in ("fit", "validate", "test"):
        return ["--print_config"]
    if command == "fit":
        configs = [rest[i + 1] for i, a in enumerate(rest[:-1]) if a == "--config"]
        task = next((t for t in TASK_SIZES for c in configs if f"configs/{t}/" in c), None)
        return TRAINER + (TASK_SIZES[task] if task else [])
    if command in ("validate", "test"):
        return EVALUATION
    if command in ("predict", "explain"):
        return FOLDER
    if command == "data":
        return ["--num_train", "40", "--num_val", "10"]
    return []


# ---------------------------------------------------------------------------------------- the runner


class BlockFailed(AssertionError):
    pass


class Runner:
    """Runs the blocks of one group's pages in one working folder, keeping shell variables."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.vars: dict[str, str] = {}
        self.done: set[str] = set()
        self.namespace: dict[str, object] = {}
        self.seconds: list[tuple[str, float]] = []  # (block, seconds), for VISION_ATTN_TUTORIAL_TIMES=1

    def run_page(self, page: str) -> None:
        self.namespace = {"__name__": "__tutorial__"}  # the Python blocks of a page share their names
        for block in blocks(page):
            body = block.body
            for old, new in SUBSTITUTIONS["*"] + SUBSTITUTIONS.get(page, []):
                body = body.replace(old, new)
            if block.file:
                (self.folder / block.file).write_text(block.body + "\n", encoding="utf-8")
                continue
            if body in self.done:  # the same block on two pages (the README's quickstart): run once
                continue
            start = time.perf_counter()
            try:
                if block.lang == "python":
                    self.python(body, block.where)
                elif block.lang in ("bash", "sh", "shell"):
                    for line in shell_lines(body):
                        self.shell(line, page in PARSE_ONLY or block.parse_only)
                else:
                    raise BlockFailed(f"a runnable block in {block.lang or 'no language'}: mark bash or python only")
            except BlockFailed as err:
                raise BlockFailed(f"{block.where}: {err}") from None
            self.done.add(body)
            self.seconds.append((block.where, time.perf_counter() - start))

    def python(self, code: str, where: str) -> None:
        exec(compile(code, where, "exec"), self.namespace)

    def expand(self, token: str) -> str:
        def value(m: re.Match) -> str:
            name = m.group(1) or m.group(2)
            return self.vars.get(name, os.environ.get(name, ""))

        return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, token)

    def shell(self, line: str, parse_only: bool) -> None:
        assign = re.fullmatch(r"(\w+)=\$\((.*)\)", line)
        if assign:
            self.vars[assign.group(1)] = self.command(assign.group(2), parse_only, capture=True).strip()
            return
        assign = re.fullmatch(r"(\w+)=(\S*)", line)
        if assign:
            self.vars[assign.group(1)] = self.expand(assign.group(2))
            return
        self.command(line, parse_only)

    def command(self, line: str, parse_only: bool, capture: bool = False) -> str:
        words = [self.expand(w) for w in shlex.split(line)]
        env = {}
        while words and re.fullmatch(r"\w+=\S*", words[0]):  # NAME=value command ...
            name, _, value = words.pop(0).partition("=")
            env[name] = value
        if words[:1] in (["torchrun"], ["srun"]):  # a launcher: the command it starts
            words = words[next(i for i, w in enumerate(words) if w.endswith(".py")) - (words[0] == "srun"):]
            words = ["python", *words] if words[0].endswith(".py") else words
        out = io.StringIO()
        with _environ(env), contextlib.redirect_stdout(out):
            self.dispatch(words, parse_only)
        text = out.getvalue()
        if not capture:
            print(text, end="")
        return text

    def dispatch(self, words: list[str], parse_only: bool) -> None:
        from vision_attn.commands import main

        if words[0] == "python" and words[1:2] == ["-c"]:
            return self.python(words[2], "python -c")
        if words[0] == "python" and words[1:2] in (["train.py"], ["eval.py"]):
            words = ["vision-attn", "fit" if words[1] == "train.py" else "validate", *words[2:]]
        if words[0] == "echo":
            return print(" ".join(words[1:]))
        if words[0] == "ls":
            return print("\n".join(sorted(n for w in words[1:] for n in os.listdir(w))))
        if words[0] != "vision-attn":
            raise BlockFailed(f"{' '.join(words)!r}: the tests run vision-attn, python train.py / eval.py, "
                              "python -c, echo and ls only")
        argv = words[1:] + tiny_overrides(words[1:], parse_only)
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                main(argv)
        except SystemExit as exit_:
            if exit_.code not in (0, None):
                raise BlockFailed(f"vision-attn {' '.join(argv)} exited with {exit_.code}: "
                                  f"{err.getvalue().strip()[-2000:]}") from None


def shell_lines(body: str) -> Iterator[str]:
    """The commands of a shell block: continuation lines joined, comments and blank lines left out."""
    for line in re.sub(r"\\\n\s*", " ", body).splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            yield re.sub(r"\s+#\s.*$", "", line)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def hub_cache(folder: Path, names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """A Hugging Face hub cache in ``folder`` as a download leaves it (``models--ORG--NAME/refs/main``
    naming a snapshot that holds ``model.safetensors``) with random weights of each timm model of
    ``names``; returns those weights by name."""
    import timm
    from safetensors.torch import save_file

    weights = {}
    for name in names:
        model = timm.create_model(name, pretrained=False)
        repo = folder / ("models--" + model.pretrained_cfg["hf_hub_id"].replace("/", "--"))
        revision = f"{len(weights):040x}"
        (repo / "snapshots" / revision).mkdir(parents=True)
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(revision, encoding="utf-8")
        weights[name] = {k: v.clone() for k, v in model.state_dict().items()}
        save_file(weights[name], str(repo / "snapshots" / revision / "model.safetensors"))
    return weights


@contextlib.contextmanager
def _offline_hub(folder: Path) -> Iterator[None]:
    """The hub cache of :func:`hub_cache` in ``folder``, offline, for the duration."""
    import huggingface_hub.constants as hub

    old = hub.HF_HUB_CACHE, hub.HF_HUB_OFFLINE
    hub.HF_HUB_CACHE, hub.HF_HUB_OFFLINE = str(folder), True
    try:
        yield
    finally:
        hub.HF_HUB_CACHE, hub.HF_HUB_OFFLINE = old


def _workfolder(folder: Path) -> Path:
    """A working folder as a reader has it: the configs, and a few pictures in ``photos/``."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "configs").symlink_to(REPO / "configs")
    photos = folder / "photos"
    photos.mkdir()
    rng = np.random.default_rng(0)
    for i, name in enumerate(PHOTOS):
        picture = rng.integers(0, 255, (120 + 20 * i, 160, 3), dtype=np.uint8)
        Image.fromarray(picture).save(photos / name, quality=90)
    (photos / "broken.jpg").write_bytes(b"\xff\xd8 not a picture")
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | BaseException]:
    """Every group's pages run in its own working folder: ``{group: folder}``, or the error that
    stopped it."""
    from vision_attn.explain.methods import METHODS

    registered = dict(METHODS)  # the pages register methods of their own: put the registry back after
    base = tmp_path_factory.mktemp("tutorials")
    results: dict[str, Path | BaseException] = {}
    cwd = Path.cwd()
    hub_cache(base / "hub", HUB_MODELS)
    try:
        for group, pages in GROUPS.items():
            folder = _workfolder(base / group)
            os.chdir(folder)
            runner = Runner(folder)
            try:
                with _offline_hub(base / "hub"):
                    for page in pages:
                        runner.run_page(page)
                results[group] = folder
            except Exception as err:  # noqa: BLE001 - reported by the group's test
                results[group] = err
            finally:
                os.chdir(cwd)
                if os.environ.get("VISION_ATTN_TUTORIAL_TIMES"):
                    print("\n".join(f"{s:6.1f} s  {where}" for where, s in runner.seconds))
    finally:
        METHODS.clear()
        METHODS.update(registered)
    return results


# ---------------------------------------------------------------------------------------- tests


def test_every_page_with_runnable_blocks_runs_in_a_group():
    grouped = {page for pages in GROUPS.values() for page in pages}
    assert set(pages_with_blocks()) - {"README.md"} <= grouped, "add the page to GROUPS in tests/test_tutorials.py"
    assert all((REPO / page).is_file() for page in grouped)


def test_the_readme_quickstart_is_getting_starteds():
    """The README's runnable blocks are blocks of Getting started, which run here."""
    started = {b.body for b in blocks("docs/getting-started.md")}
    readme = blocks("README.md")
    assert readme, "the README's quickstart marks its blocks <!-- runnable -->"
    missing = [b.where for b in readme if b.body not in started]
    assert not missing, f"README blocks that differ from docs/getting-started.md's: {missing}"


@pytest.mark.parametrize("group", list(GROUPS))
def test_pages_run_as_written(runs, group):
    result = runs[group]
    if isinstance(result, BaseException):
        raise result


# ---------------------------------------------------------------------------------------- output files

OUTPUTS = REPO / "docs" / "reference" / "outputs.md"
EXAMPLE = re.compile(r"<!-- output: (?P<id>[\w./-]+)(?P<mode>(?: [\w=$.,*]+)*) -->\n```json\n(?P<body>.*?)\n```", re.S)


def documented_outputs() -> list[tuple[str, str, str]]:
    """``(id, mode, JSON example)`` of every marked example of the output reference."""
    return [(m.group("id"), m.group("mode").strip(), m.group("body"))
            for m in EXAMPLE.finditer(OUTPUTS.read_text(encoding="utf-8"))]


def _safetensors_metadata(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata())


def _onnx_metadata(path: Path) -> dict:
    import onnx

    return {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}


def _json(path: Path):
    return json.loads(path.read_text(encoding="utf-8"))


# example id -> (group, file in its working folder, how to read it)
PRODUCED: dict[str, tuple[str, str, Callable[[Path], object]]] = {
    "classification/metrics.json": ("classification", "runs/mine/eval/metrics.json", _json),
    "classification/predictions.json": ("classification", "runs/mine/eval/predictions.json", _json),
    "classification/per_class.json": ("classification", "runs/mine/eval/per_class.json", _json),
    "classification/confusion_matrix.json": ("classification", "runs/mine/eval/confusion_matrix.json", _json),
    "classification/results_per_image.json": ("classification", "runs/mine/eval/results_per_image.json", _json),
    "classification/maps/index.json": ("classification", "runs/mine/report/maps/index.json", _json),
    "classification/sanity.json": ("classification", "runs/mine/report/sanity.json", _json),
    "predict/classification/predictions.json": ("quickstart", "out/predict/predictions.json", _json),
    "predict/skipped.json": ("quickstart", "out/predict/skipped.json", _json),
    "detection/metrics.json": ("detection", "runs/detector/eval/metrics.json", _json),
    "detection/predictions.json": ("detection", "runs/detector/eval/predictions.json", _json),
    "detection/per_class.json": ("detection", "runs/detector/eval/per_class.json", _json),
    "detection/pr_curves.json": ("detection", "runs/detector/eval/pr_curves.json", _json),
    "detection/results_per_image.json": ("detection", "runs/detector/eval/results_per_image.json", _json),
    "detection/maps/index.json": ("detection", "runs/detector/eval/maps/index.json", _json),
    "predict/detection/predictions.json": ("detection", "runs/detector/predictions/predictions.json", _json),
    "captioning/metrics.json": ("captioning", "runs/captioner/eval/metrics.json", _json),
    "captioning/predictions.json": ("captioning", "runs/captioner/eval/predictions.json", _json),
    "captioning/results_per_image.json": ("captioning", "runs/captioner/eval/results_per_image.json", _json),
    "predict/captioning/predictions.json": ("captioning", "runs/captioner/predictions/predictions.json", _json),
    "export/safetensors": ("classification", "runs/mine/export/encoder.safetensors", _safetensors_metadata),
    "export/onnx": ("classification", "runs/mine/export/model.onnx", _onnx_metadata),
}


def test_every_documented_output_is_checked():
    assert sorted(i for i, _, _ in documented_outputs()) == sorted(PRODUCED)


def _kind(value) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    return type(value).__name__


def same_shape(documented, written, where: str = "$", data: tuple[str, ...] = (), optional: bool = False) -> list[str]:
    """Where ``written`` differs in form from ``documented``: the keys of every object (except the
    objects at the paths ``data`` names, ``$`` the top and ``*`` any key, whose keys are data: each
    of their values is compared with the documented first one; with ``optional`` documented keys
    may be absent), the kind of every value (``null`` documents a value that may be missing), the
    first element of every list."""
    if documented is None or written is None:
        return []
    if _kind(documented) != _kind(written):
        return [f"{where}: documented {_kind(documented)}, written {_kind(written)}"]
    if isinstance(documented, dict):
        if any(fnmatch.fnmatchcase(where, pattern) for pattern in data):
            sample = next(iter(documented.values()), None)
            return [d for key, value in written.items()
                    for d in same_shape(sample, value, f"{where}.{key}", data, optional)][:5]
        problems = []
        extra, missing = sorted(set(written) - set(documented)), sorted(set(documented) - set(written))
        if extra:
            problems.append(f"{where}: written but not documented: {extra}")
        if missing and not optional:
            problems.append(f"{where}: documented but not written: {missing}")
        for key in sorted(set(documented) & set(written)):
            problems += same_shape(documented[key], written[key], f"{where}.{key}", data, optional)
        return problems
    if isinstance(documented, list) and documented and written:
        return same_shape(documented[0], written[0], f"{where}[0]", data, optional)
    return []


@pytest.mark.parametrize("example", sorted(PRODUCED))
def test_written_files_are_what_the_reference_documents(runs, example):
    group, name, read = PRODUCED[example]
    folder = runs[group]
    if isinstance(folder, BaseException):
        pytest.fail(f"the {group} pages did not run: {folder}")
    mode, body = next((m, b) for i, m, b in documented_outputs() if i == example)
    documented = json.loads(body)
    written = read(folder / name)
    options = dict(option.partition("=")[::2] for option in mode.split())
    data = tuple(f"$.{p}" if p != "$" else "$" for p in options.get("data", "").split(",") if p)
    problems = [f"{example}: {p}" for p in same_shape(documented, written, data=data, optional="optional" in options)]
    assert not problems, "\n".join(problems)


def test_timm_names_without_a_weights_file_read_the_hub_cache(tmp_path):
    """``timm:NAME`` without a weights file gets the hub's weights (here from the local cache,
    offline): the model holds exactly the cached tensors, not a fresh random initialisation."""
    import torch

    import vision_attn

    name = HUB_MODELS[1]
    cached = hub_cache(tmp_path, (name,))[name]
    with _offline_hub(tmp_path):
        task = vision_attn.load_model(f"timm:{name}")
    loaded = {k.rsplit("encoder.", 1)[-1].removeprefix("model."): v for k, v in task.state_dict().items()}
    for key in ("cls_token", "dist_token", "patch_embed.proj.weight", "head.weight", "head_dist.weight"):
        match = [k for k in loaded if k.endswith(key)]
        assert match and torch.equal(loaded[match[0]], cached[key]), key
    with _offline_hub(tmp_path / "empty"), pytest.raises(Exception, match="weights_file"):
        vision_attn.load_model(f"timm:{name}")  # nothing cached: the advice to pass a weights file
