"""Speculative decoding's pieces, as plain functions the step loop calls (docs/speculative.md):
the --speculative-config record (config.py), the verify arithmetic (verify.py), n-gram drafting
(ngram.py) and the expert-aware choice of k (expert_k.py). Imports nothing of moetier above errors."""
