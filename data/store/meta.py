"""meta.json's seal: a checksum over the fields that say how a store was made, so a hand edit of them
is caught by every reader (data/store/reader.py `read_meta`) and by `python -m data verify`.

`meta_sha256` is the sha256 of the canonical JSON of the SEALED fields (those present): the model
(its name, path and weight fingerprint), the capture layer, n_layers, d_model, vocab_size, dtype,
the tokenizer and chat template hashes, the benchmark and its data fingerprint, the mode, the token
cap, the stop strings, truncation, the prompt-hash scheme, the engine and meta.json's own format.
These never change over a store's life: an extension keeps them (data/store/writer.py SETTINGS
refuses one that would not). Results depend on each of them: a layer edited 4 -> 3 relabels every
state, an edited vocab_size breaks the drafters, an edited model sends the store to another
model's census.

The fields that change at every commit (`complete`, `n_requests`, `checksums`, `pending`,
`migrating`, `store_format`, `runs`, ...) are not sealed: the files vouch for them (the checksums
are each file's sha256; `n_requests` must equal requests.parquet's rows), and a kill between two
writes must leave a meta.json that still opens.

Every write of meta.json goes through `write_meta`, which reseals it. A meta.json without
`meta_sha256` was written before the seal existed: it opens as before, `verify` says it is
unsealed, and `python -m data migrate` or the next extension of the store seals it (sealing then
vouches for what the meta.json holds at that moment).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from data.errors import OilbirdError
from data.store.files import atomic_write_json

META_SEAL = "meta_sha256"
SEALED = ("format", "model", "model_path", "model_fingerprint", "layer", "n_layers", "d_model", "vocab_size",
          "dtype", "tokenizer_hash", "chat_template_hash", "bench", "data_fingerprint", "mode", "max_new_tokens",
          "stop_strings", "truncate", "prompt_hash_scheme", "engine")


def meta_digest(meta: dict) -> str:
    """sha256 of the SEALED fields of `meta` (canonical JSON; an absent field stays absent)."""
    sealed = {k: meta[k] for k in SEALED if k in meta}
    return hashlib.sha256(json.dumps(sealed, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def is_sealed(meta: dict) -> bool:
    return META_SEAL in meta


def unsealed_note(store: Path | str, computed: str) -> str:
    """The note a result computed on an unsealed store carries (the census's `notes`, replay's `store_note`):
    `computed` says what was done ("computed", "replayed"). `python -m data verify` says the same of the store."""
    return (f"{computed} on a trace store whose meta.json is unsealed (written before meta.json was sealed), so a "
            "hand edit of how it was captured (its layer, model, vocab_size) could not be caught; `python -m data "
            f"migrate {store}` seals it (each member's, for a store set)")


def check_seal(meta: dict, meta_path: Path) -> None:
    """Refuse, in one line, a meta.json whose sealed fields were edited after it was written."""
    if META_SEAL not in meta:
        return  # written before the seal existed (module docstring)
    if meta[META_SEAL] != meta_digest(meta):
        raise OilbirdError(f"{meta_path} was edited after capture: its {META_SEAL} does not match the fields it seals "
                           f"(model, layer, d_model, vocab_size, ...; one of them changed), so the store's states "
                           "cannot be trusted to be what it says; restore meta.json from a copy or recapture with "
                           "--force")


def write_meta(store: Path, meta: dict) -> str:
    """Seal `meta` (in place) and write it atomically as `store`/meta.json; returns the file's sha256."""
    meta[META_SEAL] = meta_digest(meta)
    return atomic_write_json(Path(store) / "meta.json", meta)
