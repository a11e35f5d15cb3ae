"""Benchmarks with the real perf_analyzer (scenarios land with the perf issue)."""
