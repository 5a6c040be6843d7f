"""What each resident of a run weighs, in bytes, computed from the model config alone (nothing is
allocated). Each function mirrors the code that allocates the thing, named in its docstring, so a
change there shows up here as a failing hand-computed test (tests/test_plan.py).

Stated rules (not measurable before the run; the audit checks them after load and capture), each
calibrated on a GPU with scripts/plan_audit.py (the figures: docs/measured-defaults.md):
  CUDA context     CONTEXT_BYTES: the CUDA runtime at init. The audit prints the measured figure
                   (device used minus torch reserved: context plus the next item).
  CUDA modules     modules_bytes(): kernels loaded at first use (cuBLAS, Triton) and the decode graphs'
                   executables, outside torch's allocator; grows with the layers captured.
  cuBLAS workspace cublas_workspace(): torch allocates one per stream that runs a GEMM, and keeps it.
  process baseline HOST_BASELINE_*: Python, torch and the CUDA libraries mapped in, before weights;
                   HOST_FIRST_USE: the library and kernel pages the first steps and capture touch.
  activations      the eager step's largest transient (prefill chunk of max_num_tokens tokens).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import torch

from moetier.config import ModelConfig
from moetier.experts.kernels.gemm_config import h_dtype
from moetier.experts.shape import MoeShape
from moetier.plan.units import GiB, MiB, next_pow2, round_up

# the CUDA context and the modules outside torch: three rules that give what the audit measured at 8
# and 48 layers (docs/measured-defaults.md)
CONTEXT_BYTES = 528 * MiB
MODULES_BASE, MODULES_PER_LAYER = 228 * MiB, 2458 * 1024  # 228 MiB + 2.4 MiB per layer
CUBLAS_WORKSPACE_DEFAULT = 32 * MiB  # torch on Hopper, per stream
HOST_BASELINE_CUDA = 5 * GiB // 2  # python + torch + libcudart/cublas mapped, before the first step
HOST_FIRST_USE = 512 * MiB  # VmRSS growth from load to captured graphs, as measured
HOST_BASELINE_CPU = 1 * GiB
# torch's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp): blocks round to 512 bytes;
# requests up to 1 MiB share 2 MiB segments, up to 10 MiB share 20 MiB segments, larger ones get
# their own segment rounded to 2 MiB.
BLOCK, SMALL, SMALL_SEG, MID, MID_SEG, LARGE_ROUND = 512, 1 * MiB, 2 * MiB, 10 * MiB, 20 * MiB, 2 * MiB


def modules_bytes(num_layers: int) -> int:
    return MODULES_BASE + MODULES_PER_LAYER * num_layers


def cublas_workspace(env: str | None = None) -> int:
    """Bytes of one stream's cuBLAS workspace: CUBLAS_WORKSPACE_CONFIG (":SIZE_KiB:COUNT" pairs) when
    set, else torch's default on Hopper."""
    import os

    text = os.environ.get("CUBLAS_WORKSPACE_CONFIG") if env is None else env
    parts = [p for p in (text or "").split(":") if p]
    try:
        pairs = [(int(parts[i]), int(parts[i + 1])) for i in range(0, len(parts) - 1, 2)]
    except ValueError:
        pairs = []
    return sum(kib * 1024 * n for kib, n in pairs) if pairs else CUBLAS_WORKSPACE_DEFAULT


def block(n: int) -> int:
    """Bytes the allocator charges a tensor of n bytes (memory_allocated counts this)."""
    return round_up(max(n, 1), BLOCK)


def segments(tensors: list[int]) -> int:
    """Bytes the allocator reserves for these tensors (memory_reserved): large ones rounded to 2 MiB
    each, smaller ones packed into 2 MiB and 20 MiB segments."""
    small = sum(block(n) for n in tensors if block(n) <= SMALL)
    mid = sum(block(n) for n in tensors if SMALL < block(n) < MID)
    large = sum(round_up(block(n), LARGE_ROUND) for n in tensors if block(n) >= MID)
    return round_up(small, SMALL_SEG) + round_up(mid, MID_SEG) + large


