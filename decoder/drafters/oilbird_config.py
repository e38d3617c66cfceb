"""The Oilbird drafter's settings (`OilbirdConfig`) and its arms: named presets of them (`ARM_PRESETS`);
the drafter itself is decoder/drafters/oilbird.py.

Arms (presets of this one drafter, `ARM_PRESETS`):
  oilbird                the method as above; the tree sized by the engine's cost (size auto, drafters/sizing.py)
  oilbird-no-semantic    the key never queried; everything else equal (branches and rollouts keep B_ret)
  oilbird-fixed, oilbird-no-semantic-fixed
                         the same at the fixed budget: every candidate node verified (the paper's B = 60)
  oilbird-chain, oilbird-no-semantic-chain
                         the best path of the merged tree, at most CHAIN_CAP tokens, cut by the cost rule:
                         what a chain engine (vLLM) verifies
  semantic-only          no lexical sources, no gate: key chains, rollouts and root branching (the anchor's
                         top-8 adjacency successors, one-token branches, label "root") from the root, whole budget
  semantic-null          semantic-only with the key retrieving nothing (its null control): rollouts and root
                         branching only; `@root_branching=0` shows what root branching alone does
  oilbird-root-attached  retrieved chains (key, rollouts) hung from the root as their own branches,
                         paying for every token, instead of merged into the tree
  oilbird-request-key    one key query per request (the request's first state against each trace's
                         first state) selects up to 4 traces; every pass copies, from each, what followed
                         the context's longest suffix n-gram (<= 4), depth by trace rank
  oilbird-fixed-depth    per-position key, depth by neighbour rank (16, 8, 4, 2, ...) instead of D(s)
  oilbird-one-source     one source chosen per step instead of merged (SAM-Decoding's rule, below)
  pld+pool               prompt lookup as the host, and in B_ret the pool's chain under PLD's own key:
                         what followed the most recent pool occurrence of the context's longest suffix
                         n-gram (n <= 3), up to B_ret tokens (`pld.PoolNgramIndex`)
  recycling+pool         Token Recycling as the host, and in B_ret the pool's chain under its own key
                         (the anchor token): what followed its most recent pool occurrence, up to B_ret
  pld+key                prompt lookup as the host, the key in B_ret of the same budget, asked on every pass:
                         +pool's exact key over the pool replaced by the semantic key (the paper's rung)
  recycling+key          Token Recycling as the host, likewise
  pld+key-added          pld+key with the gate: the key asked only where prompt lookup's own exact match
                         (or the anchor's adjacency, for recycling) opens it: the key added beside the
                         exact one, the rung before issue 24
  recycling+key-added    likewise for Token Recycling
  toolspec+pool, toolspec+key, toolspec+key-added
                         the same rungs on the ToolSpec host (decoder/drafters/toolspec.py: schema FSM, the
                         request's n-grams, Token Recycling's fallback); its exact key over the pool is its
                         n-gram phase's: the context's longest suffix n-gram of 7 down to 5 tokens, most
                         recent pool occurrence (ToolSpec searches its retrieved outputs earliest first)

One source per step (`one_source`, arm oilbird-one-source; the paper's "one source chosen per step
instead of merged (SAM-Decoding's mechanism)"). SAM-Decoding (Hu et al., ACL 2025) drafts from its
suffix automaton when the longest suffix match is at least `len_threshold` tokens long and otherwise
from an auxiliary drafter (Token Recycling or EAGLE-2). Here the automaton draft is the lexical host's
tree at the WHOLE budget (spine, branches, adjacency: what the gate proposes when closed) and the
auxiliary is the semantic draft at the whole budget (the key's chains, then the rollouts, from the root:
what semantic-only proposes, less its root branching, which the lexical draft's adjacency already has). Per
step, once the gate is open: the lexical draft when the spine's match
length (`automaton_match`: the longer of the request's and the pool's match) is at least
`one_source_min_match` (default 5, SAM-Decoding's evaluation default `--samd_len_threshold 5`; its pool
side gets no length bias, as the lexical host's spine has none), else the semantic draft; the key is
queried only on those steps, as SAM-Decoding runs its auxiliary only when it is used. A semantic draft
with nothing in it (the key silent, muted, or the request's first pass) gives way to the lexical draft:
SAM-Decoding's auxiliary always drafts, so its rule never meets that case. The gate is unchanged
(closed: the lexical draft alone, i.e. adjacency only when there is no match: Token Recycling, SAM-
Decoding's auxiliary). Never merged: every proposed tree is one source's draft, with its own labels.

The transplant ladder, per published host: base (`pld`, `recycling`, `toolspec`: the drafter alone), +pool (the
same host handed the cross-request pool under its own exact key) and +key (that key replaced by the
semantic key at the same 60-node budget and B_ret = 16). +pool and +key share the host, the budget
split, the merge (`merge_candidates`) and the same-prompt exclusion; they differ in what fills B_ret.
The gate opens on the exact-key sources, as for the lexical host (whose automaton spans the request
and the pool): for +pool the host's key over the request or over the pool. +key has no gate: the key
replaces the pool's exact key, so it is asked wherever +pool's exact key would have been (every pass);
+key-added keeps the gate on the host's own match (the key beside the exact one).
"""

