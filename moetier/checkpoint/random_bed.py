"""A model with random weights made in memory, for benchmarks and the server's --preset mode: the
published shapes are larger than the device machine's disk holds as a checkpoint (Qwen3-30B-A3B is
61 GB). Its routed experts sit once in a pinned host store (exact size), and use_backend() rebuilds
every MoE layer's expert backend over that store (resident: a device copy; slots at a budget; uva),
so one model serves every row of a benchmark. loaded_bed() does the same for a checkpoint.

quant="fp8": the routed experts are made as random bf16 and quantized by the block rule
(quant/fp8_block.py) into FP8 rows, as make-checkpoint --dtype fp8 does; the dense weights stay random
bf16 (what an FP8 checkpoint's dense weights become at load: dequantized to the model dtype).

Under a parallel layout (par: moetier/parallel.Parallel; docs/parallel.md) each rank makes its own
share: an expert-parallel rank draws every expert in the same order as one process and keeps the
rows it owns (e % ep == rank), so EP ranks together hold exactly the one-process experts; a
tensor-parallel rank draws its dense shards with the same seed, which are valid shards of *a*
random model but not slices of the one-process one (benchmarks time them; tests of equality use
checkpoints). Under the "columns" expert split (experts/parallel/columns.py) a tensor-parallel rank draws
every expert whole, after its dense shards, and keeps its I/tp columns: the ranks together hold the
experts of the replicated tp share (the same draws), not the one-process experts. RandomModel is the plain record a worker process rebuilds
its share from.
With keep_dense too, the dense projections the model keeps in the format (layers/quant_linear.py:
Fp8Weight, Packed4Weight; the same ones as a checkpoint of that format loaded with dense_weights
"keep") are random bf16 quantized by the format's own rule.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass

import torch

from moetier.config import ModelConfig
from moetier.experts.parallel.columns import local_shape, resolve, slice_rows
from moetier.experts.parallel.ep import local_experts
from moetier.experts.placement import ExpertOptions, ExpertPlacement
from moetier.experts.prefetch import detach_prefetch
from moetier.experts.cache.split import local_pinned
from moetier.experts.registry import Resident, Slots, Uva, backend_kind
from moetier.experts.cache.store import HostStore
from moetier.layers.fp8_linear import Fp8Weight
from moetier.layers.quant_linear import WEIGHTS
from moetier.models.base import CausalLM
from moetier.models.registry import model_class
from moetier.parallel import Parallel
from moetier.quant import fp8_block as fp8
from moetier.quant import int4, nvfp4
from moetier.quant.quant_config import example
from moetier.quant.registry import FORMATS
from moetier.tokenizer import Tokenizer
from moetier.tokenizer.synthetic import write_tokenizer


@dataclass
class Bed:
    """The model, its experts' host rows by MoE layer, and what the roofline needs to know."""

    model: CausalLM
    host: dict[int, torch.Tensor]  # layer -> [E, R] pinned
    tokenizer: Tokenizer
    row_bytes: int
    dense_bytes: int  # weights every step reads besides the routed experts (FP8 ones: weights + scales)
    dense_params: int = 0  # their parameter count (FP8 ones: the weights' elements, not the scales)
    par: Parallel = Parallel()  # the layout this share was made for (one process: everything)
    split: str = "replicate"  # the routed experts' split under tensor parallelism (experts/parallel/columns.py)
    # experts pinned on the GPU (experts/cache/split.py): per MoE layer the global ids, and their rows
    # [P, R] on the device (local ids ascending); their host rows are never backed
    pinned: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    pinned_rows: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg


@dataclass(frozen=True)
class RandomModel:
    """Random weights of a preset shape (the server's --preset, bench decode's parallel rows): plain
    data, pickled into worker processes, each of which makes its own share (build_random)."""

    preset: str
    layers: int | None = None
    backend: str = Slots.name
    budget: float = 0.5  # slots backends: the share of the model's routed experts each rank's slots hold
    policy: str = "lfru"
    seed: int = 0
    quant: str | None = None  # "fp8": FP8 expert rows
    split: str = "auto"  # routed experts under tensor parallelism: replicate, auto or columns
    # per MoE layer the experts (global ids) pinned on the GPU, made there directly (random_bed)
    pinned: dict[int, tuple[int, ...]] | None = None
    # per MoE layer the slots instead of the budget's one count (a plan's --pinned-out or slots file)
    slots_per_layer: dict[int, int] | None = None

    def options(self, cfg: ModelConfig, par: Parallel = Parallel()) -> ExpertOptions:
        """The ExpertOptions a rank's share is built with under layout par (the layout checks and the
        plan use them)."""
        tp, ep = par.tp, par.ep
        split = resolve(self.split, dataclasses.replace(cfg.moe_shape, quant=self.quant), tp, ep, self.backend)
        columns = tp if split == "columns" else 1
        slots = slots_for(cfg, self.backend, self.budget, ep, columns)
        if self.pinned and slots:  # at most the cached experts
            slots = min(slots, local_experts(cfg.num_experts, ep) - max(len(v) for v in self.pinned.values()))
        return ExpertOptions(self.backend, slots=slots or None, slots_per_layer=dict(self.slots_per_layer or {}),
                             policy=self.policy, split=self.split, pinned=dict(self.pinned or {}))


