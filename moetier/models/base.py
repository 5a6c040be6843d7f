"""What the engine needs from a model family: the interface every model class implements.

    cls.checkpoint_weights(cfg, present) -> [Weight]   the tensors a checkpoint holds and where each goes
    model.param(name) -> Tensor | None                 destination of a non-expert checkpoint tensor
    model.kv_spec() -> KVSpec                          what one token's KV holds (the engine allocates it)
    model.moe_blocks() -> [MoEBlock]                   the blocks whose expert backends the loader sets
    model.forward(input_ids [N], batch, kv) -> [N, H]  writes the step's KV, returns last hidden states
    model.logits(hidden [T, H]) -> [T, V] float32

Routed-expert tensors never get a model destination: a Weight names (layer, expert, part) and the
loader writes it into the rows the expert placement hands out (experts/placement.py), so the model
never knows whether its experts sit in HBM or in pinned host memory.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from moetier.config import ModelConfig
from moetier.layers.attention import AttnBatch
from moetier.layers.kv_cache import KVCache, KVSpec
from moetier.layers.moe import MoEBlock
from moetier.parallel import Parallel

COUNTERS = ("hits", "misses", "overflow", "steps", "bypassed")


@dataclass(frozen=True)
class ExpertTensor:
    """A checkpoint tensor of routed experts: `part` (quant/rows.PARTS) of one expert of `layer`,
    or of all of them when expert is None (fused layouts)."""

    layer: int
    expert: int | None
    part: str


@dataclass(frozen=True)
class Weight:
    name: str
    shape: tuple[int, ...]
    optional: bool = False  # may be absent (e.g. the tied lm_head copy some exporters write)
    expert: ExpertTensor | None = None
    float32: bool = False  # kept in float32 whatever the model dtype (routers' gates and biases)
    # Under tensor parallelism: the dim split into tp equal contiguous parts, rank r loading part r
    # (model.param(name) then has the part's shape); None: replicated, every rank loads it whole.
    split: int | None = None
    # known and never read, whatever its shape (a multimodal checkpoint's vision tower, MTP layers of a
    # layout we do not model): validation accepts it, the loader skips it
    skipped: bool = False


def routed_expert_weights(prefix: str, layer: int, num_experts: int, hidden: int, inter: int,
                          present: set[str]) -> list[Weight]:
    """The routed experts of one MoE layer under `prefix` ("model.layers.{i}.mlp."): fused
    experts.gate_up_proj / down_proj when the checkpoint holds them (transformers 5), else per expert
    experts.{x}.gate_proj / up_proj / down_proj (the published checkpoints)."""
    e, m = num_experts, prefix
    if m + "experts.gate_up_proj" in present or m + "experts.down_proj" in present:
        return [Weight(m + "experts.gate_up_proj", (e, 2 * inter, hidden), expert=ExpertTensor(layer, None, "gate_up")),
                Weight(m + "experts.down_proj", (e, hidden, inter), expert=ExpertTensor(layer, None, "down"))]
    out = []
    for x in range(e):
        q = f"{m}experts.{x}."
        out += [Weight(q + "gate_proj.weight", (inter, hidden), expert=ExpertTensor(layer, x, "gate")),
                Weight(q + "up_proj.weight", (inter, hidden), expert=ExpertTensor(layer, x, "up")),
                Weight(q + "down_proj.weight", (hidden, inter), expert=ExpertTensor(layer, x, "down"))]
    return out


class CausalLM(nn.Module, ABC):
    cfg: ModelConfig
    dtype: torch.dtype
    device: torch.device
    # True: the constructor takes par (moetier/parallel.Parallel) and its checkpoint_weights() give the
    # tensor-parallel splits; other families refuse tensor parallelism (expert parallelism lives in
    # the expert placement and needs nothing from the model).
    tensor_parallel: bool = False
    par: Parallel = Parallel()  # this rank; one rank for the families without tensor parallelism
    # [1] int64 on the device, set by the decode graphs (engine/graphs.py): a replay's count of real rows,
    # the padding after them. None: no graphs; an eager step's rows are all real.
    real_rows: torch.Tensor | None = None

    @classmethod
    @abstractmethod
    def checkpoint_weights(cls, cfg: ModelConfig, present: set[str]) -> list[Weight]:
        """Every tensor a checkpoint of cfg holds, in storage order. `present`: the names a checkpoint
        holds, where the family admits several layouts (fused or per-expert)."""

    @abstractmethod
    def param(self, name: str) -> torch.Tensor | None:
        """The tensor (or slice) checkpoint tensor `name` fills; None: read and not kept (a tied copy)."""

    def kv_spec(self) -> KVSpec:
        return self.kv_spec_of(self.cfg, self.par)

    @classmethod
    @abstractmethod
    def kv_spec_of(cls, cfg: ModelConfig, par: Parallel) -> KVSpec:
        """What one token's KV holds on one rank of par, from the config alone (the memory plan asks
        before any model exists)."""

    @abstractmethod
    def moe_blocks(self) -> list[MoEBlock]:
        ...

    @abstractmethod
    def forward(self, input_ids: torch.Tensor, batch: AttnBatch, kv: KVCache) -> torch.Tensor:
        ...

    @abstractmethod
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        ...

    def outer_param(self, name: str) -> torch.Tensor | None | bool:
        """The embedding, final norm and LM head, for families that keep them as self.embed, self.norm
        and self.lm_head; False: `name` is none of them."""
        if name == "model.embed_tokens.weight":
            return self.embed
        if name == "model.norm.weight":
            return self.norm
        if name == "lm_head.weight":
            return None if self.cfg.tie_word_embeddings else self.lm_head
        return False

    def hold_excluded_plain(self) -> None:
        """Under dense_weights "keep" (cfg.dense_quant), the kept weights holding a module the
        checkpoint's quantization_config leaves unquantized (exclude_modules, ignore) become model-dtype
        parameters again, whole (a fused weight with one such part too: the loader dequantizes the
        others into it). Decided from config.json alone, so the plan's model (meta) and the loaded one
        hold the same weights. The families with kept weights call this last in their constructor."""
        from moetier.layers.param import param
        from moetier.layers.quant_linear import destination
        from moetier.quant.quant_config import excluded

        cfg = self.cfg
        if not cfg.dense_quant:
            return
        plain = {id(d.owner) for w in type(self).checkpoint_weights(cfg, set())
                 if w.expert is None and (d := destination(self.param(w.name))) is not None
                 and excluded(cfg.quant_config or {}, w.name.removesuffix(".weight"))}
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if id(child) in plain:  # a Parameter replaces the submodule (nn.Module.__setattr__)
                    setattr(module, name, param(*child.shape, dtype=self.dtype, device=self.device))

    def expert_stats(self) -> dict[str, int]:
        """The expert backends' counters summed over layers (one host read per layer; between steps)."""
        total = dict.fromkeys(COUNTERS, 0)
        for block in self.moe_blocks():
            for k, v in block.experts.stats().items():
                total[k] = total.get(k, 0) + v  # a backend may count more (hybrid: host)
        return total

    def reset_experts(self) -> None:
        for block in self.moe_blocks():
            block.experts.reset()
