"""Benchmarks. Each prints a table, writes JSON under results/, and reports ratios against
a baseline measured in the same run (these machines are shared and noisy)."""
