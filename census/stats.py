"""The census's intervals: they live in data/stats.py, shared with the decoder's replay (one definition)."""

from data.stats import Z95, RequestBootstrap, mean_of, median_of, proportion, wilson  # noqa: F401
