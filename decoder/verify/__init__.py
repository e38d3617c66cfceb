"""Verification by the model: the tree's mask, positions and greedy acceptance (tree.py), the engine that
decodes one request with a KV cache (engine.py: `decode_greedy`, `ModelVerifier`), ar-static's
static-cache greedy reference (reference.py), the static-shape compiled tree verifier (graph.py, `--verifier graph`), the lossless audit
(audit.py) and what a run's passes add up to (passes.py).

May import: data, the top-level decoder modules and decoder.drafters. Imported by cost, live, replay, vllm and
__main__.
"""
