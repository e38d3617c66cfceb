"""Benchmarks becoming requests: the registry (registry.py: names, loaders, grid limits), where their files come
from (sources.py: ../shared, the cache, pinned upstream commits), the tool-calling layouts (toolbench.py),
a user's JSONL traffic (jsonl.py), and the request itself (request.py).

May import: the top modules (errors, stats, versions) only.
"""
