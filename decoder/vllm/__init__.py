"""The decoder inside vLLM: the Oilbird arms as a `custom_class` proposer (proposer.py), serving with it
(serve.py, `python -m decoder serve`) and one arm serving a benchmark for the bench and the report (run.py,
`python -m decoder vllm-run`). The profile measured inside vLLM is decoder/cost/vllm_profile.py.

May import: data and every other room of decoder (top level, drafters, verify, cost, replay). Only __main__
imports it, at the point of use (lazily), so a decoder without vLLM installed still imports.
"""
