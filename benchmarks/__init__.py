"""Benchmark and measurement scripts for fsdp-compile (not part of the installed package)."""
