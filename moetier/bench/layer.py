"""`moetier bench layer`: one MoE layer at decode (M = 1), CUDA-graph replayed, as in reference 000.

Rows: resident, uva, and slots at controlled hit rates, each with ms per layer, the split into
bookkeeping, fill and expert GEMM, and the figures it is bound by (HBM and host-to-GPU bandwidth,
measured in the same run). Also: both fill paths (copy kernel, copy engine), the decode-vs-bypass
crossover that sets the prefill threshold, and a small tuning sweep of the grouped expert GEMM (the
kernel every backend runs). `--dtype bf16,fp8` runs every row for FP8 experts too (block-scaled e4m3
rows, half the bytes plus scales, experts/fp8.py), side by side with bf16 in one record.
"""

from __future__ import annotations

import math

import torch

from moetier.bench.common import GB, links, record, time_eager, time_graph
from moetier.checkpoint.random_bed import fill_4bit_rows, fill_fp8_rows
from moetier.experts.backends import ResidentExperts, SlotExperts, UvaExperts
from moetier.experts.kernels.gemm_config import SWEEP, GemmConfig
from moetier.experts.kernels.grouped_gemm import grouped_expert_mlp
from moetier.experts.shape import RowLayout
from moetier.experts.cache.slot_kernels import BOOKKEEPING_WARPS, BookkeepingScratch, bookkeeping, copy_rows
from moetier.experts.cache.slots import SlotCache, policy_for
from moetier.experts.cache.store import DevicePointer, HostStore
from moetier.presets import moe_shape


def fill_random(rows: torch.Tensor, seed: int) -> None:
    """Random (never zero) weights, made in one 64 MiB block and tiled: a 19 GB store fills in seconds."""
    g = torch.Generator().manual_seed(seed)
    flat = rows.view(-1)
    block = (torch.randn(min(flat.numel(), 32 * 2**20), generator=g) * 0.02).to(rows.dtype)
    for start in range(0, flat.numel(), block.numel()):
        n = min(block.numel(), flat.numel() - start)
        flat[start:start + n].copy_(block[:n])


def hit_stream(experts: int, slots: int, top_k: int, steps: int, hit: float, seed: int, policy: str = "lfru"):
    """Ids [steps, 1, k] that hit a warm cache of `slots` under `policy` at rate `hit` (misses spread
    evenly). Returns (ids, initial cache state, the stats the stream must produce)."""
    cache = SlotCache(experts, slots, policy=policy_for(policy, slots, top_k))
    cache.warm(list(range(slots)))
    cache.stats.zero_()
    init = cache.state()
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(steps):
        m = math.floor((i + 1) * (1 - hit) * top_k + 1e-9) - math.floor(i * (1 - hit) * top_k + 1e-9)
        resident = (cache.expert_slot >= 0).nonzero().flatten()
        absent = (cache.expert_slot < 0).nonzero().flatten()
        ids = torch.cat([resident[torch.randperm(resident.numel(), generator=g)[: top_k - m]],
                         absent[torch.randperm(absent.numel(), generator=g)[:m]]])
        ids = ids[torch.randperm(top_k, generator=g)][None]
        cache.step_reference(ids)
        out.append(ids)
    return torch.stack(out), init, cache.read_stats()


def uniform_stream(experts: int, top_k: int, steps: int, tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
                        for _ in range(steps)])


def fill_rows(host: torch.Tensor, layout: RowLayout, seed: int) -> None:
    """Random experts: bf16 rows tiled from one block (fill_random); FP8 rows quantized on the GPU
    from random bf16, 16 experts at a time (random bytes would hold NaNs)."""
    if layout.quant is None:
        fill_random(host, seed)
        return
    g = torch.Generator("cuda").manual_seed(seed)
    fill = fill_fp8_rows if layout.quant == "fp8" else fill_4bit_rows  # 4-bit: quantized the same way
    for a in range(0, host.shape[0], 16):
        fill(host[a:a + 16], layout, g)


