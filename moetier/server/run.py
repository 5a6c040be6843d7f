"""`moetier serve`: build the engine (a checkpoint, or random weights of a named shape for
benchmarks), then run the app under uvicorn until Ctrl-C.

On Ctrl-C uvicorn stops accepting connections and lets running requests finish (up to
--drain-seconds), then the app's lifespan stops the engine thread.
"""

from __future__ import annotations

import logging
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from moetier.checkpoint.random_bed import RandomModel  # noqa: F401 -- the --preset record (re-exported)
from moetier.errors import MoetierError


@dataclass
class EngineSpec:
    model: Path | None = None
    random: RandomModel | None = None
    dtype: str = "auto"
    device: str = "auto"
    experts: object = None  # ExpertOptions for a checkpoint
    engine: dict = field(default_factory=dict)  # EngineConfig fields (tensor/expert_parallel_size among them)
    gpu_memory: str | None = None  # --gpu-memory / --host-memory: the budgets preflight plans against
    host_memory: str | None = None


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def build_llm(spec: EngineSpec):
    """The LLM, and the name it is served under. Both paths make the memory plan first (moetier/plan),
    print it, and refuse before allocating anything when it does not fit; a checkpoint's load is
    audited against it on CUDA."""
    from moetier.engine.config import EngineConfig
    from moetier.engine.llm import LLM, pick_device
    from moetier.plan.preflight import place, request_for
    from moetier.plan.render import table

    device = pick_device(spec.device)
    config = EngineConfig.of(**spec.engine)

    def on_plan(plan, rank_plans) -> None:
        _log(table(plan) if rank_plans is None else f"one rank's share of {config.world_size}:\n{table(plan)}")

    if spec.random is None:
        from moetier.engine.startup import plan_then_load

        llm, _ = plan_then_load(spec.model, spec.dtype, device, EngineConfig.of(config, experts=spec.experts),
                                spec.gpu_memory, spec.host_memory, on_plan=on_plan, on_audit=_log)
        return llm, llm.model_dir.name
    import torch

    from moetier.checkpoint.random_bed import quantized
    from moetier.presets import preset as make_preset

    r = spec.random
    dtype = {"auto": "bfloat16", "bf16": "bfloat16"}.get(spec.dtype, spec.dtype)
    cfg = quantized(make_preset(r.preset, r.layers, dtype), r.quant)  # the plan counts the rows it will make
    req = request_for(cfg, getattr(torch, dtype), device, config, spec.gpu_memory, spec.host_memory)
    name = f"{r.preset}-random" + (f"-{r.layers}l" if r.layers else "")
    # the bed's own placement (from_random makes it again from r): planned, refused if one process
    # cannot hold it; several ranks: one rank's share, every node checked once the ranks have started
    plan, _, rank_plans = place(req, EngineConfig.of(config, experts=r.options(cfg, config.layout())),
                                spec.gpu_memory, spec.host_memory)
    on_plan(plan, rank_plans)
    if config.max_num_tokens is None and rank_plans is None:  # the chunk the plan chose and counted
        config = EngineConfig.of(config, max_num_tokens=plan.request["max_num_tokens"])
    return LLM.from_random(r, dtype, device, config, rank_plans=rank_plans), name


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so a taken port fails at once."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise MoetierError(f"cannot listen on {host}:{port} ({e.strerror or e}); choose another --port or --host") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def serve(spec: EngineSpec, host: str, port: int, api_key: str | None, max_queue: int, drain_s: float,
          name: str | None = None, parsers=None) -> None:
    """parsers: the server's Parsers (server/parsers.py), None for the model family's defaults."""
    import uvicorn

    from moetier.engine.async_llm import AsyncLLM
    from moetier.server.app import build_app
    from moetier.server.parsers import Parsers

    sock = bind(host, port)
    log = logging.getLogger("moetier.server")  # request lines (aborts, internal errors), one each, on stderr
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("moetier serve: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    start = time.perf_counter()
    _log(f"moetier serve: planning {spec.model or (spec.random and spec.random.preset) or 'the default model'} ...")
    llm, default_name = build_llm(spec)
    m = llm.metrics()
    print(f"moetier serve: loaded in {time.perf_counter() - start:.1f} s on {llm.model.device}; "
          f"{m['kv_pages_total']} KV pages of {llm.config.page_size} tokens, context "
          f"{llm.scheduler.max_model_len} tokens, up to {llm.config.max_num_seqs} requests at once",
          file=sys.stderr, flush=True)
    app = build_app(AsyncLLM(llm), name or default_name, api_key=api_key, max_queue=max_queue,
                    parsers=parsers or Parsers())
    bound = sock.getsockname()
    print(f"moetier serve: http://{bound[0]}:{bound[1]}/v1 (model {name or default_name!r}"
          f"{', API key required' if api_key else ''}); Ctrl-C drains and exits", file=sys.stderr, flush=True)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=drain_s, access_log=False)
    try:
        # uvicorn drains on the first Ctrl-C, then raises the signal again for the caller to see.
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        llm.close()
    print("moetier serve: stopped", file=sys.stderr, flush=True)
