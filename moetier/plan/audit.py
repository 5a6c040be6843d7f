"""The audit: measured memory against the plan, after loading and after graph capture, printed, with a
warning where they differ by more than TOLERANCE (reference 000: the 45 GB of scales nobody counted
showed up only as an OOM two steps later).

Measured: torch.cuda.memory_allocated / memory_reserved (the caching allocator), cudaMemGetInfo (the
whole card, CUDA context included), /proc/self/status VmRSS (host resident) and VmLck / VmPin (locked
and pinned pages). Compared:
    allocated   memory_allocated       plan: the block-rounded tensors of the stages reached so far
    device use  reserved + context     plan: the same stages' items, pool and slack, plus the context
    host RSS    VmRSS                  plan: the host items (the loader buffer is transient, left out)
The measured CUDA context (device used minus torch's reserved) is printed so CONTEXT_BYTES can be
checked on each machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moetier.plan.memory import Plan
from moetier.plan.units import gib

TOLERANCE = 0.05
FLOOR = 128 * 2**20
STAGES = {"after load": ("load",), "after graph capture": ("load", "capture")}


def proc_status(path: Path = Path("/proc/self/status")) -> dict[str, int]:
    """VmRSS, VmLck, VmPin, VmHWM in bytes (0 where absent)."""
    out = dict.fromkeys(("VmRSS", "VmLck", "VmPin", "VmHWM"), 0)
    try:
        for line in path.read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in out and rest.split():
                out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def measure(device=None) -> dict[str, int]:
    import torch

    m = {f"host_{k}": v for k, v in proc_status().items()}
    if torch.cuda.is_available() and (device is None or str(device).startswith("cuda")):
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        m.update(allocated=torch.cuda.memory_allocated(), reserved=torch.cuda.memory_reserved(),
                 peak_allocated=torch.cuda.max_memory_allocated(), device_free=int(free), device_total=int(total),
                 device_used=int(total - free))
        m["context_measured"] = m["device_used"] - m["reserved"]
    return m


@dataclass
class Row:
    what: str
    planned: int
    measured: int

    @property
    def off(self) -> float:
        return (self.measured - self.planned) / self.planned if self.planned else 0.0

    @property
    def flagged(self) -> bool:
        # NOTE: VmRSS and the driver's share move by tens of MiB with no cause in the plan (lazy library
        # pages, allocator caching); a difference below FLOOR is not flagged however small the plan.
        return abs(self.off) > TOLERANCE and abs(self.measured - self.planned) > FLOOR

    def as_dict(self) -> dict:
        return {"what": self.what, "planned": self.planned, "measured": self.measured, "off": self.off}


def compare(plan: Plan, stage: str, m: dict[str, int], baseline: dict[str, int] | None = None) -> list[Row]:
    """Rows of planned against measured at `stage` ('after load' or 'after graph capture').
    baseline: a measure() from before the run (memory other code of this process already held)."""
    stages = STAGES[stage]
    b = baseline or {}
    rows = []
    if "allocated" in m:
        rows.append(Row("torch allocated", plan.stage_allocated(*stages), m["allocated"] - b.get("allocated", 0)))
        use = sum(i.bytes for i in plan.device if i.stage in stages or i.name == "allocator slack (segment rounding)")
        # a baseline taken after CUDA was initialised already holds the context
        ctx = 0 if "device_used" in b else next((i.bytes for i in plan.device if i.name == "CUDA context"), 0)
        driver = sum(i.bytes for i in plan.device if i.stage == "driver") if "capture" in stages else 0
        rows.append(Row("torch reserved", use, m["reserved"] - b.get("reserved", 0)))
        rows.append(Row("device used (cudaMemGetInfo)", use + ctx + driver, m["device_used"] - b.get("device_used", 0)))
    host = sum(i.bytes for i in plan.host if not i.name.startswith("loader buffer")
               and not (baseline and i.name.startswith("process baseline"))
               and (i.stage != "host-capture" or "capture" in stages))
    rows.append(Row("host resident (VmRSS)", host, m["host_VmRSS"] - b.get("host_VmRSS", 0)))
    # NOTE: pages the CUDA driver pins (cudaHostRegister) need not show in VmLck / VmPin; a zero there
    # says nothing, so the row appears only where the kernel reports them.
    if plan.pinned and m["host_VmLck"] + m["host_VmPin"] > 0:
        rows.append(Row("host pinned (VmLck + VmPin)", plan.pinned, m["host_VmLck"] + m["host_VmPin"]))
    return rows


def report(plan: Plan, stage: str, m: dict[str, int], baseline: dict[str, int] | None = None) -> dict:
    """The audit of one stage as data: rows, warnings (beyond TOLERANCE), the measured context."""
    rows = compare(plan, stage, m, baseline)
    warnings = [f"{r.what} {stage}: measured {gib(r.measured)}, planned {gib(r.planned)} ({r.off:+.1%}, beyond "
                f"{TOLERANCE:.0%})" for r in rows if r.flagged]
    return {"stage": stage, "rows": [r.as_dict() for r in rows], "warnings": warnings,
            "context_measured": m.get("context_measured"), "measured": m}


def lines(audit: dict) -> list[str]:
    out = [f"memory audit {audit['stage']}:"]
    for r in audit["rows"]:
        out.append(f"  {r['what']:<30} planned {gib(r['planned']):>12}  measured {gib(r['measured']):>12}  "
                   f"{r['off']:+7.1%}")
    if audit.get("context_measured") is not None:
        out.append(f"  CUDA context and non-torch device memory: {gib(audit['context_measured'])} measured")
    out += [f"warning: {w}" for w in audit["warnings"]]
    return out
