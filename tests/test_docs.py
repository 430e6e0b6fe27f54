"""The documentation stays true: the site builds strict, every relative link resolves, the
generated pages (command line, configuration keys, API, checkpoint formats, results) are what
docs/generate.py writes from today's code and results files, the README stays short, and the
pages speak of the software, never of how it was developed."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"

PROSE = ("README.md", "CHANGES.md", "mkdocs.yml", "docs", "configs", "notebooks")
"""What a user reads: searched for words about how the project was developed."""

PROCESS_WORDS = {
    r"\b(this|last|earlier|previous|next|later|latest|that|same|one|each|every|a|helper)\s+sessions?\b": "a session",
    r"\brounds?\b(?!\s*\()": "a round (of work)",  # Python's round(...) is fine
    r"\bissues?\s*#?\d+": "an issue number",
    r"\bthe issue'?s?\b": "the issue",
    r"\bhelpers?\b": "a helper",
    r"calibrat": "a timing-script reading (calibrate)",
    r"reference[ -]minutes?": "reference minutes",
    r"\.\./shared\b": "the development machine's shared folder",
    r"\b(earlier|previous|former)\s+(recipes?|small\.yaml|stem)\b|\bearlier run the same day\b": "an earlier state",
    r"\bnot kept\b|\bkept and not\b": "a narrative of what was tried",
    r"\bthis project's machines?\b": "the development machines",
}

CODE = ("vision_attn", "tests", "benchmarks", "train.py", "eval.py", "Makefile", "pyproject.toml")
"""What a developer reads: searched for the same words, less those with a meaning in code
(``round()``, helper functions)."""

CODE_PROCESS_WORDS = {
    pattern: what for pattern, what in PROCESS_WORDS.items()
    if what not in ("a round (of work)", "a helper", "a narrative of what was tried")
}

README_MAX_LINES = 200

KNOWN_WITHOUT_HELP: set[str] = set()
"""Options whose parsers give no help text (none: a new option without one fails the test below)."""


def _generate():
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generate():
    return _generate()


def _prose_files() -> list[Path]:
    files = []
    for name in PROSE:
        path = REPO / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [p for p in sorted(path.rglob("*")) if p.is_file() and p.suffix in (
                ".md", ".yaml", ".yml", ".py", ".ipynb", ".json", ".txt", ".html")]
    return files


def _development_words(files: list[Path], patterns: dict[str, str]) -> list[str]:
    """``file:line: what: match`` of every match of ``patterns`` in ``files``."""
    found = []
    for file in files:
        text = file.read_text(encoding="utf-8", errors="replace")
        for pattern, what in patterns.items():
            for match in re.finditer(pattern, text, re.IGNORECASE):
                line = text.count("\n", 0, match.start()) + 1
                found.append(f"{file.relative_to(REPO)}:{line}: {what}: {match.group(0)!r}")
    return found


def test_no_words_about_how_the_project_was_developed():
    found = _development_words(_prose_files(), PROCESS_WORDS)
    assert not found, "the pages speak of the software, not of its development:\n" + "\n".join(found[:40])


OUTPUTS = REPO / "benchmarks" / "results"
"""Where the benchmarks write their runs (ignored by git): outputs, not the project's text."""


def _code_files() -> list[Path]:
    """The ``.py``, ``.md`` and ``.yaml`` files of :data:`CODE` (not the benchmarks' outputs)."""
    files = []
    for name in CODE:
        path = REPO / name
        files += [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in (".py", ".md", ".yaml")
                                                      and p.is_file() and OUTPUTS not in p.parents)
    return [f for f in files if "__pycache__" not in f.parts]


def test_no_words_about_how_the_project_was_developed_in_the_code():
    files = [f for f in _code_files() if f != Path(__file__)]
    found = _development_words(files, CODE_PROCESS_WORDS)
    assert not found, "the code speaks of the software, not of its development:\n" + "\n".join(found[:40])


README_SECTION = re.compile(r"""README(?:'s)?,?\s+\\?["“]([^"”\\]+)\\?["”]""")
"""A mention of a README section by its title: ``README "Quickstart"``, ``the README's "Results at a glance"``."""


def test_every_readme_section_and_page_named_anywhere_exists():
    """A docstring, comment, page or notebook that sends the reader to a README section names one
    the README has (its sections are few: anything longer lives in the documentation site), and
    one that names a documentation page by its path (``docs/results/detection.md``) names a page
    that exists."""
    headings = {m.group(1).strip().lower() for m in re.finditer(r"^#+\s+(.+)$", (REPO / "README.md").read_text(
        encoding="utf-8"), re.MULTILINE)}
    files = _prose_files() + _code_files()
    missing = []
    for file in files:
        if file == Path(__file__) or "__pycache__" in file.parts:
            continue
        text = file.read_text(encoding="utf-8", errors="replace")
        for m in README_SECTION.finditer(text):
            if m.group(1).strip().lower() not in headings:
                missing.append(f"{file.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}")
        for m in re.finditer(r"(?<![\w/.])docs/[\w/.-]+\.md\b", text):  # a page named by its path
            if not (REPO / m.group(0)).is_file():
                missing.append(f"{file.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}")
    assert not missing, "README sections or documentation pages that do not exist:\n" + "\n".join(missing)


def test_readme_is_the_front_door():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move the details into docs/"


