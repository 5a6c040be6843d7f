"""The decoder the DeepSeek-V3 family shares (deepseek_v3, glm_moe_dsa): its checkpoint names, its
layers, its forward. The families differ in config fields and in GLM-5's DSA indexer, which they
add through the hooks `make_indexer`, `index_keys`, `indexer_weights` and `indexer_param`.

Decoder layer: x + mla(rms(x)); then h + mlp(rms(h)), where mlp is a dense SwiGLU for the leading
dense layers (mlp_layer_types "dense") and otherwise a MoEBlock: grouped sigmoid router, routed
experts through the expert backend, plus the dense shared experts on the device.

Checkpoint layers num_hidden_layers .. num_hidden_layers + num_nextn_predict_layers - 1 are the
multi-token-prediction (MTP) layers of the published checkpoints (models/mtp.py): optional weights,
never read, unless cfg.mtp_layers says to load them (models/mtp.with_mtp); then each is an MtpHead
around a decoder layer of its own index (KV rows, experts in the model's tiers) and draft() runs it.

Tensor parallelism (par.tp > 1, docs/parallel.md): the attention is split by query heads
(layers/mla_attention.py: q_b / q_proj, kv_b and o_proj; the latent path, its cache and the DSA
indexer replicated), the dense MLP and the shared experts by columns (layers/mlp.py, each with its
own all-reduce); the embedding, norms, router, routed experts and LM head are replicated (expert
parallelism splits the routed experts). Weight.split in layer_weights() says which checkpoint dim
each rank slices.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetier.layers.attention import AttnBatch
from moetier.layers.kv_cache import MlaKVCache, MlaKVSpec
from moetier.layers.mla_attention import MlaAttention
from moetier.layers.mlp import SwigluMLP
from moetier.layers.moe import MoEBlock
from moetier.layers.norm import add_rms_norm
from moetier.layers.param import param
from moetier.layers.rotary import rope_cos_sin
from moetier.layers.router import GroupedSigmoidTopK
from moetier.models.base import CausalLM, Weight, routed_expert_weights
from moetier.models.mla_config import MlaMoeConfig
from moetier.models.mtp import MtpHead, layer_of, mtp_weights
from moetier.parallel import Parallel

class MlaDecoderLayer(nn.Module):
    def __init__(self, cfg: MlaMoeConfig, layer: int, indexer: nn.Module | None, dtype: torch.dtype,
                 device: torch.device | str, par: Parallel):
        super().__init__()
        self.layer, self.eps = layer, cfg.rms_norm_eps
        h = cfg.hidden_size
        self.input_norm = param(h, dtype=dtype, device=device)
        self.post_norm = param(h, dtype=dtype, device=device)
        held = cfg.dense_quant  # kept in the checkpoint's format (None: the model dtype)
        self.attn = MlaAttention(layer, h, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                                 cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.attention_bias, cfg.softmax_scale,
                                 cfg.rope_interleave, dtype, device, indexer, held, par)
        if cfg.is_moe_layer(layer):
            router = GroupedSigmoidTopK(cfg.num_experts, h, cfg.top_k, cfg.n_group, cfg.topk_group,
                                        cfg.norm_topk_prob, cfg.routed_scaling_factor, device)
            # column-split under TP, with its own all-reduce inside shared(x): MoEBlock adds it after
            # the routed experts' output (whole on every rank: replicated, or summed over EP ranks)
            shared = (SwigluMLP(h, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype, device, par, held,
                                "the shared experts' width (moe_intermediate_size x n_shared_experts)")
                      if cfg.n_shared_experts else None)
            self.mlp: MoEBlock | SwigluMLP = MoEBlock(layer, router, shared)
        else:
            self.mlp = SwigluMLP(h, cfg.intermediate_size, dtype, device, par, held)

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                batch: AttnBatch, kv: MlaKVCache, topk: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The residual stream enters as x + delta and leaves the same way (see qwen3_moe); topk: the
        DSA selection of the last indexer layer, passed on to 'shared' layers."""
        h, x = add_rms_norm(x, delta, self.input_norm, self.eps)
        a, topk = self.attn(h, cos, sin, batch, kv, topk)
        h, x = add_rms_norm(x, a, self.post_norm, self.eps)
        return x, self.mlp(h), topk


