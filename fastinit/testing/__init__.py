"""Helpers for tests and benchmarks: real multi-rank runs, reference models, the stock path."""
