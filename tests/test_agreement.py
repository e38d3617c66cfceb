"""data/capture/agreement.py: two captures of the same requests compared, against a brute-force reference."""

from __future__ import annotations

import numpy as np

from data.capture.agreement import agreement, first_difference
from data.store.reader import open_store
from tests.test_store_format import golden_records, write_store


def test_first_difference_exact_arrays():
    assert first_difference([1, 2, 3], [1, 2, 3]) == 3
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # a prefix: the shorter length
    assert first_difference([], [4]) == 0


def _brute(a, b) -> tuple[int, int, list[int]]:
    """(compared, identical, first divergences) by plain Python loops."""
    ids_a = a.requests["id"].to_list()
    compared = identical = 0
    div = []
    for rb, rid in enumerate(b.requests["id"].to_list()):
        if rid not in ids_a:
            continue
        ra = ids_a.index(rid)
        if a.prompt(ra) != b.prompt(rb):
            continue
        compared += 1
        x, y = a.tokens(ra).tolist(), b.tokens(rb).tolist()
        if x == y:
            identical += 1
        else:
            i = 0
            while i < min(len(x), len(y)) and x[i] == y[i]:
                i += 1
            div.append(i)
    return compared, identical, div


def test_agreement_matches_brute_force(tmp_path):
    base = golden_records()
    other = golden_records()
    other[2].output_tokens = list(other[2].output_tokens)
    other[2].output_tokens[1] += 1  # request r2 diverges at position 1
    other[4].output_tokens = other[4].output_tokens[:3]  # r4: a prefix (stopped early)
    other[4].hidden, other[4].hidden_valid, other[4].topk = other[4].hidden[:3], other[4].hidden_valid[:3], other[4].topk[:3]
    other[1].hidden = (other[1].hidden.astype(np.float32) * 2).astype(np.float16)  # same direction: cosine 1
    a = open_store(write_store(tmp_path / "a", base))
    b = open_store(write_store(tmp_path / "b", other))
    got = agreement(a, b)
    compared, identical, div = _brute(a, b)
    assert (got["requests"], got["identical"]) == (compared, identical) == (5, 3)
    assert sorted(d["position"] for d in got["divergent"]) == sorted(div) == [1, 3]
    assert got["first_divergence"] == {"min": 1, "median": 2, "max": 3}
    assert got["state_cosine_min"] > 0.999 and got["topk_agree"] == 1.0


def test_agreement_skips_other_prompts_and_ids(tmp_path):
    base = golden_records()
    other = golden_records()
    other[0].prompt_tokens = [7, 7, 7]  # same id, another prompt: counted apart, never compared
    from data.store.schema import prompt_hash
    other[0].prompt_hash = prompt_hash(other[0].prompt_tokens)
    other[3].id = "elsewhere"
    a = open_store(write_store(tmp_path / "a", base))
    b = open_store(write_store(tmp_path / "b", other))
    got = agreement(a, b)
    assert got["prompt_differs"] == 1 and got["requests"] == 3 and got["identical"] == 3
    assert got["first_divergence"] is None
