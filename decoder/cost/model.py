"""The verification-cost model a profile is read into (`CostModel`) and the check of its times (`check_times`),
split from decoder/cost/profile.py (which measures and writes profiles, and imports these back): seconds of one
verification forward, verify_s(nodes, past_len), bilinear over the measured grid, and of prefill,
prefill_s(prompt_len). Imports nothing of the decoder's measuring side (no model, no vLLM)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from data.errors import OilbirdError

FORMAT = 1
REQUIRED_KEYS = ("format", "model", "model_fingerprint", "nodes", "contexts", "verify_s", "prefill_lengths", "prefill_s")


def _segments(x: np.ndarray, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(i, t) with x = xs[i] + t (xs[i+1] - xs[i]), i the segment (end segments for x outside: t < 0 or > 1)."""
    i = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2)
    return i, (x - xs[i]) / (xs[i + 1] - xs[i])


def _as_grid(xs: Sequence[float]) -> np.ndarray:
    """A one-point axis becomes two points one apart holding the same values (constant along it)."""
    xs = np.asarray(xs, dtype=np.float64)
    return np.array([xs[0], xs[0] + 1.0]) if len(xs) == 1 else xs


# A profile's times are medians of measured runs: a slow run (a busy machine) makes a point larger, never smaller,
# and on a tiny model a point several times its neighbours' (7.4 ms for no draft node, 1.3 ms for two: measured
# here, one run a point). So each cost is compared with the cheapest of at least two costs measured below it on
# the same axis (fewer nodes at the same context, a shorter context at the same nodes, a shorter prompt): one
# slow point is never the evidence. It is refused under 1/ORDER_FACTOR of them: no timing noise makes a larger
# forward that much cheaper than two smaller ones, while a sign flipped, a unit or an axis mixed up does.
ORDER_FACTOR = 3


def _seconds(v: float) -> str:
    return f"{float(v):.4g}"


def check_times(contexts: np.ndarray, nodes: np.ndarray, verify: np.ndarray, prefill_lengths: np.ndarray,
                prefill: np.ndarray, name: str = "verify_s") -> None:
    """One ValueError line for times that are no measurement: a time that is not positive and finite (every
    verify_s negated priced "est. speedup 0.08x", zeros 0.88x, a negative prefill_s was clamped to 0), or a
    cost under 1/ORDER_FACTOR of the cheapest of the two or more below it, or every row's cost at the most nodes
    under 1/ORDER_FACTOR of its cost at the fewest (the comment above)."""
    for label, grid in ((name, verify), ("prefill_s", prefill)):
        bad = np.argwhere(~(np.isfinite(grid) & (grid > 0)))
        if len(bad):
            at = tuple(int(i) for i in bad[0])
            raise ValueError(f"{label}{''.join(f'[{i}]' for i in at)} = {float(grid[at])!r} is not a positive time "
                             "(seconds, measured)")

    def first_drop(costs: np.ndarray) -> tuple[int, int] | None:  # (index, index of the cheapest one below it)
        for j in range(2, len(costs)):
            k = int(np.argmin(costs[:j]))
            if costs[j] * ORDER_FACTOR < costs[k]:
                return j, k
        return None

    for i, c in enumerate(contexts):
        drop = first_drop(verify[i])
        if drop:
            j, k = drop
            raise ValueError(f"{name} at context {int(c)}: {int(nodes[j])} nodes cost {_seconds(verify[i, j])} s, "
                             f"less than 1/{ORDER_FACTOR} of the {_seconds(verify[i, k])} s of {int(nodes[k])} nodes")
    # a whole row falling from its fewest nodes to its most (the grid reversed): a slow point is one row's, not every
    # row's (each row is measured at its own time)
    if len(contexts) >= 2 and len(nodes) >= 2 and np.all(verify[:, -1] * ORDER_FACTOR < verify[:, 0]):
        raise ValueError(f"{name}: at every context, {int(nodes[-1])} nodes cost less than 1/{ORDER_FACTOR} of "
                         f"{int(nodes[0])} nodes ({_seconds(verify[0, -1])} s against {_seconds(verify[0, 0])} s at "
                         f"context {int(contexts[0])})")
    for j, n in enumerate(nodes):
        drop = first_drop(verify[:, j])
        if drop:
            i, k = drop
            raise ValueError(f"{name} at {int(n)} nodes: context {int(contexts[i])} costs {_seconds(verify[i, j])} s, "
                             f"less than 1/{ORDER_FACTOR} of the {_seconds(verify[k, j])} s of context {int(contexts[k])}")
    drop = first_drop(prefill)
    if drop:
        i, k = drop
        raise ValueError(f"prefill_s: {int(prefill_lengths[i])} tokens cost {_seconds(prefill[i])} s, less than "
                         f"1/{ORDER_FACTOR} of the {_seconds(prefill[k])} s of {int(prefill_lengths[k])} tokens")


