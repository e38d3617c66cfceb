"""data: everything below the census and the decoder: the store, producing it, the keys over it, the benchmarks.

  data/store/       the trace store's format and its life (schema, reader, writer, lock, migration, verify, runs/ layout)
  data/capture/     producing a store: greedy or teacher-forced decoding, by the harness or by serving in vLLM
  data/index/       the two keys over the pool: the suffix automaton (lexical) and the state indexes (semantic)
  data/benchmarks/  benchmarks becoming requests (the registry, the tool-calling loaders, JSONL traffic)
  errors.py, stats.py, versions.py, readfile.py, results.py, raycluster.py: what every room uses (one-line errors,
    intervals, the dependency range, bounded reads of JSON and small files, the result files' schema, joining Ray)

Imports: `data` imports nothing of census, decoder or reports. Inside it, store, index and benchmarks import only
the top modules; capture imports store, benchmarks and the top modules; no room imports capture.
"""
