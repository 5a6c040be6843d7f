"""Slots per layer from traces: where a slot saves the most transfer bytes.

Every routed expert row weighs the same, so bytes saved per HBM byte is misses saved per slot.
Each layer's miss curve is simulated on a grid of slot counts; a greedy allocator starts every
layer at the smallest grid point and repeatedly gives the next grid step to the layer whose curve
falls most per slot, until the budget is spent.
"""

from __future__ import annotations

import heapq

import numpy as np

from moetier.errors import MoetierError
from moetier.traces.format import Trace
from moetier.traces.simulate import simulate


def grid_for(num_experts: int, top_k: int, points: int = 16) -> list[int]:
    step = max(1, (num_experts - top_k) // points)
    grid = list(range(top_k, num_experts + 1, step))
    return grid if grid[-1] == num_experts else grid + [num_experts]


def miss_curves(trace: Trace, grid: list[int], policy: str = "lru") -> list[list[int]]:
    """Per traced layer, link reads (fills + overflow) at each grid point."""
    out = []
    for i in range(trace.ids.shape[1]):
        ids = trace.layer_ids(i)
        out.append([(c := simulate(ids, trace.num_experts, s, policy, trace.top_k)).misses + c.overflow
                    for s in grid])
    return out


def allocate(curves: list[list[int]], grid: list[int], budget: int) -> list[int]:
    """Greedy on the marginal misses saved per slot. -> grid index per layer."""
    layers = len(curves)
    if budget < layers * grid[0]:
        raise MoetierError(f"a budget of {budget} slots is below {grid[0]} per layer for {layers} layers")
    if budget > layers * grid[-1]:
        budget = layers * grid[-1]
    at = [0] * layers
    spent = layers * grid[0]

    def gain(layer: int) -> tuple[float, int, int]:
        i = at[layer]
        cost = grid[i + 1] - grid[i]
        return (-(curves[layer][i] - curves[layer][i + 1]) / cost, layer, cost)

    heap = [gain(layer) for layer in range(layers) if len(grid) > 1]
    heapq.heapify(heap)
    while heap:
        neg, layer, cost = heapq.heappop(heap)
        if spent + cost > budget:
            continue  # a smaller step elsewhere may still fit
        at[layer] += 1
        spent += cost
        if at[layer] + 1 < len(grid):
            heapq.heappush(heap, gain(layer))
    return at


def plan(trace: Trace, budget: int, policy: str = "lru", points: int = 16) -> dict:
    grid = grid_for(trace.num_experts, trace.top_k, points)
    curves = miss_curves(trace, grid, policy)
    at = allocate(curves, grid, budget)
    lookups = trace.num_tokens * trace.top_k  # upper bound per layer; hit rate uses the same base
    planned_misses = sum(curves[i][a] for i, a in enumerate(at))
    # the same budget spread evenly, on the grid point at or below the even share
    even = max(g for g in grid if g <= max(grid[0], budget // len(curves)))
    even_misses = sum(c[grid.index(even)] for c in curves)
    layers = trace.layers
    return {
        "slots": {str(layers[i]): grid[a] for i, a in enumerate(at)},
        "budget": budget,
        "used": sum(grid[a] for a in at),
        "policy": policy,
        "grid": grid,
        "link_reads_per_token": planned_misses / trace.num_tokens,
        "even_slots": even,
        "even_link_reads_per_token": even_misses / trace.num_tokens,
        "lookups_per_layer_upper_bound": lookups,
        "curves": {str(layers[i]): c for i, c in enumerate(curves)},
    }


def mean_hit_rate(trace: Trace, slots: dict[int, int], policy: str = "lru") -> float:
    rates = [simulate(trace.layer_ids(i), trace.num_experts, slots[layer], policy, trace.top_k).hit_rate
             for i, layer in enumerate(trace.layers)]
    return float(np.mean(rates))
