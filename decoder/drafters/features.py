"""The evidence each source records on the nodes it proposes (decoder/draft.py `Draft.evidence`): one small
integer per chain, the feature bucket decoder/calibration.py learns acceptance by (with the node's position
in the chain beside it).

  spine      the automaton's match length (the suffix of the context the spine continues), bucketed
  branch     the branch's rank among the match state's frequent next tokens (0 = the most frequent)
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


def match_feature(match_length: int) -> int:
    return bisect_right(MATCH_EDGES, match_length)


def rank_feature(rank: int) -> int:
    return min(rank, RANKS - 1)


def semantic_feature(cosine: float, rank: int) -> int:
    return bisect_right(COSINE_EDGES, cosine) * RANKS + rank_feature(rank)