from __future__ import annotations

from dataclasses import dataclass

from data.index.stateindex import DEFAULT_INDEX
from decoder.drafters.semantic import DEPTH_SCHEDULE, RANK_DEPTHS

HOSTS = ("lexical", "pld", "recycling", "toolspec", "none")
TOOLSPEC_POOL_NGRAMS = (5, 7)  # toolspec+pool: ToolSpec's own exact key, its n-gram phase's n = 7 down to 5
KEY_LEVELS = ("position", "request", "null")
SIZES = ("auto", "fixed")
CHAIN_CAP = 32  # the chain arms' longest chain (vLLM's num_speculative_tokens for them; the profile measures 64)

@dataclass
class OilbirdConfig:
    host: str = "lexical"  # lexical | pld | recycling | toolspec | none (semantic-only: no lexical source, no gate)
    retrieval_budget: int = 16  # B_ret: nodes reserved for the retrieved chains (key, branches, rollouts)
    semantic: bool = True  # query the key (False = --no-semantic)
    key_level: str = "position"  # position (every pass) | request (once per request) | null (retrieve nothing)
    k: int = 8  # neighbours per query
    theta: float = 0.8  # the key fires when the best neighbour reaches this cosine
    depth_schedule: tuple[tuple[float, int], ...] = DEPTH_SCHEDULE  # D(s)
    rank_depths: tuple[int, ...] | None = None  # --fixed-depth: depth by neighbour rank instead of D(s)
    offset: int = 2  # chain starts at x[i + offset]
    min_chain: int = 2  # shorter chains are dropped
    attach: str = "merge"  # merge (re-walk from the root) | root (each retrieved chain its own root branch)
    gate: bool = True  # Algorithm 1's gate (ignored for host "none")
    spine_max: int = 32  # lexical host: spine tokens
    branch_top: int = 3  # lexical host: frequency branches (in the tree and again among the candidates)
    branch_max: int = 32  # tokens per branch
    pld_max_ngram: int = 3  # pld host
    pld_max_copy: int = 10
    toolspec_tokenizer: str = "auto"  # toolspec host: the tokenizer its schema is read with (decoder/drafters/toolspec.py)
    host_pool: bool = False  # +pool rung (hosts pld / recycling): B_ret also takes the pool's chain under the
    #                          host's own exact key (pld: suffix n-gram <= pld_max_ngram; recycling: the anchor)
    rollouts: int = 4  # rejected-branch rollouts per pass (0 = ring buffer off)
    root_branching: int = 0  # host none: the anchor's first N adjacency successors (the model's top-8 after that
    #                          token, last time it was verified) declared as one-token root branches, after the key
    #                          chains and the rollouts (the paper's semantic-only arm: "root branching declared")
    rollout_depth: int = 6  # tokens of endorsed continuation per rejected node
    rollout_theta: float = 0.8  # cos(h_t, the record's state) needed
    ring_size: int = 1024  # rejected-branch records kept
    request_traces: int = 4  # request-level key: traces selected per request
    request_ngram: int = 4  # request-level key: longest suffix n-gram matched in a selected trace
    calib_window: int = 32  # self-calibration (see keygate.SelfCalibration): buying passes judged; 0 = off
    calib_min_hit_rate: float = 1 / 32  # muted below this hit rate over a full window
    calib_cooldown: int = 64  # passes a muted key skips before it returns
    key_patience: int = 8  # passes without a hit, inside a request, before the key goes quiet (keygate.RequestPatience)
    key_probe_every: int = 4  # a quiet key is still queried every this many passes; key_patience 0 = always query
    key_floor: float = 0.88  # an answer whose best cosine is below this makes the key skip the next key_floor_skip
    key_floor_skip: int = 3  # passes (keygate.RequestPatience; off with key_patience 0)
    index: str = DEFAULT_INDEX  # the key's index (data/index/stateindex.py spec): auto, exact or a faiss spec (SemanticPool)
    key_device: str = "cpu"  # where the key's states live and its queries run (cuda: the model's GPU)
    index_train_size: int = 0  # states a trained faiss coder collects first (0: the spec's own need)
    knn_recall_every: int = 8  # auto or faiss index: every Nth inexact query also runs exactly (knn_recall); 0 = off
    one_source: bool = False  # propose the lexical OR the semantic draft per step, never merged (the ablation)
    one_source_min_match: int = 5  # one_source: the lexical draft when its automaton match is at least this
    #                                long, else the semantic draft (SAM-Decoding's len_threshold, 5)
    key_overlap: str = "auto"  # lexical host: the key's query on the kernel's worker thread (data/index/keyscan.c), on
    #                            another core, while the host builds its tree: on | off (inline) | auto (on when
    #                            the process may use more cores than torch's threads: `spare_core`)
    chain: int = 0  # > 0: propose only the best chain of the merged tree, at most this many tokens; what vLLM
    #                 verifies (size auto: the most probable child at each node, cut by the cost rule; size
    #                 fixed: decoder.draft.best_chain, the most-proposed child at each node, all k tokens)
    size: str = "auto"  # auto: verify the nodes (or chain prefix) that maximise expected tokens per second
    #                     (decoder/drafters/sizing.py) from the candidates the budget admits; fixed: the whole budget
    batch: int = 1  # the batch size whose step cost sizes the draft (the profile's verify_s_by_batch)
    step_cost: object = None  # the engine's profile (decoder/cost/model.py CostModel), set by the runner (replay,
    #                           the vLLM proposer); None: a flat cost, under which auto keeps every candidate


