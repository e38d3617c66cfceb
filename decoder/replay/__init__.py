"""Replay: every drafter over a captured trace store, without the model. The command (run.py, `python -m
decoder replay`), its arm runs in this process, worker processes or Ray tasks (arms.py; workers.py: how
many, and that they die with the replay), the store as the verifier (traces.py), the table it prints
(table.py) and the ablations by replay (ablations.py, `python -m decoder ablations`).

May import: data, the top-level decoder modules, decoder.drafters, decoder.verify and decoder.cost.
Imported by vllm and __main__.
"""
