"""Capture by serving: vLLM decodes, a custom_class "proposer" that drafts nothing records every request's
trace (tokens, states at the capture layer, top-8), and the store is written as any capture writes it.

`RequestRecorder` is vLLM's custom_class contract (`Recorder(vllm_config)`, `load_model(model)`,
`propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)`), and the base of the Oilbird proposer
(decoder/vllm/proposer.py), which drafts: the pool it drafts from and the store are the same data. Per step:
  - `StepTap` (data/capture/vllm_tap.py) has the step's states and the top-8 of every verified position;
    `RowTracker` (data/capture/vllm_rows.py) says which request each row holds;
  - a prefill row gives the state and top-8 at the prompt's last token (the store's prompt_last_*);
  - a decode row verified [anchor, drafts...]: the anchor and the accepted drafts are output tokens, and
    their states and top-8 are the trace's rows (row i: output[i] as input; the last output token is never
    fed, so its row stays invalid, as in every store);
  - a request that left the batch has finished: with OILBIRD_VLLM_TRACES set, its trace is written there
    (one .npz per request, atomically); with OILBIRD_VLLM_STORE set, it is appended to the trace store
    there (data/capture/served_store.py: serving writes the store). vLLM drops a finished request's row only at the next step, so a
    caller that needs every trace sends one more short request after the last (`flush_request`).
The tokens the store keeps are the ones vLLM returned; the recorder's copy must agree (checked per request).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from data.capture.vllm_tap import TOP_K, StepTap, full_graph_notice
from data.capture.vllm_rows import RowRequest, RowTracker
from data.capture.vllm_settings import BY_FIELD, RECORDER_CLASS, RECORDER_FIELDS, VllmSettings, read_vllm_settings
from data.errors import OilbirdError, os_error_line

TRACES_ENV = BY_FIELD["traces"].name  # OILBIRD_VLLM_TRACES
LOG = logging.getLogger("oilbird.vllm")


class RequestRecorder:
    """vLLM's custom_class proposer that drafts nothing and records every request (module docstring);
    subclasses draft by overriding `draft` and learn from a finished request in `finished`."""

    def __init__(self, vllm_config: Any, settings: VllmSettings | None = None) -> None:
        # the OILBIRD_VLLM_* settings, checked (data/capture/vllm_settings.py); a subclass passes its own
        self.settings = settings if settings is not None else read_vllm_settings(RECORDER_FIELDS)
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_len = int(vllm_config.model_config.max_model_len)
        # the most tokens one step feeds (the taps' buffer): vLLM's scheduler budget
        scheduler = getattr(vllm_config, "scheduler_config", None)
        self.max_tokens = int(getattr(scheduler, "max_num_batched_tokens", 0) or 8192)
        self.traces_dir = self.settings.traces
        self.vllm_config = vllm_config
        self.store = None  # data.capture.served_store.ServedStore when OILBIRD_VLLM_STORE is set (made in load_model)
        self.rows = RowTracker()
        self.tap: StepTap | None = None
        self.counts = dict(steps=0, rows=0, drafts=0, draft_tokens=0, verified_drafts=0, verified_draft_tokens=0,
                           accepted_tokens=0, requests=0, finished=0, written=0,
                           unverified_rows=0, unaligned_steps=0, untapped_steps=0, draft_s=0.0, stats_write_failures=0,
                           log_write_failures=0, trace_write_failures=0, store_write_failures=0, store_dropped=0)

    def load_model(self, model: Any, *args: Any, **kwargs: Any) -> None:
        """The runner hands over the target model: tap its capture layer and its logits; with
        OILBIRD_VLLM_STORE set, open the store served requests are written to (data/capture/served_store.py)."""
        from data.capture.served_store import ServedStore

        self.tap = StepTap(model, self.settings.layer or None, self.max_tokens, notice=self._say)
        notice = full_graph_notice(self.vllm_config)
        if notice:
            self._say(notice)
        self.store = ServedStore.from_env(self.vllm_config, self.tap.layer, self.settings)

    def propose(self, sampled_token_ids: Sequence[Sequence[int]], num_tokens_no_spec: np.ndarray,
                token_ids_cpu: np.ndarray, *args: Any, **kwargs: Any) -> list[list[int]]:
        t0 = time.perf_counter()
        step = self.tap.take() if self.tap is not None else None
        held, finished = self.rows.step(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        for req in finished:
            self._finish(req)
        # per row: the draft tokens vLLM verified on it this step (0 for a prefill), and where its top-8 rows
        # start (the logits processor computes 1 + verified rows per batch row, in row order)
        verified = [0] * len(held)
        if step is not None:
            for i, req in enumerate(held):
                if req is not None and req.decoding and i + 1 < len(step.query_start):
                    verified[i] = int(step.query_start[i + 1] - step.query_start[i]) - 1
            if step.topk is None or len(step.topk) != sum(verified) + len(held):
                step = None  # the taps do not line up with the rows: record nothing this step (counted)
                self.counts["unaligned_steps"] += 1
        first_top = np.concatenate([[0], np.cumsum(np.asarray(verified, np.int64) + 1)])
        drafts: list[list[int]] = []
        for i, req in enumerate(held):
            if req is None or req.sampled == 0:
                drafts.append([])
                continue
            self.counts["rows"] += 1
            if not req.decoding:
                self.counts["requests"] += 1
            if req.decoding:  # what vLLM verified on the row (its spec-decode counters count the same)
                checked = verified[i] if step is not None else len(req.pending or [])
                self.counts["verified_drafts"] += bool(checked)
                self.counts["verified_draft_tokens"] += checked
                self.counts["accepted_tokens"] += len(sampled_token_ids[i]) - 1
            rows = self._verified_rows(step, i, req, verified[i], int(first_top[i]), sampled_token_ids[i])
            room = min(self.k, self.max_len - len(req.tokens) - 1)
            draft = self.draft(req, rows, sampled_token_ids[i], room)[:max(0, room)]
            req.decoding = True
            drafts.append(draft)
            self.counts["drafts"] += bool(draft)
            self.counts["draft_tokens"] += len(draft)
        self.counts["steps"] += 1
        self.counts["untapped_steps"] = self.tap.untapped_steps if self.tap is not None else 0
        self.counts["draft_s"] += time.perf_counter() - t0
        return drafts

    def _verified_rows(self, step, row: int, req: RowRequest, verified: int, first_top: int,
                       sampled: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """(states, top-8) of the row's verified positions, [1 + verified]: a prefill's is its prompt's last
        token, a decode row's the anchor and each verified draft; the output tokens among them join the
        request's trace. None when the taps missed the row or vLLM did not verify the chain we proposed."""
        if step is None:
            self.counts["unverified_rows"] += 1
            return None
        lo = int(step.query_start[row]) if req.decoding else int(step.query_start[row + 1]) - 1
        hidden, topk = step.states[lo: lo + 1 + verified], step.topk[first_top: first_top + 1 + verified]
        accepted = len(sampled) - 1
        proposed = list(req.pending or [])[:verified]
        if accepted > len(proposed) or list(sampled[:accepted]) != proposed[:accepted]:
            self.counts["unverified_rows"] += 1
            return None
        if req.decoding:
            req.states.extend(hidden[: accepted + 1])
            req.topk.extend(topk[: accepted + 1])
        else:
            req.first = (hidden[0].copy(), topk[0].copy())
        # a committed token that is not the model's top-1 where it was chosen: the request was sampled
        req.off_argmax += int(np.count_nonzero(np.asarray(sampled[: accepted + 1]) != topk[: accepted + 1, 0]))
        return hidden, topk

    def draft(self, req: RowRequest, rows, sampled: Sequence[int], room: int) -> list[int]:
        """The draft for `req` after this step (the recorder drafts nothing); `rows` as _verified_rows."""
        req.pending = []
        return []

    def _finish(self, req: RowRequest) -> None:
        self.counts["finished"] += 1
        trace = request_trace(req)
        # a write that fails here (a full disk, a folder removed or replaced while serving) must not end the
        # engine: vLLM turns any exception in a proposer into EngineDeadError, a server that stops serving
        if self.traces_dir and trace is not None:
            try:
                write_trace(Path(self.traces_dir), req.serial, trace)
                self.counts["written"] += 1
            except Exception as e:
                self.write_failed("trace", self.traces_dir, e)
        if self.store is not None and trace is not None:
            try:
                self.store.add(trace)
            except Exception as e:  # the store keeps what it could not commit for the next try (served_store.py)
                self.write_failed("store", self.store.path, e)
            self.counts["stored"] = self.store.written
            self.counts["store_dropped"] = self.store.dropped
        self.finished(req, trace)

    def finished(self, req: RowRequest, trace: "Trace | None") -> None:
        """A request left the batch (subclasses pool its trace)."""

    # ------------------------------------------------------------ side channels that must not stop serving
    def write_failed(self, kind: str, path: Any, error: BaseException) -> None:
        """Count a failed write of the stats, log, traces or store (`<kind>_write_failures`); the first of each
        kind is logged (a warning, and a line in the log file), the rest only counted."""
        key = f"{kind}_write_failures"
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.counts[key] == 1:
            why = os_error_line(error) if isinstance(error, OSError) else f"{type(error).__name__}: {error}"
            line = (f"oilbird: cannot write the {kind} {path}: {why}; serving goes on, failures are counted "
                    f"({key} in the stats)")
            LOG.warning(line)
            if kind != "log":
                self._log(line)

    def _say(self, line: str) -> None:
        """A line a user must see: a logging warning (the engine's stderr) and the log file."""
        LOG.warning(line)
        self._log(line)

    def _log(self, line: str) -> None:
        """A line to OILBIRD_VLLM_LOG (the engine's child owns stdout); a log that cannot be written is counted."""
        if not self.settings.log:
            return
        try:
            with open(self.settings.log, "a") as f:
                f.write(line + "\n")
        except OSError as e:
            self.write_failed("log", self.settings.log, e)


