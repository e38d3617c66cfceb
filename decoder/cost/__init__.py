"""The verification cost: the model a profile is read into (model.py, `CostModel`), measuring a profile with
the harness's engine (profile.py, `python -m decoder profile`) or inside vLLM (vllm_profile.py), the engine it
is measured on (engine_choice.py, `--engine auto`), the spread of its repetitions (spread.py) and what a
profile may price (pricing.py), and what sizes the live decoder's trees (live.py, `--profile PATH|auto|flat`:
this machine's harness profile, measured once and cached).

May import: data, the top-level decoder modules, decoder.drafters and decoder.verify (a profile measures the
engine's forward). Imported by live, replay, vllm and __main__.
"""
