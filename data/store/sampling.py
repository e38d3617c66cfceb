"""How a stored request's tokens were chosen: requests.parquet `sampling` and `off_argmax`, and the one line the
census, replay and the reports say when a store holds sampled requests.

`sampling` (string), one of SAMPLINGS:
  greedy     capture decoded it at temperature 0 (`python -m data capture`, the harness's argmax or vLLM at
             temperature 0): the settings are known
  reference  capture in reference mode: the benchmark's reference tokens, teacher-forced (the model chose none)
  argmax     served (data/capture/served_store.py): every committed token the recorder saw was the model's top-1
             where it was chosen, so the request is consistent with greedy decoding (vLLM gives a proposer no
             request's SamplingParams: a sampled request whose draws all fell on the top-1 reads the same)
  sampled    served, and `off_argmax` > 0 of its committed tokens were not the model's top-1: it was sampled
  null       not recorded (a store written before the column): unknown
`off_argmax` (int32): the committed tokens that were not the model's top-1 where they were chosen; 0 for greedy
capture (by construction in the harness; vLLM's recorder counts it), null where unknown (reference capture, older
stores). Served, it counts the tokens of the steps the recorder saw (data/capture/vllm_capture.py `Trace`).

What sampled traces mean for the figures is written once, in docs/replay.md ("Sampled traces"); SAMPLED_NOTE is
its one line. This module imports nothing above data/.
"""

from __future__ import annotations

GREEDY, REFERENCE, ARGMAX, SAMPLED = "greedy", "reference", "argmax", "sampled"
SAMPLINGS = (GREEDY, REFERENCE, ARGMAX, SAMPLED)

SAMPLED_NOTE = ("{count} of {of} requests were sampled (tokens off the model's top-1): replay and the census take "
                "the stored tokens as the targets, so replay's figures estimate vLLM's expected ones under its "
                "rejection rule (not one run's), and the census's availability and oracle describe the sampled "
                "text (docs/replay.md, \"Sampled traces\")")


def served_sampling(off_argmax: int) -> str:
    """A served request's `sampling` from its count of tokens off the top-1."""
    return SAMPLED if int(off_argmax) > 0 else ARGMAX


def sampled_requests(requests, n: int | None = None) -> dict:
    """{"count": sampled requests, "of": requests, "unknown": requests whose sampling was not recorded} over the
    first `n` rows of a store's requests frame (polars; all of them by default)."""
    frame = requests if n is None else requests.head(n)
    if "sampling" not in frame.columns:  # a frame from before the column (a reader's own table)
        return {"count": 0, "of": int(frame.height), "unknown": int(frame.height)}
    col = frame["sampling"]
    return {"count": int((col == SAMPLED).sum() or 0), "of": int(frame.height), "unknown": int(col.null_count())}


def sampled_note(block: dict | None) -> str | None:
    """The one line (without "note: ") when `block` (sampled_requests') counts a sampled request, else None."""
    if not isinstance(block, dict):
        return None
    count, of = block.get("count"), block.get("of")
    if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
        return None
    return SAMPLED_NOTE.format(count=count, of=of if isinstance(of, int) and not isinstance(of, bool) else "?")


def sampling_line(requests) -> str:
    """`data show`'s line: the requests of each sampling (first seen first), "not recorded" for the null ones."""
    counts: dict[str, int] = {}
    for v in (requests["sampling"].to_list() if "sampling" in requests.columns else [None] * requests.height):
        key = "not recorded" if v is None else v
        counts[key] = counts.get(key, 0) + 1
    return "sampling: " + (", ".join(f"{k} {n}" for k, n in counts.items()) or "no requests")
