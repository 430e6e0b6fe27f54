"""Side-by-side benchmarks (ratios measured in one process, medians of repeats); not tests."""