@dataclass(frozen=True)
class Dense:
    embedding_and_head: int  # the embedding and, when untied, the LM head
    layers: int  # attention, norms, routers, dense MLP layers, shared experts
    tensors: tuple[int, ...]  # each tensor's bytes (allocator rounding)
    # dense weights kept in the checkpoint's format (cfg.dense_quant): the largest one dequantized to
    # the model dtype, the transient a prefill step's projection makes (layers/quant_linear.py); 0
    # when every dense weight is in the model dtype
    transient: int = 0


def dense_weights(cfg: ModelConfig, dtype: torch.dtype) -> Dense:
    """Every checkpoint tensor that is not a routed expert (models/<family>.checkpoint_weights),
    in the model dtype (float32 where the model keeps it so); the tied LM head (optional, never
    kept) is not counted. With cfg.dense_quant set the weights the model keeps in the checkpoint's
    format count their bytes as held, exactly: FP8 weights plus block scales, 4-bit codes plus group
    and tensor scales (which ones: kept_weights)."""
    # the exclusions of quantization_config decide which weights are kept, and ModelConfig's hash
    # leaves the config dict out: it joins the cache key as text
    return _dense_weights(cfg, dtype, json.dumps(cfg.quant_config, sort_keys=True) if cfg.dense_quant else "")


@lru_cache(maxsize=16)  # sizing and suggestions count one config many times; 235B lists 36k tensors
def _dense_weights(cfg: ModelConfig, dtype: torch.dtype, quant_config: str) -> Dense:
    from moetier.models.registry import model_class

    held, largest = kept_weights(cfg)
    head, rest, sizes = 0, 0, []
    for w in model_class(cfg).checkpoint_weights(cfg, set()):
        if w.expert is not None or w.optional:
            continue
        if w.name in held:
            n = held[w.name]
        else:
            n = (4 if w.float32 else dtype.itemsize) * _numel(w.shape)
        sizes.append(n)
        if w.shape and w.shape[0] == cfg.vocab_size:
            head += n
        else:
            rest += n
    return Dense(head, rest, tuple(sizes), largest * dtype.itemsize)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def kept_weights(cfg: ModelConfig) -> tuple[dict[str, int], int]:
    """(checkpoint name -> bytes as held, for the weights the model keeps in the checkpoint's format
    under cfg.dense_quant; the element count of the largest kept weight). The model is built on the
    meta device (no memory) and asked, so the plan follows the layers' own rules (FP8's fallback,
    layers/quant_linear.py) and the exclusions (CausalLM.hold_excluded_plain)."""
    if not cfg.dense_quant:
        return {}, 0
    from moetier.layers.quant_linear import WEIGHTS, destination
    from moetier.models.registry import model_class

    model = model_class(cfg)(cfg, torch.bfloat16, "meta")
    held = {w.name: d.nbytes for w in model_class(cfg).checkpoint_weights(cfg, set())
            if w.expert is None and (d := destination(model.param(w.name))) is not None}
    return held, max((_numel(m.shape) for m in model.modules() if isinstance(m, WEIGHTS)), default=0)


def row_bytes(shape: MoeShape, dtype: torch.dtype) -> int:
    """One routed expert's row (quant/rows.RowLayout), exact: the weights in the model dtype, or
    for FP8 experts (shape.quant) the float8 weights and their block scales in one byte row, so the
    slots and the store carry the scales with the weights."""
    return shape.layout.row_bytes(dtype)


def gemm_scratch(max_pairs: int, hidden: int, inter: int) -> list[int]:
    """GemmScratch (experts/kernels/grouped_gemm.py), one per shape and device: order, chunk_end, one_order,
    one_end [P] int32; h [P, I] and y [P, H] float32."""
    p = max_pairs
    return [4 * p, 4 * p, 4 * p * inter, 4 * p * hidden, 4 * p, 4 * p]