# arm name -> OilbirdConfig options
ARM_PRESETS: dict[str, dict] = {
    "oilbird": {},
    "oilbird-no-semantic": {"semantic": False},
    # the fixed budget (the paper's B = 60 nodes, every node verified whatever its chance)
    "oilbird-fixed": {"size": "fixed"},
    "oilbird-no-semantic-fixed": {"semantic": False, "size": "fixed"},
    # the form a chain engine (vLLM) verifies: the best path of the merged tree, cut by the cost rule
    "oilbird-chain": {"chain": CHAIN_CAP},
    "oilbird-no-semantic-chain": {"semantic": False, "chain": CHAIN_CAP},
    # the key is the only retrieval source (never quiet); root branching declared, as the paper's arm
    "semantic-only": {"host": "none", "key_patience": 0, "root_branching": 8},
    "semantic-null": {"host": "none", "key_level": "null", "key_patience": 0, "root_branching": 8},
    "oilbird-root-attached": {"attach": "root"},
    "oilbird-request-key": {"key_level": "request", "rank_depths": RANK_DEPTHS},
    "oilbird-fixed-depth": {"rank_depths": RANK_DEPTHS},
    "oilbird-one-source": {"one_source": True},
    "pld+pool": {"host": "pld", "semantic": False, "host_pool": True, "branch_top": 0, "rollouts": 0, "key_patience": 0},
    "recycling+pool": {"host": "recycling", "semantic": False, "host_pool": True, "branch_top": 0, "rollouts": 0,
                       "key_patience": 0},
    # the +key rung (the paper's): the pool's exact key REPLACED by the semantic key, so the key is asked on every
    # pass (no gate: nothing exact over the pool is left to open one); the host drafts as at base
    "pld+key": {"host": "pld", "branch_top": 0, "rollouts": 0, "key_patience": 0, "gate": False},
    "recycling+key": {"host": "recycling", "branch_top": 0, "rollouts": 0, "key_patience": 0, "gate": False},
    # the key ADDED beside the host's exact key: asked only where the host's own exact match opens the gate
    "pld+key-added": {"host": "pld", "branch_top": 0, "rollouts": 0, "key_patience": 0},
    "recycling+key-added": {"host": "recycling", "branch_top": 0, "rollouts": 0, "key_patience": 0},
    # the ToolSpec host (decoder/drafters/toolspec.py; its base rung is the `toolspec` arm)
    "toolspec+pool": {"host": "toolspec", "semantic": False, "host_pool": True, "branch_top": 0, "rollouts": 0,
                      "key_patience": 0},
    "toolspec+key": {"host": "toolspec", "branch_top": 0, "rollouts": 0, "key_patience": 0, "gate": False},
    "toolspec+key-added": {"host": "toolspec", "branch_top": 0, "rollouts": 0, "key_patience": 0},
}
