"""Under ``CI=true`` a skipped test fails the run: a missing test dependency cannot hide."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from .conftest import REPO

_SKIPPING = '''
import pytest

def test_needs_a_missing_module():
    pytest.importorskip("vision_attn_no_such_module")

def test_runs():
    pass
'''


def _pytest(folder, ci: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(folder)],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def test_a_skip_fails_under_ci_and_only_skips_elsewhere(tmp_path):
    shutil.copy(REPO / "tests" / "_ci_policy.py", tmp_path / "conftest.py")
    (tmp_path / "test_skipping.py").write_text(_SKIPPING)
    local = _pytest(tmp_path, ci=False)
    assert local.returncode == 0 and "1 passed, 1 skipped" in local.stdout, local.stdout
    ci = _pytest(tmp_path, ci=True)
    assert ci.returncode == 1 and "1 failed, 1 passed" in ci.stdout, ci.stdout
    assert "vision_attn_no_such_module" in ci.stdout
