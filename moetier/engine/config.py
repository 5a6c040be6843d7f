"""The engine's configuration: one typed record instead of loose keyword arguments.

NOTE: decode_tokens is the one decode-step limit: the scheduler's steps of at most this many tokens
are decode steps, which the CUDA graphs capture (batch sizes up to it) and the expert backends serve
through the slot cache (larger steps, prefill, bypass it). Both receive it from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from moetier.config import DENSE_WEIGHTS
from moetier.errors import MoetierError
from moetier.experts.placement import ExpertOptions
from moetier.parallel import Parallel, layout_problems
from moetier.spec.config import SpeculativeConfig, speculative_config_of

STEP_RECORD_GROUPS = ("world", "gloo", "pipe")  # EngineConfig.step_record_group; `--step-record-group`


@dataclass
class EngineConfig:
    max_num_seqs: int = 64  # requests running at once
    # Tokens computed in one step (prefill chunks share it with decodes). None: chosen from the memory
    # plan (plan/chunk.py: 2048 with every expert in HBM, up to 8192 with experts off the GPU); the
    # engine resolves it when it is built (LLM.config holds the number, LLM.chunk_reason why).
    max_num_tokens: int | None = None
    kv_tokens: int = 32768  # tokens the KV pool holds, over all requests
    page_size: int = 16  # tokens per KV page (a power of two)
    max_model_len: int | None = None  # prompt + output per request; default the model's, capped by the pool
    decode_tokens: int = 64  # steps of up to this many tokens: CUDA graphs and the expert cache
    # CUDA graphs of the decode step (False: every step eager). With hybrid backends the engine captures
    # their host path's graph (the nodes graph, or the pieces of engine/piecewise.py where a backend
    # cannot be captured) and the whole step on the slots path, and replays, step by step, whichever the
    # recent misses say is faster (engine/switch.Switch).
    cuda_graphs: bool = True
    # Overlapped scheduling (engine/overlap.py, docs/engine.md): while the GPU runs decode step N, the
    # host schedules and launches step N+1, its input ids taken on the device from step N's samples, and
    # only then reads step N's tokens back. vLLM's name (--async-scheduling). Off until measured on a GPU.
    async_scheduling: bool = False
    record_trace: str | Path | None = None  # write the routing of this run (docs/traces.md)
    replay_trace: str | Path | None = None  # route by this trace instead of the router
    trace_meta: dict[str, Any] = field(default_factory=dict)
    # Several processes (docs/parallel.md): attention and dense layers split over tensor_parallel_size
    # ranks, routed experts over expert_parallel_size ranks; world = the larger (step 1: each is 1 or
    # the world). A collective that waits longer than dist_timeout_s fails the engine (it also bounds
    # how long rank 0 waits for the workers to load).
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    dist_timeout_s: float = 600.0
    # Who starts ranks 1..N-1: "mp" spawns them on this machine (rank r on cuda:r), "ray" places one
    # Ray actor per GPU (or CPU rank) on a Ray cluster, any node (dist/ray_executor.py; pip install
    # 'moetier[ray]'). Rank 0 is this process either way.
    distributed_executor: str = "mp"
    # Which channel carries each step's record from rank 0 to the workers (dist/channel.py):
    # "world" (the collectives' group: NCCL on GPUs, so the record goes through device memory and host
    # reads), "gloo" (a second group over host sockets: the record never touches a GPU) or "pipe" (one
    # OS pipe per worker, rank 0 writes the pickled record to each; the mp executor only: one node).
    step_record_group: str = "world"
    # A quantized checkpoint's dense projections (attention, dense MLPs, shared experts): "dequantize"
    # to the model dtype at load, or "keep" in the checkpoint's format (FP8 blocks, 4-bit codes) and run
    # by layers/quant_linear.py (docs/fp8.md, docs/quant4.md say which weights fall back). "dequantize"
    # measured faster for FP8 on the H200; "keep" is for when HBM, not speed, is short.
    dense_weights: str = "dequantize"
    # Speculative decoding (--speculative-config, spec/config.py; docs/speculative.md): None is off; the
    # JSON text or dict vLLM takes is parsed into the record. Method "mtp" loads the checkpoint's MTP
    # layers (the plan counts their experts and KV); n-gram verify steps replay their own CUDA graphs where
    # they fit (engine/verify_graphs.py), the rest run eagerly.
    speculative_config: SpeculativeConfig | None = None
    # Automatic prefix caching (engine/prefix_cache.py, docs/prefix-cache.md): full KV pages keyed by a
    # hash chain of their tokens, shared between requests, the free ones kept until evicted LRU; a prompt
    # whose leading pages are cached skips their prefill. vLLM's name and default (on).
    enable_prefix_caching: bool = True
    # Bytes of pinned host memory for the host KV tier: GPU pages the prefix cache evicts are copied there
    # instead of dropped, and a later hit brings them back by the copy engine. 0 (the default): no host
    # tier, because the host memory belongs to the expert store first; the memory plan counts it.
    kv_host_bytes: int = 0
    # Where the routed experts live and how they are cached (experts/placement.py; --expert-backend,
    # --expert-slots, ...: cli/options.EXPERT_FIELDS): the memory plan chooses for backend "auto"
    # (plan/preflight.py returns the config with its choice), the loader builds what this says.
    experts: ExpertOptions = field(default_factory=ExpertOptions)

    @classmethod
    def of(cls, config: EngineConfig | None = None, **options: Any) -> EngineConfig:
        """A config from another with some fields replaced; unknown names are one clear error."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise MoetierError(f"unknown engine option(s) {', '.join(unknown)}; the options are: "
                               f"{', '.join(sorted(names))}")
        base = {f.name: getattr(config, f.name) for f in fields(cls)} if config else {}
        return cls(**{**base, **options}).validate()

    def problems(self) -> list[str]:
        out = []
        for name in ("max_num_seqs", "max_num_tokens", "kv_tokens", "decode_tokens"):
            v = getattr(self, name)
            if v is None and name == "max_num_tokens":
                continue  # automatic
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                out.append(f"{name} must be a positive integer, got {v!r}")
        p = self.page_size
        if not isinstance(p, int) or p < 1 or p & (p - 1):
            out.append(f"page_size must be a power of two, got {p!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            out.append(f"max_model_len must be an integer of at least 2 (a prompt token and an output token), "
                       f"got {self.max_model_len!r}")
        tp, ep = self.tensor_parallel_size, self.expert_parallel_size
        if all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (tp, ep)):
            out += layout_problems(max(tp, ep), tp, ep)
        else:
            out.append(f"tensor_parallel_size and expert_parallel_size must be positive integers, got {tp!r}, {ep!r}")
        if self.step_record_group not in STEP_RECORD_GROUPS:
            out.append(f"step_record_group must be world, gloo or pipe, got {self.step_record_group!r}")
        elif self.step_record_group == "pipe" and self.distributed_executor == "ray":
            out.append("step_record_group pipe needs the mp executor (its pipes join processes of one node; "
                       "Ray actors may be on other nodes): use world or gloo with ray")
        if self.distributed_executor not in ("mp", "ray"):
            out.append(f"distributed_executor must be mp or ray, got {self.distributed_executor!r}")
        if self.dense_weights not in DENSE_WEIGHTS:
            out.append(f"dense_weights must be \"dequantize\" or \"keep\", got {self.dense_weights!r}")
        spec = self.speculative_config
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            out.append("speculative_config must be a spec.config.SpeculativeConfig (parse_speculative_config "
                       f"makes one from JSON), got {type(spec).__name__}")
        if not isinstance(self.experts, ExpertOptions):
            out.append(f"experts must be an ExpertOptions (experts/placement.py), got {type(self.experts).__name__}")
        if not isinstance(self.async_scheduling, bool):
            out.append(f"async_scheduling must be True or False, got {self.async_scheduling!r}")
        elif self.async_scheduling and self.world_size > 1:
            out.append("async_scheduling with several ranks is not supported yet: the workers follow rank 0's "
                       "step records one at a time; run one process, or leave async_scheduling off")
        if not isinstance(self.enable_prefix_caching, bool):
            out.append(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        if not isinstance(self.kv_host_bytes, int) or isinstance(self.kv_host_bytes, bool) or self.kv_host_bytes < 0:
            out.append(f"kv_host_bytes must be a non-negative integer of bytes, got {self.kv_host_bytes!r}")
        elif self.kv_host_bytes and not self.enable_prefix_caching:
            out.append("kv_host_bytes (--kv-host-memory) holds evicted prefix pages: it needs prefix caching on")
        elif self.kv_host_bytes and self.world_size > 1:
            out.append("kv_host_bytes (--kv-host-memory) with several ranks is not supported yet: run one "
                       "process, or keep the prefix cache on the GPU alone (--kv-host-memory 0)")
        if not isinstance(self.dist_timeout_s, (int, float)) or self.dist_timeout_s <= 0:
            out.append(f"dist_timeout_s must be a positive number of seconds, got {self.dist_timeout_s!r}")
        return out

    def __post_init__(self):
        # vLLM's Python API takes the JSON text or a dict: parsed here, one line per problem
        self.speculative_config = speculative_config_of(self.speculative_config)

    @property
    def drafts_with_mtp(self) -> bool:
        """Speculative method mtp: the checkpoint's MTP layers are loaded and draft."""
        return self.speculative_config is not None and self.speculative_config.method == "mtp"

    @property
    def world_size(self) -> int:
        return max(self.tensor_parallel_size, self.expert_parallel_size)

    def layout(self, rank: int = 0) -> Parallel:
        """Rank `rank`'s parallel layout: where --tp and --ep become the record every rank builds by
        (the plan's share, the ranks' process group, the model's splits)."""
        return Parallel.of(self.tensor_parallel_size, self.expert_parallel_size, rank)

    def validate(self) -> EngineConfig:
        problems = self.problems()
        if problems:
            raise MoetierError("invalid engine configuration: " + "; ".join(problems))
        return self

    @property
    def num_pages(self) -> int:
        return math.ceil(self.kv_tokens / self.page_size)

    def model_len(self, model_max: int) -> int:
        """The longest request: the model's limit, max_model_len and the pool, whichever is least."""
        return min(self.max_model_len or model_max, model_max, self.num_pages * self.page_size)
