"""Prometheus metrics with vLLM's names and meanings under a `moetier:` prefix, plus the expert tiers.

Request metrics (tokens, latencies, preemptions) are observed once per finished request, from the
timings the engine keeps on it (RequestOutput.metrics). Gauges (running, waiting, KV usage) and the
expert counters are read from the engine when /metrics is scraped, so they cost nothing between
scrapes. Each app has its own registry: several servers in one process (tests) never share counters.
"""

from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# vLLM's buckets, so dashboards built for vLLM read the same
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
P = "moetier:"
# (metric name, LLM.metrics() key, help): counters since start; the host tier's only when it exists
# engine steps (LLM.metrics): all, and those above decode_tokens (the large-step expert path)
STEP_COUNTERS = (
    ("engine_steps", "steps", "Engine steps run."),
    ("engine_large_steps", "large_steps", "Engine steps of more than decode_tokens tokens (the large-step expert "
     "path: with slots, each streams every missing expert of a layer once)."),
    ("engine_large_step_tokens", "large_step_tokens", "Tokens of the engine's large steps."),
    ("engine_step_seconds", "step_seconds", "Seconds in engine steps, from scheduling to the sampled tokens on "
     "the host."),
    ("engine_large_step_seconds", "large_step_seconds", "Seconds in the engine's large steps."),
)
PREFIX_COUNTERS = (
    ("prefix_cache_queries", "prefix_cache_queries", "Prefix cache queries, in tokens of the admitted prompts."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prefix cache hits, in tokens whose prefill was skipped."),
    ("prefix_cache_evictions", "prefix_cache_evictions", "KV pages the prefix cache evicted from the GPU."),
    ("kv_host_hits", "kv_host_hits", "Prefix cache hit tokens brought back from the host KV tier."),
    ("kv_host_bytes_to_host", "kv_host_bytes_to_host", "Bytes of KV pages copied to the host KV tier."),
    ("kv_host_bytes_to_gpu", "kv_host_bytes_to_gpu", "Bytes of KV pages copied back from the host KV tier."),
    ("kv_host_evictions", "kv_host_evictions", "KV pages dropped from the host KV tier to make room."),
)
# speculative decoding (engine/speculation.py), vLLM's names; only when the engine speculates
SPEC_COUNTERS = (
    ("spec_decode_num_drafts", "Verify rows that carried draft tokens."),
    ("spec_decode_num_draft_tokens", "Draft tokens verified."),
    ("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
)


class EngineCollector:
    """Scrape-time gauges and expert counters, from a callable returning LLM.metrics()-like data."""

    def __init__(self, read, model_name: str):
        self.read, self.model_name = read, model_name

    def collect(self):
        m = self.read()
        labels = ["model_name"]
        for name, doc, value in (
                ("num_requests_running", "Requests in model execution batches.", m["running"]),
                ("num_requests_waiting", "Requests waiting to be processed.", m["waiting"]),
                ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", m["kv_usage"])):
            g = GaugeMetricFamily(P + name, doc, labels=labels)
            g.add_metric([self.model_name], value)
            yield g
        # prefix caching (engine/prefix_cache.py): vLLM's two counters in tokens, ours for the host KV tier
        for name, key, doc in STEP_COUNTERS + PREFIX_COUNTERS:
            if key in m:
                c = CounterMetricFamily(P + name, doc, labels=labels)
                c.add_metric([self.model_name], m[key])
                yield c
        if "spec_decode_num_drafts" in m:
            yield from self._speculation(m)
        if m.get("kv_pages_cached") is not None:
            g = GaugeMetricFamily(P + "kv_cache_cached_pages", "Free KV pages that still hold a cached prefix.",
                                  labels=labels)
            g.add_metric([self.model_name], m["kv_pages_cached"])
            yield g
        docs = {"hits": "Expert lookups served from HBM (a slot or a pinned expert).",
                "pinned_hits": "Expert lookups served by an expert pinned on the GPU (of the hits).",
                "misses": "Expert lookups that copied the expert into a slot first.",
                "overflow": "Expert lookups read over the link (more distinct experts than slots).",
                "link_bytes": "Expert bytes moved over the host link (misses and overflow)."}
        for key, doc in docs.items():
            c = CounterMetricFamily(P + f"expert_{key}", doc, labels=["model_name", "layer"])
            for layer, stats in m["expert_layers"].items():
                c.add_metric([self.model_name, str(layer)], stats[key])
            c.add_metric([self.model_name, "total"], sum(s[key] for s in m["expert_layers"].values()))
            yield c
        # each rank's own slot caches (LLM.metrics' expert_stats_per_rank; one process: rank 0 alone);
        # the per-layer counters above are rank 0's. NOTE: summed over ranks only under EP (each pair
        # on its owner); under TP every rank looks up every pair
        for key in ("hits", "misses", "overflow"):
            c = CounterMetricFamily(P + f"expert_rank_{key}", docs[key][:-1] + ", over the MoE layers of each rank.",
                                    labels=["model_name", "rank"])
            for rank, stats in enumerate(m["expert_stats_per_rank"]):
                c.add_metric([self.model_name, str(rank)], stats[key])
            yield c


    def _speculation(self, m: dict):
        for name, doc in SPEC_COUNTERS:
            c = CounterMetricFamily(P + name, doc, labels=["model_name"])
            c.add_metric([self.model_name], m[name])
            yield c
        c = CounterMetricFamily(P + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by their "
                                "position in the draft (0: the first).", labels=["model_name", "position"])
        for j, n in enumerate(m["spec_decode_num_accepted_tokens_per_pos"]):
            c.add_metric([self.model_name, str(j)], n)
        yield c
        c = CounterMetricFamily(P + "spec_decode_k_chosen", "Steps that chose this many draft tokens (expert-aware "
                                "k).", labels=["model_name", "k"])
        for k, n in m["spec_decode_k_chosen"].items():
            c.add_metric([self.model_name, str(k)], n)
        yield c


class ServerMetrics:
    def __init__(self, read_engine, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        lab, reg = ["model_name"], self.registry
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prefill tokens processed.", lab, registry=reg)
        self.generation_tokens = Counter(P + "generation_tokens", "Generation tokens processed.", lab, registry=reg)
        self.preemptions = Counter(P + "num_preemptions", "Cumulative preemptions from the engine.", lab,
                                   registry=reg)
        self.success = Counter(P + "request_success", "Requests that ended, by finished_reason (stop, length, abort).",
                               lab + ["finished_reason"], registry=reg)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token in seconds.", lab,
                              buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Inter-token latency in seconds.", lab,
                             buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "End-to-end request latency in seconds.", lab,
                             buckets=REQUEST_BUCKETS, registry=reg)
        self.queue = Histogram(P + "request_queue_time_seconds", "Time spent waiting in the queue in seconds.",
                               lab, buckets=REQUEST_BUCKETS, registry=reg)
        reg.register(EngineCollector(read_engine, model_name))

    def finished(self, metrics: dict, finish_reason: str | None) -> None:
        """Observe one request that ended (finished or aborted) from its engine timings."""
        name = self.model_name
        self.prompt_tokens.labels(name).inc(metrics.get("prompt_tokens", 0))
        self.generation_tokens.labels(name).inc(metrics.get("output_tokens", 0))
        self.preemptions.labels(name).inc(metrics.get("preemptions", 0))
        if finish_reason in ("stop", "length", "abort"):  # vLLM's finished reasons; abort: the client left
            self.success.labels(name, finish_reason).inc()
        for key, hist in (("ttft_s", self.ttft), ("e2e_s", self.e2e), ("queue_s", self.queue)):
            if metrics.get(key) is not None:
                hist.labels(name).observe(metrics[key])
        times = metrics.get("token_times") or []
        for a, b in zip(times, times[1:]):
            self.itl.labels(name).observe(b - a)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def engine_snapshot(llm) -> dict:
    """What the scrape-time collector reads: LLM.metrics() plus per-layer expert counters and bytes."""
    m = llm.metrics()
    dtype = getattr(llm.model, "dtype", torch.bfloat16)
    layers = {}
    for block in llm.model.moe_blocks():
        s = block.experts.stats()
        row_bytes = block.experts.layout.row_bytes(dtype)  # exact: FP8 rows count their scales
        layers[block.layer] = {"hits": s["hits"], "pinned_hits": s.get("pinned", 0), "misses": s["misses"],
                               "overflow": s["overflow"],
                               "link_bytes": (s["misses"] + s["overflow"]) * row_bytes}
    return {**m, "expert_layers": layers}
