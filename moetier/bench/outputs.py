"""Every throughput row's outputs checked against a reference row of the same run (bench decode,
bench prefill, the parallel rows): the greedy tokens, and the logits that chose them.

A row's reference is the first row of its group (same weight format and batch; prefill: and prompt
length) that ran: the benchmarks run resident first, or where resident was not asked for (or does
not fit) the one-GPU slots row first. Parallel rows: EP ranks hold the one-GPU experts, so their
reference is the one-GPU row; TP ranks draw their own random dense shards, so theirs is the first
row of their own layout.

The check, per request: the steps both rows made up to and including the first step whose greedy
tokens differ (inputs are identical up to there), and on those steps the logits' relative error
(max |row - ref| over max |ref|, at each step; the largest). At the first divergence, the
reference's top-1 minus top-2 logit gap: a flip is rounding when that gap is below what the logits
moved there (the measured max |row - ref| at that step, twice: both logits may move), else a defect.
Verdicts:
- "exact": tokens equal and logits bit-equal;
- "within tolerance (...)": a row not bit-exact by design (hybrid: the host kernel's rounding of its
  share; a parallel row's all-reduce order) whose relative error is within LOGITS_RTOL and whose
  divergence, if any, is on a near-tie;
- "MISMATCH (...)": anything else, including any difference in a row that is bit-exact by design;
- "tokens equal" / "DIFFERS (...)": a row without logits (the transformers peer), or a divergence in
  a request past the first KEPT_REQUESTS of a batch (whose logits are not kept): tokens only.

The logits are copied on the device as each step samples (engine/runner.ModelRunner.keep_logits:
no host read in the step) and brought to the host after the row's timed window.
"""

from __future__ import annotations

import torch

# The logits of a row not bit-exact by design against its reference (docs/hybrid.md, "Output check")
LOGITS_RTOL = 3e-2
KEPT_REQUESTS = 8  # requests per row whose logits are kept (the first of each step's batch)


class KeptLogits:
    """Keeps the logits of the first KEPT_REQUESTS requests of every step of `llm` while open."""

    def __init__(self, llm):
        self.runner = getattr(llm.runner, "inner", llm.runner)  # a parallel engine: rank 0 samples

    def __enter__(self) -> KeptLogits:
        self.runner.keep_logits, self.runner.kept_logits = KEPT_REQUESTS, []
        return self

    def __exit__(self, *exc) -> None:
        self.runner.keep_logits = 0

    def per_request(self, request_ids: list[str], counts: list[int]) -> list[torch.Tensor | None]:
        """[tokens, V] float32 on the host per request, the logits of each token it sampled, in order;
        None where some step did not keep its row (past the first KEPT_REQUESTS of a batch)."""
        steps, self.runner.kept_logits = self.runner.kept_logits, []
        rows: dict[str, list[torch.Tensor]] = {rid: [] for rid in request_ids}
        for ids, logits in steps:
            host = logits.cpu()
            for i, rid in enumerate(ids):
                if rid in rows:
                    rows[rid].append(host[i])
        return [torch.stack(rows[r]) if len(rows[r]) == n and n else None for r, n in zip(request_ids, counts)]


def compare(tokens: list[list[int]], logits: list | None, ref_tokens: list[list[int]], ref_logits: list | None,
            exact_by_design: bool, rtol: float = LOGITS_RTOL) -> dict:
    """One row's outputs (per request: tokens, and [tokens, V] logits or None) against its reference's."""
    out = {"tokens_equal": None, "exact_by_design": exact_by_design, "tolerance": rtol,
           "logits_equal": None, "logits_rel_err": None, "logits_max_abs_err": None, "diverged_at": None,
           "gap_at_divergence": None, "requests_with_logits": 0}
    rel, bit_equal, first = 0.0, True, None
    for i, (t, r) in enumerate(zip(tokens, ref_tokens)):
        n = min(len(t), len(r))
        d = next((j for j in range(n) if t[j] != r[j]), None)
        if d is not None and (first is None or d < first["step"]):
            first = {"request": i, "step": d}
        a = logits[i] if logits is not None and i < len(logits) else None
        b = ref_logits[i] if ref_logits is not None and i < len(ref_logits) else None
        if a is None or b is None:
            continue
        upto = n if d is None else d + 1  # the steps with identical inputs
        diff = (a[:upto] - b[:upto]).abs().amax(dim=1)  # [steps]
        scale = b[:upto].abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny)
        rel = max(rel, float((diff / scale).max())) if upto else rel
        bit_equal &= torch.equal(a[:upto], b[:upto])
        out["requests_with_logits"] += 1
        out["logits_max_abs_err"] = max(out["logits_max_abs_err"] or 0.0, float(diff.max()) if upto else 0.0)
        if first is not None and first["request"] == i:
            top = b[d].topk(2).values
            first["gap"], first["moved"] = float(top[0] - top[1]), float(diff[d])
    # over the steps both made (the transformers peer makes fewer); the engine's rows make the same count
    out["tokens_equal"] = first is None and len(tokens) == len(ref_tokens)
    if out["requests_with_logits"]:
        out["logits_equal"], out["logits_rel_err"] = bit_equal, rel
    if first is not None:
        out["diverged_at"] = {"request": first["request"], "step": first["step"]}
        out["gap_at_divergence"] = first.get("gap")
        out["moved_at_divergence"] = first.get("moved")
    out["verdict"] = verdict(out)
    return out


