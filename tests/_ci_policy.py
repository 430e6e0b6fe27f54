"""A pytest hook: under ``CI=true`` a skipped test is a failure (imported by conftest.py; kept free
of heavy imports so that its own test can run it as a conftest in a folder of its own)."""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Under CI (``CI=true``) a skipped test is a failure: a missing test dependency (Chromium,
    Playwright, ONNX Runtime) must not let the suite pass without running what it proves."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("CI", "").lower() in ("1", "true", "yes") and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, which runs every test: {reason}"
