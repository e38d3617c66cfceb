"""The evidence each source records on the nodes it proposes (decoder/draft.py `Draft.evidence`): one small
integer per chain, the feature bucket decoder/calibration.py learns acceptance by (with the node's position
in the chain beside it).

  spine, branch
             per token: the automaton's match length (three buckets), the chain's rank (spine 0, the frequency
             branches 1..) and the token's support: how many occurrences of the match, extended through the
             tokens before it, continued with it, and their share (`sam.chain_support`; SuffixDecoding's
             counts, read from the automaton)
  adjacency  the rank of the token in its parent's adjacency row: the model's own top-8 at that token, the
             last time it was verified (decoder/drafters/recycling.py sets it)
  semantic   the key's best cosine, bucketed, and the chain's rank among the key's chains
  rollout, pool, root: the chain's rank among that source's chains
"""

from __future__ import annotations

from bisect import bisect_right

MATCH_EDGES = (2, 3, 4, 6, 8, 12, 16, 24, 32)  # match-length bucket: how many edges are <= the length
COSINE_EDGES = (0.85, 0.9, 0.93, 0.96, 0.98, 0.99)  # the key's best cosine, bucketed
RANKS = 4  # ranks 0..RANKS-1 told apart, the rest in the last


SHARE_EDGES = (0.34, 0.67, 0.999)  # the share of the occurrences that continued with the token, bucketed
COUNT_EDGES = (2, 4, 16)  # how many occurrences continued with it, bucketed


def support_bucket(n_next: int, n_cur: int) -> int:
    """One token's support (`sam.chain_support`): 0 when no occurrence continued with it, else 1 + its share of
    the occurrences bucketed x its count bucketed (1..16)."""
    if n_next <= 0:
        return 0
    share = n_next / max(n_cur, n_next)
    return 1 + bisect_right(SHARE_EDGES, share) * (len(COUNT_EDGES) + 1) + bisect_right(COUNT_EDGES, n_next)


def automaton_features(match_length: int, rank: int, support: list[tuple[int, int]]) -> list[int]:
    """Per token of an automaton chain (the spine: rank 0; a branch: its rank + 1): the chain's match length
    (three buckets), its rank and the token's own support, as one feature each."""
    head = (min(2, bisect_right(MATCH_EDGES, match_length) // 3) * (RANKS + 1) + min(rank, RANKS)) * 17
    return [head + support_bucket(a, b) for a, b in support]


def rank_feature(rank: int) -> int:
    return min(rank, RANKS - 1)


def semantic_feature(cosine: float, rank: int) -> int:
    return bisect_right(COSINE_EDGES, cosine) * RANKS + rank_feature(rank)