def quantized(cfg: ModelConfig, quant: str | None) -> ModelConfig:
    """cfg with its routed experts in format `quant` (quant/registry.FORMATS; None: as it is) and its
    dense weights in the model dtype, as a checkpoint of that format loads (the plan's, the server's
    and the bench's random weights)."""
    if quant is None:
        return cfg
    if quant not in FORMATS:
        raise ValueError(f"unknown expert quantization {quant!r}; one of {', '.join(FORMATS)}")
    return dataclasses.replace(cfg, quant=quant, quant_config=example(quant))


def build_random(r: RandomModel, dtype: torch.dtype, device: str, decode_tokens: int,
                 par: Parallel = Parallel()) -> Bed:
    """This rank's share of r, its expert backends built (the worker's and rank 0's model)."""
    from moetier.presets import preset

    cfg = preset(r.preset, r.layers, str(dtype).removeprefix("torch."))
    split = resolve(r.split, dataclasses.replace(cfg.moe_shape, quant=r.quant), par.tp, par.ep, r.backend)
    bed = random_bed(cfg, r.seed, device, dtype, r.quant, par, split=split, pinned=r.pinned)
    use_backend(bed, r.backend, r.budget, r.policy, decode_tokens, slots_per_layer=dict(r.slots_per_layer or {}))
    return bed


