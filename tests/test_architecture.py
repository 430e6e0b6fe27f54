"""The package's layering, read from its imports: no cycles, nothing imports upward.

From the bottom (docs/architecture.md draws it): the core modules, ``data``, ``models``,
``losses`` and ``metrics``, ``explain``, ``tasks``, ``report``, the library entry points
(``predict``, ``export``, ``demo``, ``overlay``) and ``commands``, which only ``__main__``,
``train.py`` and ``eval.py`` import. A module may import its own layer and the layers below.
Imports under ``if __name__ == "__main__":`` (a module run as a script) and the modules that
only forward an old import path (:mod:`vision_attn._deprecated`) are not part of the layering.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

from .conftest import REPO

PACKAGE = REPO / "vision_attn"

LAYERS: list[tuple[str, tuple[str, ...]]] = [  # bottom to top
    ("core", ("vision_attn.attention", "vision_attn.boxes", "vision_attn.errors", "vision_attn.outputs",
              "vision_attn.checkpoint_io", "vision_attn.distributed", "vision_attn.schema", "vision_attn.blocks",
              "vision_attn._deprecated")),
    ("data", ("vision_attn.data",)),
    ("models", ("vision_attn.models",)),
    ("losses and metrics", ("vision_attn.losses", "vision_attn.metrics")),
    ("explain", ("vision_attn.explain",)),
    ("tasks", ("vision_attn.tasks",)),
    ("report", ("vision_attn.report",)),
    ("entry points", ("vision_attn.predict", "vision_attn.onnx_predict", "vision_attn.export", "vision_attn.demo",
                      "vision_attn.overlay")),
    ("commands", ("vision_attn.commands",)),
    ("public API", ("vision_attn",)),
]
ENTRY_SCRIPTS = (REPO / "train.py", REPO / "eval.py", PACKAGE / "__main__.py")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts}


def is_forwarding_shim(path: Path) -> bool:
    return "from vision_attn._deprecated import moved" in path.read_text()


def layer_of(module: str) -> int:
    best = (-1, -1)
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best[1]:
                best = (i, len(prefix))
    return best[0]


def _main_guard(node: ast.AST) -> bool:
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def imports_of(name: str, path: Path) -> list[tuple[str, int, bool]]:
    """``(imported module, line, inside a function)`` for each import of the package's modules."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if _main_guard(node) for n in ast.walk(node)}
    in_function = {id(n) for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name and target.startswith("vision_attn"):
                out.append((target, node.lineno, id(node) in in_function))
    return out


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items() if not is_forwarding_shim(path)}


def test_every_module_has_a_layer():
    assert [m for m in GRAPH if layer_of(m) < 0] == []


def test_nothing_imports_upward():
    upward = [f"{m}:{line} imports {t} ({LAYERS[layer_of(t)][0]} above {LAYERS[layer_of(m)][0]})"
              for m, edges in GRAPH.items() for t, line, _ in edges
              if t in GRAPH and layer_of(t) > layer_of(m)]
    assert upward == []


def test_no_import_cycles():
    edges = {m: {t for t, _, _ in e if t in GRAPH and not MODULES[t].name == "__init__.py"} for m, e in GRAPH.items()}
    cycles, seen = [], set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            cycles.append(" -> ".join(stack[stack.index(node):] + [node]))
            return
        if node in seen:
            return
        for nxt in sorted(edges.get(node, ())):
            visit(nxt, [*stack, node])
        seen.add(node)

    for module in sorted(edges):
        visit(module, [])
    assert cycles == []


# ---------------------------------------------------------------------------------------- sizes

MAX_MODULE_LINES = 600
MODULES_OVER_THE_LIMIT = 1  # at most this many modules may exceed MAX_MODULE_LINES
MAX_FUNCTION_LINES = 80
MAX_FUNCTION_LEVEL_IMPORTS = 10  # imports of the package's own modules inside functions (lazy loading only)


def test_modules_are_small():
    big = sorted((n, str(p.relative_to(REPO))) for p in MODULES.values()
                 if (n := p.read_text().count("\n")) > MAX_MODULE_LINES)
    assert len(big) <= MODULES_OVER_THE_LIMIT, f"modules over {MAX_MODULE_LINES} lines: {big}; split them by concept"


def test_functions_are_short():
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []


def test_the_package_imports_its_own_modules_at_module_level():
    inner = sorted({f"{m}:{line} imports {t}" for m, edges in GRAPH.items() for t, line, in_function in edges
                    if in_function})
    assert len(inner) <= MAX_FUNCTION_LEVEL_IMPORTS, "\n".join(inner)


TASK_NAMES = ("classification", "detection", "captioning")  # the built-in tasks' registry names


