"""The prefill chunk (tokens per engine step, EngineConfig.max_num_tokens) when the user sets none:
chosen from the memory plan, shown with its reason (`moetier plan`, the serve log, generate's
startup line), and counted in the plan, so preflight stays honest.

As `moetier bench chunk` measured (docs/bench-prefill.md, docs/measured-defaults.md):
  - every expert in device memory: a larger chunk trades the decodes' latency beside a long prompt
    for its TTFT at about the same rate, so RESIDENT_CHUNK, the middle ground;
  - experts off the GPU (slots short of every expert, uva, hybrid): a prefill step costs about the
    same at any size (the missing experts cross the link once per chunk), so small chunks do not
    spare the decodes and only lengthen the TTFT: as large as the activation budget allows, up to
    OFFLOAD_CAP. The budget is ACTIVATION_SHARE of the device budget: what the largest step's
    transients (activations and the large-step GEMM's scratch, which grows with tokens x top_k) may
    take from the expert slots, which automatic sizing gives every other byte.
A chunk whose plan does not fit is reduced (the largest ALIGN multiple down to MIN_CHUNK that fits)
and the reason says so with the numbers; when even MIN_CHUNK does not fit, the plan at MIN_CHUNK is
returned and preflight refuses it with its table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from moetier.experts.registry import backend_kind
from moetier.plan.memory import Plan, PlanRequest, count
from moetier.plan.split import SplitRefused
from moetier.plan.units import gib

RESIDENT_CHUNK = 2048
OFFLOAD_CAP = 8192
MIN_CHUNK = 512  # the floor of an automatic choice (the engine's default before it was chosen)
ACTIVATION_SHARE = 0.05
ALIGN = 256
ACTIVATIONS = "activations at the largest step"  # the plan item the chunk sizes (memory.count)


def choose_chunk(in_hbm: bool, bytes_at: Callable[[int], int], room: int | None, device: str = "cuda",
                 cap: int = OFFLOAD_CAP) -> tuple[int, str]:
    """-> (tokens, reason). in_hbm: every routed expert in device memory (or a CPU run: no link);
    bytes_at(tokens): the largest step's transient bytes at that chunk (monotone); room: the bytes
    they may take (None: no device budget known)."""
    if device != "cuda":
        return RESIDENT_CHUNK, f"{RESIDENT_CHUNK} tokens: a CPU run has no link to amortize"
    if in_hbm:
        return RESIDENT_CHUNK, (f"{RESIDENT_CHUNK} tokens: every routed expert in device memory, the measured "
                                "middle ground between a prompt's TTFT and the decodes' latency beside it")
    why = "experts off the GPU: a prefill step costs about the same at any size, so the largest chunk"
    if room is None:
        return cap, f"{cap} tokens: {why} (no device budget known: the cap)"
    tokens = largest(MIN_CHUNK, cap, lambda t: bytes_at(t) <= room) or MIN_CHUNK
    used = f"{gib(bytes_at(tokens))} of {gib(room)}, {ACTIVATION_SHARE:.0%} of the device budget"
    if tokens == cap:
        return cap, f"{cap} tokens, the cap: {why} ({used})"
    return tokens, f"{tokens} tokens: {why} whose activations fit their budget ({used})"


def largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int | None:
    """The largest multiple of ALIGN in [lo, hi] with ok(t) (ok is monotone: true up to some size), or
    None. A binary search: each ok() may count a whole plan."""
    lo_k, hi_k = -(-lo // ALIGN), hi // ALIGN
    if hi_k < lo_k or not ok(lo_k * ALIGN):
        return None
    while lo_k < hi_k:
        mid = (lo_k + hi_k + 1) // 2
        lo_k, hi_k = (mid, hi_k) if ok(mid * ALIGN) else (lo_k, mid - 1)
    return lo_k * ALIGN


def over(plan: Plan) -> int:
    """Bytes the plan's device side passes its budget by (<= 0: it fits; no budget: 0)."""
    return 0 if plan.gpu_budget is None else plan.device_total - plan.gpu_budget