def bench_shape(name: str, steps: int, hits: list[float], slot_frac: float, tune: bool, seed: int = 0,
                policy: str = "lfru", extras: bool = True, quant: str | None = None) -> dict:
    s = moe_shape(name)
    h, i, e, k = s.hidden, s.inter, s.num_experts, s.top_k
    layout = RowLayout(h, i, quant)
    dtype = torch.bfloat16  # the compute dtype; FP8 rows are bytes (layout.row_dtype)
    store = HostStore([0], e, layout, dtype, pin=True)
    host = store.rows(0)
    fill_rows(host, layout, seed)
    dev_rows = host.to("cuda")
    row_bytes = store.row_bytes
    num_slots = max(k, int(e * slot_frac))
    link = links(row_bytes=row_bytes)
    shape = {"hidden": h, "inter": i, "experts": e, "top_k": k}
    res: dict = {"shape": {**shape, "row_bytes": row_bytes, "slots": num_slots, "dtype": quant or "bf16",
                           "policy": policy},
                 "host_store": store.report(), "links": link}

    g = torch.Generator().manual_seed(seed + 1)
    x = (torch.randn(1, h, generator=g)).to(dtype).cuda()
    w = torch.rand(1, k, generator=g).to(dtype).cuda()
    uni = uniform_stream(e, k, steps, 1, seed).cuda()

    resident = ResidentExperts(dev_rows, layout, k, decode_tokens=64)

    def resident_graph(config: GemmConfig = GemmConfig()):
        def run() -> None:
            for j in range(steps):
                ids = uni[j]
                grouped_expert_mlp(x, ids.int(), ids, w, dev_rows, dev_rows, h, i, resident._work,
                                   resident._decode_out(x), config, quant)
        return run

    gemm, warps = GemmConfig(), BOOKKEEPING_WARPS
    if tune:
        best = {}
        for which in ("gate_up", "down"):
            timings = {}
            for cfg in SWEEP:
                trial = (GemmConfig().with_decode(quant, gate_up=cfg) if which == "gate_up"
                         else GemmConfig().with_decode(quant, best["gate_up"], cfg))
                try:
                    timings[cfg] = time_graph(resident_graph(trial)) / steps
                except Exception as err:  # a config that does not compile for this shape
                    timings[cfg] = float("inf")
                    print(f"  {name} {which} {cfg}: {type(err).__name__}")
            best[which] = min(timings, key=timings.get)
            res[f"tune_{which}"] = {str(c): t for c, t in timings.items()}
        gemm = GemmConfig().with_decode(quant, best["gate_up"], best["down"])
        res["kernel_config"] = {"gate_up": best["gate_up"], "down": best["down"]}

    rows = []
    expert_bytes = k * row_bytes  # bytes one token's experts weigh
    t_res = time_graph(resident_graph(gemm)) / steps
    rows.append({"row": "resident", "ms": t_res, "hit": 1.0, "GBps": expert_bytes / GB / (t_res / 1e3),
                 "bound_ms": expert_bytes / GB / link["d2d_GBps"] * 1e3})

    uva = UvaExperts(host, layout, k, decode_tokens=64, device="cuda", gemm=gemm)
    t_uva = time_graph(lambda: [uva.forward(x, uni[j], w) for j in range(steps)]) / steps
    rows.append({"row": "uva", "ms": t_uva, "hit": 0.0, "GBps": expert_bytes / GB / (t_uva / 1e3),
                 "bound_ms": expert_bytes / GB / link["h2d_copy_engine_GBps"] * 1e3})

    streams = {hit: hit_stream(e, num_slots, k, steps, hit, seed + 2, policy) for hit in hits}
    if tune:
        res["tune_bookkeeping_warps"] = sweep_bookkeeping(host, layout, k, num_slots, streams, steps, policy)
        warps = min(res["tune_bookkeeping_warps"], key=lambda w: sum(res["tune_bookkeeping_warps"][w].values()))
    for hit in hits:
        ids, init, want = streams[hit]
        ids = ids.cuda()
        slots = SlotExperts(host, layout, k, num_slots, decode_tokens=64, device="cuda", policy=policy, gemm=gemm)
        init_dev = {n: v.cuda() for n, v in init.items()}
        slots.slots[:] = dev_rows[init["slot_expert"].long().clamp(min=0)]  # contents match the maps
        sc = slots._scratch

        def reset() -> None:
            slots.cache.load_state(init_dev)

        t_bk = time_graph(lambda: [bookkeeping(slots.cache, sc, ids[j], warps) for j in range(steps)], reset) / steps

        def bk_fill() -> None:
            for j in range(steps):
                bookkeeping(slots.cache, sc, ids[j], warps)
                copy_rows(slots._host_dev, slots.slots, sc, slots._copy_programs)
        t_fill = time_graph(bk_fill, reset) / steps
        t_full = time_graph(lambda: [slots.forward(x, ids[j], w) for j in range(steps)], reset) / steps
        got = slots.cache.read_stats()
        assert got == want, f"the GPU cache took {got}, the stream was built for {want}"
        miss_bytes = got["misses"] / steps * row_bytes
        target = t_res + miss_bytes / GB / link["h2d_copy_engine_GBps"] * 1e3
        fill_s = (t_fill - t_bk) / 1e3
        rows.append({"row": f"slots {hit:.0%}", "ms": t_full, "hit": got["hits"] / (got["hits"] + got["misses"]),
                     "bookkeeping_ms": t_bk, "fill_ms": t_fill - t_bk, "gemm_ms": t_full - t_fill,
                     "miss_MB_per_layer": miss_bytes / 1e6,
                     "fill_GBps": miss_bytes / GB / fill_s if miss_bytes else None,
                     "fill_experts_per_s": got["misses"] / steps / fill_s if miss_bytes else None,
                     "bound_ms": target, "vs_resident": t_full / t_res, "vs_bound": t_full / target})
        slots = None  # free its device slots before the next row allocates
    res["rows"] = rows
    if extras:
        res["fills"] = bench_fills(host, dev_rows, row_bytes, e, k)
        res["prefill_crossover"] = bench_crossover(host, layout, e, k, num_slots, seed, dtype)
    return res


