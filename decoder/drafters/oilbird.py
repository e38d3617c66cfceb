"""Oilbird (paper section 4, Algorithm 1): the semantic draft source merged into the lexical tree.

One step, as deployed (every default is an `OilbirdConfig` field):
  1. gate      - if the automaton has no match or the anchor has no adjacency successors, draft what
                 is available with the whole budget (adjacency only, the lexical chains alone, or
                 nothing = one AR step) and query nothing else;
  2. lexical   - `build_lexical` (spine, top-3 branches, adjacency) with budget - B_ret nodes
                 (B_ret = `retrieval_budget` = 16 of 60);
  3. key       - s_i = cos(h_t, h_i) over the pool, E_t = top-k (k = 8), asked unless the request
                 has gone 8 passes without a key hit (then every 4th pass) or its last answer was below
                 cosine 0.88 (then it skips 3 passes: `RequestPatience`), or self-calibration mutes it;
                 fires when max s >= theta (0.8); each neighbour, by decreasing s, gives the chain
                 x[i+2 : i+2+D(s)] (see `semantic.py`), chains >= 2 tokens, deduplicated (the query
                 and the chains: one compiled call on a pruned pool, `SemanticPool.key`; with the lexical host it
                 starts before step 2, on the kernel's worker thread, and is collected after: `key_overlap`);
  4. candidates- then the automaton's top-3 branches (<= 32 tokens) and up to 4 rejected-branch
                 rollouts (anchor token equal, cos >= 0.8);
  5. merge     - every candidate re-walks the tree from the root (a token already there is walked
                 and credited, not bought) until B_ret new nodes are spent.
The engine verifies the tree and commits the accepted path and the bonus token; `observe` takes h_t
(the state at the last accepted node, or the anchor's: the state that predicted the bonus, uncorrected),
feeds the adjacency table, the rejected-branch ring buffer, the patience and self-calibration; `add_trace`
appends the finished trace's generated tokens and states to the pool (same-prompt traces are masked
out of every query). The states come from the verification forwards (`VerifyResult.hidden`), never
from an extra pass. `index` picks the key's index (auto by default, exact, or a faiss spec,
see `SemanticPool`); `evict_traces` drops the oldest traces from every pool (--store-budget). The
first pass of a request has no h_t (the prefill computes no state at the last prompt token), so it
drafts without the key and the rollouts.

Sources (attribution labels): spine, branch, adjacency (the lexical host), pld / recycling (the
transplant hosts), semantic (the key), rollout (the ring buffer), pool (a transplant host's own exact
key over the pool of finished traces: the +pool rungs).

Arms: presets of this one drafter (`ARM_PRESETS`, with `OilbirdConfig`, in oilbird_config.py, which
describes each arm, the one-source rule and the transplant ladder).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Hashable, Sequence

import numpy as np

from data.store.schema import prompt_hash as hash_prompt
from decoder.calibration import NodeCalibrator, accepted_labels, regime_of
from decoder.draft import ROOT, Draft, Drafter, best_chain, subtree
from decoder.drafters.features import automaton_features, rank_feature, semantic_feature
from decoder.drafters.keygate import RequestPatience, SelfCalibration
from decoder.drafters.lexical import BRANCH, LexicalConfig, build_lexical
from decoder.drafters.oilbird_config import (
    HOSTS,
    KEY_LEVELS,
    SIZES,
    TOOLSPEC_POOL_NGRAMS,
    OilbirdConfig,
)
from decoder.drafters.pld import NgramIndex, PoolNgramIndex
from decoder.drafters.recycling import AdjacencyTable, default_template
from decoder.drafters.rollouts import RejectedPool, rejected_records
from decoder.drafters.sam import (
    AutomatonIndex,
    automaton_match,
    automaton_match_support,
)
from decoder.drafters.semantic import RANK_DEPTHS, SemanticPool, ngram_continuation
from decoder.drafters.toolspec import ToolSpecConfig, ToolSpecHost
from decoder.drafters.sizing import StepCost, path_probs, select_chain, select_tree

SEMANTIC, ROLLOUT, POOL, ROOT_BRANCH = "semantic", "rollout", "pool", "root"
Chain = list[int]


def hang_from_root(draft: Draft, chain: Sequence[int], source: str, budget: int, feature: int = 0) -> int:
    """Root-attached (the ablation): `chain` as a new branch under the anchor, every token bought."""
    node, added = ROOT, 0
    for position, tok in enumerate(chain):
        if len(draft) >= budget:
            break
        shadowed = draft.child(node, tok)
        node_new = draft.add_node(node, tok, source, feature, position)
        if shadowed is not None:  # keep later merges walking the original node, not this duplicate
            draft._children[(draft.parents[node_new], int(tok))] = shadowed
        node = node_new
        added += 1
    return added


def merge_candidates(draft: Draft, candidates: Sequence[tuple], budget: int,
                     root_attached: frozenset[str] = frozenset()) -> list[int]:
    """Merge (chain, source[, feature]) candidates in order; new nodes stop once the draft holds `budget` nodes.

    Chains of a source in `root_attached` hang from the root instead. Returns the nodes each
    candidate bought (its cost, |chain| minus the prefix already on the tree, cut by the budget).
    A merged candidate still walks (and is credited on) its prefix already on the tree once the
    budget is spent, so every node lists every source that proposed it.
    """
    costs = []
    for chain, source, *feature in candidates:
        feature = feature[0] if feature else 0  # the source's evidence for the chain (features.py); none: 0
        if source in root_attached:
            costs.append(hang_from_root(draft, chain, source, budget, feature))
        else:
            costs.append(draft.add_chain(chain, source, budget, feature=feature))
    return costs


def spare_core() -> bool:
    """Whether the process may run on more cores than torch's threads use (key_overlap auto): the key's worker
    then polls on a core of its own. Where it would share one (2 cores, torch's 2 threads spinning after
    each operation), a replay over the whole API-Bank store drafted 0.35 ms a pass with the worker and 0.18 ms
    without."""
    import torch

    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call (macOS)
        cores = os.cpu_count() or 1
    return cores > torch.get_num_threads()


class OilbirdDrafter(Drafter):
    """All Oilbird arms: a host tree, the semantic key and the rejected-branch pool under one budget."""

    name = "oilbird"
    Config = OilbirdConfig

    def __init__(self, vocab_size: int, nodes: int = 60, config: OilbirdConfig | None = None) -> None:
        self.vocab_size, self.nodes = vocab_size, nodes
        c = self.config = config or OilbirdConfig()
        if c.host not in HOSTS:
            raise ValueError(f"host must be one of {', '.join(HOSTS)} (got {c.host!r})")
        if c.key_level not in KEY_LEVELS:
            raise ValueError(f"key_level must be one of {', '.join(KEY_LEVELS)} (got {c.key_level!r})")
        if c.attach not in ("merge", "root"):
            raise ValueError(f"attach must be merge or root (got {c.attach!r})")
        if c.host_pool and c.host not in ("pld", "recycling", "toolspec"):
            raise ValueError(f"host_pool needs host pld, recycling or toolspec (got {c.host!r})")
        if c.one_source and c.host != "lexical":  # the rule reads the automaton's match length
            raise ValueError(f"one_source needs host lexical (got {c.host!r})")
        if c.root_branching and c.host != "none":  # a lexical host already branches at the root (adjacency)
            raise ValueError(f"root_branching needs host none (got {c.host!r})")
        if c.chain < 0:
            raise ValueError(f"chain must be 0 (the tree) or a chain length (got {c.chain})")
        if c.key_overlap not in ("auto", "on", "off"):
            raise ValueError(f"key_overlap must be auto, on or off (got {c.key_overlap!r})")
        self.overlap = c.key_overlap == "on" or (c.key_overlap == "auto" and spare_core())
        self._adjacency_memo: tuple[int, bool] | None = None  # (anchor, `_has_adjacency`) until the table changes
        if c.one_source_min_match < 0:
            raise ValueError(f"one_source_min_match must be 0 or more (got {c.one_source_min_match})")
        self.index = AutomatonIndex() if c.host == "lexical" else None
        self.table = (AdjacencyTable(vocab_size) if c.host in ("lexical", "recycling") or c.root_branching > 0
                      else None)
        self.ngrams = NgramIndex(c.pld_max_ngram) if c.host == "pld" else None
        self.toolspec = (ToolSpecHost(vocab_size, ToolSpecConfig(tokenizer=c.toolspec_tokenizer), source="toolspec")
                         if c.host == "toolspec" else None)
        # the +pool rungs: the pool under the host's own key (pld: n-grams <= pld_max_ngram; recycling: 1-grams;
        # toolspec: its n-gram phase's 7 down to 5)
        pool_n = {"pld": (1, c.pld_max_ngram), "recycling": (1, 1), "toolspec": TOOLSPEC_POOL_NGRAMS}.get(c.host, (1, 1))
        self.pool_min_n = pool_n[0]
        self.host_pool = PoolNgramIndex(pool_n[1]) if c.host_pool else None
        self.pool = SemanticPool(c.index, c.knn_recall_every, c.index_train_size or None, c.key_device)
        self.ring = RejectedPool(c.ring_size if c.rollouts > 0 else 0)
        self.calibration = SelfCalibration(c.calib_window, c.calib_min_hit_rate, c.calib_cooldown)
        self.patience = RequestPatience(c.key_patience, c.key_probe_every, c.key_floor, c.key_floor_skip)
        self.h_t: np.ndarray | None = None  # the query state: what the last verification left
        self._first_state: np.ndarray | None = None  # this request's first state (the prompt's last token)
        self._prompt_hash: Hashable | None = None
        self._serial = 0  # this request's number (the ring buffer's owner key)
        self._begun = 0  # requests begun
        self._bought: set[int] = set()  # draft nodes the key bought in the pending pass
        self._selected: list[NgramIndex] | None = None  # request-level key: the selected traces, indexed
        if c.size not in SIZES:
            raise ValueError(f"size must be one of {', '.join(SIZES)} (got {c.size!r})")
        if c.batch < 1:
            raise ValueError(f"batch must be at least 1 (got {c.batch})")
        self.step_cost = StepCost(c.step_cost, c.batch)  # the engine's step against draft tokens (None: flat)
        self.calibrator = NodeCalibrator()
        self._cand: Draft | None = None  # size auto: the pending pass's candidates, priced
        self._detail: list = []  # ... the estimates behind their prices
        self._kept: list[int] = []  # ... the candidates verified, in the verified draft's order
        self._match, self._key_cosine = 0, 0.0  # this pass's automaton match length and key's best cosine
        self._support: list = []  # ... the support of every token of the spine and of each branch (sam.chain_support)
        self._last_accepted: int | None = None  # draft tokens this request's last pass accepted (None: no pass yet)
        self.tally = dict(passes=0, gated=0, key_queries=0, key_fired=0, key_chains=0, key_nodes=0,
                             key_buying_passes=0, key_hits=0, rollout_chains=0, semantic_time_s=0.0,
                             rollout_time_s=0.0, host_pool_queries=0, host_pool_chains=0, host_pool_time_s=0.0,
                             chose_lexical=0, chose_semantic=0, candidate_nodes=0, kept_nodes=0,
                             expected_tokens=0.0, sizing_time_s=0.0)

    # ------------------------------------------------------------ the pool
    def add_trace(self, output: Sequence[int], prompt_hash: Hashable | None = None,
                  hidden: np.ndarray | None = None, key_state: np.ndarray | None = None) -> None:
        """The trace enters every pool. The request-level key's state (`key_state`) defaults to this
        request's first state when the trace is the request just served (its prompt hash)."""
        if key_state is None and prompt_hash is not None and prompt_hash == self._prompt_hash:
            key_state, self._first_state = self._first_state, None
        if self.index is not None:
            self.index.add_trace(output, prompt_hash)
        if self.host_pool is not None:
            self.host_pool.add_trace(output, prompt_hash)
        self.pool.add_trace(output, hidden, prompt_hash, key_state)

    def evict_traces(self, count: int) -> None:
        """--store-budget: the oldest `count` traces leave every pool (automaton, host pool, states);
        the adjacency table, the ring buffer and self-calibration are not trace pools and stay."""
        if self.index is not None:
            self.index.evict_traces(count)
        if self.host_pool is not None:
            self.host_pool.evict_traces(count)
        self.pool.evict_traces(count)

    @property
    def untimed_s(self) -> float:
        """Seconds of measurement-only work (the knn_recall shadow queries) inside propose: the pass
        loops leave them out of the drafting time."""
        return self.pool.shadow_s

    def begin_request(self, prompt: Sequence[int], prompt_hash: Hashable | None = None) -> None:
        h = hash_prompt(list(prompt)) if prompt_hash is None else prompt_hash
        self._begun += 1
        self._prompt_hash, self._serial = h, self._begun
        if self.index is not None:
            self.index.begin_request(prompt, h)
        if self.ngrams is not None:
            self.ngrams = NgramIndex(self.config.pld_max_ngram)
            self.ngrams.sync(prompt)
        if self.toolspec is not None:
            self.toolspec.begin_request(prompt)
        self.pool.exclude(h)
        self.h_t = self._first_state = None
        self._selected = None
        self._last_accepted = None
        self._bought = set()
        self.patience.begin()

    REQUEST_FIELDS = ("h_t", "_first_state", "_prompt_hash", "_serial", "_bought", "_selected", "ngrams", "_cand",
                      "_detail", "_kept", "_last_accepted")

    def suspend_request(self) -> dict:
        """This request's state (contract: decoder/draft.py), so that another request can run between
        two of its passes; the pools, the adjacency table, the ring buffer and self-calibration are shared."""
        return {"fields": {f: getattr(self, f) for f in self.REQUEST_FIELDS},
                "patience": self.patience.suspend(),
                "index": self.index.suspend_request() if self.index is not None else None,
                "toolspec": self.toolspec.suspend_request() if self.toolspec is not None else None}

    def resume_request(self, saved: dict) -> None:
        for f, v in saved["fields"].items():
            setattr(self, f, v)
        self.patience.resume(saved["patience"])
        if self.index is not None:
            self.index.resume_request(saved["index"])
        if self.toolspec is not None:
            self.toolspec.resume_request(saved["toolspec"])
        self.pool.exclude(self._prompt_hash)

    # ------------------------------------------------------------ one step
    def _host(self, context: Sequence[int], budget: int, chains=None) -> tuple[Draft, bool]:
        """The host's own draft within `budget`, and whether the gate lets the retrieved sources in.

        `chains`: the lexical host's (spine, branches) from `automaton_match`."""
        c, anchor = self.config, int(context[-1])
        if c.host == "none":
            return Draft(), True
        if c.host == "pld":
            chain = self.ngrams.lookup(c.pld_max_copy)
            draft = Draft()
            draft.add_chain(chain[:budget], "pld", budget)
            return draft, bool(chain)
        if c.host == "toolspec":
            return self.toolspec.draft(context, budget)
        has_adjacency = self._has_adjacency(anchor)
        if c.host == "recycling":
            parents, ranks = default_template(budget) if budget > 0 else ((), ())
            return self.table.expand(anchor, parents, ranks, budget, "recycling"), has_adjacency
        lex = LexicalConfig(spine_max=c.spine_max, branch_top=c.branch_top, branch_max=c.branch_max)
        return (build_lexical(self.index, self.table, budget, lex, chains, self._match, self._support),
                bool(chains[0]) and has_adjacency)

    def _has_adjacency(self, anchor: int) -> bool:
        """Whether the adjacency table has successors of `anchor` (asked twice a pass: kept until it changes)."""
        memo = self._adjacency_memo
        if memo is None or memo[0] != anchor:
            memo = self._adjacency_memo = (anchor, self.table.knows(anchor))
        return memo[1]

    def _overlaps_key(self, context: Sequence[int], chains) -> bool:
        """Whether this pass's key starts before the host drafts (`key_overlap`): the lexical host, whose gate
        (`_host`'s rule: a spine and adjacency successors of the anchor) is known from the automaton's match."""
        c = self.config
        return (self.overlap and c.host == "lexical" and not c.one_source and c.semantic and self.h_t is not None
                and (not c.gate or (bool(chains[0]) and self._has_adjacency(int(context[-1])))))

    def _key_chains(self, context: Sequence[int]) -> list[Chain]:
        """The semantic key's chains for this pass (timed into semantic_time_s)."""
        return self._key_finish(self._key_start(context, overlap=False))

    def _key_start(self, context: Sequence[int], overlap: bool) -> tuple | None:
        """Whether the key is asked on this pass (None: not) and, if so, its pass started: with `overlap`, on the
        kernel's worker where the pool allows it (`SemanticPool.key_start`), else answered here."""
        c = self.config
        if (not c.semantic or c.key_level == "null" or self.h_t is None or not self.patience.allow()
                or not self.calibration.allow()):
            return None
        t0, shadow0 = time.perf_counter(), self.pool.shadow_s
        self.tally["key_queries"] += 1
        if c.key_level == "request":
            handle = ("chains", self._request_key_chains(context))
        elif overlap:
            handle = ("pool", self.pool.key_start(self.h_t, c.k, c.theta, c.depth_schedule, c.rank_depths, c.offset,
                                                  c.min_chain))
        else:
            handle = ("pool", ("answered", self.pool.key(self.h_t, c.k, c.theta, c.depth_schedule, c.rank_depths,
                                                         c.offset, c.min_chain)))
        self.tally["semantic_time_s"] += time.perf_counter() - t0 - (self.pool.shadow_s - shadow0)
        return handle

    def _key_finish(self, handle: tuple | None) -> list[Chain]:
        """The chains of a pass `_key_start` began (the time spent here and there: semantic_time_s, the knn_recall
        shadow queries left out)."""
        if handle is None:
            return []
        t0, shadow0 = time.perf_counter(), self.pool.shadow_s
        if handle[0] == "chains":
            chains = handle[1]
        else:
            scores, _, fired = self.pool.key_finish(handle[1])
            if len(scores):  # an empty pool (or one holding only this prompt's traces) says nothing of distance
                self.patience.answered(float(scores[0]))
                self._key_cosine = float(scores[0])
            self.tally["key_fired"] += fired is not None
            chains = fired or []
        self.tally["semantic_time_s"] += time.perf_counter() - t0 - (self.pool.shadow_s - shadow0)
        self.tally["key_chains"] += len(chains)
        return chains

    def _request_key_chains(self, context: Sequence[int]) -> list[Chain]:
        c = self.config
        if self._selected is None:
            if self._first_state is None:
                return []
            picked = [t for s, t in self.pool.nearest_traces(self._first_state, c.request_traces) if s >= c.theta]
            self._selected = []
            for t in picked:
                trace = NgramIndex(c.request_ngram)
                trace.sync(self.pool.trace_tokens(t))
                self._selected.append(trace)
        if self._selected:
            self.tally["key_fired"] += 1
        chains, seen = [], set()
        depths = c.rank_depths or RANK_DEPTHS
        for rank, trace in enumerate(self._selected):
            depth = depths[rank] if rank < len(depths) else 0
            chain = ngram_continuation(trace, context, depth)
            if len(chain) >= c.min_chain and tuple(chain) not in seen:
                seen.add(tuple(chain))
                chains.append(chain)
        return chains

    def _pool_chain(self, context: Sequence[int], max_copy: int) -> Chain:
        """The +pool rungs' chain: what followed, in the pool (same-prompt traces skipped), the context's
        longest suffix under the host's own key (pld: n-gram <= pld_max_ngram; recycling: the anchor),
        up to `max_copy` tokens (timed into host_pool_time_s)."""
        if self.host_pool is None or max_copy <= 0:
            return []
        t0 = time.perf_counter()
        self.tally["host_pool_queries"] += 1
        chain = self.host_pool.lookup(context, self.host_pool.max_ngram, max_copy, self._prompt_hash, self.pool_min_n)
        self.tally["host_pool_time_s"] += time.perf_counter() - t0
        self.tally["host_pool_chains"] += bool(chain)
        return chain

    def _rollouts(self, anchor: int) -> list[Chain]:
        c = self.config
        if c.rollouts <= 0 or self.h_t is None or self.ring.size == 0:
            return []
        t0 = time.perf_counter()
        h, serial = self._prompt_hash, self._serial
        chains = self.ring.lookup(self.h_t, anchor, c.rollout_theta, c.rollouts,
                                  skip=lambda owner: owner is not None and owner[0] == h and owner[1] != serial)
        self.tally["rollout_time_s"] += time.perf_counter() - t0
        self.tally["rollout_chains"] += len(chains)
        return chains

    def _root_branches(self, anchor: int) -> list[int]:
        """Root branching (host none): the anchor's first `root_branching` adjacency successors."""
        n = self.config.root_branching
        if n <= 0 or not 0 <= anchor < self.vocab_size:
            return []
        row = self.table.table[anchor]
        return [int(t) for t in row[:n] if t >= 0]

    def propose(self, context: Sequence[int], budget: int) -> Draft:
        """The merged tree under `budget` (the candidates), then what the engine verifies of it: with size auto
        the nodes (or, `chain` > 0, the best path's first nodes) that maximise expected tokens per second
        (decoder/drafters/sizing.py), priced by the calibrator; with size fixed the whole tree (or the chain of the
        most-proposed children, `best_chain`)."""
        c = self.config
        cand = self._propose_tree(context, budget)
        t0 = time.perf_counter()
        self._cand = None
        if c.size == "fixed":
            if c.chain <= 0:
                return cand
            kept = best_chain(cand, c.chain)
        else:
            cand.probs, self._detail = self.calibrator.estimate(cand.evidence, regime_of(self._last_accepted))
            self._cand = cand
            path = path_probs(cand.parents, cand.probs)
            cap = c.chain if c.chain > 0 else len(cand)
            step_s = self.step_cost.table(cap, len(context) - 1)
            kept = (select_chain(cand.parents, cand.probs, path, step_s, c.chain) if c.chain > 0
                    else select_tree(path, step_s))
            tally = self.tally
            tally["candidate_nodes"] += len(cand)
            tally["kept_nodes"] += len(kept)
            tally["expected_tokens"] += 1.0 + float(path[kept].sum())
            tally["sizing_time_s"] += time.perf_counter() - t0
        self._kept = kept
        self._bought = {j for j, i in enumerate(kept) if i in self._bought}
        return subtree(cand, kept)

    def _propose_tree(self, context: Sequence[int], budget: int) -> Draft:
        c = self.config
        self.tally["passes"] += 1
        self._bought = set()
        if self.index is not None:
            self.index.sync(context)
        if self.ngrams is not None:
            self.ngrams.sync(context)
        if budget <= 0:
            return Draft()
        match, chains = 0, None
        if self.index is not None:
            if c.size == "auto":  # the per-token support is node evidence: only a priced draft reads it
                match, spine, branches, support = automaton_match_support(self.index, c.spine_max, c.branch_top,
                                                                         c.branch_max)
            else:
                (match, spine, branches), support = automaton_match(self.index, c.spine_max, c.branch_top,
                                                                    c.branch_max), []
            chains = (spine, branches)
        else:
            support = []
        self._match, self._support, self._key_cosine = match, support, 0.0
        if c.one_source:
            return self._one_source(context, budget, chains, match)
        reserve = budget if c.host == "none" else min(budget, max(0, c.retrieval_budget))
        # where the gate is known to open before the host drafts, the key's query runs on the kernel's worker
        # (another core) while the host builds its tree; its chains are merged first all the same
        overlap = self._overlaps_key(context, chains)
        handle = self._key_start(context, overlap=True) if overlap else None
        draft, open_ = self._host(context, budget - reserve, chains)
        pooled = self._pool_chain(context, reserve)  # +pool: part of the host's exact key, so it opens the gate
        if c.gate and c.host != "none" and not (open_ or pooled):  # (never after an overlapped start)
            self.tally["gated"] += 1
            return self._host(context, budget, chains)[0] if reserve else draft
        cap = len(draft) + reserve
        candidates = self._semantic_candidates(self._key_finish(handle) if overlap else self._key_chains(context))
        if pooled:
            candidates.append((pooled, POOL, 0))
        if chains is not None:
            support = self._support
            candidates += [(g, BRANCH, automaton_features(self._match, 1 + r, support[1 + r]) if support
                            else rank_feature(r)) for r, g in enumerate(chains[1])]
        candidates += [(g, ROLLOUT, rank_feature(r)) for r, g in enumerate(self._rollouts(int(context[-1])))]
        candidates += [([t], ROOT_BRANCH, rank_feature(r)) for r, t in enumerate(self._root_branches(int(context[-1])))]
        start = len(draft)
        self._merge(draft, candidates, cap)
        assert len(draft) - start <= reserve
        return draft

    def _semantic_candidates(self, chains: list[Chain]) -> list[tuple[Chain, str, int]]:
        """The key's chains as candidates, each with its evidence: the pass's best cosine and the chain's rank."""
        cos = self._key_cosine
        return [(g, SEMANTIC, semantic_feature(cos, r)) for r, g in enumerate(chains)]

    def _merge(self, draft: Draft, candidates: list[tuple[Chain, str, int]], cap: int) -> None:
        """Merge the candidates into `draft` up to `cap` nodes, noting the nodes the key bought."""
        root = frozenset({SEMANTIC, ROLLOUT}) if self.config.attach == "root" else frozenset()
        node = len(draft)
        for (_, source, *_), cost in zip(candidates, merge_candidates(draft, candidates, cap, root)):
            if source == SEMANTIC and cost:  # a candidate's new nodes are appended together, in order
                self._bought.update(range(node, node + cost))
            node += cost
        self.tally["key_nodes"] += len(self._bought)

    def _one_source(self, context: Sequence[int], budget: int, chains, match: int) -> Draft:
        """oilbird-one-source (module docstring): the lexical draft or the semantic draft, each at the whole
        budget, chosen by SAM-Decoding's rule on the automaton's match length; never merged."""
        c = self.config
        lexical, open_ = self._host(context, budget, chains)
        if c.gate and not open_:
            self.tally["gated"] += 1
            return lexical
        if match < c.one_source_min_match:
            semantic = Draft()  # semantic-only's draft less root branching: key chains, then rollouts, from the root
            candidates = self._semantic_candidates(self._key_chains(context))
            candidates += [(g, ROLLOUT, rank_feature(r)) for r, g in enumerate(self._rollouts(int(context[-1])))]
            self._merge(semantic, candidates, budget)
            if len(semantic):
                self.tally["chose_semantic"] += 1
                return semantic
        self.tally["chose_lexical"] += 1
        return lexical

    def observe(self, context: Sequence[int], result) -> None:
        later = self.observe_split(context, result)
        if later is not None:
            later()

    def observe_split(self, context: Sequence[int], result) -> Callable[[], None]:
        """Now what the next propose reads: the accepted count (the calibrator's regime), the key's gate (patience,
        the key's calibration), the key's query state. Returned, for the loop to run beside the next verify: the
        calibration labels, the adjacency tables' update and the ring buffer's records (decoder/draft.py
        `Drafter.observe_split`); the next propose drafts without them, wherever they run."""
        c = self.config
        labels = None
        if self._cand is not None:  # size auto: the candidates whose parent's next token is now known, labelled
            cand, kept = self._cand, self._kept
            next_token = {ROOT: int(result.argmax[0])}
            for i in result.accepted_nodes:
                next_token[kept[i]] = int(result.argmax[1 + i])
            labels = (cand, self._detail, next_token, regime_of(self._last_accepted))
            self._cand = None
        self._last_accepted = len(result.accepted_nodes)
        hit = bool(self._bought) and any(i in self._bought for i in result.accepted_nodes)
        self.patience.record(hit)
        if self._bought:
            self.calibration.record(hit)
            self.tally["key_buying_passes"] += 1
            self.tally["key_hits"] += hit
            self._bought = set()
        hidden = result.hidden
        if hidden is None:
            self.h_t = None
        else:
            # rounded to float16, as the pool keeps its states and the store keeps them: live serving and replay
            # over the store then ask the key the same query (a similarity at a depth threshold otherwise differs)
            self.h_t = np.array(hidden[1 + result.accepted_nodes[-1] if result.accepted_nodes else 0], np.float16
                                ).astype(np.float32)
            if self._first_state is None:
                self._first_state = np.array(hidden[0], np.float16).astype(np.float32)
        owner = (self._prompt_hash, self._serial)
        anchor = int(context[-1])
        before = list(context) if self.toolspec is not None else None  # the loop extends `context` before later runs

        def later() -> None:
            if labels is not None:
                cand, detail, next_token, regime = labels
                self.calibrator.observe(cand.evidence, cand.probs, detail,
                                        accepted_labels(cand.parents, cand.tokens, next_token), regime)
            if self.table is not None:
                self.table.observe(anchor, result.draft.tokens, result.topk)
                self._adjacency_memo = None
            if self.toolspec is not None:
                self.toolspec.observe(before, result)
            if hidden is not None and c.rollouts > 0:
                for row, token, cont in rejected_records(result, c.rollout_depth):
                    self.ring.add(hidden[row], token, cont, owner)

        return later

    # ------------------------------------------------------------ reporting
    def counters(self) -> dict:
        """Counters for summary.json: key and ring-buffer use, timing, store size."""
        n_tok = self.pool.n_tokens
        return {
            **self.tally,
            "semantic_key": self.config.semantic and self.config.key_level != "null",
            "size": self.config.size, "step_cost": self.step_cost.describe(),
            "calibration": self.calibrator.summary() if self.config.size == "auto" else None,
            "key_overlap": self.overlap,
            "calibration_mutes": self.calibration.mutes,
            "calibration_skipped": self.calibration.skipped,
            "patience_skipped": self.patience.skipped,
            "floor_skipped": self.patience.floor_skipped,
            "patience_probes": self.patience.probes,
            "pool_tokens": n_tok,
            "pool_states": self.pool.n,
            "store_bytes": self.pool.nbytes(),
            "store_bytes_per_token": self.pool.nbytes() / n_tok if n_tok else None,
            "ring_records": self.ring.size,
            "ring_bytes": self.ring.nbytes(),
            "host_pool": self.host_pool is not None,
            "host_pool_tokens": self.host_pool.n_tokens if self.host_pool is not None else 0,
            **({"toolspec": self.toolspec.counters()} if self.toolspec is not None else {}),
            **self.pool.index_info(),
        }