def _is_task_name(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value in TASK_NAMES


def task_name_switches(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, what)`` for each place that chooses by a built-in task's name: a comparison with one
    (``== "detection"``, ``in ("classification", "captioning")``), a lookup by one (``x["captioning"]``,
    ``x.get("detection")``) and a table keyed by two or more of them (``{"classification": ...,
    "detection": ...}``, what a ``TABLE[task]`` lookup reads)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_is_task_name(o) or (isinstance(o, (ast.Tuple, ast.List, ast.Set))
                                        and any(_is_task_name(e) for e in o.elts)) for o in operands):
                found.append((node.lineno, "a comparison with a task name"))
        elif isinstance(node, ast.Subscript) and _is_task_name(node.slice):
            found.append((node.lineno, "a lookup by a task name"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
              and node.args and _is_task_name(node.args[0])):
            found.append((node.lineno, "a lookup by a task name"))
        elif isinstance(node, ast.Dict) and sum(_is_task_name(k) for k in node.keys if k is not None) >= 2:
            found.append((node.lineno, "a table keyed by task names"))
    return found


def test_task_name_switches_outside_the_tasks_are_caught():
    code = ('if task == "detection": pass\nok = name in ("captioning", "x")\nHEADLINE = {"classification": 1, '
            '"detection": 2}\nfile = files.get("captioning")\nmap = DEFAULTS["detection"]\n'
            'record = {"index": 0, "detection": 1}\nlabel = "classification"\n')
    assert [line for line, _ in task_name_switches(ast.parse(code))] == [1, 2, 3, 4, 5]


def test_no_task_name_switches_outside_the_tasks():
    """A task owns its behaviour (its report sections, mistakes, headline, options): nothing outside
    ``vision_attn/tasks/`` (the report, the explanations, the commands, the entry points) chooses by
    a task's name, so a task defined outside the package is served like the built-in ones."""
    switches = [f"{path.relative_to(REPO)}:{line}: {what}" for name, path in MODULES.items()
                if not name.startswith("vision_attn.tasks") and not is_forwarding_shim(path)
                for line, what in task_name_switches(ast.parse(path.read_text()))]
    assert switches == []


def test_only_the_entry_scripts_import_the_commands():
    importers = sorted({m for m, e in GRAPH.items() for t, _, _ in e
                        if t.startswith("vision_attn.commands")
                        and not m.startswith(("vision_attn.commands", "vision_attn.__main__"))})
    assert importers == []
    for script in ENTRY_SCRIPTS:
        assert "vision_attn.commands" in script.read_text()


OLD_PATHS = [("vision_attn.cli", "RunCheckpoint", "vision_attn.commands.callbacks"),
             ("vision_attn.cli", "train_main", "vision_attn.commands.train"),
             ("vision_attn.cli", "eval_main", "vision_attn.commands.evaluate"),
             ("vision_attn.merge", "merge_tokens", "vision_attn.models.merging"),
             ("vision_attn.scst", "scst_loss", "vision_attn.losses.scst"),
             ("vision_attn.caption_metrics", "cider_d", "vision_attn.metrics.caption"),
             ("vision_attn.caption_content", "content_accuracy", "vision_attn.metrics.caption_content"),
             ("vision_attn.caption_content", "ObjectVocabulary", "vision_attn.data.caption_objects"),
             ("vision_attn.eval_breakdown", "detection_breakdown", "vision_attn.metrics.breakdown"),
             ("vision_attn.models.sources", "load_model", "vision_attn.tasks.sources"),
             ("vision_attn.explain.report", "write_report", "vision_attn.report.page"),
             ("vision_attn.explain.report", "Report", "vision_attn.explain.records")]


@pytest.mark.parametrize(("old", "name", "new"), OLD_PATHS)
def test_old_import_paths_work_for_one_version_and_warn(old, name, new):
    import importlib

    module = importlib.import_module(old)
    with pytest.warns(FutureWarning, match=rf"{old}\.{name} is deprecated .* use {new}\.{name}"):
        obj = getattr(module, name)
    assert obj is getattr(importlib.import_module(new), name)
    with warnings.catch_warnings(), pytest.raises(AttributeError):
        warnings.simplefilter("ignore")
        module.no_such_name  # noqa: B018


def test_a_config_naming_the_old_checkpoint_callback_still_trains(tmp_path, shapes_root):
    from vision_attn.commands.train import TrainCLI

    cfg = tmp_path / "old.yaml"
    cfg.write_text("trainer:\n  callbacks:\n    - class_path: vision_attn.cli.RunCheckpoint\n"
                   "      init_args:\n        save_last: true\n")
    with pytest.warns(FutureWarning, match="vision_attn.cli.RunCheckpoint is deprecated"):
        cli = TrainCLI(args=["--config", str(REPO / "configs" / "classification" / "shapes.yaml"), "--config", str(cfg),
                             "--data.init_args.root", str(shapes_root), "--trainer.logger", "false",
                             "--trainer.default_root_dir", str(tmp_path / "run")])
    assert any(type(c).__name__ == "RunCheckpoint" for c in cli.trainer.callbacks)


def test_the_public_api_and_the_command_listing_load_no_heavy_module():
    import subprocess
    import sys

    code = ("import sys, vision_attn, vision_attn.commands as c; c.usage(); "
            "heavy = [m for m in ('torch', 'timm', 'lightning', 'cv2') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"
    import vision_attn

    assert sorted(vision_attn.__all__) == sorted(vision_attn._PUBLIC)
    assert vision_attn.load_task.__module__ == "vision_attn.tasks.base"  # each name resolves to its module
