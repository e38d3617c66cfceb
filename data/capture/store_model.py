"""Which model a trace store belongs to: what capture records in meta.json, and the one check the census
and replay make of `--model` against it (so neither computes one model's results under another's name).

Recorded: `model` and `model_path` name a local folder by its resolved path (`recorded_name`), never as
typed: `--model ../shared/models/stories260k` typed in one working directory must name the same model
from every other. Aliases (smollm2-135m, stories260k) and hub ids are recorded as given.

Checked (`check_store_model`): `--model` names the store's model when its identity (data/capture/models.py
`model_identity`: an alias's or a folder's resolved path, a hub id as written) equals that of
`model` or `model_path` in meta.json. Otherwise, when `--model` is a model folder on this machine and the
store records a weight fingerprint, the model is loaded and its fingerprint decides: the
same weights under another path (a store from before paths were resolved, whose relative path
meant this folder from its capture's working directory; a copied model folder) are the same model;
other weights under the same folder name are not.
"""

from __future__ import annotations

import os
from pathlib import Path

from data.capture.models import same_model
from data.errors import OilbirdError

ALIASES = ("smollm2-135m", "stories260k")


def recorded_name(name: str) -> str:
    """What meta.json records for `--model name`: a local folder's resolved path; an alias or hub id as given."""
    name = str(name)
    if name not in ALIASES and os.path.isdir(name):
        return str(Path(name).resolve())
    return name


def _folder(model: str) -> bool:
    """A model folder on this machine, given by its path: loading it downloads nothing. An alias names one
    model wherever it is, so its name alone decides (and smollm2-135m is never dequantized for a check)."""
    return model not in ALIASES and os.path.isdir(model)


def check_store_model(meta: dict, model: str, path: Path) -> None:
    """--model must name the model the store was captured with (module docstring); one line otherwise."""
    captured = [c for c in (meta.get("model"), meta.get("model_path")) if c]
    if any(same_model(str(c), model) for c in captured):
        return
    recorded = meta.get("model_fingerprint")
    if recorded and _folder(model):
        from data.capture.models import load_model

        try:
            fingerprint = load_model(model, dtype="float32", device="cpu").fingerprint
        except Exception:  # noqa: BLE001 -- a model that does not load here: the names alone decide (below)
            fingerprint = None
        if fingerprint == recorded:
            return  # the same weights under another path
        if fingerprint is not None:
            raise OilbirdError(f"trace store {path} was captured with model '{meta.get('model')}' (weights "
                               f"{recorded}), but '{model}' holds other weights ({fingerprint}): it sits in another "
                               f"model's folder, or the model changed since; recapture with --model {model}")
    raise OilbirdError(f"trace store {path} was captured with model '{meta.get('model')}', not '{model}': "
                       "it sits in another model's folder, or its meta.json was edited; recapture with "
                       f"--model {model}")
