"""The live decoder (`python -m decoder`): the serving harness that runs every arm over a benchmark side by side,
rounds interleaved (harness.py), and what it writes and prints per arm (results.py). Each drafter arm is verified
by the eager or the graph verifier and sized by this machine's harness profile (decoder/cost/live.py).

May import: data, the top-level decoder modules, decoder.drafters, decoder.verify and decoder.cost. Imported by
replay (its folders are written as the harness writes them), vllm and __main__.
"""
