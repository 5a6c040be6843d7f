"""Per-node preflight of a parallel engine: every rank's share of the memory plan against the free
memory of the machine it runs on, checked before any rank loads a byte (reference 004: on two
machines the tighter one failed, and its OOM surfaced as an unrelated error elsewhere).

    plan, experts, plans = rank_plans(req, experts, config.layout(), gpu, host)   # (plan/preflight.place)
        plan: one rank's share (dense weights under the TP split, its 1/ep of the experts and their
        store, its kv heads' KV pages, the usual workspaces), experts: the placement that carries it out
    after joining the group, before loading, every rank (mp or Ray alike) calls
        node_check(rank, plans, device)   # measures its GPU and its node, gathers every rank's, and
                                          # returns node_problems(...) (pure: the tests drive it)
    a non-empty answer: every rank stops; rank 0 raises PlanRefused naming the node, the ranks and
    the numbers in GiB (2^30 bytes).

Host memory is a node's: the ranks on one machine (all of them under the multiprocessing executor)
are summed against its MemAvailable (or --host-memory), keeping memory.HOST_MARGIN_* free. Device
memory is a GPU's: each rank against its own card's free memory (or --gpu-memory).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass, replace

from moetier.plan.memory import HOST_MARGIN_MIN, HOST_MARGIN_SHARE, Item, Plan, PlanRequest, _kv_bytes_per_token
from moetier.plan.expert_plan import PlanRefused, options_for, plan_for
from moetier.plan.units import gib
from moetier.parallel import Parallel


@dataclass(frozen=True)
class RankShare:
    rank: int
    gpu: int  # device bytes of this rank's plan (0 on the CPU)
    host: int  # host bytes this rank's process holds


@dataclass(frozen=True)
class RankPlans:
    """What every rank checks before loading (plain data: it travels to the workers in their spec)."""

    shares: tuple[RankShare, ...]
    gpu_memory: str | None = None  # --gpu-memory: each GPU's budget instead of its free memory
    host_memory: str | None = None  # --host-memory: each node's budget instead of its MemAvailable


@dataclass(frozen=True)
class RankMemory:
    """What one rank measured where it runs."""

    rank: int
    node: str  # "hostname (ip)"
    gpu_free: int | None  # its GPU's free bytes (None on the CPU)
    host_available: int  # its node's available host bytes


def node_problems(shares: Sequence[RankShare], seen: Sequence[RankMemory]) -> list[str]:
    """One line per GPU that cannot hold its rank's share and per node whose ranks together do not
    fit its host memory (with the margin kept free). Empty: every node fits."""
    need = {s.rank: s for s in shares}
    out = []
    nodes: dict[str, list[RankMemory]] = {}
    for m in sorted(seen, key=lambda m: m.rank):
        nodes.setdefault(m.node, []).append(m)
        s = need[m.rank]
        if m.gpu_free is not None and s.gpu > m.gpu_free:
            out.append(f"node {m.node}: rank {m.rank} needs {gib(s.gpu)} of GPU memory but its GPU has "
                       f"{gib(m.gpu_free)} free ({gib(s.gpu - m.gpu_free)} short)")
    for node, ranks in nodes.items():
        host = sum(need[m.rank].host for m in ranks)
        avail = min(m.host_available for m in ranks)
        margin = max(HOST_MARGIN_MIN, int(HOST_MARGIN_SHARE * avail))
        if host > avail - margin:
            who = f"rank {ranks[0].rank} needs" if len(ranks) == 1 else \
                f"ranks {', '.join(str(m.rank) for m in ranks)} need"
            out.append(f"node {node}: {who} {gib(host)} of host memory together and must keep {gib(margin)} "
                       f"free, but it has {gib(avail)} available ({gib(host + margin - avail)} short)")
    return out


def this_node() -> str:
    """'hostname (ip)': inside a Ray actor or driver the node address Ray uses (the one the other
    nodes reach), else what the hostname resolves to."""
    import sys

    name = socket.gethostname()
    ray = sys.modules.get("ray")
    try:
        ip = ray.util.get_node_ip_address() if ray is not None and ray.is_initialized() else socket.gethostbyname(name)
    except Exception:  # noqa: BLE001 -- a name that does not resolve: the hostname still names the node
        ip = "?"
    return f"{name} ({ip})"


def measure(rank: int, device: str, plans: RankPlans) -> RankMemory:
    """This rank's GPU (the current CUDA device: the rank's own) and its node's host memory, or the
    --gpu-memory / --host-memory budgets that cap them."""
    from moetier.plan import machine
    from moetier.plan.units import parse_size

    gpu = None
    if device.startswith("cuda"):
        text = plans.gpu_memory
        if text is not None and not str(text).strip().endswith("%"):
            gpu = parse_size(text, "--gpu-memory")
        else:
            free, total = machine.gpu_memory()
            gpu = free if text is None else parse_size(text, "--gpu-memory", total, "the card's total memory")
    host, _ = machine.host_budget(plans.host_memory)
    return RankMemory(rank, this_node(), gpu, host)


def node_check(rank: int, plans: RankPlans, device: str) -> list[str]:
    """Every rank calls this after joining the group and before loading: the ranks' measurements are
    gathered, and every rank computes the same answer (so all stop together, none waits forever)."""
    import torch.distributed as dist

    mine = measure(rank, device, plans)
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, mine)
    return node_problems(plans.shares, seen)


def refuse(problems: list[str], plan: Plan | None = None) -> PlanRefused:
    lines = [f"a node cannot hold its ranks' share of the plan: {'; '.join(problems)}"]
    if plan is not None:
        from moetier.plan.render import table

        lines.append("one rank's share:\n" + table(plan))
    return PlanRefused("\n".join(lines))


def rank_plan(req: PlanRequest, experts, par: Parallel) -> Plan:
    """One rank's plan under layout par (every rank's is the same): the plan of a model with num_experts / ep routed
    experts (its host store, its slots or resident rows), then the TP-split dense weights and KV
    heads taken down to 1/tp (GQA; an MLA latent cache stays whole on every rank). NOTE: the router
    of the smaller model counts E/ep rows where the rank holds all E (E x hidden x 4 bytes per MoE
    layer too few: 1 MiB for Qwen3-30B-A3B), and rank 0's scheduler and tokenizer are not counted
    (both small). Under the "columns" expert split (experts/parallel/columns.py; auto picks it whenever valid)
    every expert row holds I/tp: the rows, slots and store count 1/tp of the expert bytes."""
    from moetier.experts.parallel.columns import resolve

    cfg, tp, ep = req.cfg, par.tp, par.ep
    local = replace(cfg, num_experts=cfg.num_experts // ep)
    split = resolve(getattr(experts, "split", "auto"), cfg.moe_shape, tp, ep, experts.backend)
    columns = tp if split == "columns" else 1
    plan = plan_for(replace(req, cfg=local, expert_columns=columns), experts)
    if tp == 1:
        return plan
    from moetier.models.registry import model_class

    split = 0
    for w in model_class(cfg).checkpoint_weights(cfg, set()):
        if w.split is not None and w.expert is None and not w.optional:
            n = 4 if w.float32 else req.dtype.itemsize
            for d in w.shape:
                n *= d
            split += n
    cut = split - split // tp
    # GQA: 1/tp of the kv heads; MLA: the whole latent on every rank (shared by all heads)
    kv_one, kv_rank = _kv_bytes_per_token(cfg, req.dtype), _kv_bytes_per_token(cfg, req.dtype, tp)

    def shrink(items: list[Item]) -> list[Item]:
        out = []
        for i in items:
            if i.name.startswith("dense: decoder layers"):
                i = replace(i, bytes=i.bytes - cut, allocated=max(0, i.allocated - cut),
                            note=f"{i.note}; 1/{tp} of the split weights")
            elif i.name.startswith("KV pages") and kv_rank < kv_one:
                i = replace(i, bytes=i.bytes * kv_rank // kv_one, allocated=i.allocated * kv_rank // kv_one,
                            note=f"{i.note}; 1/{tp} of the kv heads")
            out.append(i)
        return out

    return replace(plan, device=shrink(plan.device), host=shrink(plan.host))


def rank_plans(req: PlanRequest, experts, par: Parallel, gpu_memory: str | None = None,
               host_memory: str | None = None) -> tuple[Plan, object, RankPlans]:
    """-> (one rank's plan, the ExpertOptions that carry it out, every rank's share to check)."""
    plan = rank_plan(req, experts, par)
    cuda = req.device == "cuda"
    share = [RankShare(r, plan.device_total if cuda else 0, plan.host_total) for r in range(par.world)]
    return plan, options_for(plan, experts), RankPlans(tuple(share), gpu_memory, host_memory)
