"""Slots per layer from traces: where a slot saves the most transfer bytes.

Every routed expert row weighs the same, so bytes saved per HBM byte is misses saved per slot.
Each layer's curve of link reads (fills + overflow) is simulated on a grid of slot counts around
the even share of the budget. Starting from the even split, a greedy exchange moves one grid step
of slots from the layer that loses least by giving it to the layer that gains most by taking it,
while the move saves reads. So a plan never reads more than the even split it starts from.
"""

from __future__ import annotations

from moetier.errors import MoetierError
from moetier.traces.format import Trace
from moetier.traces.simulate import simulate_many


def grid_around(even: int, num_experts: int, low: int, points: int = 8) -> list[int]:
    step = max(1, num_experts // 32)
    grid = {even + m * step for m in range(-points, points + 1)}
    return sorted(g for g in grid if low <= g <= num_experts)


def grid_for(num_experts: int, top_k: int, points: int = 16) -> list[int]:
    """An even grid from top_k to all experts (for curves and plots)."""
    step = max(1, (num_experts - top_k) // points)
    grid = list(range(top_k, num_experts + 1, step))
    return grid if grid[-1] == num_experts else grid + [num_experts]


def miss_curves(trace: Trace, grid: list[int], policy: str = "lru") -> list[list[int]]:
    """Per traced layer, link reads (fills + overflow) at each grid point."""
    layers = trace.ids.shape[1]
    jobs = [(i, s, policy) for i in range(layers) for s in grid]
    counts = simulate_many(trace.ids, jobs, trace.num_experts, trace.top_k)  # every cache in one pass
    reads = [c.misses + c.overflow for c in counts]
    return [reads[i * len(grid):(i + 1) * len(grid)] for i in range(layers)]


def exchange(curves: list[list[int]], grid: list[int], start: int) -> list[int]:
    """Greedy exchange from grid index `start` in every layer; moves keep the total fixed (only
    between grid points the same distance apart). -> grid index per layer."""
    at = [start] * len(curves)
    inf = float("inf")
    while True:
        best, move = 0.0, None
        for j, cj in enumerate(curves):  # j takes a step up
            if at[j] + 1 >= len(grid):
                continue
            up = grid[at[j] + 1] - grid[at[j]]
            gain = cj[at[j]] - cj[at[j] + 1]
            for i, ci in enumerate(curves):  # i gives a step down of the same size
                if i == j or at[i] == 0 or grid[at[i]] - grid[at[i] - 1] != up:
                    continue
                loss = ci[at[i] - 1] - ci[at[i]] if at[i] > 0 else inf
                if gain - loss > best:
                    best, move = gain - loss, (i, j)
        if move is None:
            return at
        at[move[0]] -= 1
        at[move[1]] += 1


def plan(trace: Trace, budget: int, policy: str = "lfru") -> dict:
    layers = trace.layers
    even = budget // len(layers)
    if not 1 <= even <= trace.num_experts:
        raise MoetierError(f"a budget of {budget} slots gives {even} per layer; it must be 1 to "
                           f"{trace.num_experts} for {len(layers)} layers")
    grid = grid_around(even, trace.num_experts, low=min(even, trace.top_k))
    curves = miss_curves(trace, grid, policy)
    start = grid.index(even)
    at = exchange(curves, grid, start)
    n = trace.num_tokens
    return {
        "slots": {str(layers[i]): grid[a] for i, a in enumerate(at)},
        "budget": budget,
        "used": sum(grid[a] for a in at),
        "policy": policy,
        "grid": grid,
        "link_reads_per_token": sum(curves[i][a] for i, a in enumerate(at)) / n,
        "even_slots": even,
        "even_link_reads_per_token": sum(c[start] for c in curves) / n,
        "curves": {str(layers[i]): c for i, c in enumerate(curves)},
    }
