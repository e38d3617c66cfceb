"""The live decoder's verification cost (`python -m decoder --profile PATH|auto|flat`): what sizes the cost-aware
arms' trees (size auto, decoder/drafters/sizing.py) when the harness itself decodes.

  flat   every node costs the same: the whole candidate tree is verified (the fixed budget's tree);
  auto   (the default) this machine's harness profile for the model, device and dtype (decoder/cost/profile.py
         `measure_profile`, the verify forward the eager verifier runs), read from runs/profiles/<model>-<device>.json
         when it covers the run (its contexts, shortest to longest, and its node budget), else measured once before
         any timing, with the loaded model, and written there; a profile short only of some contexts has just
         those measured and merged in (`merge_profiles`), so it grows to cover every benchmark served;
  PATH   a harness profile file; one measured for another model, dtype or device, or by vLLM, is refused.

Each verifier has its own profile: the eager one's (`<model>-<device>.json`) and the graph verifier's
(`<model>-<device>-graph.json`: its step is flat within a row bucket, decoder/verify/graph.py), so that an arm is
sized by the cost of the forward that verifies it.

A tree grows only where a node pays on the machine that runs it: at context 300 on this CPU a 60-node verify
costs about 5x a 0-node one, so a flat cost verified trees that made the decoder slower than greedy on gsm8k.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from data.errors import OilbirdError

PROFILES = ("auto", "flat")  # besides a path
LIVE_REPS = 3


def live_contexts(prompt_lens: Sequence[int], max_new: int, points: int = 4) -> list[int]:
    """Context lengths the run's passes see: from the shortest prompt to the longest prompt plus the cap, at
    `points` quantiles, rounded up to 16 (the profile's grid; CostModel clamps between its ends)."""
    lo, hi = min(prompt_lens), max(prompt_lens) + max_new
    qs = np.quantile(np.array([lo, *prompt_lens, hi]), np.linspace(0, 1, points))
    return sorted({int(16 * np.ceil(max(q, 1) / 16)) for q in qs})


def live_nodes(nodes: int) -> list[int]:
    from decoder.cost.profile import DEFAULT_NODES

    return sorted({n for n in DEFAULT_NODES if n <= nodes} | {0, nodes})


def _fits(cost, lm, contexts: Sequence[int], nodes: int, verifier: str) -> str | None:
    """Why a profile cannot size this run (another model, dtype, device or engine; a range short of the run's);
    None when it can."""
    meta = cost.meta
    if meta.get("engine", "harness") != "harness":
        return f"was measured by {meta.get('engine')}, not this package's harness"
    if meta.get("verifier", "eager") != verifier:
        return f"times the {meta.get('verifier', 'eager')} verifier, not the {verifier} one"
    if meta.get("model_fingerprint") != lm.fingerprint:
        return f"is {meta.get('model')}'s, not {lm.name}'s"
    if meta.get("dtype") != str(lm.dtype).removeprefix("torch.") or meta.get("device") != lm.device.type:
        return f"was measured in {meta.get('dtype')} on {meta.get('device')}"
    if cost.nodes_range()[1] < nodes:
        return f"was measured up to {cost.nodes_range()[1]} draft nodes, not {nodes}"
    lo, hi = cost.contexts_range()
    if lo > min(contexts) or hi < max(contexts):  # outside its range the cost model clamps: a wrong price
        return f"was measured at contexts {lo}..{hi}, not {min(contexts)}..{max(contexts)}"
    return None


def missing_contexts(cost, contexts: Sequence[int]) -> list[int]:
    """The run's contexts outside the profile's measured range (inside it the cost model interpolates)."""
    lo, hi = cost.contexts_range()
    return [c for c in contexts if c < lo or c > hi]


def merge_profiles(old: dict, new: dict) -> dict:
    """`old` with `new`'s contexts added (both measured for the same model, device, dtype, verifier and node grid):
    the rows by context, `new`'s where both measured one; prefill points by prompt length, likewise. So a cached
    profile grows to cover every benchmark a machine serves instead of flipping between their ranges."""
    def by_context(d: dict) -> dict:
        lo, hi = d.get("verify_s_min", d["verify_s"]), d.get("verify_s_max", d["verify_s"])
        return {c: (d["verify_s"][i], lo[i], hi[i]) for i, c in enumerate(d["contexts"])}

    rows = {**by_context(old), **by_context(new)}
    prefill = dict(zip(old["prefill_lengths"], old["prefill_s"]))
    prefill.update(zip(new["prefill_lengths"], new["prefill_s"]))
    contexts, lengths = sorted(rows), sorted(prefill)
    return {**new, "contexts": contexts, "verify_s": [rows[c][0] for c in contexts],
            "verify_s_min": [rows[c][1] for c in contexts], "verify_s_max": [rows[c][2] for c in contexts],
            "prefill_lengths": lengths, "prefill_s": [prefill[n] for n in lengths],
            "merged": [*old.get("merged", []), {"created": old.get("created"), "contexts": old["contexts"]}]}


def live_profile_path(out: str, lm, verifier: str) -> Path:
    """Where `python -m decoder profile --engine harness --verifier V` writes this model's profile."""
    from decoder.cost.profile import profile_path

    return profile_path(out, lm.slug, lm.device.type, "harness", verifier)


def resolve_live_profile(spec: str, lm, prompt_lens: Sequence[int], max_new: int, nodes: int, out: str,
                         progress: bool = True, verifier: str = "eager", graph=None):
    """(CostModel or None for flat, the path it came from or None, what summary.json says sizes the drafts)."""
    from data.store.files import atomic_write_json
    from decoder.cost.model import CostModel
    from decoder.cost.profile import measure_profile

    if spec == "flat":
        return None, None, "flat"
    contexts = live_contexts(prompt_lens, max_new)
    if spec != "auto":
        path = Path(spec)
        cost = CostModel.load(path)
        why = _fits(cost, lm, contexts, nodes, verifier)
        if why and why.startswith("times the"):  # the user's choice: taken, and said
            print(f"note: --profile {path} {why}: its costs size the {verifier} verifier's arms", file=sys.stderr)
        elif why:
            raise OilbirdError(f"--profile {path}: the profile {why}; measure one with `python -m decoder profile "
                               f"--engine harness --model {lm.name}` or give --profile auto")
        return cost, path, f"harness profile {path}"
    path = live_profile_path(out, lm, verifier)
    why, old = "is missing", None
    if path.is_file():
        try:
            cost = CostModel.load(path)
            why = _fits(cost, lm, contexts, nodes, verifier)
        except OilbirdError as e:
            why = f"cannot be read ({e})"
        if why is None:
            return cost, path, f"harness profile {path}"
        if why.startswith("was measured at contexts") and cost.meta.get("nodes") == live_nodes(nodes):
            from data.readfile import read_json

            old, contexts = read_json(path, "decoder profile"), missing_contexts(cost, contexts)  # what it lacks
    print(f"note: --profile auto: the harness profile {path} {why}; measuring this machine's verification cost "
          f"with the {verifier} verifier once (contexts {','.join(map(str, contexts))}, up to {nodes} nodes; "
          f"{'added to it; ' if old else ''}untimed)", file=sys.stderr)
    d = measure_profile(lm, contexts, live_nodes(nodes), LIVE_REPS, progress, verifier=verifier, graph=graph)
    atomic_write_json(path, merge_profiles(old, d) if old else d)
    return CostModel.load(path), path, f"harness profile {path} (measured now)"


def check_profile_spec(spec: str) -> str:
    if spec in PROFILES:
        return spec
    if not Path(spec).is_file():
        raise OilbirdError(f"--profile must be auto, flat or a profile file (no file at {spec})")
    return spec