def _swiglu_weights(prefix: str, hidden: int, inter: int) -> list[Weight]:
    # tensor parallelism: gate and up by output columns, down by its input (layers/mlp.py)
    return [Weight(prefix + "gate_proj.weight", (inter, hidden), split=0),
            Weight(prefix + "up_proj.weight", (inter, hidden), split=0),
            Weight(prefix + "down_proj.weight", (hidden, inter), split=1)]


def mlp_param(mlp: MoEBlock | SwigluMLP, rest: str) -> torch.Tensor | None:
    """Where checkpoint tensor mlp.<...> of a decoder layer goes (`rest` from "mlp." on): the router's
    gate and correction bias, the shared experts' or the dense MLP's projections."""
    if rest == "mlp.gate.weight":
        return mlp.router.weight
    if rest == "mlp.gate.e_score_correction_bias":
        return mlp.router.bias
    if rest.startswith("mlp.shared_experts."):
        mlp, rest = mlp.shared, "mlp." + rest[len("mlp.shared_experts."):]
    return mlp.part(rest[len("mlp."):].removesuffix(".weight"))


class MlaMoeForCausalLM(CausalLM):
    cfg: MlaMoeConfig
    tensor_parallel = True

    def __init__(self, cfg: MlaMoeConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
                 par: Parallel = Parallel()):
        super().__init__()
        self.cfg, self.dtype, self.device, self.par = cfg, dtype, torch.device(device), par
        self.embed = param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            MlaDecoderLayer(cfg, i, self.make_indexer(cfg, i, dtype, device), dtype, device, par)
            for i in range(cfg.num_layers))
        self.norm = param(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head = self.embed if cfg.tie_word_embeddings else param(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        n = cfg.num_layers
        self.mtp = nn.ModuleList(
            MtpHead(cfg.hidden_size, cfg.rms_norm_eps, MlaDecoderLayer(
                cfg, n + d, self.make_indexer(cfg, n + d, dtype, device), dtype, device, par), dtype, device)
            for d in range(cfg.mtp_layers))
        self.register_buffer("inv_freq", cfg.inv_freq().to(device), persistent=False)
        self.hold_excluded_plain()

    # -- family hooks (GLM-5's DSA indexer) --

    @classmethod
    def make_indexer(cls, cfg: MlaMoeConfig, layer: int, dtype: torch.dtype, device: torch.device | str
                     ) -> nn.Module | None:
        return None

    @classmethod
    def index_keys(cls, cfg: MlaMoeConfig) -> tuple[int, tuple[int, ...]]:
        """(indexer key width, the layers whose indexer keys the KV cache holds)."""
        return 0, ()

    @classmethod
    def indexer_weights(cls, cfg: MlaMoeConfig, prefix: str, layer: int) -> list[Weight]:
        return []

    def indexer_param(self, indexer: nn.Module, rest: str) -> torch.Tensor | None:
        return None

    # -- checkpoint --

    @classmethod
    def layer_weights(cls, cfg: MlaMoeConfig, layer: int, present: set[str], moe: bool) -> list[Weight]:
        """The tensors of decoder layer `layer` (routed experts as ExpertTensor of `layer`). split=0 on
        q_b / q_proj / kv_b (rows grouped by head) and split=1 on o_proj (its input: the heads) give
        each TP rank its contiguous heads; the latent path (q_a, kv_a, their norms and biases) and the
        indexer are replicated."""
        h, hq, r, p = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
        pre = f"model.layers.{layer}."
        a = pre + "self_attn."
        out = [Weight(pre + "input_layernorm.weight", (h,)), Weight(pre + "post_attention_layernorm.weight", (h,))]
        bias = cfg.attention_bias
        if cfg.q_lora_rank:
            ql = cfg.q_lora_rank
            out += [Weight(a + "q_a_proj.weight", (ql, h))] + ([Weight(a + "q_a_proj.bias", (ql,))] if bias else [])
            out += [Weight(a + "q_a_layernorm.weight", (ql,)),
                    Weight(a + "q_b_proj.weight", (hq * cfg.qk_head_dim, ql), split=0)]
        else:
            out.append(Weight(a + "q_proj.weight", (hq * cfg.qk_head_dim, h), split=0))
        out.append(Weight(a + "kv_a_proj_with_mqa.weight", (r + p, h)))
        if bias:
            out.append(Weight(a + "kv_a_proj_with_mqa.bias", (r + p,)))
        out += [Weight(a + "kv_a_layernorm.weight", (r,)),
                Weight(a + "kv_b_proj.weight", (hq * (cfg.qk_nope_head_dim + cfg.v_head_dim), r), split=0),
                Weight(a + "o_proj.weight", (h, hq * cfg.v_head_dim), split=1)]
        if bias:
            out.append(Weight(a + "o_proj.bias", (h,)))
        out += cls.indexer_weights(cfg, a + "indexer.", layer)
        m = pre + "mlp."
        if not moe:
            return out + _swiglu_weights(m, h, cfg.intermediate_size)
        e, mi = cfg.num_experts, cfg.moe_intermediate_size
        out += [Weight(m + "gate.weight", (e, h), float32=True),
                Weight(m + "gate.e_score_correction_bias", (e,), float32=True)]
        if cfg.n_shared_experts:
            out += _swiglu_weights(m + "shared_experts.", h, mi * cfg.n_shared_experts)
        return out + routed_expert_weights(m, layer, e, h, mi, present)

    @classmethod
    def checkpoint_weights(cls, cfg: MlaMoeConfig, present: set[str]) -> list[Weight]:
        out = [Weight("model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))]
        for layer in range(cfg.num_layers):
            out += cls.layer_weights(cfg, layer, present, cfg.is_moe_layer(layer))
        out.append(Weight("model.norm.weight", (cfg.hidden_size,)))
        out.append(Weight("lm_head.weight", (cfg.vocab_size, cfg.hidden_size), optional=cfg.tie_word_embeddings))
        return out + mtp_weights(cls.layer_weights, cfg, present)  # DeepSeek-V3 / GLM-5 layout

    def param(self, name: str) -> torch.Tensor | None:
        if (outer := self.outer_param(name)) is not False:
            return outer
        found = layer_of(self, name)
        if not isinstance(found, tuple):  # not a layer's tensor, or an MTP layer's own
            return found
        layer, rest = found
        if rest == "input_layernorm.weight":
            return layer.input_norm
        if rest == "post_attention_layernorm.weight":
            return layer.post_norm
        if rest.startswith("self_attn.indexer."):
            return self.indexer_param(layer.attn.indexer, rest[len("self_attn.indexer."):])
        if rest.startswith("self_attn."):
            return layer.attn.part(rest[len("self_attn."):])
        return mlp_param(layer.mlp, rest)

    # -- runtime --

    @classmethod
    def kv_spec_of(cls, cfg: MlaMoeConfig, par: Parallel) -> MlaKVSpec:
        # whole under tensor parallelism: the latent is shared by all heads, so every rank holds (and
        # writes) all of it; loaded MTP layers (cfg.mtp_layers) have KV rows of their own
        return MlaKVSpec(cfg.num_layers + cfg.mtp_layers, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                         *cls.index_keys(cfg))

    def moe_blocks(self) -> list[MoEBlock]:
        layers = [*self.layers, *(head.block for head in self.mtp)]
        return [layer.mlp for layer in layers if isinstance(layer.mlp, MoEBlock)]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: AttnBatch, kv: MlaKVCache) -> torch.Tensor:
        # input_ids: [N] -> last hidden states [N, H]
        cos, sin = rope_cos_sin(batch.positions, self.inv_freq, self.dtype, self.cfg.rope_attention_factor)
        x, delta, topk = F.embedding(input_ids, self.embed), None, None
        for layer in self.layers:
            x, delta, topk = layer(x, delta, cos, sin, batch, kv, topk)
        return add_rms_norm(x, delta, self.norm, self.cfg.rms_norm_eps)[0]

    @torch.inference_mode()
    def draft(self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: AttnBatch, kv: MlaKVCache, depth: int = 0,
              rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One MTP draft step (models/mtp.py): input_ids [N], each row's next token, hidden [N, H] the
        hidden state that predicted it (forward()'s output, or the previous draft step's), batch at
        the positions of those hidden states -> (logits [N, V] float32, the hidden state to chain).
        rows [R]: only these rows' logits and hidden states ([R, V], [R, H]); every row still writes
        its KV (a prefill chunk's catch-up needs the logits of its last row alone)."""
        head = self.mtp[depth % len(self.mtp)]
        cos, sin = rope_cos_sin(batch.positions, self.inv_freq, self.dtype, self.cfg.rope_attention_factor)
        x = head.project(F.embedding(input_ids, self.embed), hidden)
        x, delta, _ = head.block(x, None, cos, sin, batch, kv, None)
        out = head.finish(x, delta)
        if rows is not None:
            out = out[rows]
        return self.logits(out), out

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [T, H] -> [T, V] float32
        return F.linear(hidden, self.lm_head).float()
