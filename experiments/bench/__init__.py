"""Benchmarks (each prints JSON lines; figures in experiments/results/) and the round profiler."""
