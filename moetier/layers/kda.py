"""Kimi Delta Attention (KDA), GLM-5.3-Flash's linear-attention layer, over the per-sequence state
pool (layers/state_cache.py) instead of KV pages.

    x [N, H] -> [q | k | v | f_a(x) | g_a(x) | b_proj(x)] = x W_in^T   [N, 3D + 2d + heads]
                (D = heads * head_dim = heads * d; every projection of x in one GEMM)
    [q | k | v] -> causal depthwise conv (width W, float32 weights, its state: the last W - 1 inputs),
             silu -> q, k, v [N, heads, d]
    [f_b(f_a(x)), g_b(g_a(x))] = one batched GEMM over the stacked up-projections [2, D, d]
    forget gate g = f_b(f_a(x)) + dt_bias (float32), per head and channel:
             lower_bound * sigmoid(exp(A_log) g)   (a lower bound given: g in (lower_bound, 0))
             -exp(A_log) softplus(g)               (none)
    beta = sigmoid(b_proj(x))                                          [N, heads]
    o = the delta-rule recurrence (layers/kda_reference.py) from the sequence's carried state
    out = o_proj(rms_norm(o) * o_norm * sigmoid(g_b(g_a(x))))         (the gated norm per head, float32)

The fused projections replace seven GEMMs a layer by three (in, up, o_proj): at one token each
small GEMM was a launch (and a split-K reduce) for well under a megabyte (docs/models.md).

A step's sequences each read and write their state slot (batch.state_slots; a step starting at
position 0 starts from zeros). Decode steps (one token per sequence) run one batched recurrent step
with no host read (graph-safe shapes); other steps loop over their sequences on the host: the chunked
form for several tokens, the recurrent step for one. Same ops as transformers' Glm5NextTextLinear-
Attention, so float32 agrees to rounding.

On CUDA the recurrence runs in fla-core's kernels (layers/kda_cuda.py): decode updates the slots in
place inside the decode graph; prefill runs a step's sequences of up to 64 new tokens in fla's
recurrent kernel and the longer ones in its chunked kernel, one varlen launch per kind (_prefill_fla). The
decode conv is one Triton launch over the slots (layers/kda_conv_triton.py), prefill's one a sequence. A
decode row at position 0 (a one-token prompt) has its slot zeroed first from host integers, so such
a step runs eagerly (engine/graphs.DecodeGraphs.fits keeps it out of the graphs).
"""

from __future__ import annotations

import torch
from torch import nn

from moetier.layers.attention import AttnBatch
from moetier.layers.kda_cuda import RECURRENT_TOKENS, kda_decode_slots, kda_prefill_slot, kda_prefill_varlen
from moetier.layers.kda_reference import causal_conv, causal_conv_step, kda_chunked, kda_step
from moetier.layers.param import param
from moetier.layers.quant_linear import linear
from moetier.layers.state_cache import KdaStateCache

GATES_TOKENS = 64  # decode steps up to this many tokens take layers/kda_gates_triton (the graphs' sizes)


def on_fla(x: torch.Tensor) -> bool:
    """Whether this layer's recurrence runs in fla-core's kernels (CUDA) rather than the reference.
    NOTE: tests on the CPU point it at True, with the kernels swapped for references, to check the
    slot gathering, scattering and zeroing around the kernels."""
    return x.is_cuda


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x, gate: [..., d]; weight [d] -> float32 norm, float32 weight and sigmoid gate, back to x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf * torch.sigmoid(gate.float())).to(x.dtype)


def log_decay(low: torch.Tensor, dt_bias: torch.Tensor, a_log: torch.Tensor, lower_bound: float | None
              ) -> torch.Tensor:
    # low [N, heads * d] (f_b's output), dt_bias [heads * d], A_log [heads] -> [N, heads, d] float32 (<= 0)
    heads = a_log.shape[0]
    g = (low.float() + dt_bias).view(low.shape[0], heads, -1)
    rate = a_log.exp()[None, :, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * g)
    return -rate * torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))


