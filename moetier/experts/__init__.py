"""The expert tiers: the exact-pinned host store, the per-layer HBM slot cache and its kernels, the
grouped expert GEMM, and the backends (resident, slots, uva) built over them. Knows a MoE shape,
never a model family or the engine."""
