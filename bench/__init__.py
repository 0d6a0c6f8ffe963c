"""Benchmarks of spot-trainer (issue 5): one command each, its ratio on its last line; see BENCHMARKS.md."""
