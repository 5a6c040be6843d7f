"""What a large step (prefill) does with the slots backend: how missed experts are streamed in
(ring.py: ring or uva) and what the step does to the slot cache (cache_policy.py)."""