GRAPH_SIZES = (1, 2, 4, 8, 16, 32, 64)  # decode batch sizes the engine may capture


def captured_sizes(max_num_seqs: int, decode_tokens: int) -> list[int]:
    """The decode graphs an engine captures (engine/graphs.decode_graphs) and the plan counts: the
    sizes up to the decode cap; steps above it run eagerly."""
    cap = min(max_num_seqs, decode_tokens)
    return [n for n in GRAPH_SIZES if n <= cap] or [1]


def verify_shapes(sizes, max_k: int, token_cap: int) -> list[tuple[int, int]]:
    """The verify graphs an engine captures (engine/verify_graphs.py) and the plan counts: (n, q) for
    q = 2 .. max_k + 1 verified positions a sequence and the decode sizes n whose n q rows stay within
    token_cap (decode_tokens: a larger step takes the large-step expert path)."""
    return [(n, q) for q in range(2, max_k + 2) for n in sorted(sizes) if n * q <= token_cap]


def verify_graph_parts(cfg: ModelConfig, shapes: list[tuple[int, int]], max_k: int, width: int,
                       dtype: torch.dtype) -> tuple[list[int], list[int], list[int]]:
    """What the verify graphs (engine/verify_graphs.py) add, as (static inputs, what each graph keeps,
    the largest step's transients): inputs int64 [3 t + b k + 4 b + 1] and int32 [b (3 + width)] and a
    query-start row [b + 1] int32 per q (t the most rows, b the largest batch); kept, per shape and
    sampling mode, the verdict [n, 1 + q] int64; the peak, one layer of a t-row step with its logits
    and the verify arithmetic over them."""
    b, t = max(n for n, _ in shapes), max(n * q for n, q in shapes)
    inputs = [8 * (3 * t + b * max_k + 4 * b + 1), 4 * b * (3 + width)] + [4 * (b + 1)] * len({q for _, q in shapes})
    kept = [8 * n * (1 + q) for n, q in shapes for _ in range(3)]
    return inputs, kept, step_activations(cfg, t, dtype, t) + [verify_transient(t, cfg.vocab_size)]


def verify_transient(rows: int, vocab: int) -> int:
    """The verify arithmetic's largest transient over [rows, V] float32 logits (engine/spec_step.verdict
    in filter mode): the sampler's filter (sampler_transient) and the tempered, one-hot, target,
    residual and final distributions, 5 more float32 copies: 68 bytes per logit."""
    return sampler_transient(rows, vocab) + 20 * rows * vocab


BUCKET_TOKENS = 4096  # the narrowest context bucket of the decode graphs; each next one is 4x wider


