"""The peer users try first: Hugging Face transformers' Qwen3MoeForCausalLM with accelerate offloading.

`moetier bench decode` times our engine and this peer on the same weights, at an expert budget: the
share of routed-expert bytes allowed in GPU memory. Our slot cache keeps the rest in pinned host
memory; here the routed-experts modules of the last MoE layers go to "cpu" in an explicit device_map
and accelerate's hooks copy their weights to the GPU at every forward, which is what
`from_pretrained(device_map=..., max_memory=...)` sets up. The weights are ours (random, built in
memory): hf_state_dict is the inverse of moetier.loader.destination, and the HF model is built on
the meta device and filled tensor by tensor, so no second full copy of the model is ever held. GPU
tensors that already sit on the GPU contiguously are shared, not copied; offloaded experts are
copied into ordinary pageable CPU memory, as from_pretrained leaves them.

A routing override makes the peer route by a trace the way moetier.traces.hooks.Replayer makes our
engine do: token i of the run gets the trace's ids of token i (mod length), MoE layer j traced
layer j (mod L); the weights stay computed (softmax probabilities at the forced ids, renormalised
when the model renormalises).
"""

from __future__ import annotations

import inspect
import statistics
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.nn.functional as F

from moetier.errors import MoetierError
from moetier.models.base import CausalLM
from moetier.models.qwen3_moe import Qwen3MoeForCausalLM

EXPERTS = "model.layers.{}.mlp.experts"


def expert_rows(model: CausalLM) -> dict[int, torch.Tensor]:
    """[E, R] rows of every MoE layer wherever its backend keeps them: the device (resident) or the host
    store (slots, uva)."""
    out = {}
    for block in model.moe_blocks():
        rows = getattr(block.experts, "rows", None)
        out[block.layer] = rows if rows is not None else block.experts.host
    return out


def hf_state_dict(model: CausalLM, fused_experts: bool = True,
                  rows: dict[int, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the Hugging Face checkpoint of `model`, as views of our parameters: the model's
    own checkpoint map (checkpoint_weights, param) read backwards.

    fused_experts: transformers 5 names (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]);
    otherwise per-expert mlp.experts.{e}.{gate,up,down}_proj.weight. A tied lm_head is not yielded.
    rows: MoE layer -> its experts' rows [E, R] (default: where the model's backends keep them).
    """
    cfg = model.cfg
    rows = rows if rows is not None else expert_rows(model)
    present = {f"model.layers.{i}.mlp.experts.gate_up_proj" for i in cfg.moe_layers} if fused_experts else set()
    layout = cfg.moe_shape.layout
    for w in type(model).checkpoint_weights(cfg, present):
        if w.expert is not None:
            yield w.name, layout.part(rows[w.expert.layer], w.expert.part, w.expert.expert)
        elif (t := model.param(w.name)) is not None:
            yield w.name, t


def hf_config(model: Qwen3MoeForCausalLM):
    from transformers import Qwen3MoeConfig

    d = model.cfg.to_hf_dict()
    d.pop("architectures"), d.pop("model_type")
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta")}
    d["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    return Qwen3MoeConfig(**d)


def offloaded_layers(moe_layers: list[int], expert_budget: float) -> list[int]:
    """The MoE layers whose experts leave the GPU: the last round(L * (1 - budget))."""
    if not 0.0 <= expert_budget <= 1.0:
        raise MoetierError(f"the expert budget must be within 0..1, got {expert_budget}")
    n = round(len(moe_layers) * (1.0 - expert_budget))
    return moe_layers[len(moe_layers) - n:] if n else []


def device_map_for(cfg, offloaded: list[int], main) -> dict:
    """Whole decoder layers on `main`; in offloaded layers every module but the routed experts."""
    if not offloaded:
        return {"": main}
    dm = {"model.embed_tokens": main, "model.rotary_emb": main, "model.norm": main, "lm_head": main}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        if i not in offloaded:
            dm[p] = main
            continue
        for m in ("self_attn", "input_layernorm", "post_attention_layernorm", "mlp.gate"):
            dm[f"{p}.{m}"] = main
        dm[EXPERTS.format(i)] = "cpu"
    return dm


def _set_tensor(root: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    path, _, leaf = name.rpartition(".")
    module = root.get_submodule(path)
    if leaf in module._parameters:
        module._parameters[leaf] = torch.nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[leaf] = value


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Expert tensors [E, ., .] are strided views of rows. Across devices copy expert by expert: each
    slice is contiguous, so pinned rows go to the GPU by DMA, where copy_ would stage the whole tensor
    in a contiguous CPU temporary first. Within the CPU one copy_ is faster (it runs on every core)."""
    if src.dim() < 3 or src.is_contiguous() or src.device == dst.device:
        dst.copy_(src)
        return
    for e in range(src.shape[0]):
        dst[e].copy_(src[e])


