"""Routed experts: the tiers that hold them (store, slots) and the backends that compute them."""
