"""Benchmarks: workloads, arrivals, the serving benchmark client and its report."""