@dataclass
class HFPeer:
    model: torch.nn.Module | None  # transformers Qwen3MoeForCausalLM, dispatched (None once closed)
    device: torch.device
    device_map: dict
    offloaded: list[int]  # MoE layers whose experts sit in CPU memory
    report: dict = field(default_factory=dict)
    _route: object = None

    def details(self) -> dict:
        import accelerate
        import transformers

        c = self.model.config
        return {"transformers": transformers.__version__, "accelerate": accelerate.__version__,
                "experts_implementation": getattr(c, "_experts_implementation", None),
                "attn_implementation": getattr(c, "_attn_implementation", None),
                "offload": "accelerate dispatch_model; offloaded experts in pageable CPU memory",
                "routing_override": self._route is not None, **self.report}

    def replay(self, ids) -> None:
        """Route by a trace: ids [N, L, k] (None: the model's own routing again)."""
        if self._route is not None:
            self._route.close()
            self._route = None
        if ids is not None:
            self._route = _RouteOverride(self.model, torch.as_tensor(ids), self.device)

    def close(self) -> None:
        """Drop the peer's weights (the GPU copies and the pageable CPU copies)."""
        import gc

        self.replay(None)
        self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.no_grad()
    def decode(self, prompt_ids: list[list[int]], new_tokens: int, warmup: int = 1) -> dict:
        """Greedy, as `bench decode` times our engine: untimed until every sequence has `warmup` output
        tokens (the prefill's one included), then `new_tokens` timed decode steps of one token per
        sequence. tokens [B, max(warmup, 1) + new_tokens]."""
        from transformers import DynamicCache

        if len({len(p) for p in prompt_ids}) != 1:
            raise MoetierError("the HF peer decodes prompts of equal length only (no padding)")
        if new_tokens < 1:
            raise MoetierError(f"new_tokens must be >= 1, got {new_tokens}")
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)  # [B, P]
        b = ids.shape[0]
        params = inspect.signature(type(self.model).forward).parameters
        key = "cache" if "cache" in params else "past_key_values"
        cache = DynamicCache(config=self.model.config)

        def step(x: torch.Tensor) -> torch.Tensor:
            out = self.model(input_ids=x, use_cache=True, logits_to_keep=1, **{key: cache})
            return out.logits[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]

        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        t0 = time.perf_counter()
        tokens = [step(ids)]
        sync()
        prefill_s = time.perf_counter() - t0
        for _ in range(warmup - 1):
            tokens.append(step(tokens[-1]))
        sync()
        times = []
        last = time.perf_counter()
        for _ in range(new_tokens):
            tokens.append(step(tokens[-1]))
            sync()
            now = time.perf_counter()
            times.append(now - last)
            last = now
        seconds = sum(times)
        return {"batch": b, "prompt_len": ids.shape[1], "prefill_s": prefill_s, "timed_tokens": b * new_tokens,
                "timed_steps": new_tokens, "seconds": seconds, "tok_s": b * new_tokens / seconds,
                "tok_s_median_step": b / statistics.median(times),
                "step_ms_median": statistics.median(times) * 1e3, "step_ms_mean": seconds / new_tokens * 1e3,
                "tokens": torch.cat(tokens, dim=1).tolist(), "peer": self.details()}


