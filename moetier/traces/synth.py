"""Synthetic routing traces with stated parameters.

Per layer, experts have a popularity that falls off as a power law (Zipf exponent `skew`, the
order of experts shuffled per layer). Each of a token's k choices at a layer is, in this order of
trial:
  - with probability `layer_corr` (layers after the first): the image of the same choice at the
    layer before, through a fixed random map between the two layers' experts;
  - with probability `reuse`: one of the experts this layer used in the last `window` tokens;
  - otherwise: a draw from the layer's popularity.
A draw that repeats an expert already chosen for the token falls back to popularity. Presets are
calibrated to published figures (docs/traces.md says how, with the numbers).
"""

from __future__ import annotations

import bisect
import itertools
import math
import random
from dataclasses import asdict, dataclass

import numpy as np

from moetier.errors import MoetierError


@dataclass(frozen=True)
class SynthParams:
    experts: int
    top_k: int
    layers: int
    tokens: int = 8192
    skew: float = 1.0
    reuse: float = 0.0
    window: int = 1
    layer_corr: float = 0.0
    seed: int = 0

    def check(self) -> SynthParams:
        problems = []
        if not 1 <= self.top_k <= self.experts:
            problems.append(f"top_k {self.top_k} must be in 1..experts ({self.experts})")
        if self.layers < 1 or self.tokens < 1 or self.window < 1:
            problems.append("layers, tokens and window must be positive")
        for name in ("reuse", "layer_corr"):
            if not 0 <= getattr(self, name) <= 1:
                problems.append(f"{name} must be a probability in [0, 1]")
        if self.reuse + self.layer_corr > 1:
            problems.append("reuse + layer_corr must be at most 1")
        if not (math.isfinite(self.skew) and self.skew >= 0):  # nan would make synthesize() loop forever
            problems.append(f"skew must be a finite number >= 0 (0 is uniform), got {self.skew}")
        if problems:
            raise MoetierError("invalid trace parameters: " + "; ".join(problems))
        return self


MAX_LAYERS = 1024  # above any published model's layer count (DeepSeek-V3 has 61, Qwen3-235B 94)
MAX_TOKENS = 2**32 - 1  # a trace record's token count is a uint32


def synth_bytes(p: SynthParams) -> int:
    """Host bytes synthesize + write_trace hold at once: the int64 ids [T, L, k] and their uint16
    copy (layer-major) for the record."""
    return p.tokens * p.layers * p.top_k * (8 + 2)


# Calibrated by `moetier trace calibrate` (8,192 tokens, 8 layers, seed 0); numbers in docs/traces.md.
PRESETS: dict[str, dict] = {
    # GLM-5.3 (256 routed experts, top-8): LRU with 128 slots per layer hit 75% (reference 000).
    "glm-5.3-like": dict(experts=256, top_k=8, layers=8, skew=0.6, reuse=0.368, window=2, layer_corr=0.2),
    # Qwen3-30B-A3B (128 experts, top-8): 45 to 51% of the experts cover 90% of routing.
    "qwen3-30b-like": dict(experts=128, top_k=8, layers=8, skew=1.473, reuse=0.3, window=2, layer_corr=0.2),
}


def preset_params(name: str, **overrides) -> SynthParams:
    if name not in PRESETS:
        raise MoetierError(f"unknown trace preset {name!r}; choose one of: {', '.join(PRESETS)}")
    return SynthParams(**{**PRESETS[name], **{k: v for k, v in overrides.items() if v is not None}}).check()


def synthesize(p: SynthParams) -> np.ndarray:
    """-> ids [tokens, layers, top_k] int64."""
    p.check()
    rng = random.Random(p.seed)
    e, k = p.experts, p.top_k
    weights = [1.0 / (r + 1) ** p.skew for r in range(e)]
    cum = list(itertools.accumulate(weights))
    total = cum[-1]
    order = [rng.sample(range(e), e) for _ in range(p.layers)]  # popularity rank -> expert, per layer
    maps = [rng.sample(range(e), e) for _ in range(p.layers)]  # layer l-1 expert -> layer l expert
    out = np.empty((p.tokens, p.layers, k), dtype=np.int64)
    recent: list[list[list[int]]] = [[] for _ in range(p.layers)]  # per layer, the last `window` tokens

    def popular(layer: int) -> int:
        return order[layer][bisect.bisect_left(cum, rng.random() * total)]

    for t in range(p.tokens):
        for layer in range(p.layers):
            chosen: list[int] = []
            pool = [x for past in recent[layer] for x in past]
            for j in range(k):
                u = rng.random()
                if layer and u < p.layer_corr:
                    cand = maps[layer][int(out[t, layer - 1, j])]
                elif pool and u < p.layer_corr + p.reuse:
                    cand = pool[rng.randrange(len(pool))]
                else:
                    cand = popular(layer)
                while cand in chosen:
                    cand = popular(layer)
                chosen.append(cand)
            out[t, layer] = chosen
            recent[layer].append(chosen)
            if len(recent[layer]) > p.window:
                recent[layer].pop(0)
    return out


def meta_of(p: SynthParams, preset: str | None = None) -> dict:
    return {"experts": p.experts, "top_k": p.top_k, "layers": list(range(p.layers)),
            "model": preset or "synthetic", "source": "moetier trace synth", "synth": asdict(p)}


def _bisect(measure, lo: float, hi: float, target: float, increasing: bool, iters: int = 12,
            progress=lambda i, n: None) -> float:
    for i in range(iters):
        progress(i + 1, iters)
        mid = (lo + hi) / 2
        if (measure(mid) < target) == increasing:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 3)


def calibrate(tokens: int = 8192, layers: int = 8, seed: int = 0, progress=lambda text: None) -> dict:
    """Fit the presets' free parameter to the published figures (docs/traces.md).

    qwen3-30b-like: skew such that the most popular experts covering 90% of routing are 48% of
    them (the published range is 45 to 51%). glm-5.3-like: reuse such that LRU with 128 of 256
    slots per layer hits 75%. The other parameters are fixed by hand and stated. progress: told
    each bisection step, one short line."""
    from moetier.traces.stats import coverage
    from moetier.traces.simulate import simulate

    fixed = dict(window=2, layer_corr=0.2, tokens=tokens, layers=layers, seed=seed)

    def qwen_cov(skew: float) -> float:
        ids = synthesize(SynthParams(128, 8, skew=skew, reuse=0.3, **fixed))
        return float(np.mean([coverage(ids[:, i], 128) for i in range(layers)]))

    def glm_lru(reuse: float) -> float:
        ids = synthesize(SynthParams(256, 8, skew=0.6, reuse=reuse, **fixed))
        return float(np.mean([simulate(ids[:, i], 256, 128, "lru", 8).hit_rate for i in range(layers)]))

    skew = _bisect(qwen_cov, 1.0, 2.0, 0.48, increasing=False,
                   progress=lambda i, n: progress(f"qwen3-30b-like skew, step {i} of {n}"))
    reuse = _bisect(glm_lru, 0.1, 0.6, 0.75, increasing=True, iters=10,
                    progress=lambda i, n: progress(f"glm-5.3-like reuse, step {i} of {n}"))
    progress("checking the fitted presets")
    return {
        "qwen3-30b-like": {"skew": skew, "reuse": 0.3, **fixed, "coverage90": qwen_cov(skew)},
        "glm-5.3-like": {"skew": 0.6, "reuse": reuse, **fixed, "lru_128_of_256": glm_lru(reuse)},
    }
