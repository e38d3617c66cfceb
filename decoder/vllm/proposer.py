"""Oilbird inside vLLM: the decoder's own drafters as a vLLM speculative proposer (`method: custom_class`).

Turn it on (one line of Python; `vllm serve` takes the same dict as --speculative-config):

    LLM(model, speculative_config=speculative_config("oilbird", k=8))   # vLLM's default compilation; eager works too

`speculative_config(arm, k, nodes=None, index=None)` returns vLLM's dict and puts the arm in the
environment (OILBIRD_VLLM_ARM, ..._NODES, ..._INDEX), which the engine's child process inherits:
vLLM passes a custom class nothing but its own config. Every setting (argument or OILBIRD_VLLM_*
variable) is checked by `proposer_settings` (data/capture/vllm_settings.py's rules) twice: in
`speculative_config`, before the engine starts, and in the proposer's constructor, in the worker.
For `vllm serve` (`python -m decoder serve` / `make serve` check the settings and run it: decoder/vllm/serve.py):

    OILBIRD_VLLM_ARM=oilbird vllm serve MODEL \\
        --speculative-config '{"method": "custom_class", "model": "decoder.vllm.proposer.OilbirdProposer",
                               "num_speculative_tokens": 8}'

What runs, per engine step (vLLM calls `propose` after committing the step's tokens):
  1. `StepTap` (data/capture/vllm_engine.py) has the step's states at the capture layer (the store's layer) and the
     top-8 of every verified position; `RowTracker` (data/capture/vllm_rows.py) says which request each row holds.
  2. A request that left the batch has finished: its trace (tokens and states) enters the pool, under its
     prompt's hash (data.store.schema.prompt_hash, the store's), so requests of the same prompt never draft from it.
  3. Per row: the drafter resumes that request (`Drafter.resume_request`), observes the verification of
     the chain it proposed there at the last step (accepted = the sampled tokens but the last; the states
     and top-8 of the anchor and every verified node), proposes the next draft and suspends the request.
     One drafter serves every row, so every request drafts from one pool.
  4. vLLM verifies one chain per row, so the arm runs with `chain=k`: it builds its whole tree (at `nodes`
     nodes, as in replay) and proposes its best chain: at each node the most probable child (the node
     probabilities of decoder/calibration.py), cut where the expected tokens per second of a step stop
     growing, priced on the vLLM profile OILBIRD_VLLM_PROFILE names at the arm's batch size (`@batch=B`;
     decoder/drafters/sizing.py), so the chain's length varies by row and step, 0 to k tokens (without a profile the
     cost is flat and every chain runs to k; `@size=fixed` keeps the most-proposed child and k tokens).
     The replay of the same arm with `@chain=k` predicts it.
The arms are the replay's names (`oilbird`, `oilbird-no-semantic`, variants `oilbird@field=value`); an arm
whose drafter keeps per-request state without `suspend_request` is refused.
With OILBIRD_VLLM_STORE=<folder> (the one flag) every finished request is also written to a trace store
there (data/capture/served_store.py), and a proposer that starts on an existing one pools its traces first.
Counters (the drafter's, and the proposer's: steps, rows, requests, drafting seconds) go to the JSON file
OILBIRD_VLLM_STATS names (after every finished request, atomically); log lines to OILBIRD_VLLM_LOG, never
stdout (the engine's child process owns it). A stats, log or store write that fails while serving (a full
disk, a folder replaced) is logged once (logging, and the log file) and counted (`<kind>_write_failures` in
the stats), never raised into vLLM: the server keeps serving.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from data.capture.vllm_capture import RequestRecorder, Trace
from data.capture.vllm_rows import RowRequest
from data.capture.vllm_settings import BY_FIELD, PROPOSER_CLASS, PROPOSER_FIELDS, VllmSettings, read_vllm_settings
from data.errors import OilbirdError
from data.store.files import atomic_write_json
from data.store.schema import prompt_hash
from decoder.draft import Draft, Drafter, VerifyResult
from decoder.drafters import make_drafter
from decoder.pools import PoolSettings, check_index

CLASS_PATH = PROPOSER_CLASS
OWN_FIELDS = ("arm", "nodes", "index", "stats", "log", "profile")  # what speculative_config puts in the environment


def speculative_config(arm: str | None = None, k: int = 8, nodes: int | None = None, index: str | None = None,
                       stats: str | None = None, log: str | None = None, profile: str | None = None) -> dict:
    """vLLM's speculative_config for an Oilbird arm, the settings put in this process's environment (the
    engine's child inherits it). Every setting is checked here (`proposer_settings`), so a bad one is one line
    before the engine starts. An argument left None keeps what the environment says (OILBIRD_VLLM_ARM, ...), else
    its default (arm oilbird, nodes 60, index auto, no stats, log or profile)."""
    settings, _ = proposer_settings(arm=arm, k=k, nodes=nodes, index=index, stats=stats, log=log, profile=profile)
    os.environ.update(settings.to_env(OWN_FIELDS))
    return {"method": "custom_class", "model": CLASS_PATH, "num_speculative_tokens": settings.k}


def proposer_settings(environ: Mapping[str, str] | None = None, **explicit: Any) -> tuple[VllmSettings, Any]:
    """Every setting the proposer reads, checked in one place (data/capture/vllm_settings.py: types, ranges,
    writable paths), then what only the decoder can check: the arm builds a drafter that interleaves requests,
    the index spec parses, the profile loads and measured the arm's batch size. Returns the settings and the
    profile's cost model (None without one). Each failure is one OilbirdError line naming the argument or
    the variable, its value and what is allowed."""
    s = read_vllm_settings(PROPOSER_FIELDS, explicit, environ)
    env = os.environ if environ is None else environ

    def named(field: str, e: OilbirdError) -> OilbirdError:
        var = BY_FIELD[field].name
        label = f"{field}={getattr(s, field)!r}" if explicit.get(field) is not None else f"{var}={env.get(var)!r}"
        # an index or profile error already says what would do; an unknown arm's lists drafters vLLM cannot run
        return OilbirdError(f"{label}: {e}" + (f"; allowed: {BY_FIELD[field].allowed}" if field == "arm" else ""))

    try:
        check_arm(s.arm, s.k)
    except OilbirdError as e:
        raise named("arm", e) from None
    try:
        check_index(s.index, None)
    except OilbirdError as e:
        raise named("index", e) from None
    try:
        cost = load_step_cost(s.profile, s.arm)
    except OilbirdError as e:
        raise named("profile", e) from None
    return s, cost


def check_arm(arm: str, k: int, vocab_size: int = 16) -> Drafter:
    """A drafter for `arm` drafting chains of k, or one line why not."""
    if k < 1:
        raise OilbirdError(f"num_speculative_tokens must be at least 1 (got {k})")
    drafter = make_drafter(arm, vocab_size=vocab_size, nodes=60)
    if type(drafter).suspend_request is Drafter.suspend_request:
        raise OilbirdError(f"arm {arm!r} cannot interleave requests (its drafter has no suspend_request); "
                           "in vLLM use an Oilbird arm: oilbird, oilbird-no-semantic, oilbird@field=value")
    return make_drafter(arm, vocab_size=vocab_size, nodes=60, chain=k)


def load_step_cost(profile: str, arm: str):
    """The profile's cost model (None without one), refused in one line when unreadable or when it did not
    measure the batch size the arm is sized for (`@batch=B`)."""
    if not profile:
        return None
    from decoder.cost.profile import CostModel
    from decoder.cost.pricing import arm_batch

    cost = CostModel.load(profile)
    cost.meta["path"] = profile
    cost.at_batch(arm_batch(arm))
    return cost


class OilbirdProposer(RequestRecorder):
    """vLLM's custom_class proposer: `OilbirdProposer(vllm_config)`, `load_model(model)`, `propose(...)`
    (data/capture/vllm_capture.py's RequestRecorder follows the rows and records the traces; this drafts)."""

    def __init__(self, vllm_config: Any) -> None:
        # the worker reads the environment itself (`vllm serve` runs none of our parent code): the same checks
        try:
            s, cost = proposer_settings(k=int(vllm_config.speculative_config.num_speculative_tokens))
        except OilbirdError as e:  # what vLLM shows of its worker's failure: this line, clear on its own
            raise OilbirdError(f"{e} (the Oilbird proposer, in vLLM's engine process; `python -m decoder vllm-check` "
                               "checks these settings before serving)") from None
        super().__init__(vllm_config, s)
        vocab = int(vllm_config.model_config.get_vocab_size())
        self.drafter = make_drafter(s.arm, vocab_size=vocab, nodes=s.nodes, chain=self.k,
                                    shared=PoolSettings(index=s.index, knn_recall_every=0, step_cost=cost).shared())
        self.counts["pooled_tokens"] = 0
        self._log(f"oilbird proposer: arm {s.arm}, chain k={self.k}, tree nodes {s.nodes}, index {s.index}, "
                  f"sized by {s.profile or 'a flat cost'}")

    def load_model(self, model: Any, *args: Any, **kwargs: Any) -> None:
        """The recorder's taps (and the served store, when OILBIRD_VLLM_STORE is set); an existing served
        store's traces enter the pool first, so a restarted server drafts from what it served before."""
        super().load_model(model, *args, **kwargs)
        if self.store is not None and self.store.writer.done:
            from data.store.reader import open_store
            from decoder.replay.traces import load_traces

            # a store of another model is refused (its states mean nothing here); unknown rows are zeros
            store = open_store(self.store.path, model_fingerprint=self.store.writer.meta["model_fingerprint"])
            warm = load_traces(store, None, None)
            for t in warm:
                self.drafter.add_trace(t.tokens, prompt_hash(t.prompt), t.pool_states())
                self.counts["pooled_tokens"] += len(t.tokens)
            self._log(f"oilbird proposer: {len(warm)} traces of the served store {self.store.path} pooled")

    def draft(self, req: RowRequest, rows, sampled: Sequence[int], room: int) -> list[int]:
        """Resume the request, observe the verification of its last chain, propose the next, suspend it."""
        if req.saved is None:  # a new request: the prompt list is built once, here
            prompt = req.tokens[:req.prompt_len].tolist()
            self.drafter.begin_request(prompt, prompt_hash(prompt))
        else:
            self.drafter.resume_request(req.saved)
        if rows is not None:
            hidden, topk = rows
            accepted = len(sampled) - 1
            pending = req.draft if req.draft is not None else Draft()
            draft = Draft()  # the chain as vLLM verified it (a scheduler may have cut it)
            for j in range(min(len(hidden) - 1, len(pending))):
                draft.add_node(j - 1, pending.tokens[j], "")
                draft.sources[j] = set(pending.sources[j])
            context = req.tokens[: len(req.tokens) - len(sampled)].tolist()
            self.drafter.observe(context, VerifyResult(draft, list(range(accepted)), int(sampled[-1]),
                                                       list(map(int, sampled)), topk[:, 0].copy(), topk, hidden))
        req.draft = self.drafter.propose(req.tokens.tolist(), self.settings.nodes) if room > 0 else Draft()
        req.pending = req.draft.tokens[:max(0, room)]
        req.saved = self.drafter.suspend_request()
        return req.pending

    def finished(self, req: RowRequest, trace: Trace | None) -> None:
        """A finished request's trace enters the pool under its prompt's hash (the store's conventions:
        the rows the taps missed, and the last output token's, are zeros)."""
        if trace is None or not len(trace.output) or req.saved is None:
            return
        hidden = trace.hidden * trace.hidden_valid[:, None]
        self.drafter.add_trace(trace.output.tolist(), prompt_hash(trace.prompt.tolist()), hidden)
        self.counts["pooled_tokens"] += len(trace.output)
        self._write_stats()

    # ------------------------------------------------------------ reporting
    def stats(self) -> dict:
        return {"arm": self.settings.arm, "k": self.k, "nodes": self.settings.nodes, "profile": self.settings.profile,
                **self.counts,
                "drafter": self.drafter.counters()}

    def _write_stats(self) -> None:
        if not self.settings.stats:
            return
        try:
            atomic_write_json(Path(self.settings.stats), json.loads(json.dumps(self.stats(), default=float)))
        except Exception as e:  # a full disk, the folder replaced while serving: the counters wait, serving goes on
            self.write_failed("stats", self.settings.stats, e)