def width_buckets(width: int, page_size: int, first_tokens: int = BUCKET_TOKENS) -> tuple[int, ...]:
    """Page-table widths (pages, ascending) the decode graphs of a model whose decode reads the whole
    table (engine/graphs.py, context buckets) capture for a table of `width` pages: first_tokens, 4x
    that, ... (in pages, rounded up), each below `width`, then `width` itself."""
    out, tokens = [], first_tokens
    while -(-tokens // page_size) < width:
        out.append(-(-tokens // page_size))
        tokens *= 4
    return (*out, width)


def graph_widths(width: int, page_size: int, reads_width: bool, hybrid: bool,
                 first_tokens: int = BUCKET_TOKENS) -> tuple[int, ...]:
    """The page-table widths the decode graphs capture per size (engine/graphs.py) and the plan counts:
    the context buckets for a model whose decode reads the table's whole width (the DSA and kpool
    indexers), unless the backend is hybrid (its pieces and whole-step switch keep one graph per size);
    else the whole width alone."""
    return width_buckets(width, page_size, first_tokens) if reads_width and not hybrid else (width,)


def graph_inputs(max_batch: int, max_pages_per_seq: int) -> list[int]:
    """DecodeGraphs' static device blocks (engine/graphs.py): int64 [6b], int32 [b (3 + width)],
    query_start int32 [b + 1]."""
    b = max_batch
    return [8 * 6 * b, 4 * b * (3 + max_pages_per_seq), 4 * (b + 1)]


def hybrid_piece_buffers(tokens: int, top_k: int, hidden: int) -> list[int]:
    """The pieces' device buffer, one per model (experts/hybrid/backend.HybridExperts._device_cuda, on the
    HostPath): the pair outputs y [P, H] fp32 (P = T x top_k)."""
    return [4 * tokens * top_k * hidden]


def hybrid_node_buffers(tokens: int, top_k: int, hidden: int, num_experts: int) -> list[int]:
    """The nodes mode's device buffers, one set per model (experts/hybrid/nodes.NodeBuffers and the plan's
    PlanBuffers): host outputs' twin [P, H], y [P+1, H] and the GEMM's output [P, H] fp32, positions [P]
    int64; dev_ids [P], job [1+2P] and pos [P] int64, first and count [E] int32 (P = T x top_k)."""
    p = tokens * top_k
    return [4 * p * hidden, 4 * (p + 1) * hidden, 4 * p * hidden, 8 * p, 8 * p, 8 * (1 + 2 * p), 8 * p,
            4 * num_experts, 4 * num_experts]


def hybrid_host_staging(tokens: int, top_k: int, hidden: int, inter: int, itemsize: int) -> int:
    """The hybrid backend's host buffers, one set per model: pinned by torch's allocator, which rounds a
    block up to a power of two and keeps freed blocks cached; HostPath.buffer grows a buffer to the
    largest step seen, so up to one freed block of each smaller power of two stays cached too (their sum
    is less than the last): each pinned buffer counted twice its rounded size. The pieces' (HostPath):
    ids int32 [2, P], hidden [T, H], positions int64 [P], host outputs fp32 [P, H]; the nodes mode's
    (NodeBuffers, made once at full size): hidden fp32 [T, H], job int64 [1 + 2P], outputs fp32 [P, H],
    and the kernel's scratch h fp32 [P, I] (not pinned). P = T x top_k. Both modes' are counted: the
    plan does not know which runs."""
    p = tokens * top_k
    pieces = sum(2 * next_pow2(n) for n in (8 * p, itemsize * tokens * hidden, 8 * p, 4 * p * hidden))
    nodes = sum(next_pow2(n) for n in (4 * tokens * hidden, 8 * (1 + 2 * p), 4 * p * hidden)) + 4 * p * inter
    return pieces + nodes


def hybrid_piece_transients(tokens: int, top_k: int, hidden: int, itemsize: int) -> list[int]:
    """What one eager hybrid layer of the pieces allocates at the largest step, freed when it ends (layers
    run one after another): the positions [P] int64, the device pairs' gathered hidden rows [P, H],
    ids [P] int64 and weights [P], the GEMM's weighted output [P, H] fp32 and the host outputs' upload
    [P, H] fp32."""
    p = tokens * top_k
    return [8 * p, itemsize * p * hidden, 8 * p, itemsize * p, 4 * p * hidden, 4 * p * hidden]


def graph_host_inputs(max_batch: int, max_pages_per_seq: int) -> int:
    """The pinned host twins of the graph inputs, allocated by torch's pinned allocator, which rounds
    each block up to a power of two."""
    b = max_batch
    return next_pow2(8 * 6 * b) + next_pow2(4 * b * (3 + max_pages_per_seq))


def step_activations(cfg: ModelConfig, tokens: int, dtype: torch.dtype, logit_rows: int) -> list[int]:
    """The largest transient of one step of `tokens` tokens, one layer deep (layers run one after
    another; each frees its intermediates): residual stream, normed input and the layer output
    [T, H] x 3, the attention's own transients (the family says: ModelConfig.attention_activations),
    router logits [T, E] float32 and top-k, the MoE input copy and output [T, H] x 2; then logits
    [rows, V] in the model dtype and float32."""
    h, isz, t = cfg.hidden_size, dtype.itemsize, tokens
    out = [t * h * isz] * 5 + cfg.attention_activations(t, dtype) + [
        t * cfg.num_experts * 4, t * cfg.top_k * 8, t * cfg.top_k * isz]
    return out + [logit_rows * cfg.vocab_size * isz, logit_rows * cfg.vocab_size * 4]


def large_step_scratch(tokens: int, shape: MoeShape, dtype: torch.dtype, max_rows: int) -> list[int]:
    """What one layer's large-step expert GEMM allocates per call (experts/kernels/grouped_gemm_large.py),
    P = tokens x top_k pairs: h [P, I] in the dot's type (the model dtype when 16-bit, else float32:
    gemm_config.h_dtype) and y [P, H] float32, out [T, H]; its plan: keys and the sort's
    order [P] int64, order as int32 and chunk_end [P] int32, counts [2 max_rows + 1] int32, starts
    [P / 64 + min(P, max_rows)] int32; the slot ids [P] int32; and the refresh's ranking (counts [E]
    int32, the sort [E] int64 twice: prefill_cache.ranking). Live together in one layer, then freed."""
    p, e = tokens * shape.top_k, shape.num_experts
    return [h_dtype(dtype).itemsize * p * shape.inter, 4 * p * shape.hidden, tokens * shape.hidden * dtype.itemsize,
            8 * p, 8 * p, 4 * p, 4 * p, 4 * (2 * max_rows + 1), 4 * (p // 64 + min(p, max_rows)), 4 * p, 4 * e, 16 * e]


def staging_ring(shape: MoeShape, dtype: torch.dtype, group: int, depth: int) -> int:
    """The ring prefill stream mode's staging ring (experts/prefill/ring.StagingRing): D buffers of G
    exact expert rows, one for every layer of the shape, made at the first ring step and kept."""
    return depth * group * row_bytes(shape, dtype)


def ring_step_scratch(tokens: int, shape: MoeShape) -> list[int]:
    """What a ring step adds to the large-step GEMM's transients (experts/prefill/ring.ring_forward),
    P = tokens x top_k: hit / miss counts [2, E + 1] int32, the missing list [E] int64, group and place
    maps [E] int32; per pair the clamped ids int64, its group and place int32, two masks, a pass's
    masked ids int64 and row ids int32."""
    p, e = tokens * shape.top_k, shape.num_experts
    return [8 * (e + 1), 8 * e, 4 * e, 4 * e, 8 * p, 4 * p, 4 * p, p, p, 8 * p, 4 * p]


def sampler_transient(rows: int, vocab: int) -> int:
    """layers/sampler.py filter mode on [rows, V] float32 logits: sorted values, order (int64), the
    cumulative mass, the masked and scattered copies and the probabilities: 48 bytes per logit."""
    return 48 * rows * vocab


def prefill_stream(shape: MoeShape, dtype: torch.dtype) -> int:
    """Prefill through a host-backed backend streams one expert row at a time to the device
    (experts/reference.row_fetch): two rows in flight."""
    return 2 * row_bytes(shape, dtype)


def store_allocation(num_layers: int, num_experts: int, row: int, page: int, pinned: list[int] | None = None
                     ) -> tuple[int, int]:
    """HostStore (experts/cache/store.py): per layer one [E, row] block, over-allocated by one page for
    alignment. A layer with P pinned experts backs only its E - P cached rows, each run of them rounded
    out to whole pages (at most min(P + 1, E - P) runs, two partial pages each: the bound counted).
    -> (requested bytes, allocated bytes)."""
    pinned = pinned or [0] * num_layers
    requested = sum((num_experts - p) * row for p in pinned)
    rounding = sum(2 * page * min(p + 1, num_experts - p) if p else page for p in pinned)
    return requested, requested + rounding


def torch_pinned_would_charge(num_layers: int, num_experts: int, row: int) -> int:
    """What torch.empty(pin_memory=True) would have pinned for the same blocks (each rounded up to a
    power of two, reference 000): shown next to the exact figure."""
    return num_layers * next_pow2(num_experts * row)
