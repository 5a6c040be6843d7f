"""Building blocks the model families share: norms, activations, rotary, attention and its paged
kernels, the KV pool, the MoE block and its routers, the sampler kernels."""
