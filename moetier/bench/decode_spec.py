"""`bench decode --speculative-config`: each engine row run again with speculative decoding, beside the
plain row of the same backend, budget and batch in the same run (bench/decode.py).

A speculative row's greedy tokens are checked against the run's reference like every other row, by
tokens alone: its verify steps sample several tokens per sequence, which the kept-logits probe
(one row per sequence a step) does not cover, and keeping logits would switch the verify graphs off.
Greedy speculation promises the tokens of plain decoding. With routing replayed from a trace (one
cursor for the whole batch, traces/hooks.Replayer) the engine rewinds the trace rows of rejected
drafts, so at batch 1 each verified position routes the experts the plain run routed there and the
check is a verdict. At batch > 1 a verify step takes the trace's rows in another order (each
sequence's k + 1 rows together, where plain steps interleave the sequences), so the experts, and
with them the tokens, may differ by design: there the comparison is listed, not a verdict (judge()).

What it adds to a row (over the timed window only, warm-up excluded): the speculation counters as vLLM
names them, the tokens a sequence made per step, the k the engine chose per step (expert-aware k), and the
speedup over the plain row. Its roofline is the plain row's, a step of one token per sequence: above
100% of it is what speculation gained over the one-token step's bytes.

Random weights rarely repeat what n-gram drafting looks up and never train an MTP layer, so the
acceptance of random-weight rows is whatever the model happens to do; the cost of a verify step
against k, with acceptance forced, is scripts/spec_verify_cost.py's.
"""

from __future__ import annotations

from moetier.engine.speculation import SpecCounters
from moetier.errors import MoetierError
from moetier.spec.config import SpeculativeConfig, speculative_config_of


def parse(text: str | None) -> SpeculativeConfig | None:
    """The checked --speculative-config of bench decode (None: no speculative rows). Its rows draft by
    n-gram: the bench's models are built without MTP layers (random weights have none to train)."""
    spec = speculative_config_of(text, "--speculative-config")
    if spec is not None and spec.method != "ngram":
        raise MoetierError(f"--speculative-config: bench decode's rows speculate with method ngram, not {spec.method} "
                           "(its models are built without MTP layers); measure MTP with `moetier bench serve` "
                           "against `moetier serve --speculative-config ...` or scripts/spec_heldout.py")
    return spec


def label(spec: SpeculativeConfig) -> str:
    """A row's speculation in its name: spec:ngram3, spec:mtp2 (the configured most drafts per step)."""
    return f"spec:{spec.method}{spec.num_speculative_tokens}"


def fields(window: SpecCounters, r: dict) -> dict:
    """The speculation counters of a run's timed window (decode_steps.decode_once's record r) -> the row's
    spec_decode_* fields and the tokens a sequence made per step (1 without speculation)."""
    steps = r["timed_steps"]
    return {**window.as_dict(), "tokens_per_seq_step": r["timed_tokens"] / (steps * r["batch"]) if steps else None}


ROUTED_DIFFERENTLY = ("routed differently (at batch > 1 a verify step takes the replayed trace's rows in "
                      "another order: tokens compared, not a verdict)")


def judge(row: dict) -> None:
    """A speculative row at batch > 1 whose tokens differ from the reference: listed, not flagged (the
    module docstring). Every other verdict stands."""
    check = row.get("check") or {}
    if row.get("spec") and row["batch"] > 1 and check.get("verdict", "").startswith("DIFFERS"):
        check["verdict"] = ROUTED_DIFFERENTLY


def pair_with_plain(rows: list[dict]) -> None:
    """Each speculative row's speedup over the plain row of the same backend, budget, prefetch, format
    and batch (None where that row did not run), and that row's roofline."""
    def key(r: dict) -> tuple:
        return (r["backend"], r.get("budget"), r.get("graphs"), r.get("prefetch", "off"), r.get("dtype"), r["batch"],
                bool(r.get("slots_per_layer")))

    plain = {key(r): r for r in rows if not r.get("spec")}
    for r in rows:
        if not r.get("spec"):
            continue
        p = plain.get(key(r))
        r["speedup_over_plain"] = r["tok_s"] / p["tok_s"] if p else None
        if p:  # the one-token step's roofline (module docstring)
            for k in ("hbm_bytes_per_step", "link_bytes_per_step", "roofline_step_ms", "roofline_tok_s"):
                r[k] = p[k]
            r["of_roofline"] = r["tok_s"] / p["roofline_tok_s"]


def line(r: dict) -> str:
    """The table's speculation column of a row ("" for a plain row)."""
    s = r.get("spec_decode")
    if not s:
        return ""
    acc = "-" if s["spec_decode_acceptance_rate"] is None else f"{s['spec_decode_acceptance_rate']:.1%}"
    tps = "-" if s["tokens_per_seq_step"] is None else f"{s['tokens_per_seq_step']:.2f}"
    up = "" if r.get("speedup_over_plain") is None else f", {r['speedup_over_plain']:.2f}x plain"
    ks = " ".join(f"{k}:{n}" for k, n in s["spec_decode_k_chosen"].items())  # k: steps that chose it
    return (f"  {r['spec']}: accepted {acc} of {s['spec_decode_num_draft_tokens']} drafts, {tps} tokens/seq/step{up}, "
            f"steps by k chosen {ks}")
