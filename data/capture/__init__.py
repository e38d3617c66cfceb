"""Producing a trace store: `python -m data capture` (run.py) decodes a benchmark greedily (greedy.py) or
teacher-forced (teacher.py) with a loaded model (models.py, kvcache.py), or by serving in vLLM (vllm_engine.py,
vllm_rows.py, vllm_capture.py, and served_store.py: serving writes the store); agreement.py compares two stores;
store_model.py records a store's model and checks --model against it (for the census and replay);
ray_capture.py runs the capture over Ray actors into a store set (`--ray`, on data/raycluster.py's set-up).

May import: data.store, data.benchmarks and the top modules (errors, stats, versions). Nothing in data imports it.
"""