def sweep_bookkeeping(host, layout, k, num_slots, streams, steps, policy) -> dict:
    """Per-step bookkeeping time (us) by warps per program, on each hit-rate stream."""
    out = {}
    for warps in (1, 2, 4, 8):
        out[warps] = {}
        for hit, (ids, init, _) in streams.items():
            ids = ids.cuda()
            cache = SlotCache(host.shape[0], num_slots, "cuda", policy_for(policy, num_slots, k))
            sc = BookkeepingScratch(host.shape[0], num_slots, 64 * k, torch.device("cuda"))
            init_dev = {n: v.cuda() for n, v in init.items()}
            t = time_graph(lambda: [bookkeeping(cache, sc, ids[j], warps) for j in range(steps)],
                           lambda: cache.load_state(init_dev))
            out[warps][str(hit)] = t / steps * 1e3
    return out


def bench_fills(host: torch.Tensor, dev_rows: torch.Tensor, row_bytes: int, e: int, k: int) -> list[dict]:
    """Both fill paths for m missed rows: the copy kernel (graph) and the copy engine (eager)."""
    out = []
    slots_t = torch.empty(32, host.shape[1], dtype=host.dtype, device="cuda")
    sc = BookkeepingScratch(e, 32, 32, torch.device("cuda"))
    src = DevicePointer(host)
    programs = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    for m in (1, 8, 32):
        experts = torch.randperm(e)[:m]
        sc.miss_expert[:m] = experts.int().cuda()
        sc.miss_slot[:m] = torch.arange(m, dtype=torch.int32, device="cuda")
        sc.miss_count.fill_(m)
        t_kernel = time_graph(lambda: copy_rows(src, slots_t, sc, programs))
        assert torch.equal(slots_t[:m], dev_rows[experts.cuda()]), "copy kernel moved the wrong bytes"
        stream = torch.cuda.Stream()

        def engine() -> None:
            with torch.cuda.stream(stream):
                for r, ex in enumerate(experts.tolist()):
                    slots_t[r].copy_(host[ex], non_blocking=True)
            torch.cuda.current_stream().wait_stream(stream)
        t_engine = time_eager(engine)
        out.append({"rows": m, "kernel_ms": t_kernel, "kernel_GBps": m * row_bytes / GB / (t_kernel / 1e3),
                    "kernel_experts_per_s": m / (t_kernel / 1e3),
                    "copy_engine_ms": t_engine, "copy_engine_GBps": m * row_bytes / GB / (t_engine / 1e3),
                    "copy_engine_experts_per_s": m / (t_engine / 1e3)})
    sc.miss_count.zero_()  # the no-miss step: what the copy launch costs when there is nothing to copy
    out.append({"rows": 0, "kernel_ms": time_graph(lambda: copy_rows(src, slots_t, sc, programs))})
    return out