def random_bed(cfg: ModelConfig, seed: int = 0, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
               quant: str | None = None, par: Parallel = Parallel(), keep_dense: bool = False,
               split: str = "auto", pinned: dict[int, tuple[int, ...]] | None = None) -> Bed:
    """Random weights made on the device; routed experts copied into the (pinned) host store, as FP8
    rows when quant is "fp8", 4-bit rows for "nvfp4", "int4", "int4-g32"; keep_dense (with a quant): dense projections in it too. par: this
    rank's share only (module docstring); split: "columns" keeps this rank's I/tp of every expert.
    pinned: per MoE layer the experts (global ids) kept on the device instead (experts/cache/split.py):
    the same draws, their rows stay on the device and only the cached rows reach the host, so a model
    larger than the host fits when the GPU holds the difference."""
    from moetier.config import with_dense

    cfg = with_dense(quantized(cfg, quant), "keep" if keep_dense else "dequantize")
    cls = model_class(cfg)
    model = cls(cfg, dtype, device, par) if par.tp > 1 else cls(cfg, dtype, device)
    layout = cfg.moe_shape.layout
    split = resolve(split, cfg.moe_shape, par.tp, par.ep, Resident.name)  # refuses a bad explicit columns
    ours = local_shape(cfg.moe_shape, split, par.tp).layout  # this rank's rows (the whole without columns)
    ep, mine = par.ep, par.ep_rank
    pinned = {layer: tuple(sorted(ids)) for layer, ids in (pinned or {}).items() if ids}
    held = {layer: local_pinned(ids, mine, ep) for layer, ids in pinned.items()}
    store = HostStore(cfg.moe_layers, local_experts(cfg.num_experts, ep), ours, dtype,
                      pin=torch.device(device).type == "cuda", pinned=held)
    host = {layer: store.rows(layer) for layer in cfg.moe_layers}
    on_gpu = {layer: torch.empty(len(ids), ours.numel, dtype=store.dtype, device=device) for layer, ids in held.items()}
    g = torch.Generator(device=device).manual_seed(seed)
    kept = [m for m in model.modules() if isinstance(m, WEIGHTS)]
    in_kept = {id(p) for m in kept for p in m.parameters()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in in_kept:
                continue
            if name.endswith("norm") or "_norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
        for m in kept:
            w = torch.empty(m.shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=g)
            if isinstance(m, Fp8Weight):
                m.rows().copy_(*fp8.quantize(w), "random")
            elif m.quant == "nvfp4":
                m.rows().copy_(*nvfp4.quantize(w), "random")
            else:  # asymmetric formats: the zero codes third
                codes, scale, *zero = int4.quantize(w, m.group, m.zero is not None)
                m.rows().copy_(codes, scale, None, "random", *zero)
        for layer, rows in host.items():
            # every expert is drawn, in one order whatever the layout; a rank keeps the ones it owns
            if layer in held:
                rows = _SplitRows(rows, held[layer], on_gpu[layer])
            for a in range(0, cfg.num_experts, 16):  # 16 Qwen3-30B experts are 151 MB of scratch
                b = min(a + 16, cfg.num_experts)
                tmp = torch.empty(b - a, layout.numel, dtype=rows.dtype, device=device)
                if layout.quant == "fp8":
                    fill_fp8_rows(tmp, layout, g, dtype)
                elif layout.quant is not None:
                    fill_4bit_rows(tmp, layout, g, dtype)
                else:
                    tmp.normal_(0.0, 0.02, generator=g)
                if split == "columns":  # ep is 1 here
                    part = torch.zeros(b - a, ours.numel, dtype=rows.dtype, device=device)
                    slice_rows(tmp, layout, part, ours, par.tp_rank, par.tp)
                    rows[a:b].copy_(part)
                    continue
                if ep == 1:
                    rows[a:b].copy_(tmp)
                    continue
                own = [e for e in range(a, b) if e % ep == mine]
                rows[[e // ep for e in own]] = tmp[[e - a for e in own]].to(rows.device)
    bed = _bed(model, host, par=par)
    bed.split = split
    bed.pinned, bed.pinned_rows = pinned, on_gpu
    return bed


class _SplitRows:
    """Rows [E, R] of one layer as random_bed writes them (rows[a:b] = ..., rows[list] = ...): a pinned
    expert's row goes to the device rows [P, R], the others to the host block."""

    def __init__(self, host: torch.Tensor, pinned: tuple[int, ...], device_rows: torch.Tensor):
        self.host, self.device_rows = host, device_rows
        self.dtype = host.dtype
        self.at = {e: j for j, e in enumerate(pinned)}

    def __setitem__(self, index, value: torch.Tensor) -> None:
        ids = list(range(index.start, index.stop)) if isinstance(index, slice) else list(index)
        for i, e in enumerate(ids):
            if e in self.at:
                self.device_rows[self.at[e]].copy_(value[i])
            else:
                self.host[e].copy_(value[i])

    def __getitem__(self, index):
        return _Slice(self, index)

    @property
    def device(self) -> torch.device:
        return self.host.device


class _Slice:
    def __init__(self, rows: _SplitRows, index):
        self.rows, self.index = rows, index

    def copy_(self, value: torch.Tensor) -> None:
        self.rows[self.index] = value


def fill_fp8_rows(rows: torch.Tensor, layout, g: torch.Generator, dtype: torch.dtype = torch.bfloat16) -> None:
    """FP8 rows [N, R] of random experts: each projection drawn as N(0, 0.02) in `dtype` on the
    generator's device, quantized by the block rule (fp8.quantize), written with its scales."""
    h, i = layout.hidden, layout.inter
    for part, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
        w = torch.empty(rows.shape[0], *shape, dtype=dtype, device=g.device).normal_(0.0, 0.02, generator=g)
        q, scale = fp8.quantize(w)
        layout.part(rows, part).copy_(q)
        layout.part(rows, part + "_scale").copy_(scale)


def fill_4bit_rows(rows: torch.Tensor, layout, g: torch.Generator, dtype: torch.dtype = torch.bfloat16) -> None:
    """4-bit rows [N, R] (NVFP4, INT4) of random experts: each projection drawn as N(0, 0.02) in `dtype`,
    quantized by the format's rule (quant/nvfp4.quantize, quant/int4.quantize), written with its scales
    (and, asymmetric, its zero codes)."""
    h, i = layout.hidden, layout.inter
    for part, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
        w = torch.empty(rows.shape[0], *shape, dtype=dtype, device=g.device).normal_(0.0, 0.02, generator=g)
        if layout.quant == "nvfp4":
            q, scale, s2 = nvfp4.quantize(w)
            layout.part(rows, part + "_scale_2").copy_(s2)
        elif layout.asymmetric:
            q, scale, zero = int4.quantize(w, layout.group, asymmetric=True)
            layout.part(rows, part + "_zero_point").copy_(zero)
        else:
            q, scale = int4.quantize(w, layout.group)
        layout.part(rows, part).copy_(q)
        layout.part(rows, part + "_scale").copy_(scale)


def loaded_bed(path: str) -> Bed:
    from moetier.checkpoint.loader import load_model

    _, model, _ = load_model(path, dtype="bf16", device="cuda", experts=ExpertOptions(Uva.name))
    host = {block.layer: block.experts.host for block in model.moe_blocks()}
    return _bed(model, host, Tokenizer.from_dir(path))


def _bed(model: CausalLM, host: dict[int, torch.Tensor], tokenizer: Tokenizer | None = None,
         par: Parallel = Parallel()) -> Bed:
    for block in model.moe_blocks():
        block.experts = None
    if tokenizer is None:
        with tempfile.TemporaryDirectory() as d:
            write_tokenizer(d)
            tokenizer = Tokenizer.from_dir(d)
    first = next(iter(host.values()))
    # A step reads every dense weight once, but only its tokens' rows of the embedding.
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    params = sum(p.numel() for p in model.parameters())
    for m in model.modules():  # kept weights: their elements, not their codes and scales
        if isinstance(m, WEIGHTS):
            params += m.shape.numel() - sum(p.numel() for p in m.parameters())
    if not model.cfg.tie_word_embeddings:
        dense -= model.embed.numel() * model.embed.element_size()
        params -= model.embed.numel()
    return Bed(model, host, tokenizer, first.shape[1] * first.element_size(), dense, params, par)


def slots_for(cfg: ModelConfig, backend: str, budget: float, ep: int = 1, columns: int = 1) -> int:
    """Slots per MoE layer of a budget (0: a backend without slots): the share of the model's routed
    expert bytes, at least top_k slots, at most the experts a rank holds. columns: the "columns" expert
    split's tp (a slot holds 1/columns of an expert, so the same bytes hold columns times the slots)."""
    if not backend_kind(backend).cached:
        return 0
    return min(local_experts(cfg.num_experts, ep), max(cfg.top_k, round(cfg.num_experts * budget * columns)))


def use_backend(bed: Bed, backend: str, budget: float = 1.0, policy: str = "lfru", decode_tokens: int = 64,
                **options) -> int:
    """Rebuild every MoE layer's backend over the host rows. Returns the slots per layer (0: none; with
    per-layer counts, their mean rounded down).
    options: further ExpertOptions fields (slots_per_layer: a count per MoE layer instead of the
    budget's; hybrid: host_kernel, host_threads, rates).
    budget: the share of the model's routed experts in each rank's slots (per-GPU bytes), capped at
    the experts the rank holds (under expert parallelism 2, 50% is every expert a rank owns)."""
    cfg, dev = bed.cfg, bed.model.device
    detach_prefetch(bed.model)  # the new backend may not prefetch; the next engine links it again
    for block in bed.model.moe_blocks():
        block.experts = None  # free the previous backend's device memory first
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    slots = slots_for(cfg, backend, budget, bed.par.ep, bed.par.tp if bed.split == "columns" else 1)
    kind = backend_kind(backend)
    if bed.pinned and not (kind.cached or not kind.host_store):
        raise ValueError(f"a bed with pinned experts serves resident, slots or hybrid, not {backend}: "
                         "their host rows are not there")
    if bed.pinned and kind.cached:
        most = max(len(ids) for ids in bed.pinned_rows.values())  # slots: at most the cached experts
        slots = min(slots, local_experts(cfg.num_experts, bed.par.ep) - most) if slots else slots
        options.setdefault("pinned", bed.pinned)
    per_layer = options.get("slots_per_layer") or {}
    if per_layer and kind.cached:
        slots = sum(per_layer.values()) // len(per_layer)
    placement = ExpertPlacement(cfg.moe_shape, bed.model.dtype, cfg.moe_layers,
                                ExpertOptions(backend, slots=slots or None, policy=policy, split=bed.split,
                                              **options), dev,
                                decode_tokens, bed.par)
    for block in bed.model.moe_blocks():
        rows, layer = bed.host[block.layer], block.layer
        if not placement.kind.host_store:  # resident: a device copy of every row
            rows = rows.to(dev, copy=True)
            if layer in bed.pinned_rows:  # the pinned experts' host rows are unbacked zeros
                rows[list(local_pinned(bed.pinned[layer], bed.par.ep_rank, bed.par.ep))] = bed.pinned_rows[layer]
        elif layer in bed.pinned_rows:  # into the new device block, after its slots; the old block goes
            dest = placement.device_rows(layer)
            dest[placement.num_slots(layer):] = bed.pinned_rows[layer]
            bed.pinned_rows[layer] = dest[placement.num_slots(layer):]
        block.experts = placement.build(layer, rows)
    return slots
