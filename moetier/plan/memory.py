"""The memory plan: every resident of a run on the device and on the host, with totals and headroom,
from a config and the engine's settings, before anything is allocated.

    req = PlanRequest(cfg, dtype, "cuda", backend="slots", slots_per_layer={...}, max_model_len=..., ...)
    plan = count(req)          # backend and slots as given; sizing.py chooses them automatically
    plan.device_total, plan.host_total, plan.fits()

Each item carries the stage at which it exists, so the audit (audit.py) compares what is measured
after loading and after graph capture with what the plan says should be there by then:
    load     weights, expert rows and the backends' scratch (built by the loader)
    capture  KV pages, graph inputs, decode outputs, the graph pool, the capture streams' cuBLAS
             workspaces
    runtime  room kept free for the largest eager step (prefill) and the sampler
    fixed    the CUDA context and the allocator's rounding
    driver   device memory outside torch that arrives by capture: loaded kernels, graph executables
    host, host-capture   host residents from the start, and those the first steps and capture add
"""

from __future__ import annotations

import mmap
from dataclasses import asdict, dataclass, field

import torch

from moetier.config import ModelConfig
from moetier.experts.prefill.ring import RING_DEPTH, RING_GROUP
from moetier.experts.registry import Resident, backend_kind
from moetier.layers.kv_cache import KVSpec
from moetier.plan import residents as r
from moetier.plan.units import GiB, gib, round_up

HOST_MARGIN_SHARE, HOST_MARGIN_MIN = 0.05, 4 * GiB  # keep this much of available host memory free


@dataclass
class PlanRequest:
    cfg: ModelConfig
    dtype: torch.dtype
    device: str = "cuda"  # "cuda" or "cpu" (everything then lives in host memory)
    backend: str = Resident.name  # experts/registry's names (sizing.auto_plan chooses for "auto")
    slots_per_layer: dict[int, int] = field(default_factory=dict)  # slots backend: every MoE layer
    # slots, hybrid: experts per MoE layer pinned on the GPU, with no host copy (experts/cache/split.py)
    pinned_per_layer: dict[int, int] = field(default_factory=dict)
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 1
    kv_tokens: int | None = None  # default: max_num_seqs full-length requests
    page_size: int = 16
    max_num_tokens: int | None = 512  # None: chosen from the plan (chunk.py, through preflight.plan_for)
    decode_tokens: int = 64
    cuda_graphs: bool = True
    gpu_budget: int | None = None  # bytes this run may use on the device (None: unknown)
    gpu_source: str = ""
    context_in_budget: bool = True  # False when the budget was read after our context existed
    host_available: int | None = None
    host_source: str = ""
    memlock: int | None = None  # RLIMIT_MEMLOCK in bytes; None: unlimited or not enforced
    page: int = mmap.PAGESIZE
    # slots / hybrid prefill: how a bypass step's misses reach the GEMM (experts/prefill/ring.py), and
    # the ring's (G rows per buffer, D buffers) in the ring mode
    prefill_stream: str = "ring"
    ring: tuple[int, int] = (RING_GROUP, RING_DEPTH)
    # the "columns" expert split (experts/parallel/columns.py): each rank's expert rows hold I / expert_columns
    expert_columns: int = 1
    # prefix caching (engine/prefix_cache.py): state checkpoints of linear-attention models on the device,
    # and the host KV tier's pinned bytes (--kv-host-memory; whole pages of the pool are kept)
    prefix_caching: bool = True
    kv_host_bytes: int = 0
    # speculative decoding (0: off): the most drafts a sequence verifies per step. A verify step's logits
    # cover every sequence's last token and its drafts; linear-attention models keep a state backup per
    # running sequence (engine/kv_setup.num_backups); MTP drafting keeps the distributions sampled
    # requests drew their drafts from until the next step (draft_distributions: engine/spec_step.py)
    draft_tokens: int = 0
    draft_distributions: bool = False

    @property
    def model_len(self) -> int:
        return min(self.max_model_len or self.cfg.max_position_embeddings, self.cfg.max_position_embeddings)

    @property
    def pool_tokens(self) -> int:
        """Tokens the KV pool holds, in whole pages (kv_pool_tokens)."""
        return kv_pool_tokens(self.max_num_seqs, self.model_len, self.page_size, self.kv_tokens)

    @property
    def graph_sizes(self) -> list[int]:
        """The batch sizes the engine captures (residents.captured_sizes)."""
        if not (self.cuda_graphs and self.device == "cuda"):
            return []
        return r.captured_sizes(self.max_num_seqs, self.decode_tokens)


