"""A verification-cost profile prices only what it measured (issue 35, item 2).

A profile (decoder/cost/profile.py) is measured over some node counts, context lengths and batch sizes. A replay
prices plain greedy decoding and every arm's passes with it (decoder/replay/run.py `estimate`). Before the replay
runs, `check_coverage` refuses, in one line naming the arm, the quantity, the measured range and the command
that measures a wider profile:
  - an arm sized for a batch size the profile did not measure (`arm@batch=B`);
  - greedy decoding's step, 0 draft nodes (the baseline of every speedup), when the profile did not measure 0;
  - passes of more draft nodes than the profile measured: a fixed-size arm may fill its whole budget, so its
    budget is what is checked; a cost-sized arm (size auto, decoder/drafters/sizing.py) chooses among the measured
    counts only (its search stops at the largest), so its budget may exceed them: that is no extrapolation;
  - steps over a longer context (tokens already in the cache) than the longest measured, and prompts longer
    than the longest measured prefill.
After the replay, `check_passes` checks every arm's passes themselves, so nothing is priced beyond the
measured nodes even should an arm outgrow its budget.

Contexts shorter than the shortest measured one are not refused: they are priced at it (CostModel clamps),
and the summary says so (`estimate.context_note`: how many of greedy's steps, from which context). A step
over a shorter cache does no more work than one over a longer cache, so this prices those steps at most at
what they cost, greedy's and the arm's alike; and a profile measured from a store written before its
shortest context was measured (the 10% quantile, older decoder/cost/profile.py) still prices it. Longer contexts
are refused instead, even slightly longer ones: that is where the traffic grows (an extended store), and a
step there may cost more than anything measured. docs/replay.md says the same.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from data.errors import OilbirdError

CONTEXT_ROUND = 16  # a context the wider profile should measure is rounded up to this (decoder/cost/profile.py's grid)


@dataclass(frozen=True)
class PricedSpan:
    """What a replay's estimate prices, from its traces: greedy's steps bound every arm's."""

    shortest_context: int  # tokens in the cache at the first step of the shortest prompt
    longest_context: int  # ... at the last step of the longest request
    longest_prompt: int  # the longest prefill
    steps: int  # greedy's steps (one per generated token)
    steps_below: int  # ... of which over a context shorter than the profile's shortest


def priced_span(prompt_lengths: Sequence[int], generated: Sequence[int], shortest_measured: int) -> PricedSpan:
    """The contexts and prompt lengths a replay of these requests prices (decoder/replay/run.py `estimate`: the
    cache holds the prompt minus its last token, the anchor, then one more token per step)."""
    prompt = np.asarray(prompt_lengths, dtype=np.int64)
    tokens = np.asarray(generated, dtype=np.int64)
    live = tokens > 0
    first, last = prompt[live] - 1, prompt[live] + tokens[live] - 2
    below = np.clip(np.minimum(last + 1, shortest_measured) - first, 0, None)  # steps with context < shortest
    return PricedSpan(int(first.min()) if live.any() else 0, int(last.max()) if live.any() else 0,
                      int(prompt.max()) if len(prompt) else 0, int(tokens.sum()), int(below.sum()))


def widen_command(cost, nodes: int | None = None, context: int | None = None, batch: int | None = None) -> str:
    """The `python -m decoder profile` command that measures the same profile, widened to cover `nodes` draft
    nodes, a `context`-token context and `batch` rows a step; it overwrites the profile file."""
    meta = cost.meta
    node_list = sorted({0, *(int(n) for n in cost.nodes), *([nodes] if nodes is not None else [])})
    contexts = {int(c) for c in cost.contexts}
    if context is not None:
        contexts.add(max(CONTEXT_ROUND, math.ceil(context / CONTEXT_ROUND) * CONTEXT_ROUND))
    engine = meta.get("engine", "harness")
    parts = ["python -m decoder profile", "--model", shlex.quote(str(meta.get("model", "M"))), "--engine", engine,
             "--nodes", ",".join(map(str, node_list)), "--contexts", ",".join(map(str, sorted(contexts)))]
    batches = sorted({*cost.batch_sizes(), *([batch] if batch else [])})
    if engine == "vllm" and len(batches) > 1:
        parts += ["--batch-sizes", ",".join(map(str, batches))]
    if engine == "vllm" and meta.get("vllm_mode") == "eager":
        parts += ["--vllm-eager"]  # the mode it was measured in
    if meta.get("path"):
        parts += ["--file", shlex.quote(str(meta["path"]))]
    return " ".join(parts)


def arm_batch(arm: str) -> int:
    """The batch size an arm sizes its drafts for (`@batch=B`; 1 otherwise): the batch its estimate prices."""
    from decoder.drafters import parse_variant

    value = parse_variant(arm)[1].get("batch")
    return int(value) if value and value.isdigit() else 1


def _refuse(arm: str, what: str, measured: str, cost, **wider) -> OilbirdError:
    return OilbirdError(f"arm {arm}: {what}, but the profile {cost.meta.get('path', '')} measured {measured}: "
                        f"measure a wider one with `{widen_command(cost, **wider)}`")


def check_nodes(cost, arm: str, most: int) -> None:
    """Refuse pricing `arm`'s passes of up to `most` draft nodes, or greedy's 0-node step, outside the measured
    node counts."""
    lo, hi = cost.nodes_range()
    if lo > 0:
        raise _refuse(arm, "plain greedy decoding, the baseline of its speedup, verifies 0 draft nodes a step",
                      f"draft nodes {lo}..{hi}", cost, nodes=most)
    if most > hi:
        raise _refuse(arm, f"its passes verify up to {most} draft nodes", f"draft nodes {lo}..{hi}", cost, nodes=most)


def check_coverage(cost, arms: Sequence[str], budgets: Sequence[int], cost_sized: Sequence[bool],
                   span: PricedSpan) -> str | None:
    """Refuse, before the replay runs, what the profile did not measure (module docstring); the note for
    the summary when some contexts are shorter than the shortest measured (None: none are)."""
    lo_c, hi_c = cost.contexts_range()
    for arm, sized in zip(arms, cost_sized):
        cost.at_batch(arm_batch(arm), arm)
        check_nodes(cost, arm, 0 if sized else max(budgets))  # a cost-sized arm stays within the measured nodes
        if span.longest_context > hi_c:
            raise _refuse(arm, f"its requests reach contexts of {span.longest_context} tokens",
                          f"contexts {lo_c}..{hi_c}", cost, context=span.longest_context)
        longest_prefill = int(cost.prefill_lengths[-1])
        if span.longest_prompt > longest_prefill:
            raise _refuse(arm, f"its prompts run to {span.longest_prompt} tokens",
                          f"prefills of up to {longest_prefill} tokens", cost, context=span.longest_prompt)
    if not span.steps_below:
        return None
    return (f"{span.steps_below} of greedy's {span.steps} steps ({100 * span.steps_below / span.steps:.1f}%) have "
            f"contexts below the profile's shortest measured one, {lo_c} tokens (down to {span.shortest_context}): "
            f"priced at {lo_c} (a shorter cache costs no more; docs/replay.md)")


def cost_sized_arms(arms: Sequence[str], sizing: str) -> list[bool]:
    """Per arm, whether the profile sizes its drafts (size auto under `--sizing profile`): its passes then
    verify only node counts the profile measured (decoder/drafters/sizing.py StepCost)."""
    from decoder.drafters import make_drafter

    if sizing != "profile":
        return [False] * len(arms)
    return [getattr(getattr(make_drafter(a, vocab_size=2, nodes=1), "config", None), "size", None) == "auto"
            for a in arms]
