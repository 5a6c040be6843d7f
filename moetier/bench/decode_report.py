"""What `moetier bench decode` prints and plots from its rows (bench/decode.py makes them): the
greedy-token check against resident, the table, the format ratios and the tok/s plot."""

from __future__ import annotations

from moetier.bench import decode_spec
from moetier.bench.common import GB, batch_axes, finish_axis, save_figure
from moetier.bench.outputs import column
from moetier.experts.registry import NAMES, Hybrid, Resident, Slots, Uva
from moetier.quant.registry import PACKED4


def row_name(r: dict) -> str:
    """A row's name in the record's checks: resident/b1, slots@0.5/b1, uva/b8, hybrid/nodes-auto@0.5/b8;
    quantized rows end in /fp8, /nvfp4, ... (or /fp8-dense, /nvfp4-dense, ...), parallel rows in /tp2, /ep2."""
    par = r.get("parallel", "1")
    name = r["backend"] + ("/" + r["graphs"] if r["backend"] == Hybrid.name else "")
    name += f"+prefetch:{r['prefetch']}" if r.get("prefetch", "off") != "off" else ""
    name += f"+{r['spec']}" if r.get("spec") else ""
    at = "file" if r.get("slots_per_layer") else r.get("budget")  # a slots file's row: its per-layer counts
    key = f"{name}@{at}/b{r['batch']}" if at is not None else f"{name}/b{r['batch']}"
    return key + (f"/{r['dtype']}" if str(r.get("dtype")).startswith(("fp8", "nvfp4", "int4")) else "") + ("" if par == "1" else "/" + par)


def check_tokens(rows: list[dict]) -> dict[str, bool]:
    """Greedy tokens of every engine row against resident's at the same batch and expert format (same
    trace, same prompts); empty without a resident row (the record's output_checks then name the
    reference that ran: bench/outputs.py)."""
    ref = {(r.get("dtype"), r["batch"]): r["tokens"] for r in rows if r["backend"] == Resident.name
           and r.get("parallel", "1") == "1" and not r.get("spec")}
    out = {}
    for r in rows:
        if "tp" in r.get("parallel", "1"):  # EP ranks hold the one-GPU weights; TP ranks' random shards differ
            continue
        # hybrid: equal only where no host pair changed a greedy choice (host and device round differently)
        if r.get("spec"):  # speculative rows: their check is in output_checks (bench/decode_spec.py)
            continue
        if r["backend"] in NAMES and r["backend"] != Resident.name and (r.get("dtype"), r["batch"]) in ref:
            out[row_name(r)] = r["tokens"] == ref[r.get("dtype"), r["batch"]]
    return out


def table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        budget = "" if r.get("budget") is None else f"{r['budget']:.0%}"
        if r.get("slots_per_layer"):  # the slots file's counts (their share of the experts)
            budget = "file"
        hit = "" if r.get("hit_rate") is None else f"{r['hit_rate']:.1%}"
        if r.get("parallel", "1") != "1" and r.get("hit_rate_per_rank"):  # every rank's, rank 0's first
            hit = "/".join("-" if h is None else f"{h:.1%}" for h in r["hit_rate_per_rank"])
        hyb = r.get("hybrid")
        host = "" if not hyb else f"  host {hyb['host_experts_per_layer_step']:.2f} exp/layer-step"
        if r.get("switch"):
            st = r["switch"]["steps"]
            host += f"  pieces {st['pieces']}/{st['pieces'] + st['whole']} steps"
        name = r["backend"] + ("/" + r["graphs"][:5] if r["backend"] == Hybrid.name else "")
        if r.get("prefetch", "off") != "off":  # the rows it filled ahead, beside the step's own misses
            name += f"+pf:{r['prefetch'][:5]}"
            host += f"  prefetched {r['prefetch_experts_per_layer_step']:.2f} exp/layer-step"
        if r.get("parallel", "1") != "1":  # rank 0's roofline; every rank's hit rate; the all-reduce time
            name = f"{r['parallel']}:{name}"
            host += f"  all-reduce {r['all_reduce_ms_per_step']:.2f} ms/step"
            if "record_broadcast_ms_per_step" in r:
                host += f"  record {r['record_broadcast_ms_per_step']:.3f} ms/step ({r['step_record_group']})"
            if "eager_tok_s" in r:  # the all-reduce window: every rank eager (decode_parallel.bench_layout)
                host += f" (eager steps: {r['eager_tok_s']:.1f} tok/s)"
        if r.get("spec"):
            name += "+" + r["spec"].removeprefix("spec:")  # spec:ngram3 -> +ngram3
            host += decode_spec.line(r)
        spread = f" ({r['tok_s_min']:.1f}-{r['tok_s_max']:.1f} over {r['runs']})" if r.get("runs", 1) > 1 else ""
        lines.append(f"{name:>13} {r.get('dtype', ''):>9} {budget:>5} b{r['batch']:<3} {r['tok_s']:9.1f} tok/s{spread}  "
                     f"step {r['step_ms_median']:8.2f} ms  roofline {r['roofline_tok_s']:9.1f} tok/s  "
                     f"{r['of_roofline']:6.1%} of it  hit {hit:>6}  HBM {r['hbm_bytes_per_step'] / GB:6.2f} GB  "
                     f"link {r['link_bytes_per_step'] / GB:6.3f} GB per step  {column(r.get('check'))}{host}")
        if hyb and hyb.get("phases_us"):
            lines.append(" " * 14 + phases_line(hyb))
    return "\n".join(lines)


