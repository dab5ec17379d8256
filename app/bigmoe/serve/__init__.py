"""Serving: checks before start, the paging file, the vLLM process, its records, log and metrics."""