@dataclass
class Trace:
    """One served request as the recorder saw it (the store's conventions)."""

    prompt: np.ndarray  # int32
    output: np.ndarray  # int32
    hidden: np.ndarray  # [n, d] float32; row i: the state with output[i] as input
    hidden_valid: np.ndarray  # [n] bool
    topk: np.ndarray  # [n, 8] int64 (-1 rows where invalid)
    prompt_last_hidden: np.ndarray  # [d]
    prompt_last_topk: np.ndarray  # [8]
    off_argmax: int = 0  # committed tokens that were not the model's top-1 there (> 0: a sampled request)


def request_trace(req: RowRequest) -> Trace | None:
    """The trace of a finished request; None when its prefill was never seen (no state at all)."""
    if req.first is None:
        return None
    out = req.output
    d = req.first[0].shape[-1]
    n = min(len(req.states), len(out))
    hidden = np.zeros((len(out), d), np.float32)
    topk = np.full((len(out), TOP_K), -1, np.int64)
    valid = np.zeros(len(out), bool)
    if n:
        hidden[:n] = np.stack(req.states[:n])
        topk[:n] = np.stack(req.topk[:n])
        valid[:n] = True
    return Trace(req.tokens[:req.prompt_len].copy(), out.copy(), hidden, valid, topk, req.first[0], req.first[1],
                 req.off_argmax)