def phases_line(hyb: dict) -> str:
    """One hybrid row's mean phase offsets (experts/hybrid/phases.py) in microseconds from a layer's entry."""
    p = hyb["phases_us"]
    out = f"host threads {hyb.get('host_threads')}:"
    if p.get("layers"):
        out += (f" host layers {p['layers']}: sync {p['sync']:.0f} choose {p['choose']:.0f} "
                f"args {p.get('host_args', 0):.0f} host_start "
                f"{p['host_start']:.0f} launched {p['launched']:.0f} host {p['host_begin']:.0f}..{p['host_end']:.0f} "
                f"joined {p['joined']:.0f} done {p['done']:.0f} us")
    if p.get("device_gpu") is not None:
        out += f"; device path {p['device_gpu']:.0f} us on the GPU"
    if p.get("device_first") is not None:
        out += f", done first in {p['device_first']:.0%}"
    if p.get("slots_layers"):
        q = p["slots"]
        out += f"; slots layers {p['slots_layers']}: sync {q['sync']:.0f} done {q['done']:.0f} us"
    return out


def ratios(rows: list[dict]) -> list[str]:
    """For each (backend, budget, batch) measured in both formats: FP8 tok/s over bf16 tok/s, kept
    dense over dequantized dense (fp8-dense over fp8, nvfp4-dense over nvfp4, ...), and each 4-bit
    format over FP8 and over bf16 (issue 30's targets are both)."""
    by = {(r["backend"], r.get("budget"), r["batch"], r.get("dtype")): r["tok_s"] for r in rows if not r.get("spec")}
    out = []
    four = ("fp8", "bf16")
    kept = {f"{q}-dense": (q,) for q in ("fp8", *PACKED4)}  # kept dense over dequantized dense
    bases = {"fp8": ("bf16",), **kept, **dict.fromkeys(PACKED4, four)}
    for (backend, budget, batch, dtype), tok_s in by.items():
        for over in bases.get(dtype, ()):
            base = by.get((backend, budget, batch, over))
            if base:
                where = f"{backend}" + (f" {budget:.0%}" if budget is not None else "")
                out.append(f"{dtype}/{over} {where} b{batch}: {tok_s / base:.2f}x ({tok_s:.1f} / {base:.1f} tok/s)")
    return out


def plot(result: dict, path: str) -> None:
    # the budget curve of one GPU without speculation (speculative rows: the table)
    rows = [r for r in result["rows"] if r.get("parallel", "1") == "1" and not r.get("spec")]
    batches = sorted({r["batch"] for r in rows if r["batch"] <= 8})
    budgets = sorted({r["budget"] for r in rows if r["backend"] == Slots.name})
    fig, axes = batch_axes(batches)
    dtypes = list(dict.fromkeys(r.get("dtype") for r in rows))
    for ax, b in zip(axes, batches):
        for dt in dtypes:  # one series per backend and expert format (bf16, fp8)
            tag = f" {dt}" if len(dtypes) > 1 else ""
            mine = [r for r in rows if r.get("dtype") == dt and r["batch"] == b]
            for name, style in ((Slots.name, "o-"), (Hybrid.name, "^-"), ("hf-accelerate", "s-")):
                pts = sorted((r["budget"], r["tok_s"]) for r in mine if r["backend"] == name)
                if pts:
                    ax.plot([100 * x for x, _ in pts], [y for _, y in pts], style, label=name + tag)
            for name, style in ((Resident.name, "--"), (Uva.name, ":")):
                flat = [r["tok_s"] for r in mine if r["backend"] == name]
                if flat and budgets:
                    ax.plot([100 * budgets[0], 100 * budgets[-1]], [flat[0]] * 2, style, label=name + tag)
        finish_axis(ax, "expert budget (% of routed-expert bytes in HBM)", "decode tok/s", f"batch {b}")
    c = result["config"]
    save_figure(fig, f"moetier bench decode: {c['layers']} layers, hidden {c['hidden']}, "
                     f"{c['experts']} experts top-{c['top_k']}, {c.get('dtype', 'bf16')}", path)
