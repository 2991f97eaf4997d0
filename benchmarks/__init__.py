"""Benchmarks and the workloads they run (not part of the batchrun package)."""