def in_hbm(plan: Plan) -> bool:
    """Every routed expert in device memory: resident, or a cache with a slot for every expert."""
    kind = backend_kind(plan.backend)
    if not kind.host_store:
        return True
    return kind.cached and sum(plan.slots_per_layer.values()) * plan.row_bytes >= plan.expert_bytes


def activations(plan: Plan) -> int:
    return next((i.bytes for i in plan.device + plan.host if i.name.startswith(ACTIVATIONS)), 0)


def plan_with_chunk(req: PlanRequest, place: Callable[[PlanRequest], Plan]) -> Plan:
    """The plan with an automatic chunk (req.max_num_tokens is None). place(req): the plan of the
    run's expert options at req's chunk (preflight.plan_for). The backend is decided at MIN_CHUNK
    (a resident model is not pushed into offload by its chunk); under offload the slots are sized
    again at the chosen chunk (automatic sizing gives them the rest). -> plan, with plan.chunk."""
    probe = place(replace(req, max_num_tokens=MIN_CHUNK))
    hbm = in_hbm(probe)
    fixed = replace(req, backend=probe.backend, slots_per_layer=dict(probe.slots_per_layer))

    def plan_at(tokens: int) -> Plan:
        return place(replace(req, max_num_tokens=tokens))

    def why_not(plan: Plan) -> str | None:
        """Why a chunk's plan is refused ('' or None: it is fine)."""
        if over(plan) > 0:  # the device (the host's room does not depend on the chunk)
            return f"the plan was {gib(over(plan))} over the device budget"
        if hbm and not in_hbm(plan):  # a resident model is not offloaded for its chunk
            return "automatic sizing would no longer hold every expert in device memory"
        return None

    def bytes_at(tokens: int) -> int:
        return activations(count(replace(fixed, max_num_tokens=tokens)))

    def attempt(tokens: int) -> tuple[Plan | None, str | None]:
        """(the plan at this chunk, why it is refused); a split that cannot fit both budgets at this
        chunk is refused here, so a smaller chunk leaves its rows to pinned experts (plan/split.py)."""
        try:
            plan = plan_at(tokens)
        except SplitRefused:
            return None, "the experts would not fit the two budgets"
        return plan, why_not(plan)

    room = None if probe.gpu_budget is None else int(ACTIVATION_SHARE * probe.gpu_budget)
    tokens, reason = choose_chunk(hbm, bytes_at, room, req.device)
    plan, refused = attempt(tokens)
    if refused:
        wanted = tokens
        found = largest(MIN_CHUNK, wanted - ALIGN, lambda t: not attempt(t)[1])
        tokens = found or MIN_CHUNK
        plan = plan_at(tokens) if found else probe
        if found:
            reason += f"; reduced from {wanted} to {tokens} tokens: at {wanted} {refused}"
        elif over(plan) > 0:  # preflight refuses the plan at the floor, with its table
            reason += f"; the device does not hold the plan even at {MIN_CHUNK} tokens"
        else:
            reason += f"; {MIN_CHUNK} tokens, the floor: above it {refused}"
    plan.chunk = {"tokens": tokens, "reason": reason, "automatic": True}
    plan.notes.append(f"prefill chunk: {reason} (automatic; set --max-num-tokens to choose)")
    return plan


def engine_chunk(cfg, dtype, device: str, offloaded: bool, device_bytes: int | None) -> tuple[int, str]:
    """The chunk of an engine built without a memory plan (LLM.from_model, LLM() without preflight):
    the same rule, the budget being the device's whole memory."""
    from moetier.plan import residents as r

    shape = cfg.moe_shape

    def bytes_at(tokens: int) -> int:
        act = r.step_activations(cfg, tokens, dtype, 1) + r.large_step_scratch(tokens, shape, dtype,
                                                                                 2 * shape.num_experts)
        return r.segments(act)

    room = None if device_bytes is None else int(ACTIVATION_SHARE * device_bytes)
    return choose_chunk(not offloaded, bytes_at, room, device)
