"""The hybrid rows of `moetier bench decode`: the backend options a row is built with (the host
kernel and its threads, the rates from a host profile) and the rates it ran with."""

from __future__ import annotations

from moetier.models.base import CausalLM


def host_options(args: dict, bw: dict) -> dict:
    """ExpertOptions fields of the hybrid rows: the host kernel and threads, and the rates: from a
    scripts/bench_cpu_experts.py JSON with this run's link bandwidth when given, else measured by the
    backend when it is built. Threads: --host-threads, else with a profile its winner's but at most the
    cores less one (the launching thread keeps a core), else the backend's default (cores less one).
    With a profile, the rates are its fit at those threads where it measured them (rates_from_bench)."""
    import json

    from moetier.experts.hybrid.cost_model import rates_from_bench
    from moetier.experts.hybrid.host_path import default_host_threads

    out = {"host_kernel": args.get("host_kernel", "auto"), "host_threads": args.get("host_threads")}
    if args.get("host_profile"):
        with open(args["host_profile"]) as f:
            data = json.load(f)
        out["host_kernel"] = data["winner"]["kernel"]
        if out["host_threads"] is None:
            won = data["winner"]["threads"]
            out["host_threads"] = min(won, default_host_threads())
        out["rates"] = rates_from_bench(data, bw["link_GBps"], out["host_threads"])
    return out


def hybrid_rates(model: CausalLM) -> dict | None:
    b = model.moe_blocks()[0].experts
    rates = getattr(getattr(b, "hostpath", None), "rates", None)
    return None if rates is None else {"link_GBps": rates.link_GBps, "host_GBps": rates.host_GBps,
                                       "host_overhead_s": rates.host_overhead_s, "host_token_s": rates.host_token_s}
