"""Tree verification as pure functions: attention mask, position ids, greedy acceptance, cache compaction.

Convention (the usual one): the anchor is the last committed token and its KV is NOT cached yet, so
the verify forward feeds `[anchor] + draft nodes` (N + 1 inputs) on top of a cache holding
`past_len` = len(prompt + committed) - 1 tokens. Input row / key column 0 is the anchor, row
1 + i is draft node i. Node i sees the whole prefix, the anchor, its ancestors and itself; its
position id is past_len + depth(i) (the anchor's is past_len, children of the anchor have depth 1).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

ROOT = -1  # parent index meaning "child of the anchor" (as in decoder.draft)


def tree_ancestors(parents: Sequence[int]) -> np.ndarray:
    """[N+1, N+1] bool: entry (r, c) says input c is row r itself or one of its ancestors (0 = anchor)."""
    n = len(parents)
    anc = np.zeros((n + 1, n + 1), dtype=bool)
    anc[0, 0] = True
    for i, p in enumerate(parents):
        if not ROOT <= p < i:
            raise ValueError(f"node {i} has parent {p}: parents must precede their children")
        anc[i + 1] = anc[p + 1]  # p + 1 is the parent's row (0 when p is ROOT)
        anc[i + 1, i + 1] = True
    return anc


def tree_attention_mask(parents: Sequence[int], past_len: int, dtype: torch.dtype = torch.float32,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """The additive mask [1, 1, N+1, past_len+N+1] in `dtype`: 0 where a row may attend, finfo.min elsewhere.

    It must be a float mask in the model's dtype: transformers passes a 4D mask through unchanged,
    and eager attention adds it to the scores, so a bool mask would be added as 0/1 and mask nothing.
    """
    allowed = torch.from_numpy(tree_ancestors(parents))
    n1 = allowed.shape[0]
    mask = torch.zeros((1, 1, n1, past_len + n1), dtype=dtype, device=device)
    tree = torch.zeros((n1, n1), dtype=dtype)
    tree.masked_fill_(~allowed, torch.finfo(dtype).min)
    mask[0, 0, :, past_len:] = tree.to(device=mask.device)
    return mask


def tree_position_ids(parents: Sequence[int], past_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """[1, N+1] position ids: past_len for the anchor, past_len + depth for each node."""
    depth = tree_ancestors(parents).sum(axis=1) - 1  # a row's ancestors, itself and the anchor, minus one
    pos = depth + past_len
    return torch.as_tensor(pos, dtype=torch.long, device=device)[None]


def greedy_accept(tokens: Sequence[int], parents: Sequence[int], argmax: Sequence[int]) -> tuple[list[int], int]:
    """The longest root path whose tokens equal the model's argmax, and the bonus token after it.

    `argmax[0]` is the model's next token after the anchor, `argmax[1 + i]` after node i. Node i
    agrees when its parent agrees (or is the anchor) and tokens[i] == argmax[parent's row]; the
    accepted path leads to the deepest agreeing node, ties to the earliest node index (without
    duplicate siblings at most one path agrees). Duplicate siblings (root-attached chains beside
    the spine) can make several paths agree: the longest is committed, never merely the first
    sibling that matches. A negative argmax (-1: unknown, as replay passes off the true path)
    equals no token. Returns (accepted node indices in root-to-leaf order, bonus = the argmax after
    the last accepted node); with no match the bonus is argmax[0]. One pass, O(N).
    """
    am = argmax.tolist() if hasattr(argmax, "tolist") else list(argmax)
    depth = [0] * len(tokens)  # depth of node i if it agrees, else 0
    best, best_depth = ROOT, 0
    for i, p in enumerate(parents):
        p = int(p)
        if not ROOT <= p < i:
            raise ValueError(f"node {i} has parent {p}: parents must precede their children")
        if p != ROOT and not depth[p]:
            continue  # below a node that does not agree
        want = int(am[p + 1])
        if want >= 0 and int(tokens[i]) == want:
            d = depth[i] = 1 if p == ROOT else depth[p] + 1
            if d > best_depth:  # strictly deeper: ties keep the earliest node
                best, best_depth = i, d
    accepted: list[int] = []
    node = best
    while node != ROOT:
        accepted.append(node)
        node = int(parents[node])
    accepted.reverse()
    return accepted, int(am[best + 1])


def compact_cache(cache, past_len: int, keep: Sequence[int]) -> None:
    """Keep only the rows `past_len + keep` of the rows written by the last verify forward, in place.

    `keep` indexes the verify inputs (0 = anchor, 1 + i = node i). The kept rows are gathered
    with index_select, written right after the prefix, and the rest is cropped, so the cache ends
    with exactly past_len + len(keep) positions, in the order of `keep`.
    """
    keep = [int(k) for k in keep]
    n_keep = len(keep)
    in_place = keep == list(range(n_keep))  # a path along the first nodes: nothing to move
    index: dict[torch.device, torch.Tensor] = {}
    for layer in cache.layers:
        if layer.keys is None or layer.keys.numel() == 0:
            continue
        total = layer.keys.shape[-2]
        if not in_place:
            dev = layer.keys.device
            if dev not in index:
                index[dev] = torch.tensor(keep, dtype=torch.long, device=dev) + past_len
            for name in ("keys", "values"):
                t = getattr(layer, name)
                t[..., past_len:past_len + n_keep, :] = t.index_select(-2, index[dev])
        if total > past_len + n_keep:
            layer.crop(past_len + n_keep - total)
