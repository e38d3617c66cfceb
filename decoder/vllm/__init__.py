"""The decoder inside vLLM: the Oilbird arms as a `custom_class` proposer (proposer.py), the verification-cost
profile measured in vLLM (profile.py), and serving a benchmark through vLLM for the bench and the report (run.py).

May import: data, decoder's drafters and kernels. Nothing else in decoder imports it except at the point of use
(lazily), so a decoder without vLLM installed still imports.
"""
