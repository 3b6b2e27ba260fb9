"""Benchmarks (not tests): throughput and speed-up measurements."""
