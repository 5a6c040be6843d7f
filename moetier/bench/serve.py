"""`moetier bench serve`: a client-only load generator for any OpenAI-compatible server (moetier's,
vLLM's, SGLang's), reporting with the field names of vLLM's `bench serve`.

Prompts are token ids sampled, with a fixed seed, from the server's own tokenization of random words
(/tokenize), so inputs have exact lengths on any tokenizer; `ignore_eos` makes outputs exact too.
Each concurrency level (or request rate) first runs untimed warm-up requests, then the measured
ones. A request's TTFT is its first chunk, ITL the gaps between chunks (a server sends one per step
that brings tokens, text or not, as vLLM's does), TPOT its decode time over its output tokens after
the first, E2EL the whole request. Failures (an HTTP error, a
broken stream) and cancellations (the client timed out, or the server aborted) are counted apart.
Outputs: requests are greedy and the levels share their prompts, so each level's completions are
compared with the first level's (`check`); a level whose completions differ is marked.

Datasets with repeated prefixes (prefix caching, docs/prefix-cache.md): `shared-prefix` sends requests
over a few long prefixes (--num-prefixes of --prefix-len tokens, the rest of --input-len a random
suffix); `multi-turn` runs conversations of --turns turns under one shared system prompt of
--prefix-len tokens, each turn's prompt the previous turn's plus a reply of --output-len tokens and a
new user message of --input-len minus --prefix-len tokens, the turns of a conversation one after the
other (a concurrency slot holds a conversation). NOTE: the replies in the history are client-made
tokens, not the server's completions, so that every level sends the same prompts. Against a moetier
server each level also reads the prefix cache's counters from /metrics: tokens queried, tokens hit
(prefill skipped) and those brought back from the host KV tier; and, where the server speculates
(--speculative-config), vLLM's speculative decoding counters: drafts, draft tokens, accepted tokens
(with the acceptance rate and the mean acceptance length they give).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

from moetier.errors import MoetierError

WORDS = ("data time file value list model table order point state group field class thread server "
         "stream token layer cache expert route batch queue page block graph kernel memory").split()


@dataclass
class Result:
    ok: bool = False
    cancelled: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    text: str = ""  # the completion (greedy: the output check compares it across levels)


DATASETS = ("random", "sharegpt-like", "shared-prefix", "multi-turn")


@dataclass(frozen=True)
class Prefixes:
    """The shape of the repeated-prefix datasets (the CLI's --prefix-len, --num-prefixes, --turns)."""

    prefix_len: int = 0  # 0: three quarters of input_len
    num_prefixes: int = 4
    turns: int = 4


def chains(dataset: str, n: int, input_len: int, output_len: int, ids: list[int], seed: int, shape: Prefixes
           ) -> list[list[tuple[list[int], int]]]:
    """At least n requests as chains (each chain's requests run in order, one after the other), their
    prompts cut from the token ids `ids`: one request per chain but for multi-turn."""
    rng = random.Random(seed)

    def cut(k: int) -> list[int]:
        start = rng.randrange(0, max(1, len(ids) - k))
        return ids[start:start + k]

    if dataset in ("random", "sharegpt-like"):
        return [[(cut(i), o)] for i, o in lengths(dataset, n, input_len, output_len, seed)]
    head = min(shape.prefix_len or input_len * 3 // 4, input_len - 1)
    if dataset == "shared-prefix":
        heads = [cut(head) for _ in range(shape.num_prefixes)]
        return [[(heads[i % len(heads)] + cut(input_len - head), output_len)] for i in range(n)]
    system, out = cut(head), []
    for _ in range(-(-n // shape.turns)):
        prompt, turns = list(system), []
        for _ in range(shape.turns):
            prompt = prompt + cut(input_len - head)
            turns.append((prompt, output_len))
            prompt = prompt + cut(output_len)  # the reply, as the next turn's history
        out.append(turns)
    return out


def corpus_tokens(dataset: str, n: int, input_len: int, output_len: int, seed: int) -> int:
    """Tokens of the corpus the prompts are cut from."""
    if dataset in ("random", "sharegpt-like"):
        return sum(i for i, _ in lengths(dataset, n, input_len, output_len, seed))
    return 4 * (input_len + output_len)  # a pool to cut from: prompts repeat by construction


def lengths(dataset: str, n: int, input_len: int, output_len: int, seed: int) -> list[tuple[int, int]]:
    """(input, output) token counts: fixed, or a ShareGPT-like log-normal mix around the given ones."""
    if dataset == "random":
        return [(input_len, output_len)] * n
    rng = np.random.default_rng(seed)
    ins = np.clip(rng.lognormal(np.log(input_len), 0.8, n), 4, 4 * input_len).astype(int)
    outs = np.clip(rng.lognormal(np.log(output_len), 0.6, n), 2, 4 * output_len).astype(int)
    return list(zip(ins.tolist(), outs.tolist()))


async def corpus(client: httpx.AsyncClient, url: str, tokens: int, seed: int) -> list[int]:
    """Token ids of random words, tokenized by the server, at least `tokens` long."""
    rng = random.Random(seed)
    ids: list[int] = []
    while len(ids) < tokens:
        text = " ".join(rng.choice(WORDS) for _ in range(max(64, tokens)))
        r = await client.post(url + "/tokenize", json={"prompt": text})
        if r.status_code != 200:
            raise MoetierError(f"{url}/tokenize answered {r.status_code}: {r.text[:200]}; bench serve needs it "
                               "to make prompts of exact lengths")
        ids += r.json()["tokens"]
    return ids


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], out_len: int,
              timeout: float) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    res, start = Result(prompt_len=len(prompt)), time.perf_counter()
    last = start
    try:
        async with asyncio.timeout(timeout):
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                    return res
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        res.error = str(chunk["error"])
                        return res
                    if chunk.get("usage"):
                        res.output_tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices") or []:
                        res.text += choice.get("text") or ""
                        # every chunk with a choice is a step that brought tokens (text or not); the
                        # usage chunk has none
                        now = time.perf_counter()
                        if res.ttft == 0.0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                        if choice.get("finish_reason") == "abort":
                            res.cancelled = True
    except TimeoutError:
        res.cancelled = True
        return res
    except (httpx.HTTPError, ValueError, KeyError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2el = time.perf_counter() - start
    res.ok = not res.cancelled and res.output_tokens > 0
    if not res.ok and not res.cancelled:
        res.error = "no usage in the stream"
    return res


async def level(client, url: str, model: str, work: list[list[tuple[list[int], int]]], warmup: int,
                concurrency: int | None, rate: float | None, seed: int, timeout: float) -> dict:
    """One concurrency level (or request rate): warm-up chains, then the measured ones; a concurrency
    slot runs one chain's requests in order. With a moetier server, the prefix cache's counters."""
    limit = asyncio.Semaphore(concurrency or len(work))

    async def limited(chain):
        async with limit:
            return [await one(client, url, model, p, n, timeout) for p, n in chain]

    warm = [r for rs in await asyncio.gather(*(limited(c) for c in work[:warmup])) for r in rs]
    before, spec0, steps0 = (await prefix_counters(client, url), await spec_counters(client, url),
                             await step_counters(client, url))
    rng = np.random.default_rng(seed)
    tasks, start = [], time.perf_counter()
    for chain in work[warmup:]:
        tasks.append(asyncio.create_task(limited(chain)))
        if rate:  # Poisson arrivals
            await asyncio.sleep(rng.exponential(1.0 / rate))
    results = [r for rs in await asyncio.gather(*tasks) for r in rs]
    out = summarize(results, time.perf_counter() - start, concurrency, rate)
    after, spec1, steps1 = (await prefix_counters(client, url), await spec_counters(client, url),
                            await step_counters(client, url))
    if steps0 is not None and steps1 is not None:  # the level's steps, and how many took the large path
        d = {k: steps1[k] - steps0[k] for k in steps1}
        for key in ("server_ttft", "queue"):  # engine-side means over the requests that ended in the level
            n, total = d.pop(f"{key}_count"), d.pop(f"{key}_sum")
            d[f"{key}_ms_mean"] = 1e3 * total / n if n else None
        out |= d
    if spec0 is not None and spec1 is not None:
        d = {k: spec1[k] - spec0[k] for k in spec1}
        drafts, tokens, kept = d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]
        out |= {"spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": tokens,
                "spec_decode_num_accepted_tokens": kept,
                "spec_decode_acceptance_rate": kept / tokens if tokens else None,
                "spec_decode_mean_acceptance_length": 1 + kept / drafts if drafts else None}
    if before is not None and after is not None:
        d = {k: after[k] - before[k] for k in after}
        out |= {"prefix_cache_queries": d["queries"], "prefix_cache_hits": d["hits"],
                "prefix_cache_hit_rate": d["hits"] / d["queries"] if d["queries"] else 0.0,
                "kv_host_hit_tokens": d["host"]}
    out["_texts"] = {i: r.text for i, r in enumerate([*warm, *results]) if r.ok}  # by prompt index
    return out


async def counters(client, url: str, names: dict[str, str], optional: dict[str, float]) -> dict[str, float] | None:
    """Counters from /metrics: {metric name: key}; keys in `optional` default to their value, the
    others must be there (None from a server without them)."""
    try:
        r = await client.get(url + "/metrics")
    except httpx.HTTPError:
        return None
    got = {key: optional.get(key) for key in names.values()}
    for line in r.text.splitlines() if r.status_code == 200 else ():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            got[names[name]] = float(line.rsplit(" ", 1)[-1])
    return None if any(v is None for v in got.values()) else got


async def prefix_counters(client, url: str) -> dict[str, float] | None:
    """moetier's prefix cache counters (tokens); None from a server without them."""
    return await counters(client, url, {"moetier:prefix_cache_queries_total": "queries",
                                        "moetier:prefix_cache_hits_total": "hits",
                                        "moetier:kv_host_hits_total": "host"}, {"host": 0.0})


async def step_counters(client, url: str) -> dict[str, float] | None:
    """moetier's engine step counters (server/metrics.py STEP_COUNTERS) and its own latency histograms'
    sums (engine-side TTFT and queue time, from the request's arrival in the engine: beside the
    client's TTFT they show the time spent before the engine); None from another server."""
    return await counters(client, url, {"moetier:engine_steps_total": "engine_steps",
                                        "moetier:engine_large_steps_total": "large_steps",
                                        "moetier:engine_large_step_tokens_total": "large_step_tokens",
                                        "moetier:engine_step_seconds_total": "step_seconds",
                                        "moetier:engine_large_step_seconds_total": "large_step_seconds",
                                        **{f"moetier:{m}_seconds_{x}": f"{key}_{x}" for m, key in
                                           (("time_to_first_token", "server_ttft"), ("request_queue_time", "queue"))
                                           for x in ("sum", "count")}}, {})


async def spec_counters(client, url: str) -> dict[str, float] | None:
    """moetier's speculative decoding counters (server/metrics.py); None from a server that does not
    speculate."""
    return await counters(client, url, {f"moetier:spec_decode_{k}_total": k for k in
                                        ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}, {})


def check_levels(rows: list[dict]) -> None:
    """Each level's completions against the first level's for the same prompts (temperature 0, the
    same server): rows get "check", a level whose completions differ is marked. Drops the texts."""
    ref = rows[0].pop("_texts") if rows else {}
    name = f"concurrency {rows[0]['max_concurrency']}" if rows else ""
    if rows:
        rows[0]["check"] = {"verdict": "reference", "reference": name}
    for r in rows[1:]:
        texts = r.pop("_texts")
        both = sorted(set(texts) & set(ref))
        differ = [i for i in both if texts[i] != ref[i]]
        r["check"] = {"reference": name, "compared": len(both), "differ": len(differ), "first_differing": differ[:5],
                      "verdict": "exact" if not differ and both else "not compared" if not both else
                      f"DIFFERS ({len(differ)} of {len(both)} completions; greedy, same prompts)"}


def stats_ms(name: str, values: list[float]) -> dict:
    ms = [v * 1e3 for v in values] or [0.0]
    return {f"mean_{name}_ms": statistics.fmean(ms), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(np.std(ms)), f"p90_{name}_ms": float(np.percentile(ms, 90)),
            f"p99_{name}_ms": float(np.percentile(ms, 99))}


def summarize(results: list[Result], duration: float, concurrency: int | None, rate: float | None) -> dict:
    ok = [r for r in results if r.ok]
    tpot = [(r.e2el - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    inp, out = sum(r.prompt_len for r in ok), sum(r.output_tokens for r in ok)
    errors = sorted({r.error for r in results if r.error})[:5]
    return {"max_concurrency": concurrency, "request_rate": rate if rate else "inf", "duration": duration,
            "completed": len(ok), "failed": sum(1 for r in results if r.error), "cancelled":
            sum(1 for r in results if r.cancelled), "errors": errors, "total_input_tokens": inp,
            "total_output_tokens": out, "request_throughput": len(ok) / duration,
            "output_throughput": out / duration, "total_token_throughput": (inp + out) / duration,
            **stats_ms("ttft", [r.ttft for r in ok]), **stats_ms("tpot", tpot),
            **stats_ms("itl", [x for r in ok for x in r.itl]), **stats_ms("e2el", [r.e2el for r in ok])}


async def run_async(url: str, api_key: str | None, concurrencies: list[int], rate: float | None, num_prompts: int,
                    input_len: int, output_len: int, dataset: str, warmup: int, seed: int, timeout: float,
                    shape: Prefixes = Prefixes()) -> dict:
    url = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max(concurrencies + [64]) + 8)
    async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
        try:
            answer = await client.get(url + "/v1/models")
            if answer.status_code == 401:  # a server that wants a key is there: say so, not "no server"
                fix = "the given --api-key was refused" if api_key else "give --api-key KEY"
                raise MoetierError(f"--url {url}: the server there wants an API key ({fix})")
            models = answer.raise_for_status().json()["data"]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            raise MoetierError(f"--url {url}: no OpenAI server answers there ({e})") from None
        model = models[0]["id"]
        levels = [None] if rate else concurrencies
        per_chain = shape.turns if dataset == "multi-turn" else 1
        biggest = max(num_prompts or 4 * (c or 16) for c in levels) + warmup * per_chain
        ids = await corpus(client, url, corpus_tokens(dataset, biggest, input_len, output_len, seed), seed)
        work = chains(dataset, biggest, input_len, output_len, ids, seed, shape)
        rows = []
        for c in levels:
            n = -(-(num_prompts or max(16, 4 * (c or 16))) // per_chain) + warmup
            rows.append(await level(client, url, model, work[:n], warmup, c, rate, seed, timeout))
        check_levels(rows)
        return {"url": url, "model": model, "dataset": dataset, "input_len": input_len, "output_len": output_len,
                "warmup": warmup, "seed": seed, "results": rows,
                **({"prefixes": shape.__dict__} if dataset in ("shared-prefix", "multi-turn") else {})}


def run(*args, **kw) -> dict:
    return asyncio.run(run_async(*args, **kw))


def table(data: dict) -> str:
    lines = [f"{'conc':>5} {'rate':>6} {'done':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>9} {'TTFT ms':>8} "
             f"{'TPOT ms':>8} {'p99 ITL':>8} {'E2EL ms':>8} {'hit tok':>8} {'hit %':>6}  outputs"]
    for r in data["results"]:
        hit = (f"{r['prefix_cache_hits']:8.0f} {r['prefix_cache_hit_rate']:6.1%}" if "prefix_cache_hits" in r
               else f"{'-':>8} {'-':>6}")
        lines.append(f"{str(r['max_concurrency']):>5} {str(r['request_rate']):>6} {r['completed']:>5} "
                     f"{r['failed'] + r['cancelled']:>4} {r['request_throughput']:7.2f} {r['output_throughput']:9.1f} "
                     f"{r['median_ttft_ms']:8.1f} {r['median_tpot_ms']:8.2f} {r['p99_itl_ms']:8.1f} "
                     f"{r['median_e2el_ms']:8.0f} {hit}  {check_text(r.get('check'))}")
    return "\n".join(lines)


def check_text(check: dict | None) -> str:
    if check is None:
        return "-"
    if check["verdict"] == "reference":
        return "(reference)"
    mark = "  <<< OUTPUTS DIFFER" if check["verdict"].startswith("DIFFERS") else ""
    return f"{check['verdict']} vs {check['reference']}{mark}"


def plot(data: dict, path: str, num_gpus: int = 1) -> None:
    """Output throughput per GPU against interactivity (1 / median TPOT), one point per level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [(1e3 / r["median_tpot_ms"], r["output_throughput"] / num_gpus, r["max_concurrency"])
           for r in data["results"] if r["median_tpot_ms"] > 0]
    fig, ax = plt.subplots(figsize=(6.4, 4.8))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-")
    for x, y, c in pts:
        ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("interactivity (tok/s per user = 1 / median TPOT)")
    ax.set_ylabel("output throughput per GPU (tok/s)")
    ax.set_title(f"{data['model']}: in {data['input_len']}, out {data['output_len']} tokens")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
