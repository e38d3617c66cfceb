"""`ar-static`: the greedy decoder a GPU user runs, beside our `ar`, as a second speed reference.

transformers' `model.generate` with `cache_implementation="static"`, `do_sample=False`, one request at a
time (batch 1). The static cache is sized once for the whole run (`max_cache_len` = the longest prompt +
the token cap), so every request decodes with the same shapes and the compiled step is built once.

Compilation: on CUDA (and XPU) transformers compiles the decode step itself (`_valid_auto_compile_criteria`:
a static cache on such a device; the model's default `CompileConfig`, inductor with "reduce-overhead",
i.e. CUDA graphs). On CPU transformers would not compile; we ask it to (`CompileConfig` with
`_compile_all_devices`), since inductor's CPU code runs the step about twice as fast as eager on this
machine for SmolLM2-135M and stories260k: the first compile takes 30-70 s on 2 cores (5 s once inductor's
on-disk cache holds it). `compile=False` (`--no-compile`) keeps the static cache uncompiled; a compile that
fails in the untimed warm-up falls back to uncompiled with a note. `compiled` in the summary says which ran.
The prefill is never compiled (transformers compiles the one-token decode step only).

Stopping equals ours exactly: the same EOS ids and token cap handed to generate, and decoder/verify/engine.py's
`StopRule.reason` wrapped as a StoppingCriteria (EOS, stop strings in the decoded tail, cap), called after
every token, so generate stops on the very token `ar` stops on. Logits processors a model's own
generation config could add (repetition penalty, n-gram blocking, minimum length) are set neutral; any
left are reported on stderr, and the lossless audit against `ar` has the last word (a logits processor that
passes the scores unchanged keeps each step's top-8 ids and logits for it, as decode_greedy does).

Timing (as `ar`): the wall time of the request, prefill + decode. `prefill_s` is the time to the first
generated token (generate's prefill forward over the whole prompt yields it; ar's prefill leaves the last
prompt token for the first pass); one Cycle per token as ar (tau 1): the first with no time of its own (it
is in prefill_s), every later one the time since the previous token.
"""

from __future__ import annotations

import sys
import time
from typing import Sequence

import torch

from data.capture.models import LoadedModel
from data.store.schema import TOPK
from decoder.verify.engine import StopRule
from decoder.loop import Cycle, Generation

REFERENCE_ARM = "ar"  # plain greedy decoding (decoder/verify/engine.py decode_greedy): the audit's reference
STATIC_ARM = "ar-static"
WARMUP_TOKENS = 8  # decode steps of each untimed warm-up call (CUDA graphs record on the second call)


def _topk_recorder(rows: list):
    from transformers import LogitsProcessor

    class TopkRecorder(LogitsProcessor):
        """Keeps each step's top-8 (ids, logits) on the device for the lossless audit; the scores pass unchanged."""

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            rows.append(scores[0].float().topk(TOPK))
            return scores

    return TopkRecorder()


def _stopping_criteria(stop: StopRule, times: list[float], output: list[int], reasons: list[str]):
    from transformers import StoppingCriteria

    class StopRuleCriteria(StoppingCriteria):
        """StopRule.reason after every generated token: True stops generate right after that token."""

        def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
            output.append(int(input_ids[0, -1]))
            times.append(time.perf_counter())
            reason = stop.reason(output)
            if reason is not None:
                reasons.append(reason)
            return torch.full((input_ids.shape[0],), reason is not None, dtype=torch.bool, device=input_ids.device)

    return StopRuleCriteria()


