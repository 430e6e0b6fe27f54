"""The benchmarks run (on tiny sizes); their numbers are reported, not asserted."""

from __future__ import annotations

from benchmarks.explain_overhead import run


def test_explain_overhead_runs_tiny():
    r = run("vit_tiny_patch16_224", img=32, batch=2, repeats=1, patch_size=8, depth=2, embed_dim=32, num_heads=2)
    assert set(r["median_s"]) == {"forward", "forward_capture", "rollout"}
    assert r["capture_over_forward"] > 0 and r["rollout_over_forward"] > 0


def test_caption_kv_cache_runs_tiny():
    from benchmarks.caption_kv_cache import run as run_cache

    r = run_cache(tokens=6, batch=2, beam=2, hidden=16, layers=1, heads=2, vocab=20, grid=2, in_dim=8, repeats=1)
    assert r["same_tokens"] and r["speedup"] > 0 and set(r["median_s"]) == {"cached", "uncached"}


def test_benchmark_suite_runs_tiny_and_reports_every_pair():
    from benchmarks.suite import format_table, run_all

    result = run_all(quick=True)
    pairs = [r["pair"] for r in result["rows"]]
    assert len(pairs) == 10 and len(set(pairs)) == 10
    assert all(r["ratio"] > 0 and isinstance(r["met"], bool) for r in result["rows"])
    assert format_table(result).count("\n") == 11