class CostModel:
    """Seconds of one verification forward, verify_s(nodes, past_len), and of prefill, prefill_s(prompt_len).

    verify_s: bilinear over the measured (context, nodes) grid, never extrapolated: a context or node count
    outside the measured range takes the value at the nearest measured one (a replay that would price such
    a step refuses first, or notes it: decoder/cost/pricing.py; the cost-sized drafts never ask beyond the
    measured nodes: decoder/drafters/sizing.py). prefill_s: piecewise linear between the measured lengths and from
    (0 tokens, 0 s) up to the first; the last measured value beyond the last.
    Both take scalars (-> float) or numpy arrays (broadcast; -> array).
    """

    def __init__(self, contexts: Sequence[int], nodes: Sequence[int], verify: np.ndarray,
                 prefill_lengths: Sequence[int], prefill: Sequence[float], meta: dict | None = None):
        self.contexts = np.asarray(contexts, dtype=np.float64)
        self.nodes = np.asarray(nodes, dtype=np.float64)
        self.verify = np.asarray(verify, dtype=np.float64)
        self.prefill_lengths = np.asarray(prefill_lengths, dtype=np.float64)
        self.prefill = np.asarray(prefill, dtype=np.float64)
        self.meta = dict(meta or {})
        self.by_batch: dict[int, "CostModel"] = {}  # batch size >= 2 -> the cost model of such a step
        if self.verify.shape != (len(self.contexts), len(self.nodes)) or self.verify.size == 0:
            raise ValueError(f"verify_s has shape {self.verify.shape}, expected "
                             f"{(len(self.contexts), len(self.nodes))} (contexts x nodes)")
        if len(self.prefill) != len(self.prefill_lengths) or len(self.prefill) == 0:
            raise ValueError("prefill_s and prefill_lengths differ in length or are empty")
        for name, axis in (("contexts", self.contexts), ("nodes", self.nodes), ("prefill_lengths", self.prefill_lengths)):
            if np.any(np.diff(axis) <= 0):
                raise ValueError(f"{name} must be strictly increasing")
        check_times(self.contexts, self.nodes, self.verify, self.prefill_lengths, self.prefill,
                    "verify_s" if "batch_size" not in self.meta else f"verify_s_by_batch[{self.meta['batch_size']}]")
        self._floor = float(self.verify.min())
        # one-point axes are made constant by duplicating the point
        self._cx = _as_grid(self.contexts)
        self._nx = _as_grid(self.nodes)
        v = self.verify
        self._v = np.concatenate([v, v], 0) if len(self.contexts) == 1 else v
        self._v = np.concatenate([self._v, self._v], 1) if len(self.nodes) == 1 else self._v

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        missing = [k for k in REQUIRED_KEYS if k not in d] if isinstance(d, dict) else list(REQUIRED_KEYS)
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        if d["format"] != FORMAT:
            raise ValueError(f"format {d['format']}, this version reads {FORMAT}")
        meta = {k: v for k, v in d.items() if k not in ("verify_s", "prefill_s", "verify_s_by_batch")}
        model = cls(d["contexts"], d["nodes"], np.asarray(d["verify_s"], dtype=np.float64),
                    d["prefill_lengths"], d["prefill_s"], meta)
        by_batch = d.get("verify_s_by_batch") or {}
        if not isinstance(by_batch, dict):
            raise ValueError("verify_s_by_batch is not a mapping of batch size to a grid")
        for b, grid in by_batch.items():
            if not str(b).isdigit() or int(b) < 2:
                raise ValueError(f"verify_s_by_batch has batch size {b!r}")
            model.by_batch[int(b)] = cls(d["contexts"], d["nodes"], np.asarray(grid, dtype=np.float64),
                                         d["prefill_lengths"], d["prefill_s"], {**meta, "batch_size": int(b)})
        return model

    def nodes_range(self) -> tuple[int, int]:
        """The fewest and the most draft nodes the profile measured."""
        return int(self.nodes[0]), int(self.nodes[-1])

    def contexts_range(self) -> tuple[int, int]:
        """The shortest and the longest context the profile measured."""
        return int(self.contexts[0]), int(self.contexts[-1])

    def batch_sizes(self) -> list[int]:
        """The batch sizes this profile prices: 1 and every measured `verify_s_by_batch` size."""
        return [1, *sorted(self.by_batch)]

    def at_batch(self, batch: int, arm: str | None = None) -> "CostModel":
        """The cost model of a step of `batch` rows (each verifying `nodes` draft tokens); one line when the
        profile did not measure that batch size (naming `arm`, the arm sized for it, when given)."""
        if batch == 1:
            return self
        if batch not in self.by_batch:
            who = f"arm {arm} is sized for batch {batch}, but " if arm else ""
            wider = sorted({*self.batch_sizes(), batch})
            raise OilbirdError(f"{who}the profile {self.meta.get('path', '')} measured batch sizes "
                               f"{', '.join(map(str, self.batch_sizes()))}, not {batch}: remeasure it with "
                               f"`python -m decoder profile --engine vllm --batch-sizes {','.join(map(str, wider))}`")
        return self.by_batch[batch]

    @classmethod
    def load(cls, path: str | Path, model_fingerprint: str | None = None, model: str | None = None) -> "CostModel":
        """Read a profile; one-line OilbirdError when it is missing, malformed, or for another model
        (`model` only names the model in the messages)."""
        from data.readfile import read_json

        path = Path(path)
        want = model or "M"
        make = f"make one with `python -m decoder profile --model {want}`"
        if not path.exists():
            raise OilbirdError(f"no decoder profile at {path}: {make}")
        try:  # bounded: a regular file, its size and nesting (a FIFO or /dev/zero is refused, never read)
            d = read_json(path, "decoder profile")
        except OilbirdError as e:
            raise OilbirdError(f"{e}: not a decoder profile; {make}") from None
        try:
            cm = cls.from_dict(d)
        except (ValueError, TypeError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise OilbirdError(f"{path} is not a decoder profile ({reason}); make one with "
                               f"`python -m decoder profile --model {want}`") from None
        if model_fingerprint is not None and d["model_fingerprint"] != model_fingerprint:
            want = model or f"<the model with fingerprint {model_fingerprint}>"
            raise OilbirdError(f"profile {path} was measured for model {d['model']} ({d['model_fingerprint']}), "
                               f"not {want} ({model_fingerprint}): make one with `python -m decoder profile --model {want}`")
        return cm

    def verify_s(self, nodes, past_len):
        # clamped to the measured grid: what was not measured is never extrapolated (class docstring)
        n = np.clip(np.asarray(nodes, dtype=np.float64), self.nodes[0], self.nodes[-1])
        c = np.clip(np.asarray(past_len, dtype=np.float64), self.contexts[0], self.contexts[-1])
        i, s = _segments(c, self._cx)
        j, t = _segments(n, self._nx)
        v = self._v
        out = ((1 - s) * ((1 - t) * v[i, j] + t * v[i, j + 1])
               + s * ((1 - t) * v[i + 1, j] + t * v[i + 1, j + 1]))
        out = np.maximum(out, self._floor)
        return float(out) if out.ndim == 0 else out

    def prefill_s(self, prompt_len):
        # a prefill of no tokens takes no time: (0, 0) is the curve's first point, so a prompt shorter than the
        # shortest measured one is interpolated, not extrapolated; beyond the longest, its value (never priced:
        # decoder/cost/pricing.py refuses longer prompts)
        x = np.clip(np.asarray(prompt_len, dtype=np.float64), 0.0, self.prefill_lengths[-1])
        lengths, times = self.prefill_lengths, self.prefill
        if lengths[0] > 0:
            lengths, times = np.concatenate([[0.0], lengths]), np.concatenate([[0.0], times])
        if len(lengths) == 1:  # one profile point at 0 tokens: constant
            out = np.full_like(x, times[0])
        else:
            i, t = _segments(x, lengths)
            out = np.maximum((1 - t) * times[i] + t * times[i + 1], 0.0)
        return float(out) if out.ndim == 0 else out