class KdaAttention(nn.Module):
    def __init__(self, layer: int, hidden: int, heads: int, head_dim: int, conv_width: int,
                 lower_bound: float | None, norm_eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.layer, self.heads, self.d, self.eps, self.lower_bound = layer, heads, head_dim, norm_eps, lower_bound
        inner = heads * head_dim
        self.inner = inner
        # rows [q; k; v; f_a; g_a; b_proj]: every projection of x (the checkpoint's tensors are row blocks)
        self.in_proj = param(3 * inner + 2 * head_dim + heads, hidden, dtype=dtype, device=device)
        self.up_proj = param(2, inner, head_dim, dtype=dtype, device=device)  # [f_b, g_b]
        self.conv = param(3 * inner, 1, conv_width, dtype=torch.float32, device=device)  # [q; k; v] channels
        self.dt_bias = param(inner, dtype=torch.float32, device=device)
        self.A_log = param(heads, dtype=torch.float32, device=device)
        self.o_norm = param(head_dim, dtype=dtype, device=device)
        self.o_proj = param(hidden, inner, dtype=dtype, device=device)

    def part(self, name: str) -> torch.Tensor | None:
        """Where checkpoint tensor self_attn.<name> goes (q/k/v projections and convs are row blocks)."""
        i, d = self.inner, self.d
        rows = {"q_proj": (0, i), "k_proj": (i, 2 * i), "v_proj": (2 * i, 3 * i), "f_a_proj": (3 * i, 3 * i + d),
                "g_a_proj": (3 * i + d, 3 * i + 2 * d), "b_proj": (3 * i + 2 * d, 3 * i + 2 * d + self.heads)}
        stem = name.removesuffix(".weight")
        if name.endswith(".weight") and stem in rows:
            a, b = rows[stem]
            return self.in_proj[a:b]
        if name.endswith("_conv1d.weight") and name[0] in "qkv":
            a = "qkv".index(name[0]) * i
            return self.conv[a:a + i]
        return {"f_b_proj.weight": self.up_proj[0], "g_b_proj.weight": self.up_proj[1], "dt_bias": self.dt_bias,
                "A_log": self.A_log, "o_norm.weight": self.o_norm, "o_proj.weight": self.o_proj}.get(name)

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, H] -> (qkv [N, 3D] (strided rows), f_b(f_a(x)) [N, D], g_b(g_a(x)) [N, D], b_proj(x) [N, heads])."""
        n, i, d = x.shape[0], self.inner, self.d
        proj = linear(x, self.in_proj)
        low = proj[:, 3 * i: 3 * i + 2 * d].reshape(n, 2, d).transpose(0, 1)  # [2, N, d]: f_a(x), g_a(x)
        up = torch.bmm(low, self.up_proj.transpose(1, 2))  # [2, N, D]
        return proj[:, : 3 * i], up[0], up[1], proj[:, 3 * i + 2 * d:]

    def forget_gate(self, low: torch.Tensor) -> torch.Tensor:
        # low [N, D] (f_b(f_a(x))) -> g [N, heads, head_dim] float32, the log of each channel's decay (<= 0)
        if low.is_cuda:
            from moetier.layers import fused  # one launch for everything after the projections

            return fused.kda_forget_gate(low, self.dt_bias, self.A_log, self.lower_bound)
        return log_decay(low, self.dt_bias, self.A_log, self.lower_bound)

    def forward(self, x: torch.Tensor, batch: AttnBatch, state: KdaStateCache) -> torch.Tensor:
        """x: [N, H] -> [N, H]; reads and writes the sequences' state slots of this layer."""
        n = x.shape[0]
        if x.is_cuda and batch.max_query_len == 1 and n <= GATES_TOKENS:  # decode: the gates in one launch
            from moetier.layers.kda_gates_triton import kda_gates

            proj = linear(x, self.in_proj)
            qkv = proj[:, : 3 * self.inner]
            g, gate, beta = kda_gates(proj, self.up_proj, self.dt_bias, self.A_log, self.lower_bound, self.inner)
        else:
            qkv, low, gate, b = self.projections(x)
            g = self.forget_gate(low)
            beta = torch.sigmoid(b)
        row = state.state_slot[self.layer]
        conv, rec = state.conv[row], state.recurrent[row]
        slots = batch.state_slots if batch.state_slots is not None else torch.arange(
            batch.num_seqs, device=x.device)
        if batch.max_query_len == 1 and n == batch.num_seqs:
            o = self._decode(qkv, g, beta, conv, rec, slots.long(), batch)
        else:
            o = self._prefill(qkv, g, beta, conv, rec, batch)
        gate = gate.view(n, self.heads, self.d)
        if o.is_cuda:
            from moetier.layers import fused  # one launch for the gated norm

            normed = fused.gated_rms_norm(o, gate, self.o_norm, self.eps)
        else:
            normed = gated_rms_norm(o, gate, self.o_norm, self.eps)
        return linear(normed.reshape(n, self.inner), self.o_proj)

    def _split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # [N, 3D] -> q, k, v [N, heads, head_dim]
        return tuple(t.reshape(-1, self.heads, self.d) for t in mixed.split(self.inner, dim=-1))

    def _decode(self, qkv, g, beta, conv, rec, slots, batch) -> torch.Tensor:
        """One token per sequence, all sequences at once: gather the slots' states, one step, scatter
        back. A token at position 0 (a one-token prompt) starts from zeros (fixed shapes, no branch)."""
        if qkv.is_cuda:  # the same conv in one launch, the slots' states updated in place
            from moetier.layers.kda_conv_triton import conv_step_slots

            mixed = conv_step_slots(qkv, conv, self.conv, slots, batch.positions)
        else:
            conv_in = conv[slots] * (batch.positions > 0)[:, None, None].to(conv.dtype)
            mixed, conv_out = causal_conv_step(qkv, conv_in, self.conv)
            conv[slots] = conv_out
        q, k, v = self._split(mixed)
        if on_fla(qkv):
            # host integers only: a graph's batch says every context is long (no fresh row replays)
            host = batch.state_slots_host or list(range(batch.num_seqs))
            fresh = [s for s, n in zip(host, batch.seq_lens_host) if n == 1]
            if fresh:
                rec[torch.tensor(fresh, device=rec.device)] = 0
            return kda_decode_slots(q, k, v, g, beta, rec, slots)
        rec_in = rec[slots] * (batch.positions > 0)[:, None, None, None].float()
        o, rec_out = kda_step(q, k, v, g, beta, rec_in)
        rec[slots] = rec_out
        return o

    def _prefill_fla(self, q, k, v, g, beta, rec, batch, todo: list[int]) -> torch.Tensor:
        """fla's kernels (kda_cuda.py), chosen per sequence by its token count: up to RECURRENT_TOKENS
        the recurrent kernel, beyond it the chunked one; each kind in one varlen launch over its
        sequences' tokens (gathered when the other kind's sit between them), states gathered from and
        scattered to their slots by index. One short sequence alone (a prefix hit's tail, a short
        prompt) runs on a view of its slot: no host-to-device copy in the layer."""
        qs, lens = batch.query_start_host, batch.seq_lens_host
        slots = batch.state_slots_host or list(range(batch.num_seqs))
        short = [i for i in todo if qs[i + 1] - qs[i] <= RECURRENT_TOKENS]
        long = [i for i in todo if qs[i + 1] - qs[i] > RECURRENT_TOKENS]
        if len(todo) == 1 and short:
            a, b, slot = qs[todo[0]], qs[todo[0] + 1], slots[todo[0]]
            state = rec[slot:slot + 1]
            if lens[todo[0]] == b - a:  # the sequence starts here: from zeros
                state.zero_()
            return kda_prefill_slot(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], state)
        out = None
        for group, recurrent in ((short, True), (long, False)):
            if not group:
                continue
            spans = [(qs[i], qs[i + 1]) for i in group]
            starts = [0]
            for a, b in spans:
                starts.append(starts[-1] + b - a)
            whole = len(group) == len(todo)  # the step's tokens are this group's, in order
            xs = (q, k, v, g, beta) if whole else [torch.cat([x[a:b] for a, b in spans]) for x in (q, k, v, g, beta)]
            rows = torch.tensor([slots[i] for i in group], device=rec.device)
            keep = torch.tensor([lens[i] != qs[i + 1] - qs[i] for i in group], device=rec.device)
            initial = rec[rows] * keep[:, None, None, None].float()
            o, final = kda_prefill_varlen(*xs, initial, starts, recurrent=recurrent)
            rec[rows] = final
            if whole:
                return o
            if out is None:
                out = o.new_empty(q.shape[0], *o.shape[1:])
            for (a, b), s0 in zip(spans, starts):
                out[a:b] = o[s0:s0 + b - a]
        return out

    def _prefill(self, qkv, g, beta, conv, rec, batch) -> torch.Tensor:
        """Each sequence on its own (host integers): the conv from its carried state, then the chunked
        recurrence from its carried state (on CUDA: fla's kernels, _prefill_fla)."""
        qs, lens = batch.query_start_host, batch.seq_lens_host
        slots = batch.state_slots_host or list(range(batch.num_seqs))
        todo = [i for i in range(batch.num_seqs) if qs[i + 1] > qs[i]]
        if qkv.is_cuda:  # one launch a sequence, no float32 copy of the chunk
            from moetier.layers.kda_conv_triton import conv_prefill

            # q, k and v planes [3, T, D], each contiguous: fla's kernels take them without a copy
            planes = qkv.new_empty(3, qkv.shape[0], self.inner)
            for i in todo:
                a, b = qs[i], qs[i + 1]
                conv_prefill(qkv[a:b], conv[slots[i]], self.conv, lens[i] == b - a, out=planes[:, a:b])
            q, k, v = (x.view(-1, self.heads, self.d) for x in planes)
        else:
            mixed = torch.empty_like(qkv)
            for i in todo:
                a, b = qs[i], qs[i + 1]
                c0 = torch.zeros_like(conv[slots[i]]) if lens[i] == b - a else conv[slots[i]]
                mixed[a:b], conv[slots[i]] = causal_conv(qkv[a:b], c0, self.conv)
            q, k, v = self._split(mixed)
        if on_fla(qkv) and todo:
            return self._prefill_fla(q, k, v, g, beta, rec, batch, todo)
        out = qkv.new_empty(qkv.shape[0], self.heads, self.d)
        for i in todo:
            a, b = qs[i], qs[i + 1]
            slot, fresh = slots[i], lens[i] == b - a
            s0 = torch.zeros_like(rec[slot]) if fresh else rec[slot]
            if b - a == 1 and not fresh:
                o, s = kda_step(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s0[None])
                s = s[0]
            else:
                o, s = kda_chunked(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s0)
            rec[slot] = s
            out[a:b] = o
        return out