def write_trace(folder: Path, serial: int, trace: Trace) -> Path:
    """One .npz per request, written whole or not at all (tmp + rename)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{os.getpid()}-{serial:08d}.npz"
    tmp = folder / f".{path.name}.tmp"
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **{k: getattr(trace, k) for k in Trace.__dataclass_fields__})
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.filename is not None:
            raise
        # a write's OSError names no file ("No space left on device"): name the trace it was for
        raise OSError(e.errno, e.strerror or str(e), os.fspath(path)) from e
    return path


# ------------------------------------------------------------------ capture's side (the parent process)

def flush_request(prompt: Sequence[int]):
    """The short request sent after a wave so that vLLM drops the wave's rows and the recorder writes them."""
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(prompt[:4]))


def vllm_generations(llm, prompts: list[list[int]], max_new: int, stop_strings: tuple[str, ...], wave: int,
                     traces_dir: Path) -> Iterator[tuple[int, "object"]]:
    """(index in `prompts`, data.capture.greedy.Generated), in serving order, `wave` requests at a time; the
    engine runs RequestRecorder writing into `traces_dir`."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from data.capture.greedy import Generated

    greedy = SamplingParams(temperature=0.0, max_tokens=max_new, stop=list(stop_strings) or None)
    flush = SamplingParams(temperature=0.0, max_tokens=1)
    for lo in range(0, len(prompts), wave):
        batch = prompts[lo:lo + wave]
        t0 = time.perf_counter()
        results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], greedy, use_tqdm=False)
        llm.generate([flush_request(batch[0])], flush, use_tqdm=False)
        seconds = (time.perf_counter() - t0) / len(batch)
        recorded: dict[tuple, list[Trace]] = {}
        for p in sorted(traces_dir.glob("*.npz")):
            with np.load(p) as z:
                t = Trace(**{k: z[k] for k in Trace.__dataclass_fields__ if k in z})
            recorded.setdefault(tuple(t.prompt.tolist()), []).append(t)
            p.unlink()
        for j, (prompt, r) in enumerate(zip(batch, results)):
            out = r.outputs[0]
            tokens = list(out.token_ids)
            got = recorded.get(tuple(prompt)) or []
            t = got.pop(0) if got else None
            if t is not None and len(t.output) > len(tokens) and t.output[:len(tokens)].tolist() == tokens:
                # vLLM finds stop strings in its front end, after the engine has decoded past them: the
                # returned tokens are the output; the trace is cut to them, its last row invalid as always
                n = len(tokens)
                t = Trace(t.prompt, t.output[:n], t.hidden[:n], t.hidden_valid[:n].copy(), t.topk[:n],
                          t.prompt_last_hidden, t.prompt_last_topk, int(t.off_argmax))
                if n:
                    t.hidden_valid[n - 1] = False
            if t is None or t.output.tolist() != tokens:
                why = "no trace" if t is None else (f"recorded {len(t.output)} tokens, vLLM returned {len(tokens)}, first "
                                                    f"difference at {_first_difference(t.output.tolist(), tokens)}")
                raise OilbirdError(f"vLLM capture: request {lo + j} was not recorded as served ({why}); "
                                   "nothing of it is kept")
            stop = "length" if out.finish_reason == "length" else (
                "stop_string" if isinstance(out.stop_reason, str) else "eos")
            yield lo + j, Generated(tokens, t.hidden, t.hidden_valid, t.topk, t.prompt_last_hidden,
                                    t.prompt_last_topk, stop, seconds, int(r.num_cached_tokens or 0),
                                    off_argmax=int(t.off_argmax))


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
