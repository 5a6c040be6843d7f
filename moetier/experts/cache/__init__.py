"""The slot cache: the exact-size pinned host store of every routed expert (store.py), the per-layer HBM
slots over it with their replacement policies (slots.py), and the Triton kernels of one cache step
(slot_kernels.py)."""