def kv_pool_tokens(max_num_seqs: int, model_len: int, page_size: int, kv_tokens: int | None = None) -> int:
    """The one KV-sizing rule, for the plan and every command: the tokens the pool holds, in whole
    pages: kv_tokens when given (serve's --kv-tokens), else max_num_seqs requests that each reach
    model_len tokens."""
    if kv_tokens:
        return round_up(kv_tokens, page_size)
    return max_num_seqs * round_up(model_len, page_size)


@dataclass
class Item:
    name: str
    bytes: int
    stage: str  # load, capture, runtime, fixed, driver (device, outside torch), host, host-capture
    note: str = ""
    allocated: int = 0  # what torch's memory_allocated counts for it (block-rounded); 0: not a tensor


@dataclass
class Plan:
    request: dict
    backend: str
    slots_per_layer: dict[int, int]
    device: list[Item]
    host: list[Item]
    gpu_budget: int | None
    host_available: int | None
    pinned: int
    memlock: int | None
    row_bytes: int
    expert_bytes: int  # all routed experts of all MoE layers
    notes: list[str] = field(default_factory=list)
    pinned_per_layer: dict[int, int] = field(default_factory=dict)  # experts pinned on the GPU, by layer
    pinned_experts: dict[int, list[int]] = field(default_factory=dict)  # which (global ids), when chosen
    prediction: dict | None = None  # with a trace: hit rate and tok/s (sizing.py)
    chunk: dict | None = None  # an automatic prefill chunk: tokens, reason (chunk.py); None: as given

    @property
    def device_total(self) -> int:
        return sum(i.bytes for i in self.device)

    @property
    def host_total(self) -> int:
        return sum(i.bytes for i in self.host)

    @property
    def host_margin(self) -> int:
        return max(HOST_MARGIN_MIN, int(HOST_MARGIN_SHARE * (self.host_available or 0)))

    def stage_allocated(self, *stages: str) -> int:
        return sum(i.allocated for i in self.device if i.stage in stages)

    def problems(self) -> list[str]:
        """Why this plan cannot run, one line each (empty: it fits)."""
        from moetier.plan.units import both

        out = []
        if self.gpu_budget is not None and self.device_total > self.gpu_budget:
            out.append(f"the device needs {both(self.device_total)} but has {both(self.gpu_budget)} "
                       f"({both(self.device_total - self.gpu_budget)} short)")
        if self.host_available is not None and self.host_total > self.host_available - self.host_margin:
            out.append(f"the host needs {both(self.host_total)} and must keep {both(self.host_margin)} free, "
                       f"but has {both(self.host_available)} available")
        if self.memlock is not None and self.pinned > self.memlock:
            out.append(f"pinning {both(self.pinned)} passes the locked-memory limit of {both(self.memlock)} "
                       f"(ulimit -l); raise it to at least {self.pinned // 1024 + 1} KiB or unlimited")
        return out

    def fits(self) -> bool:
        return not self.problems()

    def as_dict(self) -> dict:
        d = asdict(self)
        d["slots_per_layer"] = {str(k): v for k, v in self.slots_per_layer.items()}
        d["pinned_per_layer"] = {str(k): v for k, v in self.pinned_per_layer.items()}
        d["pinned_experts"] = {str(k): v for k, v in self.pinned_experts.items()}
        d.update(device_total=self.device_total, host_total=self.host_total, host_margin=self.host_margin,
                 device_headroom=None if self.gpu_budget is None else self.gpu_budget - self.device_total,
                 host_headroom=None if self.host_available is None else self.host_available - self.host_total,
                 units="bytes", fits=self.fits(), problems=self.problems())
        return d


