"""Benchmarks of spes-node against its alternatives (DiLoCo-style full sync, centralized training).

Not tests: each benchmark prints a table and writes its numbers to `benchmarks/results/<name>.json`;
`python -m benchmarks` runs them all and gathers the headline ratios in `benchmarks/results/latest.json`.
"""