# ---------------------------------------------------------------------------------------- links

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) and GitHub give a heading."""
    text = re.sub(r"<[^>]+>", "", heading).replace("`", "")
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = unicodedata.normalize("NFKD", text)
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    return {slug(h) for h in _HEADING.findall(text)}


def relative_links(page: Path) -> list[str]:
    text = _CODE.sub("", _FENCE.sub("", page.read_text(encoding="utf-8")))
    return [t for t in _LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def _pages() -> list[Path]:
    return [REPO / "README.md", REPO / "CHANGES.md", *sorted(DOCS.rglob("*.md"))]


def test_every_relative_link_resolves():
    broken = []
    for page in _pages():
        for target in relative_links(page):
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(REPO)}: ({target})"
            if not file.exists():
                broken.append(f"{where}: no such file")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{where}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert not broken, "\n".join(broken)


def test_mkdocs_builds_strict(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=REPO, capture_output=True, text=True, env={**_env(), "NO_MKDOCS_2_WARNING": "1"})
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    warnings = [line for line in log.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert not warnings, "\n".join(warnings)
    assert (tmp_path / "site" / "reference" / "api" / "index.html").is_file()


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


# ---------------------------------------------------------------------------------------- generated pages


def test_generated_pages_are_current(generate):
    files = generate.generate()
    stale = [str(p.relative_to(REPO)) for p in generate.stale(files)]
    assert not stale, (f"out of date: {stale}; run `python docs/generate.py` (or make docs) and check the "
                       "difference")


def test_every_option_has_a_help_text(generate):
    missing = set(generate.options_without_help())
    new = sorted(missing - KNOWN_WITHOUT_HELP)
    assert not new, f"options without a help text (the command line reference would show none): {new}"


def test_the_reference_names_every_subcommand_and_public_name(generate):
    from vision_attn.commands import SUBCOMMANDS

    cli = (DOCS / "reference" / "cli.md").read_text(encoding="utf-8")
    assert all(f"## vision-attn {name}\n" in cli for name in SUBCOMMANDS)
    api = "".join(p.read_text(encoding="utf-8") for p in (DOCS / "reference" / "api").glob("*.md"))
    for entries in generate.api_targets().values():
        for name, target in entries:
            assert f"::: {target}\n" in api or f"[{target}]" in api, name
    config = (DOCS / "reference" / "configuration.md").read_text(encoding="utf-8")
    for path in generate.shipped_class_paths():
        name = path.rsplit(".", 1)[-1]
        assert f"### {name}\n" in config or f"`{path}`" in config, path


# ---------------------------------------------------------------------------------------- results


def test_results_files_follow_the_schema_and_render_with_their_provenance(generate, tmp_path):
    from benchmarks.results_json import SCHEMA, machine_info, validate, write_results

    path = write_results(tmp_path / "r.json", page="performance", title="a pair", command="python -m benchmarks.x",
                         columns=["pair", {"name": "ratio", "format": ".2f"}], rows=[["a vs b", 0.5], ["c", None]],
                         notes=["random weights"])
    data = json.loads(path.read_text())
    assert data["schema"] == SCHEMA and not validate(data)
    assert data["machine"]["cores"] >= 1 and data["machine"]["cpu"]
    assert set(machine_info()) == set(data["machine"])
    page = generate.results_table("r.json", data)
    assert "python -m benchmarks.x" in page and data["date"] in page and data["commit"] in page
    assert data["machine"]["cpu"] in page and "| a vs b | 0.50 |" in page and "| c | – |" in page
    with pytest.raises(ValueError, match="rows\\[0\\]"):
        write_results(tmp_path / "bad.json", page="performance", title="t", command="c", columns=["a", "b"],
                      rows=[[1]])
    with pytest.raises(ValueError, match="page"):
        write_results(tmp_path / "bad.json", page="elsewhere", title="t", command="c", columns=["a"], rows=[])
    kept = write_results(tmp_path / "runs.json", page="performance", title="t", command="c", columns=["a"],
                         rows=[[1]], runs=[{"seed": 0, "map": 0.987654}])
    assert json.loads(kept.read_text())["runs"] == [{"seed": 0, "map": 0.987654}]  # kept, not rendered
    assert "0.98" not in generate.results_table("runs.json", json.loads(kept.read_text()))
    with pytest.raises(ValueError, match="runs"):
        write_results(tmp_path / "bad.json", page="performance", title="t", command="c", columns=["a"], rows=[],
                      runs=[[0, 0.5]])


def test_demo_summary_becomes_the_readmes_glance_rows(generate):
    from benchmarks.results_json import demo_results

    summary = {"classification": {"metrics": {"acc_top1": 0.9, "acc_macro": 0.9}, "train_seconds": 120.0,
                                  "headline": ["acc_top1"]},
               "detection": {"metrics": {"map": 0.5, "map_50": 0.8}, "train_seconds": 300.0, "headline": ["map"]}}
    data = demo_results(summary, date="2025-01-02", commit="abc1234", machine={"cpu": "a CPU", "cores": 2})
    glance = generate.glance_table([("demo.json", data)])
    assert "| classification |" in glance and "acc_top1 0.900" in glance and "2025-01-02" in glance
    assert "a CPU, 2 cores" in glance and "`make demo`" in glance
    assert [r[2] for r in data["rows"]] == ["acc_top1", "map", "map_50"]


def test_every_committed_results_file_is_rendered(generate):
    results = generate.load_results()  # raises on a file that does not follow the schema
    pages = generate.results_pages()
    for name, data in results:
        page = pages[generate.RESULTS / generate.PAGE_FILES[data["page"]]]
        assert f"`docs/results/{name}`" in page