def verdict(c: dict) -> str:
    at = c["diverged_at"]
    where = "" if at is None else f"diverged at step {at['step']} of request {at['request']}"
    if c["logits_equal"] is None:  # tokens only
        return "tokens equal" if c["tokens_equal"] else f"DIFFERS ({where}; no logits to judge)"
    if c["tokens_equal"] and c["logits_equal"]:
        return "exact"
    rel = f"rel err {c['logits_rel_err']:.2e}"
    if c["exact_by_design"]:
        return f"MISMATCH ({rel}{'; ' + where if where else ''}; this row is bit-exact by design)"
    if c["logits_rel_err"] > c["tolerance"]:
        return f"MISMATCH ({rel} > {c['tolerance']:.0e}{'; ' + where if where else ''})"
    if at is None:
        return f"within tolerance ({rel})"
    gap = c["gap_at_divergence"]
    if gap is None:  # the diverging request's logits were not kept: tokens alone cannot say which
        return f"DIFFERS ({rel} where kept; {where}, whose logits were not kept: judge it at batch <= {KEPT_REQUESTS})"
    if gap > 2 * c["moved_at_divergence"]:
        return f"MISMATCH ({rel}; {where} on a gap {gap:.3g} the rounding could not close)"
    return f"within tolerance ({rel}, {where} on a near-tie gap {gap:.3g})"


def flagged(check: dict | None) -> bool:
    """A row whose outputs are not shown equal or within tolerance (the table marks it)."""
    return check is not None and check["verdict"].startswith(("MISMATCH", "DIFFERS"))


def column(check: dict | None) -> str:
    """The table's check column: the verdict, short."""
    if check is None:
        return "check -"
    if check.get("verdict") == "reference":
        return "check (reference)"
    v = check["verdict"]
    short = "exact" if v == "exact" else "tokens=" if v == "tokens equal" else (
        f"~ {check['logits_rel_err']:.1e}" + ("" if check["diverged_at"] is None else
                                            f" div@{check['diverged_at']['step']} gap {check['gap_at_divergence']:.2g}")
        if v.startswith("within") else v)
    return f"check {short} vs {check['reference']}" + ("  <<< OUTPUTS DIFFER" if flagged(check) else "")


class References:
    """The reference row of each group, kept (with its logits) while the run lasts; check() sets a
    row's "check" and drops its logits unless it becomes a reference."""

    def __init__(self):
        self.rows: dict[tuple, dict] = {}

    def check(self, row: dict, group: tuple, name: str, exact_by_design: bool, fallback: tuple | None = None) -> None:
        ref = self.rows.get(group) or (self.rows.get(fallback) if fallback is not None else None)
        if ref is None:
            self.rows[group] = {**row, "ref_name": name}
            row["check"] = {"verdict": "reference", "reference": name}
            row.pop("logits", None)  # kept with the reference
            return
        row["check"] = {"reference": ref["ref_name"], **compare(row["tokens"], row.get("logits"), ref["tokens"],
                                                              ref.get("logits"), exact_by_design)}
        row.pop("logits", None)

    def summary(self, rows: list[dict], name) -> dict:
        """{row name: verdict} of every checked row, and {group: its reference's name}."""
        return {"output_checks": {name(r): r["check"]["verdict"] for r in rows if r.get("check")},
                "output_references": {"/".join(map(str, g)): r["ref_name"] for g, r in self.rows.items()}}


def strip(rows: list[dict]) -> list[dict]:
    """Rows for the JSON record: without their tokens and logits."""
    return [{k: v for k, v in r.items() if k not in ("tokens", "logits")} for r in rows]
