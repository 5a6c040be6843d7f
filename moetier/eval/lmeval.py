"""One evaluation: lm-eval's tasks against one OpenAI-compatible server, offline, summarised as plain
data (EvalRun.as_dict) that the gate compares item by item.

lm-eval's `local-completions` client sends token ids (the tokenizer is the checkpoint directory's,
read by transformers from local files) and scores with `echo: true, logprobs: 1, max_tokens: 1`;
`local-chat-completions` (--api chat) sends chat messages and runs generation tasks only. The hub is
switched off for the run (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE): a task whose data is not local fails
instead of downloading.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from moetier.errors import MoetierError
from moetier.eval.tasks import name_of

BOOTSTRAP = 1000  # lm-eval's resamples for the errors of non-mean metrics (perplexities); means have exact ones
APIS = {"completions": ("local-completions", "/v1/completions"),
        "chat": ("local-chat-completions", "/v1/chat/completions")}


def import_lm_eval():
    """lm_eval, or one line saying how to install it."""
    try:
        import lm_eval  # noqa: F401
        import lm_eval.models.openai_completions  # noqa: F401 -- the API clients (aiohttp, tenacity)
    except ImportError as e:
        raise MoetierError(f"moetier eval needs lm-eval ({e}); install it with: pip install 'moetier[eval]'") from None
    return lm_eval


@dataclass
class TaskResult:
    output_type: str
    n: int  # documents
    metrics: dict[str, float] = field(default_factory=dict)  # lm-eval's aggregate, by metric name
    stderr: dict[str, float] = field(default_factory=dict)
    per_doc: dict[str, list[float]] = field(default_factory=dict)  # a metric's value per document (paired errors)
    outputs: list[str] = field(default_factory=list)  # greedy generations, in document order
    lls: list[float] = field(default_factory=list)  # every log-likelihood scored, in document order
    ll_tokens: list[int] = field(default_factory=list)  # the tokens each of lls scores (the same order)
    tokens: int = 0  # loglikelihood_rolling: tokens scored (for nats per token)


@dataclass
class EvalRun:
    label: str
    url: str
    model: str
    seconds: float
    tasks: dict[str, TaskResult]
    serve_flags: list[str] | None = None  # the `moetier serve` flags of a spawned server

    def as_dict(self) -> dict:
        return asdict(self)


def served_model(url: str) -> tuple[str, int | None]:
    """The first model id a server lists at GET /v1/models, and its max_model_len when it says."""
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/v1/models", timeout=30)
        r.raise_for_status()
        card = r.json()["data"][0]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise MoetierError(f"--url {url}: GET /v1/models failed ({e}); give the server's base URL, like "
                           "http://127.0.0.1:8000") from None
    return card["id"], card.get("max_model_len")


def run(url: str, tokenizer: Path, tasks: list, *, label: str = "", api: str = "completions",
        include: list[Path] = (), limit: int | None = None, max_length: int = 2048, concurrent: int = 1,
        prefix_token_id: int | None = None) -> EvalRun:
    """lm-eval's simple_evaluate over `tasks` (names or config dicts) against the server at `url`."""
    lm_eval = import_lm_eval()
    from lm_eval.tasks import TaskManager

    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"  # nothing fetched, ever
    model, path = APIS[api]
    name, _ = served_model(url)
    args = {"base_url": url.rstrip("/") + path, "model": name, "num_concurrent": concurrent, "max_retries": 1,
            "max_length": max_length, "timeout": 600}
    if api == "completions":
        args.update(tokenizer=str(tokenizer), tokenizer_backend="huggingface", tokenized_requests=True)
        if prefix_token_id is not None:
            args["custom_prefix_token_id"] = prefix_token_id
    start = time.perf_counter()
    try:
        out = lm_eval.simple_evaluate(model=model, model_args=args, tasks=tasks, limit=limit, log_samples=True,
                                      apply_chat_template=api == "chat", task_manager=TaskManager(
                                          include_path=[str(p) for p in include] or None),
                                      bootstrap_iters=BOOTSTRAP, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                      fewshot_random_seed=0)
    except NotImplementedError as e:  # a chat client asked for log-likelihoods
        raise MoetierError(f"--api {api}: lm-eval's {model} cannot run these tasks ({e or 'log-likelihoods'}); "
                           "use --api completions, or only generation tasks") from None
    seconds = time.perf_counter() - start
    return EvalRun(label, url, name, seconds, {name_of(t): summarise(out, name_of(t), tokenizer) for t in tasks})


def summarise(out: dict, task: str, tokenizer: Path) -> TaskResult:
    """lm-eval's results and samples of one task. A metric under a filter other than "none" is named
    `metric (filter)` (GSM8K's strict-match and flexible-extract); outputs and log-likelihoods are the
    raw responses (before filters), once per document."""
    cfg, res = out["configs"][task], out["results"][task]
    by_filter: dict[str, list[dict]] = {}
    for s in out["samples"][task]:
        by_filter.setdefault(s.get("filter", "none"), []).append(s)
    docs = sorted(next(iter(by_filter.values()), []), key=lambda s: s["doc_id"])
    r = TaskResult(cfg["output_type"], len(docs))
    names = {m["metric"] for m in cfg.get("metric_list", [])}
    for key, value in res.items():
        metric, _, filt = key.partition(",")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or metric.removesuffix("_stderr") not in names:
            continue  # the alias, an "N/A" error
        name = metric.removesuffix("_stderr") + ("" if filt in ("none", "") else f" ({filt})")
        (r.stderr if metric.endswith("_stderr") else r.metrics)[name] = float(value)
    for filt, samples in by_filter.items():
        samples = sorted(samples, key=lambda s: s["doc_id"])
        for m in names:
            values = [s.get(m) for s in samples]
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                r.per_doc[m + ("" if filt == "none" else f" ({filt})")] = [float(v) for v in values]
    for s in docs:
        _walk(s["resps"], r)
    if r.lls:
        from moetier.tokenizer import Tokenizer

        tok = Tokenizer.from_dir(tokenizer)
        r.ll_tokens = [scored_tokens(tok, args) for s in docs for args in s["arguments"]]
    if r.output_type == "loglikelihood_rolling":
        r.tokens = sum(r.ll_tokens)
        r.metrics["nats_per_token"] = -sum(r.lls) / r.tokens if r.tokens else math.nan
    return r


def scored_tokens(tok, args: tuple) -> int:
    """Tokens one request scores: a rolling document's all; a continuation's, counted as lm-eval splits
    it (the context's trailing whitespace moves to the continuation, the pair is tokenized whole)."""
    if len(args) == 1 or not isinstance(args[1], str):
        return len(tok.encode(args[0]))
    ctx, cont = args[0], args[1]
    context = len(tok.encode(ctx.rstrip())) if ctx.rstrip() else 0
    return max(1, len(tok.encode(ctx + cont)) - context)


def _walk(resp, r: TaskResult) -> None:
    """Greedy generations (strings) and log-likelihoods (floats) of one document, in order; the
    is-greedy flags lm-eval keeps beside log-likelihoods are booleans and skipped."""
    if isinstance(resp, str):
        r.outputs.append(resp)
    elif isinstance(resp, bool):
        return
    elif isinstance(resp, (int, float)):
        r.lls.append(float(resp))
    elif isinstance(resp, (list, tuple)):
        for x in resp:
            _walk(x, r)
