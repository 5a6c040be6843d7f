"""What a trace says about routing: popularity skew, temporal reuse, and the LRU curve."""

from __future__ import annotations

import numpy as np

from moetier.traces.simulate import simulate_many


def coverage(ids: np.ndarray, num_experts: int, share: float = 0.9) -> float:
    """Fraction of the experts that, most popular first, take `share` of one layer's routing."""
    counts = np.sort(np.bincount(ids.reshape(-1), minlength=num_experts))[::-1]
    cum = np.cumsum(counts) / counts.sum()
    return (int(np.searchsorted(cum, share)) + 1) / num_experts


def reuse(ids: np.ndarray) -> float:
    """Share of a token's experts that the token before also used (one layer, ids [N, k])."""
    if ids.shape[0] < 2:
        return 0.0
    prev, cur = ids[:-1], ids[1:]
    same = (cur[:, :, None] == prev[:, None, :]).any(-1)
    return float(same.mean())


def summary(ids: np.ndarray, num_experts: int, top_k: int, slots: list[int] | None = None,
            policy: str = "lru") -> dict:
    """ids [N, L, k] -> per-layer and mean coverage, reuse, and hit rates at `slots`."""
    layers = ids.shape[1]
    cov = [coverage(ids[:, i], num_experts) for i in range(layers)]
    reu = [reuse(ids[:, i]) for i in range(layers)]
    out = {"tokens": int(ids.shape[0]), "layers": layers, "coverage90": float(np.mean(cov)),
           "coverage90_per_layer": cov, "reuse": float(np.mean(reu)), "reuse_per_layer": reu}
    if slots:
        jobs = [(i, s, policy) for s in slots for i in range(layers)]
        counts = simulate_many(ids, jobs, num_experts, top_k)  # every cache in one pass
        out["hit_rate"] = {s: float(np.mean([c.hit_rate for c in counts[j * layers:(j + 1) * layers]]))
                           for j, s in enumerate(slots)}
    return out