class _RouteOverride:
    """Wraps each HF router's output: top-k ids from `ids` [N, L, k], weights gathered from the softmax."""

    def __init__(self, hf, ids: torch.Tensor, device: torch.device):
        c = hf.config
        if ids.dim() != 3 or ids.shape[2] != c.num_experts_per_tok or ids.shape[0] == 0:
            raise MoetierError(f"routing ids must be [N, L, {c.num_experts_per_tok}], got {tuple(ids.shape)}")
        if int(ids.min()) < 0 or int(ids.max()) >= c.num_experts:
            raise MoetierError(f"routing ids must lie in 0..{c.num_experts - 1}")
        self.ids = ids.to(device=device, dtype=torch.long)
        self.norm = c.norm_topk_prob
        self.cursor = torch.zeros(1, dtype=torch.long, device=device)
        gates = [(i, layer.mlp.gate) for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
        self.last = gates[-1][0]
        self.handles = [g.register_forward_hook(self._hook(i, j % ids.shape[1])) for j, (i, g) in enumerate(gates)]

    def _hook(self, layer: int, slot: int):
        def hook(module, args, output):
            logits = output[0]  # [T, E]
            t = logits.shape[0]
            rows = (self.cursor + torch.arange(t, device=logits.device)) % self.ids.shape[0]
            ids = self.ids[rows, slot].to(logits.device)  # [T, k]
            weights = F.softmax(logits, dim=-1, dtype=torch.float32).gather(1, ids)
            if self.norm:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            if layer == self.last:
                self.cursor.add_(t)
            return (logits, weights.to(logits.dtype), ids, *output[3:])
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def build_hf_peer(model: CausalLM, expert_budget: float, device: str | torch.device = "cuda",
                  host_rows: dict[int, torch.Tensor] | None = None) -> HFPeer:
    """transformers' Qwen3MoeForCausalLM holding `model`'s weights, the experts of the last MoE layers
    offloaded to CPU memory through accelerate so that a share 1 - expert_budget of expert bytes is off
    the GPU. GPU-side tensors already on `device` (contiguous, same dtype) are shared with `model`.
    host_rows: MoE layer -> expert rows [E, R] to read instead of the model's own (hf_state_dict)."""
    from accelerate import dispatch_model, init_empty_weights
    from transformers import Qwen3MoeForCausalLM as HFModel

    if not isinstance(model, Qwen3MoeForCausalLM):
        raise MoetierError(f"the transformers peer is built for qwen3_moe models only, not {model.cfg.model_type}")
    main = torch.device(device)
    if main.type == "cuda" and main.index is None:
        main = torch.device("cuda", torch.cuda.current_device())
    config = hf_config(model)
    with init_empty_weights():
        hf = HFModel(config)
    hf.eval()
    names = dict(hf.named_parameters(remove_duplicate=False))
    fused = not any(".mlp.experts.0." in n for n in names)  # transformers 5: 3-D expert tensors
    offloaded = offloaded_layers(model.cfg.moe_layers, expert_budget)
    off_prefixes = tuple(EXPERTS.format(i) + "." for i in offloaded)
    acc = {"gpu_bytes": 0, "shared_bytes": 0, "offloaded_bytes": 0, "expert_bytes": 0, "expert_bytes_offloaded": 0}
    seen = set()
    for name, src in hf_state_dict(model, fused, host_rows):
        if name not in names or names[name].shape != src.shape:
            raise MoetierError(f"transformers' Qwen3MoeForCausalLM has no tensor {name} {tuple(src.shape)}")
        seen.add(name)
        nbytes = src.numel() * src.element_size()
        off = name.startswith(off_prefixes)
        target = torch.device("cpu") if off else main
        if not off and src.device == target and src.is_contiguous():
            dst = src  # shared with our model
            acc["shared_bytes"] += nbytes
        else:
            dst = torch.empty(src.shape, dtype=src.dtype, device=target)  # pageable on the CPU
            _copy(dst, src)
        acc["offloaded_bytes" if off else "gpu_bytes"] += nbytes
        if ".mlp.experts." in name:
            acc["expert_bytes"] += nbytes
            acc["expert_bytes_offloaded"] += nbytes if off else 0
        _set_tensor(hf, name, dst)
    if model.cfg.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
        seen.add("lm_head.weight")
    missing = sorted(set(names) - seen)
    if missing:
        raise MoetierError(f"no weights for {len(missing)} HF tensors, e.g. {missing[:3]}")
    for name, buf in list(hf.named_buffers()):
        _set_tensor(hf, name, buf.to(main))
    device_map = device_map_for(model.cfg, offloaded, main)
    # as from_pretrained(device_map=...) calls it; skip_keys keeps the KV cache where it is
    dispatch_model(hf, device_map=device_map, main_device=main,
                   skip_keys=getattr(hf, "_skip_keys_device_placement", None))
    moe = len(model.cfg.moe_layers)
    where = (f"routed experts of the last {len(offloaded)} of {moe} MoE layers "
             f"({offloaded[0]}..{offloaded[-1]}) on cpu, the rest on {main}") if offloaded else f"all on {main}"
    report = {"expert_budget": expert_budget, "offloaded_layers": len(offloaded), **acc,
              "offloaded_share": acc["expert_bytes_offloaded"] / max(acc["expert_bytes"], 1),
              "device_map": where, "device_map_entries": len(device_map)}
    return HFPeer(hf, main, device_map, offloaded, report)
