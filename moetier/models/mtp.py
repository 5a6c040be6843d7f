"""Multi-token-prediction (MTP) layers of the DeepSeek-V3 family (deepseek_v3, glm_moe_dsa), and of
qwen3_moe checkpoints that store one in the same shape (the embedded tiny-stdlib: scripts/train_mtp.py),
the draft model of speculative decoding (docs/speculative.md). Checkpoint layer num_hidden_layers + d
(d < num_nextn_predict_layers) holds, besides a whole MoE decoder layer of its own (attention with
its KV, GLM-5's indexer, router, shared and routed experts):

    enorm, hnorm [H]      RMSNorms of the next token's embedding and of the previous hidden state
    eh_proj [H, 2H]       their concatenation [enorm(e) | hnorm(h)] projected back to H
    shared_head.norm [H]  the norm before the head
    embed_tokens, shared_head.head   copies of the model's embedding and LM head: not read (the
                          model's own are used, as transformers' MtpModel does)

One draft step, for the row that pairs the token t_{i+1} with the hidden state h_i that predicted it
(position i: the MTP layer's KV row sits beside the target's row of position i, in the same pages):

    x = decoder_layer(eh_proj([enorm(embed(t_{i+1})) | hnorm(h_i)]))
    h' = shared_head.norm(x);  logits = lm_head(h')           -> the token at i + 2

Chaining (k drafts): draft j runs MTP layer j % num_nextn_predict_layers on (its draft token, the h'
of draft j - 1), one position on: transformers 5.24's MtpModel chains its layers so (h' after the
norm). NOTE: vLLM chains the pre-norm x instead; where the checkpoints were trained one way the
other costs acceptance, never correctness (verification is exact either way).
"""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn.functional as F
from torch import nn

from moetier.errors import MoetierError
from moetier.layers.norm import add_rms_norm, rms_norm
from moetier.layers.param import param
from moetier.models.base import Weight

MTP_FAMILIES = ("deepseek_v3", "glm_moe_dsa", "qwen3_moe")
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# the MTP layer's own tensors besides its decoder layer; (name, shape as a function of H, V), kept
_OWN = (("enorm.weight", lambda h, v: (h,)), ("hnorm.weight", lambda h, v: (h,)),
        ("eh_proj.weight", lambda h, v: (h, 2 * h)), ("shared_head.norm.weight", lambda h, v: (h,)))
# copies of the model's embedding and head that some exporters write: known, not read
_COPIES = (("embed_tokens.weight", lambda h, v: (v, h)), ("shared_head.head.weight", lambda h, v: (v, h)))


def with_mtp(cfg, on: bool):
    """cfg with its MTP layers loaded (on) or skipped; one clear line where there are none to load."""
    if not on:
        return dataclasses.replace(cfg, mtp_layers=0) if getattr(cfg, "mtp_layers", 0) else cfg
    if cfg.model_type not in MTP_FAMILIES:
        raise MoetierError(f"speculative method mtp: {cfg.model_type} has no MTP layers moetier can load (it loads "
                           f"them for {', '.join(MTP_FAMILIES)}); use method ngram")
    if not cfg.num_nextn_predict_layers:
        raise MoetierError("speculative method mtp: this checkpoint has no MTP layers (num_nextn_predict_layers is "
                           "0 in its config.json); use method ngram")
    return dataclasses.replace(cfg, mtp_layers=cfg.num_nextn_predict_layers)


def mtp_own_weights(prefix: str, hidden: int, vocab: int, loaded: bool) -> list[Weight]:
    """The MTP layer's own tensors under prefix ("model.layers.{N}."): required when loaded, the
    copies always optional (the loader reads nothing the model does not keep)."""
    own = [Weight(prefix + n, s(hidden, vocab), optional=not loaded) for n, s in _OWN]
    return own + [Weight(prefix + n, s(hidden, vocab), optional=True) for n, s in _COPIES]


def mtp_weights(layer_weights, cfg, present: set[str]) -> list[Weight]:
    """The MTP layers of cfg's checkpoint (layers num_layers ..): each a MoE decoder layer, its tensors
    from the family's layer_weights(cfg, layer, present, moe=True), plus its own. The first
    cfg.mtp_layers are loaded (required; their routed experts go to the tiers like any layer's); the
    rest optional and not kept (expert=None: no tier)."""
    out = []
    for d, layer in enumerate(range(cfg.num_layers, cfg.num_layers + cfg.num_nextn_predict_layers)):
        loaded = d < cfg.mtp_layers
        decoder = layer_weights(cfg, layer, present, True)
        out += decoder if loaded else [Weight(w.name, w.shape, optional=True) for w in decoder]
        out += mtp_own_weights(f"model.layers.{layer}.", cfg.hidden_size, cfg.vocab_size, loaded)
    return out


def layer_of(model, name: str) -> tuple[nn.Module, str] | torch.Tensor | None:
    """Checkpoint tensor `name` of a model with decoder `layers` and MtpHead list `mtp` -> (its decoder
    layer, the rest of the name: the family maps that), or an MTP layer's own tensor, or None (not a
    layer's tensor, a copy, or an MTP layer not loaded)."""
    cfg = model.cfg
    m = _LAYER.fullmatch(name)
    if not m or int(m.group(1)) >= cfg.num_layers + cfg.mtp_layers:
        return None
    i, rest = int(m.group(1)), m.group(2)
    if i < cfg.num_layers:
        return model.layers[i], rest
    head = model.mtp[i - cfg.num_layers]
    own = head.own_param(rest)
    return (head.block, rest) if own is False else own


class MtpHead(nn.Module):
    """One MTP layer around its decoder layer (`block`, the family's decoder layer of index
    num_layers + d: its attention writes that layer's KV rows)."""

    def __init__(self, hidden: int, eps: float, block: nn.Module, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps, self.block = eps, block
        self.enorm = param(hidden, dtype=dtype, device=device)
        self.hnorm = param(hidden, dtype=dtype, device=device)
        self.eh_proj = param(hidden, 2 * hidden, dtype=dtype, device=device)
        self.head_norm = param(hidden, dtype=dtype, device=device)

    def own_param(self, rest: str) -> torch.Tensor | None | bool:
        """The tensor of checkpoint name rest (after "model.layers.{N}."); None: a copy, not kept;
        False: the decoder layer's."""
        if rest in ("embed_tokens.weight", "shared_head.head.weight"):
            return None
        return {"enorm.weight": self.enorm, "hnorm.weight": self.hnorm, "eh_proj.weight": self.eh_proj,
                "shared_head.norm.weight": self.head_norm}.get(rest, False)

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # embeds, hidden [N, H] -> the decoder layer's input [N, H]
        e = rms_norm(embeds, self.enorm, self.eps)
        h = rms_norm(hidden.to(embeds.dtype), self.hnorm, self.eps)
        return F.linear(torch.cat([e, h], dim=-1), self.eh_proj)

    def finish(self, x: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        # the decoder layer's residual stream (x + delta) -> h' [N, H], the head's input
        return add_rms_norm(x, delta, self.head_norm, self.eps)[0]
