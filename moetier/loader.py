"""Load a checkpoint directory into our model: validate first, allocate once, stream tensor by tensor.

Each checkpoint tensor is read from its shard once and copied into its place in our (fused)
parameters, converting dtype on the way; no second full copy of the model is ever held.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from moetier.checkpoint import Checkpoint, validate
from moetier.config import ModelConfig
from moetier.errors import MoetierError
from moetier.experts.placement import ExpertOptions
from moetier.models.qwen3_moe import MoE, Qwen3MoeForCausalLM

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def resolve_dtype(name: str, cfg: ModelConfig) -> torch.dtype:
    """'auto' takes the checkpoint's dtype (config.json torch_dtype)."""
    key = cfg.torch_dtype if name == "auto" else name
    if key not in DTYPES:
        raise MoetierError(f"unsupported --dtype {name!r}; choose auto, float32 or bfloat16")
    return DTYPES[key]


def destination(model: Qwen3MoeForCausalLM, name: str) -> torch.Tensor | None:
    """The slice of our parameters that checkpoint tensor `name` fills (None: not used, e.g. tied head)."""
    cfg = model.cfg
    if name == "model.embed_tokens.weight":
        return model.embed
    if name == "model.norm.weight":
        return model.norm
    if name == "lm_head.weight":
        return None if cfg.tie_word_embeddings else model.lm_head
    m = _LAYER.fullmatch(name)
    if not m:
        return None
    layer = model.layers[int(m.group(1))]
    rest = m.group(2)
    if rest == "input_layernorm.weight":
        return layer.input_norm
    if rest == "post_attention_layernorm.weight":
        return layer.post_norm
    a = layer.attn
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
    if rest.startswith("self_attn."):
        proj, kind = rest[len("self_attn."):].split(".")
        if proj in rows:
            lo, hi = rows[proj]
            return (a.qkv if kind == "weight" else a.qkv_bias)[lo:hi]
        return {"o_proj": a.o if kind == "weight" else a.o_bias, "q_norm": a.q_norm, "k_norm": a.k_norm}.get(proj)
    mlp = layer.mlp
    if isinstance(mlp, MoE):
        w13, w2 = mlp.layout.w13(mlp.rows), mlp.layout.w2(mlp.rows)
        i = cfg.moe_intermediate_size
        if rest == "mlp.gate.weight":
            return mlp.gate
        if rest == "mlp.experts.gate_up_proj":
            return w13
        if rest == "mlp.experts.down_proj":
            return w2
        e = _EXPERT.fullmatch(rest)
        if e:
            expert, proj = int(e.group(1)), e.group(2)
            return {"gate_proj": w13[expert, :i], "up_proj": w13[expert, i:], "down_proj": w2[expert]}[proj]
        return None
    i = cfg.intermediate_size
    return {"mlp.gate_proj.weight": mlp.w13[:i], "mlp.up_proj.weight": mlp.w13[i:],
            "mlp.down_proj.weight": mlp.w2}.get(rest)


@dataclass
class LoadReport:
    seconds: float
    checkpoint_bytes: int
    tensors: int
    notes: list[str] = field(default_factory=list)


def load_weights(model: Qwen3MoeForCausalLM, ckpt: Checkpoint, names: dict[str, tuple[int, ...]],
                 progress: Callable[[int, int], None] | None = None) -> int:
    """Copy every named tensor into its destination, shard by shard. Returns the tensors copied."""
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(ckpt.tensors[name].file, []).append(name)
    done, total = 0, len(names)
    for file in sorted(by_file):
        with safe_open(str(ckpt.path / file), framework="pt", device="cpu") as f:
            for name in by_file[file]:
                dest = destination(model, name)
                if dest is not None:
                    with torch.no_grad():
                        dest.copy_(f.get_tensor(name))
                done += 1
                if progress:
                    progress(done, total)
    return done


def load_model(path: str | Path, dtype: str = "auto", device: str = "cpu", experts: ExpertOptions | None = None,
               progress: Callable[[int, int], None] | None = None
               ) -> tuple[ModelConfig, Qwen3MoeForCausalLM, LoadReport]:
    t0 = time.perf_counter()
    cfg = ModelConfig.from_dir(path)
    torch_dtype = resolve_dtype(dtype, cfg)
    ckpt = Checkpoint(path)
    names = validate(cfg, ckpt)  # before any weight is allocated
    model = Qwen3MoeForCausalLM(cfg, torch_dtype, device, experts)
    n = load_weights(model, ckpt, names, progress)
    model.build_experts()
    return cfg, model, LoadReport(time.perf_counter() - t0, ckpt.nbytes(), n)