class StaticGreedy:
    """transformers' generate (static cache, greedy, compiled where it can be) behind decode_greedy's interface."""

    def __init__(self, lm: LoadedModel, stop: StopRule, max_prompt_tokens: int, compile: bool | None = None):
        from transformers import CompileConfig, GenerationConfig

        self.lm = lm
        self.stop = stop
        eos = sorted(lm.eos_ids)
        pad = lm.tokenizer.pad_token_id
        pad = pad if isinstance(pad, int) else (eos[0] if eos else 0)
        want = compile is not False
        gpu = lm.device.type in ("cuda", "xpu")
        self.config = GenerationConfig(
            do_sample=False, num_beams=1, max_new_tokens=stop.max_new_tokens, eos_token_id=eos or None,
            pad_token_id=pad, cache_implementation="static", max_cache_len=int(max_prompt_tokens) + stop.max_new_tokens,
            # neutral values, so a model's own generation config cannot fill these in (greedy = plain argmax)
            repetition_penalty=1.0, encoder_repetition_penalty=1.0, no_repeat_ngram_size=0,
            encoder_no_repeat_ngram_size=0, min_length=0, min_new_tokens=0,
            disable_compile=not want)
        if want and not gpu:  # transformers compiles on CUDA/XPU by itself; on CPU only when asked
            cc = CompileConfig()
            cc._compile_all_devices = True
            self.config.compile_config = cc
        self.compile_requested = want
        self.compiled = False  # set by warm_up
        self.compile_error: str | None = None
        self.processors = self._logits_processors()
        if self.processors:
            print(f"note: {STATIC_ARM}: the model's generation config adds {', '.join(self.processors)}; its tokens "
                  "may differ from ar's (the lossless audit says)", file=sys.stderr)

    def _logits_processors(self) -> list[str]:
        """Names of the logits processors generate would apply (best effort: transformers internals)."""
        model = self.lm.model
        try:
            merged, _ = model._prepare_generation_config(self.config)
            procs = model._get_logits_processor(generation_config=merged, input_ids_seq_length=1,
                                                encoder_input_ids=torch.zeros((1, 1), dtype=torch.long),
                                                device=str(self.lm.device))
        except (AttributeError, TypeError, ValueError):
            return []
        return [type(p).__name__ for p in procs]

    def warm_up(self, prompt: Sequence[int]) -> None:
        """Untimed generate calls before any timing: they compile the decode step (CUDA: record its graphs)."""
        stop = StopRule(self.stop.tokenizer, frozenset(), (), WARMUP_TOKENS)  # no early stop: every step runs
        try:
            for _ in range(2):
                self._generate(prompt, stop)
        except Exception as e:  # noqa: BLE001 - any compiler failure: run uncompiled rather than not at all
            if self.config.disable_compile:
                raise
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            print(f"note: {STATIC_ARM}: torch.compile failed ({type(e).__name__}: {first}); "
                  "running the static cache uncompiled", file=sys.stderr)
            self.compile_error = f"{type(e).__name__}: {first}"
            self.config.disable_compile = True
            self.config.compile_config = None
            for _ in range(2):
                self._generate(prompt, stop)
        self.compiled = not self.config.disable_compile and getattr(self.lm.model, "_compiled_call", None) is not None

    def summary(self) -> dict:
        """What ar-static's summary.json adds: whether the decode step ran compiled, and generate's settings."""
        how = ("off" if not self.compile_requested else f"failed, off ({self.compile_error})" if self.compile_error
               else "transformers auto-compile" if self.config.compile_config is None else "CompileConfig, all devices")
        return {"compiled": self.compiled,
                "generate": {"cache_implementation": "static", "max_cache_len": self.config.max_cache_len,
                             "do_sample": False, "compile": how, "logits_processors": self.processors}}

    @torch.no_grad()
    def _generate(self, prompt: Sequence[int], stop: StopRule) -> tuple[list[int], list[float], list[str], float, list]:
        from transformers import LogitsProcessorList, StoppingCriteriaList

        times: list[float] = []
        output: list[int] = []
        reasons: list[str] = []
        chosen: list = []  # per token, on the device: read back after the timing (as decode_greedy)
        t_start = time.perf_counter()
        ids = torch.tensor([list(prompt)], device=self.lm.device)
        out = self.lm.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=self.config,
                                     logits_processor=LogitsProcessorList([_topk_recorder(chosen)]),
                                     stopping_criteria=StoppingCriteriaList([_stopping_criteria(stop, times, output,
                                                                                                reasons)]))
        tokens = [int(t) for t in out[0, len(prompt):].tolist()]
        t_end = time.perf_counter()
        if tokens != output:  # generate stopped or padded differently from what the criteria saw
            raise RuntimeError(f"{STATIC_ARM}: generate returned {len(tokens)} tokens, the stop rule saw {len(output)}")
        times.insert(0, t_start)
        return tokens, times, reasons, t_end - t_start, chosen

    def decode(self, prompt: Sequence[int]) -> Generation:
        """One request, timed as decode_greedy: wall time of prefill + decode."""
        tokens, times, reasons, seconds, chosen = self._generate(prompt, self.stop)
        # generate also stops on its own EOS and cap criteria; ours is called on every token and agrees with them
        reason = reasons[-1] if reasons else ("length" if len(tokens) >= self.stop.max_new_tokens else "eos")
        # one pass per token as ar: the first token's is the prefill forward (its time is prefill_s)
        cycles = [Cycle(0, 0, 1, [], 0.0, times[k] - times[k - 1] if k > 1 else 0.0, 0.0)
                  for k in range(1, len(tokens) + 1)]
        return Generation(tokens=tokens, stop_reason=reason, seconds=seconds,
                          prefill_s=times[1] - times[0] if len(times) > 1 else seconds, cycles=cycles,
                          chosen_ids=torch.stack([c.indices for c in chosen]).cpu().numpy(),
                          chosen_logits=torch.stack([c.values for c in chosen]).cpu().numpy())
