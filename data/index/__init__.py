"""The two keys over the pool: the lexical key (automaton.py, a suffix automaton) and the semantic key's indexes
(stateindex.py: exact and faiss specs; pruner.py: the auto PCA-IVF index queried by keyscan.py / keyscan.c),
tie-aware recall (knnrecall.py), and bytes per pooled token and the store window (budget.py).

May import: the top modules (errors, stats, versions) only; pure structures, no store and no model.
"""
