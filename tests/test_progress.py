"""Progress of long work: explanation measures and ONNX export say what they do and the time left."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from vision_attn.explain.measures import Localisation, Perturbation, Sanity
from vision_attn.explain.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def informed():
    """The vision_attn logger at INFO (the commands' level), restored after."""
    logger = logging.getLogger("vision_attn")
    before = logger.level
    logger.setLevel(logging.INFO)
    yield
    logger.setLevel(before)


def test_a_terminal_gets_a_bar_with_the_time_left(informed):
    term = _Terminal()
    with Progress("explanation measures: deletion / insertion curves", 4, "image", stream=term) as p:
        for _ in range(3):
            p.update()
        p.bar.refresh()  # tqdm redraws at most every 0.1 s
    out = term.getvalue()
    assert "explanation measures: deletion / insertion curves" in out and "3/4" in out and "<" in out  # tqdm's ETA


def test_without_a_terminal_log_lines_say_how_far_and_how_long(informed, caplog):
    caplog.set_level(logging.INFO, logger="vision_attn.progress")
    p = Progress("explanation measures: sanity check", 8, "image", stream=io.StringIO(), log_every=0.0)
    p.update(2)
    p.update(6)
    lines = [r.getMessage() for r in caplog.records if r.name == "vision_attn.progress"]
    assert lines[0].startswith("explanation measures: sanity check: 2/8 images,") and "left" in lines[0]
    assert lines[-1].startswith("explanation measures: sanity check: 8/8 images,") and "left" not in lines[-1]


def test_quiet_means_no_progress(caplog):
    logging.getLogger("vision_attn").setLevel(logging.WARNING)
    try:
        term = _Terminal()
        p = Progress("x", 2, stream=term, log_every=0.0)
        p.update(2)
        p.close()
        assert term.getvalue() == "" and not p.enabled
    finally:
        logging.getLogger("vision_attn").setLevel(logging.NOTSET)


def test_measures_report_their_items(informed, monkeypatch):
    seen: list[tuple[str, int | None, int]] = []
    real = Progress.update

    def spy(self, n=1):
        seen.append((self.desc, self.total, n))
        real(self, n)

    monkeypatch.setattr(Progress, "update", spy)
    curve = torch.linspace(1, 0, 5).repeat(3, 1)
    perturbation = Perturbation(first="rollout", total=6)
    for _ in range(2):
        perturbation.update({"rollout": {"deletion": curve, "insertion": curve.flip(-1)}})
    assert perturbation.compute() and perturbation._progress is None  # closed by compute
    sanity = Sanity(total=3)
    sanity.update({"rollout": {"all": torch.ones(3)}})
    loc = Localisation()
    loc.update({"rollout": torch.ones(4, 4).numpy()}, [[0, 0, 2, 2]])
    assert seen == [("explanation measures: deletion / insertion curves", 6, 3)] * 2 + [
        ("explanation measures: sanity check", 3, 3), ("explanation measures: localisation", None, 1)]
    assert Perturbation(progress=False).progress_enabled is False


def test_onnx_export_reports_its_steps(informed, caplog, tmp_path):
    pytest.importorskip("onnx")
    from vision_attn.export import export_onnx

    from .test_export import _checkpoint, _tasks

    caplog.set_level(logging.INFO, logger="vision_attn.progress")
    ckpt = _checkpoint(_tasks()["classification"], tmp_path / "m.ckpt")
    export_onnx(ckpt, tmp_path / "out" / "model.onnx")
    lines = [r.getMessage() for r in caplog.records if r.name == "vision_attn.progress"]
    assert [ln.split(":")[1].strip() for ln in lines] == [
        "tracing the classification model", "adding the metadata", "writing model.onnx", "wrote model.onnx"]
    assert lines[0].endswith("left") and "4/4 steps" in lines[-1]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.onnx"]
