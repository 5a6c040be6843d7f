"""Routing traces: the experts each MoE layer chose, per token. Record them from real runs,
synthesize them with stated parameters, replay them through the engine, simulate caches on them."""
