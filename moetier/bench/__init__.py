"""Benchmarks that measure every claim against baselines and link limits in the same run."""
