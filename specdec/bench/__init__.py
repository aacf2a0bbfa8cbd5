"""Benchmarks: side-by-side runs in one process, reported as ratios (not timed tests)."""