def _item(name: str, stage: str, tensors: list[int], note: str = "") -> Item:
    return Item(name, sum(r.block(n) for n in tensors), stage, note, sum(r.block(n) for n in tensors))


def count(req: PlanRequest) -> Plan:
    """The plan for the request's backend and slots, as given."""
    cfg, dt, cuda = req.cfg, req.dtype, req.device == "cuda"
    shape, layers = cfg.moe_shape, cfg.moe_layers
    if req.expert_columns > 1:  # one tensor-parallel rank's columns of every expert
        from moetier.experts.parallel.columns import local_shape

        shape = local_shape(shape, "columns", req.expert_columns)
    row = r.row_bytes(shape, dt)
    e, p = shape.num_experts, req.decode_tokens * shape.top_k
    backend, kind = req.backend, backend_kind(req.backend)
    slots = {layer: req.slots_per_layer.get(layer, 0) for layer in layers} if kind.cached else {}
    pins = {layer: req.pinned_per_layer.get(layer, 0) for layer in layers} if kind.cached else {}
    pins = {layer: n for layer, n in pins.items() if n}
    dense = r.dense_weights(cfg, dt)
    dev: list[Item] = []
    tensors: list[int] = list(dense.tensors)  # every device tensor, for the allocator's rounding
    dev.append(Item("dense: embedding + LM head", dense.embedding_and_head, "load",
                    "tied: one copy" if cfg.tie_word_embeddings else "", r.block(dense.embedding_and_head)))
    what = "attention, norms, routers, dense MLPs, shared experts"
    dev.append(Item("dense: decoder layers", dense.layers, "load",
                    what + (f" ({cfg.dense_quant} projections kept: weights + scales)" if cfg.dense_quant else ""),
                    sum(r.block(n) for n in dense.tensors) - r.block(dense.embedding_and_head)))
    if not kind.host_store:
        rows = [kind.device_rows(e, 0) * row] * len(layers)
        note = f"{len(layers)} layers x {e} experts x {row:,} B rows (scales in the row)"
    elif kind.cached:  # one block [S + P, R] a layer: its slots, then its pinned experts
        rows = [(kind.device_rows(e, slots[layer]) + pins.get(layer, 0)) * row for layer in layers]
        note = (f"{sum(slots.values())} slots over {len(layers)} layers "
                f"({min(slots.values(), default=0)}..{max(slots.values(), default=0)} per layer) x {row:,} B rows")
    else:
        rows, note = [], "none on the device: every expert read from pinned host memory"
    if pins:
        held = sum(pins.values()) * row
        dev.append(Item("routed experts pinned on the GPU", held, "load",
                        f"{sum(pins.values())} experts ({min(pins.values())}..{max(pins.values())} in the "
                        f"{len(pins)} layers that pin) x {row:,} B rows: always hits, no host copy", held))
        whole = _item("", "load", rows)
        dev.append(Item("expert slots (weights + scales)", whole.bytes - held, "load", note, whole.allocated - held))
    else:
        dev.append(_item("routed experts (weights + scales)", "load", rows, note))
    tensors += rows
    if cuda:
        scratch = r.gemm_scratch(p, shape.hidden, shape.inter)
        state = [n for layer in layers
                 for n in kind.layer_state(shape, dt, req.decode_tokens, slots.get(layer, 0), pins.get(layer, 0))]
        if kind.host_compute:  # the pieces' pair outputs and the nodes mode's buffers, one set per model
            # NOTE: both counted: the plan does not know which mode the backend builds (registry.nodes_by_default)
            state += r.hybrid_piece_buffers(req.decode_tokens, shape.top_k, shape.hidden)
            state += r.hybrid_node_buffers(req.decode_tokens, shape.top_k, shape.hidden, shape.num_experts)
        dev.append(_item("expert workspaces", "load", scratch + state,
                         f"GEMM scratch, slot maps, miss lists: {p} pairs per step"))
        if kind.host_compute:  # an eager layer of the pieces: counted whichever mode runs, as above
            gathered = r.hybrid_piece_transients(req.decode_tokens, shape.top_k, shape.hidden, dt.itemsize)
            dev.append(Item("hybrid pieces' layer transients", r.segments(gathered), "load",
                            f"{p} pairs' gathered rows and outputs, one layer at a time",
                            sum(r.block(n) for n in gathered)))
        outs = [req.decode_tokens * shape.hidden * dt.itemsize] * len(layers)
        dev.append(_item("expert decode outputs", "capture", outs, f"[{req.decode_tokens}, {shape.hidden}] per layer"))
        tensors += scratch + state + outs
    kv_spec_bytes = _kv_bytes_per_token(cfg, dt)
    kv_pages = req.pool_tokens // req.page_size + 1  # engine/llm.py: one scratch page for graph padding
    kv = [kv_spec_bytes * kv_pages * req.page_size // 2] * 2  # k and v, one tensor each
    dev.append(_item("KV pages", "capture", kv,
                     f"{req.pool_tokens:,} tokens + 1 page, {kv_spec_bytes:,} B/token"))
    tensors += kv
    spec = _kv_spec(cfg)
    if spec.state_bytes_per_seq(dt):  # linear-attention layers: a state slot per running sequence
        st = spec.state.tensor_bytes(dt, req.max_num_seqs + 1)  # engine/llm.py: one spare, as the spare page
        dev.append(_item("KDA state slots", "capture", st,
                         f"{req.max_num_seqs} sequences + 1, {spec.state_bytes_per_seq(dt):,} B/sequence"))
        tensors += st
        if req.prefix_caching:  # engine/kv_setup.num_checkpoints: one per running sequence
            ck = spec.state.tensor_bytes(dt, req.max_num_seqs)
            dev.append(_item("KDA state checkpoints", "capture", ck,
                             f"{req.max_num_seqs} prefix-cache checkpoints at page boundaries"))
            tensors += ck
        if req.draft_tokens:  # engine/kv_setup.num_backups: one per running sequence
            bk = spec.state.tensor_bytes(dt, req.max_num_seqs)
            dev.append(_item("KDA state backups", "capture", bk,
                             f"{req.max_num_seqs} states saved before a verify step, restored on a rejection"))
            tensors += bk
    sizes = req.graph_sizes
    width = -(-req.model_len // req.page_size)
    verify = []
    if sizes:
        b = sizes[-1]
        gin = r.graph_inputs(b, width)
        dev.append(_item("decode graph inputs", "capture", gin, f"batch {b}, {width} pages per sequence"))
        selection = cfg.decode_selection_activations(b, width * req.page_size, dt)
        # each context bucket keeps its own logits and sampled tokens per size (engine/graphs.py)
        buckets = len(r.graph_widths(width, req.page_size, bool(selection), kind.host_compute))
        kept = [n * cfg.vocab_size * 4 for n in sizes for _ in range(buckets)]
        kept += [8 * n for n in sizes for _ in range(3 * buckets)]
        if kind.host_compute:  # engine/piecewise.py keeps, per size and MoE layer, hidden and out [n, H]
            kept += [n * cfg.hidden_size * dt.itemsize for n in sizes for _ in layers for _ in range(2)]
        peak = r.step_activations(cfg, b, dt, 0) + selection + [r.sampler_transient(b, cfg.vocab_size)]
        # n-gram speculation's verify graphs, in the same pool (engine/verify_graphs.captures_verify)
        verify = r.verify_shapes(sizes, req.draft_tokens, req.decode_tokens) if req.draft_tokens and not (
            req.draft_distributions or spec.state_bytes_per_seq(dt) or kind.host_compute) else []
        if verify:
            vin, vkept, vpeak = r.verify_graph_parts(cfg, verify, req.draft_tokens, width, dt)
            # the DSA indexer scores every verified row over the whole table (its kernel's [rows, C])
            verified = max(n * q for n, q in verify)  # the largest verify step's rows
            vpeak = vpeak + cfg.decode_selection_activations(verified, width * req.page_size, dt)
            dev.append(_item("verify graph inputs", "capture", vin, f"{len(verify)} (batch, k + 1) shapes"))
            kept, peak, gin = kept + vkept, max(peak, vpeak, key=r.segments), gin + vin
        pool = r.segments(kept) + r.segments(peak)
        dev.append(Item("CUDA graph pool", pool, "capture",
                        f"batch {sizes}: logits fp32 kept" + (f" at {buckets} context buckets" if buckets > 1 else "")
                        + f" + batch-{b} peak"
                        + (f" (indexer scoring {width * req.page_size:,} rows a sequence)" if selection else ""),
                        sum(r.block(n) for n in kept)))
        tensors += gin
    if cuda:
        # NOTE: engine/graphs.py warms every size up on one side stream and torch captures on one more;
        # the default stream's workspace comes with the first eager step
        ws = r.cublas_workspace()
        streams = [ws] * (2 if sizes else 0)
        if streams:
            dev.append(_item("cuBLAS workspaces", "capture", streams, f"{ws // 2**20} MiB per stream: graph "
                             "warm-up, capture"))
        dev.append(_item("cuBLAS workspace (default stream)", "runtime", [ws], "at the first eager step"))
        tensors += streams + [ws]
    rows_eager = min(req.max_num_seqs, req.max_num_tokens)
    if req.draft_tokens:  # a verify step's logits and its sampler's distributions over them (engine/spec_step.py)
        rows_eager = min(req.max_num_seqs * (1 + req.draft_tokens), req.max_num_tokens)
    act = r.step_activations(cfg, req.max_num_tokens, dt, rows_eager) + [r.sampler_transient(rows_eager, cfg.vocab_size)]
    if req.draft_distributions:
        # q [B, K, V] float32 kept from the last step's MTP passes, and the verify's [B, K, V] made of them
        q = req.max_num_seqs * req.draft_tokens * cfg.vocab_size * 4
        dev.append(_item("MTP draft distributions", "runtime", [q],
                         f"{req.max_num_seqs} sequences x {req.draft_tokens} drafts x {cfg.vocab_size:,} float32, "
                         "kept for the next step's verify"))
        act.append(q)
    if kind.host_store:
        act.append(r.prefill_stream(shape, dt))
    if dense.transient:  # kept dense weights: a prefill projection dequantizes its weight first
        act.append(dense.transient)
    if cuda and req.max_num_tokens > req.decode_tokens:  # the step takes the large-step expert GEMM
        act += r.large_step_scratch(req.max_num_tokens, shape, dt,
                                    e + max((slots[la] + pins.get(la, 0) for la in slots), default=0))
        if kind.cached and req.prefill_stream == "ring":
            act += r.ring_step_scratch(req.max_num_tokens, shape)
            ring = r.staging_ring(shape, dt, *req.ring)
            dev.append(Item("prefill staging ring", ring, "runtime",
                            f"{req.ring[1]} buffers x {req.ring[0]} rows x {row:,} B, one for every layer",
                            r.block(ring)))
            tensors.append(ring)
    dev.append(Item("activations at the largest step", r.segments(act), "runtime",
                    f"eager {req.max_num_tokens}-token step, {rows_eager} logit rows"))
    if cuda:
        slack = r.segments(tensors) - sum(r.block(n) for n in tensors)
        dev.append(Item("allocator slack (segment rounding)", slack, "fixed", "2 MiB / 20 MiB segments"))
        dev.append(Item("CUDA context", r.CONTEXT_BYTES if req.context_in_budget else 0, "fixed",
                        "measured on the H200" if req.context_in_budget else
                        "already in use: the budget is free memory"))
        dev.append(Item("CUDA modules and graph executables", r.modules_bytes(cfg.num_layers), "driver",
                        "kernels loaded at first use, outside torch (measured rule)"))
    host: list[Item] = []
    pinned = 0
    if cuda:
        host.append(Item("process baseline", r.HOST_BASELINE_CUDA, "host",
                         "python, torch, CUDA libraries (stated)"))
        host.append(Item("libraries touched at first use", r.HOST_FIRST_USE, "host-capture",
                         "cuBLAS, Triton kernels, graph capture (measured)"))
    else:
        host.append(Item("process baseline", r.HOST_BASELINE_CPU, "host", "python, torch (stated)"))
        host += [Item(f"{i.name} (in host memory)", i.bytes, "host", i.note) for i in dev]
        dev = []
    if kind.host_store:
        requested, allocated = r.store_allocation(len(layers), e, row, req.page, [pins.get(la, 0) for la in layers])
        pinned = allocated if pins and cuda else requested if cuda else 0
        would = sum(r.torch_pinned_would_charge(1, e - pins.get(la, 0), row) for la in layers)
        cached = f"the {len(layers) * e - sum(pins.values())} cached experts' rows, " if pins else ""
        host.append(Item("expert store (exact size)", allocated, "host",
                         f"{cached}{requested:,} B + page rounding; "
                         + (f"pinned exactly (torch would pin {gib(would)})" if cuda else "not pinned (cpu)")))
    host_pages = req.kv_host_bytes // (kv_spec_bytes * req.page_size) if req.prefix_caching else 0
    if host_pages:  # engine/kv_moves.py: one page-aligned block, registered at exact size on CUDA
        nbytes = host_pages * kv_spec_bytes * req.page_size
        pinned += nbytes if cuda else 0
        host.append(Item("KV host tier (exact size)", nbytes + req.page, "host",
                         f"{host_pages:,} pages of {kv_spec_bytes * req.page_size:,} B (evicted prefix pages); "
                         + ("pinned exactly" if cuda else "not pinned (cpu)")))
    if cuda and sizes:
        twins = r.graph_host_inputs(sizes[-1], width) + sum(r.next_pow2(n) for n in (vin[:2] if verify else []))
        host.append(Item("decode graph input twins", twins, "host", "pinned by torch: 2^n"
                         + (", the verify graphs' too" if verify else "")))
    if cuda and kind.host_compute:
        host.append(Item("hybrid host staging", r.hybrid_host_staging(req.decode_tokens, shape.top_k, shape.hidden,
                                                                     shape.inter, dt.itemsize), "host-capture",
                         "hidden states down, host outputs up: pinned by torch (2^n, cached)"))
    biggest = max(dense.tensors + ((row * e // 3 * 2,) if layers else ()), default=0)
    host.append(Item("loader buffer", biggest, "host", "largest tensor read at once"))
    request = {"model_type": cfg.model_type, "layers": cfg.num_layers, "moe_layers": len(layers),
               "dtype": str(dt).replace("torch.", ""), "experts_quant": cfg.quant,  # "fp8": FP8 rows with scales
               "dense_quant": cfg.dense_quant,  # the format dense projections are kept in, with their scales
               "device": req.device, "max_model_len": req.model_len,
               "max_num_seqs": req.max_num_seqs, "kv_tokens": req.pool_tokens, "page_size": req.page_size,
               "prefix_caching": req.prefix_caching, "kv_host_pages": host_pages,
               "max_num_tokens": req.max_num_tokens, "decode_tokens": req.decode_tokens, "graph_sizes": sizes,
               "gpu_budget_source": req.gpu_source, "host_source": req.host_source}
    return Plan(request, backend, slots, dev, host, req.gpu_budget if cuda else None, req.host_available, pinned,
                req.memlock, row, len(layers) * e * row, pinned_per_layer=pins)


def _kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, tp: int = 1) -> int:
    """One rank's KV bytes per token under tensor parallelism tp (GQA: its kv heads; MLA: all of it)."""
    return _kv_spec(cfg, tp).bytes_per_token(dtype)


def _kv_spec(cfg: ModelConfig, tp: int = 1) -> KVSpec:
    from moetier.models.registry import model_class
    from moetier.parallel import Parallel

    return model_class(cfg).kv_spec_of(cfg, Parallel(0, tp, tp, 1) if tp > 1 else Parallel())
