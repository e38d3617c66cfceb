"""decoder: speculative decoding over the store, in rooms that import one way.

  top level          the one speculative loop and request runner (loop.py), the draft format and the drafter
                     contract (draft.py), whose traces a request drafts from (pools.py), a probability on every
                     draft node (calibration.py), the decision policy (policy.py) and the verdict (verdict.py);
                     __main__.py is the CLI (`python -m decoder ...`)
  decoder/drafters/  the training-free drafters, one per arm, and sizing a draft by the engine's cost (sizing.py)
  decoder/verify/    verification by the model: the tree kernels, the engine, the static-cache reference
                     (ar-static), the graph-captured tree verifier, the lossless audit, what passes add up to
  decoder/cost/      the verification cost: the cost model, measuring a profile (the harness or vLLM), the engine
                     it is measured on, the spread of its repetitions, what a profile may price
  decoder/live/      the live decoder (`python -m decoder`): every arm served side by side, sized by this
                     machine's profile, verified eagerly or by the graph verifier
  decoder/replay/    replay over a captured store: the command, its arm runs and workers, the trace verifier,
                     the table it prints, the ablations
  decoder/vllm/      the decoder inside vLLM: the Oilbird proposer, serving, one arm served (vllm-run)

Room order: each room imports only rooms before it, at module level and inside functions alike
(tests/test_layout.py ROOMS):
  decoder (top level) <- drafters <- verify <- cost <- live <- replay <- vllm <- __main__
__main__.py sits at the top but is a room of its own, last: it imports every room, at the point of use.
Outside: decoder imports data only; census and decoder import neither each other nor reports.
"""
