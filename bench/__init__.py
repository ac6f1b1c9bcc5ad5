"""Benchmark scripts (``python -m bench.<name>``). Figures go to docs/, never into timed tests."""
