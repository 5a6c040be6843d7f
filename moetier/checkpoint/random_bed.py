"""A model with random weights made in memory, for benchmarks and the server's --preset mode: the
published shapes are larger than the device machine's disk holds as a checkpoint (Qwen3-30B-A3B is
61 GB). Its routed experts sit once in a pinned host store (exact size), and use_backend() rebuilds
every MoE layer's expert backend over that store (resident: a device copy; slots at a budget; uva),
so one model serves every row of a benchmark. loaded_bed() does the same for a checkpoint.

quant="fp8": the routed experts are made as random bf16 and quantized by the block rule
(experts/fp8.py) into FP8 rows, as make-checkpoint --dtype fp8 does; the dense weights stay random
bf16 (what an FP8 checkpoint's dense weights become at load: dequantized to the model dtype).
With fp8_dense too, the dense projections the model holds in FP8 (layers/fp8_linear.Fp8Weight; the
same ones as an FP8 checkpoint loaded with fp8_dense "fp8") are random bf16 quantized the same way.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass

import torch

from moetier.config import ModelConfig
from moetier.experts import fp8
from moetier.experts.placement import ExpertOptions, ExpertPlacement
from moetier.experts.store import HostStore
from moetier.layers.fp8_linear import Fp8Weight
from moetier.models.base import CausalLM
from moetier.models.registry import model_class
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

    @property
    def cfg(self) -> ModelConfig:
        return self.model.cfg


def random_bed(cfg: ModelConfig, seed: int = 0, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
               quant: str | None = None, fp8_dense: bool = False) -> Bed:
    """Random weights made on the device; routed experts copied into the (pinned) host store, as FP8
    rows when quant is "fp8"; fp8_dense (with quant "fp8"): dense projections in FP8 too."""
    from moetier.checkpoint.fp8_weights import with_dense

    if quant is not None:
        if quant != "fp8":
            raise ValueError(f"unknown expert quantization {quant!r}; only fp8")
        cfg = dataclasses.replace(cfg, quant=quant, quant_config=dict(fp8.QUANT_CONFIG))
    cfg = with_dense(cfg, "fp8" if fp8_dense else "dequantize")
    model = model_class(cfg)(cfg, dtype, device)
    layout = cfg.moe_shape.layout
    store = HostStore(cfg.moe_layers, cfg.num_experts, layout, dtype, pin=device == "cuda")
    host = {layer: store.rows(layer) for layer in cfg.moe_layers}
    g = torch.Generator(device=device).manual_seed(seed)
    fp8_weights = [m for m in model.modules() if isinstance(m, Fp8Weight)]
    in_fp8 = {id(p) for m in fp8_weights for p in (m.q, m.scale)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in in_fp8:
                continue
            if name.endswith("norm") or "_norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
        for m in fp8_weights:
            w = torch.empty(m.shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=g)
            m.rows().copy_(*fp8.quantize(w), "random")
        for rows in host.values():
            for a in range(0, rows.shape[0], 16):  # 16 Qwen3-30B experts are 151 MB of scratch
                b = min(a + 16, rows.shape[0])
                if layout.quant == "fp8":
                    fill_fp8_rows(rows[a:b], layout, g, dtype)
                    continue
                rows[a:b].copy_(torch.empty(b - a, rows.shape[1], dtype=rows.dtype, device=device)
                                .normal_(0.0, 0.02, generator=g))
    return _bed(model, host)


def fill_fp8_rows(rows: torch.Tensor, layout, g: torch.Generator, dtype: torch.dtype = torch.bfloat16) -> None:
    """FP8 rows [N, R] of random experts: each projection drawn as N(0, 0.02) in `dtype` on the
    generator's device, quantized by the block rule (fp8.quantize), written with its scales."""
    h, i = layout.hidden, layout.inter
    for part, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
        w = torch.empty(rows.shape[0], *shape, dtype=dtype, device=g.device).normal_(0.0, 0.02, generator=g)
        q, scale = fp8.quantize(w)
        layout.part(rows, part).copy_(q)
        layout.part(rows, part + "_scale").copy_(scale)


def loaded_bed(path: str) -> Bed:
    from moetier.checkpoint.loader import load_model

    _, model, _ = load_model(path, dtype="bf16", device="cuda", experts=ExpertOptions("uva"))
    host = {block.layer: block.experts.host for block in model.moe_blocks()}
    return _bed(model, host, Tokenizer.from_dir(path))


def _bed(model: CausalLM, host: dict[int, torch.Tensor], tokenizer: Tokenizer | None = None) -> Bed:
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
    params -= sum(m.scale.numel() for m in model.modules() if isinstance(m, Fp8Weight))
    if not model.cfg.tie_word_embeddings:
        dense -= model.embed.numel() * model.embed.element_size()
        params -= model.embed.numel()
    return Bed(model, host, tokenizer, first.shape[1] * first.element_size(), dense, params)


def use_backend(bed: Bed, backend: str, budget: float = 1.0, policy: str = "lfru", decode_tokens: int = 64,
                **options) -> int:
    """Rebuild every MoE layer's backend over the host rows. Returns the slots per layer (0: none).
    options: further ExpertOptions fields (hybrid: host_kernel, host_threads, rates)."""
    cfg, dev = bed.cfg, bed.model.device
    for block in bed.model.moe_blocks():
        block.experts = None  # free the previous backend's device memory first
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    slots = max(cfg.top_k, round(cfg.num_experts * budget)) if backend in ("slots", "hybrid") else 0
    placement = ExpertPlacement(cfg.moe_shape, bed.model.dtype, cfg.moe_layers,
                                ExpertOptions(backend, slots=slots or None, policy=policy, **options), dev,
                                decode_tokens)
    for block in bed.model.moe_blocks():
        rows = bed.host[block.layer]
        block.experts = placement.build(block.layer, rows.to(dev, copy=True) if backend == "resident" else rows)
    return slots
