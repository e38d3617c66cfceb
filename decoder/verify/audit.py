"""The lossless audit: every arm's output against the reference greedy decoding, token for token,
and each mismatch classified as `numeric` or `algorithmic` (docs/lossless.md).

A speculative arm scores a draft tree in one forward; plain greedy decoding scores one token at a
time. In float32 the two agree to ~1e-5 in the logits and every arm's output equals greedy's. In
bfloat16 (and float16) the kernels round differently for 1 and for N query rows, so where two
tokens' logits are nearly tied the two computations can choose differently: the output changes
although no draft token was accepted that the model did not choose. That is a `numeric` mismatch.

Classification at the first differing position p (reference token a, arm token b), from the top-8
ids and logits of the forward row that chose each token (`Generation.chosen_ids/chosen_logits`):
  - `numeric` when the arm's row ranks b first (the arm committed its own argmax: acceptance was
    right), b is in the reference row's top-8 and a in the arm row's, and both gaps are within the
    dtype's rounding: ref_gap = logit_ref(a) - logit_ref(b) <= T and arm_gap = logit_arm(b) -
    logit_arm(a) <= T, with T = NUMERIC_MARGIN[dtype];
  - `algorithmic` otherwise: a token accepted that its own forward did not choose, a wrong context
    (the gap is then large), or outputs equal up to a different stop.
`margin` = max(ref_gap, arm_gap), the number compared with T (None where a token is outside the
other's top-8, or the outputs differ only in length); `ref_margin` and `arm_margin` are each row's
top-2 margin (top-1 logit minus top-2 logit).

T per dtype (NUMERIC_MARGIN): for a numeric flip ref_gap + arm_gap = |delta|, the change of the
(a, b) logit gap between one-token and tree scoring of the same context, so T bounds that change.
`make bench-numerics` measures it (benchmarks/bench_numerics.py: greedy decoding, then the same
tokens re-scored in tree passes of 2-60 nodes, |delta| of each position's top-2 gap) and T is set
to twice the largest |delta| measured, rounded up; the figures and the command are in
docs/lossless.md.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

# Twice the largest |delta| of the top-2 logit gap between one-token and tree scoring that
# `make bench-numerics` measured (SmolLM2-135M, API-Bank; docs/lossless.md), rounded up.
NUMERIC_MARGIN = {"float32": 1e-4, "bfloat16": 1.0, "float16": 0.125}
NUMERIC = "numeric"
ALGORITHMIC = "algorithmic"


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first position where two token lists differ (a prefix differs at the shorter length)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _logit(ids: np.ndarray, logits: np.ndarray, token: int) -> float | None:
    """The logit of `token` in a row's top-8, or None when it is not there."""
    hit = np.flatnonzero(np.asarray(ids) == token)
    return float(logits[hit[0]]) if hit.size else None


def classify(ref_token: int, ref_ids: np.ndarray, ref_logits: np.ndarray, arm_token: int,
             arm_ids: np.ndarray, arm_logits: np.ndarray, threshold: float) -> dict:
    """One mismatch's kind and margins from the two rows that chose the differing tokens."""
    ref_margin = float(ref_logits[0] - ref_logits[1])
    arm_margin = float(arm_logits[0] - arm_logits[1])
    ref_b, arm_a, arm_b = (_logit(ref_ids, ref_logits, arm_token), _logit(arm_ids, arm_logits, ref_token),
                           _logit(arm_ids, arm_logits, arm_token))
    own_argmax = arm_b is not None and arm_b >= float(arm_logits[0])  # ties count: the row's maximum
    margin = None
    if ref_b is not None and arm_a is not None and arm_b is not None:
        ref_a = _logit(ref_ids, ref_logits, ref_token)
        ref_gap = (ref_a if ref_a is not None else float(ref_logits[0])) - ref_b
        margin = max(ref_gap, arm_b - arm_a)
    numeric = own_argmax and margin is not None and margin <= threshold
    return {"kind": NUMERIC if numeric else ALGORITHMIC, "margin": margin, "ref_margin": ref_margin,
            "arm_margin": arm_margin, "arm_chose_own_argmax": bool(own_argmax)}


def lossless_audit(arm_generations: list, reference_generations: list, request_ids: list[str],
                   dtype: str, reference: str = "ar") -> dict:
    """Exact comparison with the reference, every mismatch classified (module docstring).

    `lossless` is exact equality of every request; `numeric` + `algorithmic` = the mismatches.
    Generations without the audit's evidence (chosen_ids) classify as algorithmic with no margin."""
    threshold = NUMERIC_MARGIN.get(dtype, NUMERIC_MARGIN["float32"])
    mismatches = []
    for r, (g, ref) in enumerate(zip(arm_generations, reference_generations)):
        pos = first_difference(g.tokens, ref.tokens)
        if pos is None:
            continue
        row = {"request": r, "id": request_ids[r], "first_diff": pos, "ar_tokens": len(ref.tokens),
               "arm_tokens": len(g.tokens)}
        both = pos < min(len(g.tokens), len(ref.tokens))
        if both and g.chosen_ids is not None and ref.chosen_ids is not None:
            row.update(classify(ref.tokens[pos], ref.chosen_ids[pos], ref.chosen_logits[pos], g.tokens[pos],
                                g.chosen_ids[pos], g.chosen_logits[pos], threshold))
        else:  # same tokens, another stop; or no evidence recorded
            row.update({"kind": ALGORITHMIC, "margin": None, "ref_margin": None, "arm_margin": None,
                        "arm_chose_own_argmax": None})
        mismatches.append(row)
    n = len(arm_generations)
    numeric = sum(m["kind"] == NUMERIC for m in mismatches)
    return {"reference": reference, "requests": n, "matched": n - len(mismatches), "lossless": not mismatches,
            "dtype": dtype, "numeric_threshold": threshold, "numeric": numeric,
            "algorithmic": len(mismatches) - numeric, "mismatches": mismatches}
