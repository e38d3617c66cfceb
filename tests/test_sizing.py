"""The cost rule (decoder/drafters/sizing.py) and the node probabilities (decoder/calibration.py): exact arrays and
brute-force references."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from decoder.calibration import (
    COMBINED,
    ECE_BINS,
    NodeCalibrator,
    accepted_labels,
    expected_calibration_error,
    merge_summaries,
    position_bucket,
)
from decoder.draft import Draft, best_path, subtree
from decoder.cost.profile import CostModel
from decoder.drafters.sizing import (
    StepCost,
    best_count,
    path_probs,
    select_chain,
    select_tree,
)

# a small tree: 0 -> 1 -> 2, 0 -> 3, root -> 4 -> 5
PARENTS = [-1, 0, 1, 0, -1, 4]
PROBS = [0.9, 0.8, 0.5, 0.3, 0.6, 0.95]


def test_path_probs_exact():
    assert path_probs(PARENTS, PROBS).tolist() == pytest.approx([0.9, 0.72, 0.36, 0.27, 0.6, 0.57])


def _closed(parents, keep) -> bool:
    return all(parents[i] == -1 or parents[i] in keep for i in keep)


def _brute_tree(parents, probs, step_s) -> float:
    P = path_probs(parents, probs)
    best = 1.0 / step_s[0]
    for r in range(1, len(parents) + 1):
        for keep in itertools.combinations(range(len(parents)), r):
            if _closed(parents, set(keep)):
                best = max(best, (1.0 + P[list(keep)].sum()) / step_s[r])
    return best


@pytest.mark.parametrize("slope", [0.0, 0.05, 0.2, 0.6, 2.0])
def test_select_tree_matches_brute_force(slope):
    step_s = 1.0 + slope * np.arange(len(PARENTS) + 1)
    keep = select_tree(path_probs(PARENTS, PROBS), step_s)
    assert _closed(PARENTS, set(keep)) and keep == sorted(keep)
    P = path_probs(PARENTS, PROBS)
    assert (1.0 + P[keep].sum()) / step_s[len(keep)] == pytest.approx(_brute_tree(PARENTS, PROBS, step_s))


def test_select_tree_random_trees_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(40):
        n = int(rng.integers(1, 8))
        parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
        probs = rng.uniform(0.01, 0.99, n).tolist()
        step_s = np.cumsum(np.concatenate([[1.0], rng.uniform(0, 0.5, n)]))  # a step never gets cheaper
        keep = select_tree(path_probs(parents, probs), step_s)
        assert _closed(parents, set(keep))
        P = path_probs(parents, probs)
        assert (1 + P[keep].sum()) / step_s[len(keep)] == pytest.approx(_brute_tree(parents, probs, step_s))


def test_flat_cost_keeps_every_node_and_steep_cost_none():
    assert select_tree(path_probs(PARENTS, PROBS), np.ones(7)) == list(range(6))
    assert select_tree(path_probs(PARENTS, PROBS), 1.0 + 10.0 * np.arange(7)) == []
    assert best_count(np.array([0.5, 0.4]), np.array([1.0, 1.2, 1.5])) == 2  # 1.5/1.2 = 1.25 < 1.9/1.5 = 1.27


def test_chain_is_the_most_probable_path_cut_by_the_rule():
    assert best_path(PARENTS, PROBS, 8) == [0, 1, 2]  # 0.9 beats 0.6 at the root; 0.8 beats 0.3 below
    assert best_path(PARENTS, PROBS, 2) == [0, 1]
    # P = 0.9, 0.72, 0.36: with a step of 1 + 0.3 n, the values are 1, 1.46, 1.63, 1.56: two nodes
    step_s = 1.0 + 0.3 * np.arange(4)
    assert select_chain(PARENTS, PROBS, path_probs(PARENTS, PROBS), step_s, 3) == [0, 1]
    for n in range(4):  # brute force over the chain's prefixes
        value = (1 + path_probs(PARENTS, PROBS)[[0, 1, 2][:n]].sum()) / step_s[n]
        assert value <= (1 + 0.9 + 0.72) / step_s[2] + 1e-12


def test_subtree_keeps_sources_evidence_and_probs():
    d = Draft()
    a = d.add_chain([10, 11, 12], "spine", 60, feature=3)
    assert a == 3
    d.add_chain([10, 20], "semantic", 60, feature=9)
    d.probs = [0.9, 0.8, 0.7, 0.6]
    s = subtree(d, [0, 3])
    assert s.tokens == [10, 20] and s.parents == [-1, 0]
    assert s.sources == [{"spine", "semantic"}, {"semantic"}]
    assert s.evidence == [{"spine": (3, 0), "semantic": (9, 0)}, {"semantic": (9, 1)}]
    assert s.probs == [0.9, 0.6]


def test_step_cost_from_a_profile_and_its_batch():
    d = {"format": 1, "model": "m", "model_fingerprint": "f", "nodes": [0, 8, 64], "contexts": [100, 500],
         "verify_s": [[0.02, 0.03, 0.1], [0.02, 0.03, 0.1]], "prefill_lengths": [1, 500], "prefill_s": [0.1, 0.2],
         "verify_s_by_batch": {"8": [[0.05, 0.1, 0.6], [0.05, 0.1, 0.6]]}}
    cost = CostModel.from_dict(d)
    assert cost.batch_sizes() == [1, 8]
    t1, t8 = StepCost(cost).table(8, 300), StepCost(cost, 8).table(8, 300)
    assert t1[[0, 4, 8]].tolist() == pytest.approx([0.02, 0.025, 0.03])
    assert t8[[0, 8]].tolist() == pytest.approx([0.05, 0.1])
    assert StepCost(None).table(3, 10).tolist() == [1, 1, 1, 1]
    from data.errors import OilbirdError

    with pytest.raises(OilbirdError, match="batch sizes 1, 8, not 4"):
        cost.at_batch(4)


# ------------------------------------------------------------------ calibration

def test_labels_from_known_next_tokens():
    parents, tokens = [-1, 0, 1, 0, -1, 4], [5, 6, 7, 8, 9, 1]
    # the model's next token after the anchor is 5 (node 0 accepted), after node 0 it is 8 (node 3, not node 1)
    labels = accepted_labels(parents, tokens, {-1: 5, 0: 8})
    assert labels == {0: True, 1: False, 3: True, 4: False}
    assert accepted_labels(parents, tokens, {-1: -1}) == {}  # unknown: nothing labelled


def test_hierarchical_estimate_exact():
    cal = NodeCalibrator(prior_strength=4.0)
    ev = [{"spine": (2, 0)}]
    probs, detail = cal.estimate(ev)
    assert probs == [0.5] and detail == [0.5]  # nothing seen: the source's prior
    cal.observe(ev, probs, detail, {0: True})
    cal.observe(ev, *cal.estimate(ev), {0: True})
    cal.observe(ev, *cal.estimate(ev), {0: False})
    # (spine,): 3 trials, 2 accepted -> 3/5; (spine, pos 0): (2 + 4 * 0.6) / 7; (spine, pos 0, feature 2): same counts
    p0 = 3 / 5
    p1 = (2 + 4 * p0) / (3 + 4)
    p2 = (2 + 4 * p1) / (3 + 4)
    assert cal.source_p("spine", 2, 0) == pytest.approx(p2)
    assert cal.source_p("spine", 5, 0) == pytest.approx(p1)  # an unseen feature reads like its position
    assert cal.source_p("spine", 5, 30) == pytest.approx(p0)  # an unseen position like its source
    assert position_bucket(0) == 0 and position_bucket(1) == 1 and position_bucket(30) == 9


def test_combined_estimate_is_the_noisy_or_until_learned():
    cal = NodeCalibrator()
    ev = [{"spine": (0, 0), "semantic": (0, 0)}]
    probs, detail = cal.estimate(ev)
    assert probs[0] == pytest.approx(1 - 0.5 * 0.5) and detail == [(0.5, 0.5)]
    cal.observe(ev, probs, detail, {0: False})
    assert cal.counts[("+", 2, 15)] == [1.0, 0.0]  # the noisy-or 0.75: bin 15 of 20, two sources
    assert cal.combined_p([0.5, 0.5]) == pytest.approx((0 + 4 * 0.75) / (1 + 4))  # that bucket learned
    probs, _ = cal.estimate(ev)  # the sources learned too: their noisy-or falls in a bucket not seen yet
    spine = cal.source_p("spine", 0, 0)
    assert spine == pytest.approx((0 + 4 * (0 + 4 / 3) / 5) / 5)
    assert probs[0] == pytest.approx(1 - (1 - spine) * (1 - cal.source_p("semantic", 0, 0)))


def _direct_ece(pairs):
    bins = [[] for _ in range(ECE_BINS)]
    for p, y in pairs:
        bins[min(int(p * ECE_BINS), ECE_BINS - 1)].append((p, y))
    n = len(pairs)
    return sum(len(b) / n * abs(np.mean([p for p, _ in b]) - np.mean([y for _, y in b])) for b in bins if b)


def test_ece_against_a_direct_computation():
    rng = np.random.default_rng(1)
    cal = NodeCalibrator()
    pairs = []
    for _ in range(300):
        f = int(rng.integers(0, 3))
        ev = [{"spine": (f, 0)}]
        probs, detail = cal.estimate(ev)
        y = bool(rng.random() < 0.2 + 0.3 * f)
        pairs.append((probs[0], y))
        cal.observe(ev, probs, detail, {0: y})
    summary = cal.summary()
    assert summary["spine"]["labels"] == summary[COMBINED]["labels"] == 300
    assert summary["spine"]["ece"] == pytest.approx(_direct_ece(pairs))
    merged = merge_summaries([summary, summary])
    assert merged["spine"]["labels"] == 600 and merged["spine"]["ece"] == pytest.approx(summary["spine"]["ece"])
    assert expected_calibration_error(np.zeros((ECE_BINS, 3))) is None


# ------------------------------------------------------------------ the automaton's support (node evidence)

def _naive_occurrences(seqs, pattern) -> int:
    n = len(pattern)
    return sum(1 for s in seqs for i in range(len(s) - n + 1) if list(s[i:i + n]) == list(pattern))


def test_chain_support_counts_every_extension_against_brute_force():
    from data.index.automaton import SuffixAutomaton
    from decoder.drafters.features import automaton_features, support_bucket
    from decoder.drafters.sam import chain_support

    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 4, 40).tolist() for _ in range(5)]
    sam = SuffixAutomaton()
    for s in seqs:
        sam.add_sequence(s)
    count = sam.count.__getitem__
    for _ in range(50):
        s = seqs[int(rng.integers(0, 5))]
        i = int(rng.integers(0, 30))
        match, chain = s[i:i + 3], s[i + 3:i + 9] + [7]  # 7 never occurs: the walk leaves the automaton there
        got = chain_support(sam, sam.state_of(match), count, chain)
        want, before = [], _naive_occurrences(seqs, match)
        for j in range(len(chain)):
            n = _naive_occurrences(seqs, match + chain[:j + 1])
            want.append((n, before))
            before = n
        assert got == want
    # the feature: no occurrence -> 0; otherwise share and count buckets, above the chain's match and rank
    assert support_bucket(0, 5) == 0 and support_bucket(5, 5) == 1 + 3 * 4 + 2 and support_bucket(1, 9) == 1
    assert automaton_features(1, 0, [(5, 5), (0, 5)]) == [15, 0]
    assert automaton_features(40, 2, [(1, 1)]) == [17 * (2 * 5 + 2) + 1 + 3 * 4]  # long match, rank 2, share 1
