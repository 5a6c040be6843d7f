"""Helpers the tests share that the product does not need."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile

import torch

from moetier.layers.attention import make_batch
from moetier.models.base import CausalLM


class Sequence:
    """One sequence over a KV cache of its own, for tests and scripts; the engine pages requests."""

    def __init__(self, model: CausalLM, max_len: int, page_size: int = 16):
        self.model = model
        self.kv = model.kv_spec().allocate(math.ceil(max_len / page_size), page_size, model.dtype, model.device)
        self.pages = list(range(self.kv.num_pages))
        self.length = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] continuing the sequence -> last hidden states [T, H]."""
        n = input_ids.shape[0]
        if self.length + n > self.kv.num_pages * self.kv.page_size:
            raise ValueError(f"the sequence would hold {self.length + n} tokens, more than its cache")
        batch = make_batch([(self.length, n, self.pages)], self.kv.page_size, self.model.device)
        hidden = self.model.forward(input_ids.to(self.model.device), batch, self.kv)
        self.length += n
        return hidden


def tiny_hybrid_bench(tmp_path, threads: int, **args) -> dict:
    """`bench decode`'s hybrid rows on the CPU: the tiny preset, a uniform trace and a host profile of
    `threads` threads, run with `args` over the defaults -> the run's record."""
    import json

    from moetier.bench import decode
    from moetier.checkpoint.random_bed import random_bed
    from moetier.presets import preset
    from moetier.traces.format import write_trace
    from moetier.traces.synth import SynthParams, meta_of, synthesize

    cfg = preset("tiny")
    trace = tmp_path / "uniform.mtrace"
    p = SynthParams(experts=cfg.num_experts, top_k=cfg.top_k, layers=cfg.num_layers, tokens=256, skew=0.0, seed=1)
    write_trace(trace, synthesize(p), meta_of(p))
    profile = tmp_path / "cpu.json"
    profile.write_text(json.dumps({"shape": {"dtype": "fp32"}, "winner": {"kernel": "grouped", "threads": threads,
                                   "GBps": 10.0, "overhead_s": 0.0}, "results": []}))
    bed = random_bed(cfg, seed=1, device="cpu", dtype=torch.float32)
    batch = args.pop("batch")
    run = {"hf_tokens": 2, "policy": "lfru", "decode_tokens": 16, "seed": 0, "host_profile": str(profile), **args}
    return decode.run(cfg, str(trace), [0.5], [batch], ["hybrid"], run, bed=bed, bw={"hbm_GBps": 100.0, "link_GBps": 10.0})


def batch_and_alone(llm, prompts, params) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy token ids of the prompts generated together, and of each generated alone."""
    batch = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return batch, [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]


@contextlib.contextmanager
def ieee_fp32_dots(*packages: str):
    """Inside: Triton compiles float32 `tl.dot`s that name no precision in IEEE float32, not TF32 (the
    TRITON_F32_DEFAULT setting, which Triton's on-disk kernel cache keys by). Its in-memory cache does
    not key by it, so the kernels of `packages` (module prefixes, e.g. "fla") already compiled are
    dropped on entry and again on exit; they compile again as they are next called. For tests that hold
    a library's float32 kernels (fla's chunked KDA) to the CPU reference's float32 bounds.

    Inside, each of their autotuners (imported by then) also tries one config, not its list: an IEEE
    float32 dot compiles to unrolled FMAs, many times slower to build than a TF32 one, and fla's kernels
    autotune over 6 to 18 configs each (compiling them all made the slowest GPU test). The
    bounds hold for any config; the one kept has the fewest stages and the smallest blocks (the least
    shared memory). Their lists and tuned choices come back on exit."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    def chain(obj):  # an object, then through autotuners and heuristics to the JIT function
        for _ in range(4):
            yield obj
            if obj is None or isinstance(obj, JITFunction):
                return
            try:
                obj = getattr(obj, "fn", None)
            except Exception:  # a lazy namespace's attribute
                return

    def kernels():
        for name, module in list(sys.modules.items()):
            if module is not None and name.startswith(packages):
                yield from list(vars(module).values())

    def drop() -> int:
        n = 0
        for obj in kernels():
            for o in chain(obj):
                if isinstance(o, JITFunction) and getattr(o, "device_caches", None) is not None:
                    o.device_caches.clear()
                    n += 1
        return n

    def one_config(c) -> tuple:
        return (c.num_stages, sum(v for v in c.kwargs.values() if isinstance(v, int)), -c.num_warps)


    from triton._C.libtriton import get_cache_invalidating_env_vars

    saved = {k: os.environ.get(k) for k in ("TRITON_F32_DEFAULT", "TRITON_CACHE_DIR")}
    os.environ["TRITON_F32_DEFAULT"] = "ieee"
    scratch = None
    if "TRITON_F32_DEFAULT" not in get_cache_invalidating_env_vars():  # a Triton whose disk cache ignores it
        scratch = tempfile.TemporaryDirectory()
        os.environ["TRITON_CACHE_DIR"] = scratch.name
    drop()
    narrowed = {}  # id -> (autotuner, its configs, its tuned choices)
    for obj in kernels():
        for o in chain(obj):
            if isinstance(o, Autotuner) and id(o) not in narrowed and len(o.configs) > 1:
                narrowed[id(o)] = (o, o.configs, dict(o.cache))
                o.configs = [min(o.configs, key=one_config)]
                o.cache.clear()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if scratch is not None:
            scratch.cleanup()
        for o, configs, cache in narrowed.values():
            o.configs = configs
            o.cache.clear()
            o.cache.update(cache)
        assert drop() > 0, f"no Triton kernels of {packages} were loaded: the setting held nothing"