def bench_crossover(host: torch.Tensor, layout: RowLayout, e: int, k: int, num_slots: int, seed: int,
                    dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Decode path (cache + expert kernels, graph) against the prefill bypass (eager) by step size."""
    out = []
    for t in (1, 2, 4, 8, 16, 32, 64):
        g = torch.Generator().manual_seed(seed + t)
        x = torch.randn(t, layout.hidden, generator=g).to(dtype).cuda()
        w = torch.rand(t, k, generator=g).to(dtype).cuda()
        ids = uniform_stream(e, k, 1, t, seed + t)[0].cuda()
        slots = SlotExperts(host, layout, k, num_slots, decode_tokens=64, device="cuda")
        slots.cache.warm(list(range(num_slots)))
        init = slots.cache.state()
        reset = lambda: slots.cache.load_state(init)  # noqa: E731 -- both paths start from the same warm cache
        t_decode = time_graph(lambda: slots.forward(x, ids, w), reset)
        t_bypass = time_eager(lambda: slots._bypass(x, ids, w), reps=3, reset=reset)
        out.append({"tokens": t, "decode_ms": t_decode, "bypass_ms": t_bypass})
        slots = None  # free its device slots before the next row allocates
    return out


def run(presets: list[str], steps: int, hits: list[float], slot_frac: float, tune: bool, policy: str = "lfru",
        extras: bool = True, dtypes: list[str] = ("bf16",)) -> dict:
    """Every row per preset and expert format; shapes are keyed by preset, "<preset> fp8" for FP8."""
    results = {"steps": steps, "shapes": {}}
    for name in presets:
        for dt in dtypes:
            quant = None if dt == "bf16" else dt
            key = name if quant is None else f"{name} {quant}"
            results["shapes"][key] = bench_shape(name, steps, hits, slot_frac, tune, policy=policy, extras=extras,
                                                 quant=quant)
            torch.cuda.empty_cache()
    return record("layer", results)


def fill_text(x: dict) -> str:
    text = f"{x['rows']} rows kernel {x['kernel_ms']:.3f} ms"
    if not x["rows"]:
        return text
    return (text + f" ({x['kernel_GBps']:.1f} GB/s, {x['kernel_experts_per_s']:.0f} experts/s), copy engine "
            f"{x['copy_engine_ms']:.3f} ms ({x['copy_engine_GBps']:.1f} GB/s, "
            f"{x['copy_engine_experts_per_s']:.0f} experts/s)")


def table(data: dict) -> str:
    lines = []
    for name, r in data["shapes"].items():
        l, sh = r["links"], r["shape"]
        lines.append(f"\n{name}: {sh.get('dtype', 'bf16')}, H {sh['hidden']}, I {sh['inter']}, E {sh['experts']}, "
                     f"top-{sh['top_k']}, "
                     f"{sh['slots']} slots, row {sh['row_bytes'] / 1e6:.2f} MB; links: H2D {l['h2d_copy_engine_GBps']:.1f} "
                     f"GB/s (rows {l.get('h2d_copy_engine_row_GBps', 0):.1f}), HBM copy {l['d2d_GBps']:.0f} GB/s; "
                     f"kernels {r.get('kernel_config', 'default')}")
        lines.append(f"{'row':<12}{'ms/layer':>10}{'bound ms':>10}{'x bound':>9}{'x resident':>11}{'bookkeep us':>12}"
                     f"{'fill ms':>9}{'gemm ms':>9}{'fill GB/s':>10}{'fill exp/s':>11}")
        t_res = r["rows"][0]["ms"]
        for row in r["rows"]:
            def f(key, scale=1.0, fmt="{:.3f}"):
                v = row.get(key)
                return fmt.format(v * scale) if isinstance(v, (int, float)) else "-"
            lines.append(f"{row['row']:<12}{row['ms']:>10.3f}{row['bound_ms']:>10.3f}{row['ms'] / row['bound_ms']:>9.2f}"
                         f"{row['ms'] / t_res:>11.2f}{f('bookkeeping_ms', 1e3, '{:.1f}'):>12}{f('fill_ms'):>9}"
                         f"{f('gemm_ms'):>9}{f('fill_GBps', 1, '{:.1f}'):>10}"
                         f"{f('fill_experts_per_s', 1, '{:.0f}'):>11}")
        if "tune_bookkeeping_warps" in r:
            lines.append("bookkeeping us by warps: " + "; ".join(
                f"{w}: " + ", ".join(f"{h} {t:.1f}" for h, t in v.items()) for w, v in r["tune_bookkeeping_warps"].items()))
        if "fills" not in r:
            continue
        lines.append("fills: " + "; ".join(fill_text(x) for x in r["fills"]))
        lines.append("decode vs bypass (ms): " + ", ".join(
            f"T={x['tokens']}: {x['decode_ms']:.3f} / {x['bypass_ms']:.3f}" for x in r["prefill_crossover"]))
    return "\n".join(lines)
