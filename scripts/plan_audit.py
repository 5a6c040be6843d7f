"""The memory plan against measured use on a CUDA machine (issue 14): the Qwen3-30B-A3B shape at 8 and
48 layers, experts resident and in slots (half the experts per layer), and GLM-5.3-Flash cut to 4
layers (resident, 32,768 tokens a request: the indexer's decode selection), each case in its own
process so every baseline is clean (GLM-5.3-Flash's KDA needs fla-core).

    python scripts/plan_audit.py                       # every case; JSON to $OUT/plan_audit.json if OUT is set
    python scripts/plan_audit.py --case 48:slots       # one case (what the driver runs per process)

Each case builds the model with random weights in memory (moetier/checkpoint/random_bed.py: the 48-layer
checkpoint, 61 GB, does not fit the device machine's disk), counts the plan for the engine settings
used, then measures after the experts are placed ("after load") and after the engine allocated its KV
pool and captured its decode graphs ("after graph capture"), and prints planned against measured with
a warning beyond 5%.

The random bed differs from the loader in one way: it always keeps a pinned host store of every expert
(the resident rows are copied from it). For resident cases that store is subtracted from the measured
host figures, since a loaded resident model has none.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CASES = ("8:resident", "8:slots", "48:resident", "48:slots", "glm-5.3-flash:4:resident")
SEQS, LEN = 8, 4096  # engine settings of every case: 8 requests of 4,096 tokens (GLM_LEN for GLM-5.3-Flash)
# GLM-5.3-Flash cut to 4 layers (three KDA, one indexed MLA; one MoE layer): its decode graphs hold the
# indexer's fixed-shape selection over every page-table row, about 0.4 GiB at 8 x 32,768 tokens
GLM_LEN = 32768


def capture_sites(snapshot: dict, top: int = 12) -> list[tuple[str, int]]:
    """Live device bytes allocated while history was recorded, by the innermost moetier frame that
    asked for them (which plan item undercounts, when the audit says one does)."""
    sites: dict[str, int] = {}
    for seg in snapshot["segments"]:
        for b in seg["blocks"]:
            if b["state"] != "active_allocated" or not b.get("frames"):
                continue
            f = next((f for f in b["frames"] if "moetier" in f["filename"]),
                     b["frames"][0])
            key = f"{Path(f['filename']).name}:{f['line']} {f['name']}"
            sites[key] = sites.get(key, 0) + b["size"]
    return sorted(sites.items(), key=lambda kv: -kv[1])[:top]


def run_case(case: str, why: bool = False) -> dict:
    import torch

    from moetier.checkpoint.random_bed import random_bed, use_backend
    from moetier.engine.config import EngineConfig
    from moetier.engine.llm import LLM
    from moetier.plan import audit
    from moetier.plan.memory import PlanRequest, count
    from moetier.plan.render import table
    from moetier.presets import preset

    name, layers, backend = case.split(":") if case.count(":") == 2 else ("qwen3-30b-a3b", *case.split(":"))
    cfg = preset(name, int(layers), "bfloat16")
    length = GLM_LEN if name == "glm-5.3-flash" else LEN
    torch.cuda.init()
    torch.cuda.mem_get_info()  # the context exists from here on: the baseline holds it
    base = audit.measure("cuda")
    config = EngineConfig.of(max_num_seqs=SEQS, max_model_len=length, kv_tokens=SEQS * length)
    bed = random_bed(cfg, seed=0, device="cuda")
    slots = use_backend(bed, backend, budget=0.5, decode_tokens=config.decode_tokens)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the bed's random-number scratch; the loader has none
    req = PlanRequest(cfg, torch.bfloat16, "cuda", backend=backend,
                      slots_per_layer=dict.fromkeys(cfg.moe_layers, slots) if backend == "slots" else {},
                      max_model_len=length, max_num_seqs=SEQS, kv_tokens=SEQS * length, context_in_budget=False,
                      gpu_budget=torch.cuda.mem_get_info()[1], gpu_source="the card's total")
    plan = count(req)
    print(table(plan), flush=True)
    store = sum(t.numel() * t.element_size() for t in bed.host.values())
    out = {"case": case, "plan": plan.as_dict(), "audits": []}

    def stage(name: str) -> None:
        m = audit.measure("cuda")
        if backend == "resident":  # the bed's host store, which a loaded resident model does not have
            m["host_VmRSS"] -= store
            m["host_VmLck"] = m["host_VmPin"] = 0
        rep = audit.report(plan, name, m, base)
        print("\n".join(audit.lines(rep)), flush=True)
        out["audits"].append(rep)

    stage("after load")
    if why:
        torch.cuda.memory._record_memory_history(max_entries=200000)
    llm = LLM.from_model(bed.model, bed.tokenizer, config)
    stage("after graph capture")
    if why:
        sites = capture_sites(torch.cuda.memory._snapshot())
        torch.cuda.memory._record_memory_history(enabled=None)
        print("device bytes allocated by the engine's start (KV, workspaces, graph capture), by site:")
        for site, n in sites:
            print(f"  {n / 2**20:10.1f} MiB  {site}")
        out["capture_sites"] = sites
    ids = list(range(100, 116))
    from moetier.sampling_params import SamplingParams

    llm.generate([ids] * SEQS, SamplingParams(max_tokens=8, ignore_eos=True))  # the engine runs in this memory
    out["peak_allocated_after_8_steps"] = torch.cuda.max_memory_allocated()
    out["planned_device_total"] = plan.device_total
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=CASES, help="run one case in this process and print its JSON last")
    ap.add_argument("--cases", default=",".join(CASES), help="the cases the driver runs, comma-separated")
    ap.add_argument("--why", action="store_true", help="record allocation sites during the engine's start "
                    "and print the largest")
    args = ap.parse_args()
    if args.case:
        print("JSON " + json.dumps(run_case(args.case, args.why)), flush=True)
        return
    results = []
    for case in args.cases.split(","):
        print(f"== {case} ==", flush=True)
        p = subprocess.run([sys.executable, __file__, "--case", case] + ["--why"] * args.why, capture_output=True,
                           text=True)
        sys.stdout.write("".join(line + "\n" for line in p.stdout.splitlines() if not line.startswith("JSON ")))
        if p.returncode != 0:
            print(f"case {case} failed (exit {p.returncode}):\n{p.stderr[-3000:]}", flush=True)
            results.append({"case": case, "error": p.stderr[-3000:]})
            continue
        results.append(json.loads(next(line[5:] for line in p.stdout.splitlines() if line.startswith("JSON "))))
    print("\nsummary: planned vs measured (GiB = 2^30 bytes); off beyond 5% is flagged")
    print(f"{'case':<13}{'stage':<21}{'what':<30}{'planned':>11}{'measured':>11}{'off':>8}")
    warned = 0
    for r in results:
        for a in r.get("audits", []):
            for row in a["rows"]:
                flag = " !" if abs(row["off"]) > 0.05 and abs(row["measured"] - row["planned"]) > 128 * 2**20 else ""
                warned += bool(flag)
                print(f"{r['case']:<13}{a['stage']:<21}{row['what']:<30}{row['planned'] / 2**30:>11.3f}"
                      f"{row['measured'] / 2**30:>11.3f}{row['off']:>+8.1%}{flag}")
            if a.get("context_measured") is not None:
                print(f"{r['case']:<13}{a['stage']:<21}{'(context + other, measured)':<30}{'':>11}"
                      f"{a['context_measured'] / 2**30:>11.3f}")
        if "peak_allocated_after_8_steps" in r:
            print(f"{r['case']:<13}{'after 8 decode steps':<21}{'peak allocated vs plan total':<30}"
                  f"{r['planned_device_total'] / 2**30:>11.3f}{r['peak_allocated_after_8_steps'] / 2**30:>11.3f}")
    print(f"{warned} row(s) beyond 5%")
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "plan_audit.json"
        path.write_text(json.dumps(results, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
