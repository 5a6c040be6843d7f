"""The output check of bench rows (bench/outputs.py) on made-up logits: exact, rounding within the
tolerance (a divergence on a near-tie), and the defects it must flag."""

from __future__ import annotations

import torch

from moetier.bench import outputs


def sequences(g, steps=5, vocab=50):
    logits = torch.randn(steps, vocab, generator=g) * 4
    return logits.argmax(dim=1).tolist(), logits


def test_equal_outputs_are_exact():
    g = torch.Generator().manual_seed(0)
    t, l = sequences(g)
    c = outputs.compare([t], [l], [list(t)], [l.clone()], exact_by_design=True)
    assert c["verdict"] == "exact" and c["logits_rel_err"] == 0 and c["tokens_equal"]
    assert not outputs.flagged(c)


def test_rounding_is_within_tolerance_and_a_near_tie_flip_is_rounding():
    g = torch.Generator().manual_seed(1)
    t, ref = sequences(g)
    row = ref + 1e-3 * torch.randn(ref.shape, generator=g)
    c = outputs.compare([row.argmax(1).tolist()], [row], [t], [ref], exact_by_design=False)
    assert c["verdict"].startswith("within tolerance") and 0 < c["logits_rel_err"] < 1e-3
    # step 3 is a near-tie in the reference; the row's rounding flips it
    ref[3, :2] = torch.tensor([20.0, 19.999])
    row = ref.clone()
    row[3, 1] += 0.002
    rt, tt = row.argmax(1).tolist(), ref.argmax(1).tolist()
    c = outputs.compare([rt], [row], [tt], [ref], exact_by_design=False)
    assert c["diverged_at"] == {"request": 0, "step": 3} and c["gap_at_divergence"] < 2e-3
    assert c["verdict"].startswith("within tolerance") and "near-tie gap" in c["verdict"]


def test_defects_are_flagged():
    g = torch.Generator().manual_seed(2)
    t, ref = sequences(g)
    tiny = ref + 1e-6
    c = outputs.compare([t], [tiny], [t], [ref], exact_by_design=True)  # any bit off where none may be
    assert c["verdict"].startswith("MISMATCH") and "bit-exact by design" in c["verdict"]
    wrong = ref.clone()
    wrong[1] = torch.randn(ref.shape[1], generator=g) * 4  # one step's logits from elsewhere
    c = outputs.compare([wrong.argmax(1).tolist()], [wrong], [t], [ref], exact_by_design=False)
    assert c["verdict"].startswith("MISMATCH") and c["logits_rel_err"] > outputs.LOGITS_RTOL
    row = {"check": {**c, "reference": "resident/b1"}}
    assert outputs.flagged(row["check"]) and "<<< OUTPUTS DIFFER" in outputs.column(row["check"])
    c = outputs.compare([[1, 2, 3]], None, [[1, 2, 4]], None, exact_by_design=False)  # tokens only
    assert c["verdict"].startswith("DIFFERS") and c["diverged_at"]["step"] == 2
    # the transformers peer makes fewer steps: compared over the steps both made
    assert outputs.compare([[1, 2]], None, [[1, 2, 4]], None, False)["verdict"] == "tokens equal"


def test_kept_logits_follow_each_request():
    class Runner:
        keep_logits, kept_logits = 0, []

    class Engine:
        runner = Runner()

    kept = outputs.KeptLogits(Engine())
    with kept:
        assert Engine.runner.keep_logits == outputs.KEPT_REQUESTS
        Engine.runner.kept_logits += [(["a", "b"], torch.tensor([[1.0], [2.0]])), (["b", "a"], torch.tensor([[3.0], [4.0]]))]
    assert Engine.runner.keep_logits == 0
    a, b, c = kept.per_request(["a", "b", "c"], [2, 2, 1])
    assert a.flatten().tolist() == [1.0, 4.0] and b.flatten().tolist() == [2.0, 3.0] and c is None


def test_bench_serve_levels_are_checked_against_the_first():
    from moetier.bench import serve

    def level(c, texts):
        return {"max_concurrency": c, "request_rate": "inf", "completed": 3, "failed": 0, "cancelled": 0,
                "request_throughput": 1.0, "output_throughput": 1.0, "median_ttft_ms": 1.0, "median_tpot_ms": 1.0,
                "p99_itl_ms": 1.0, "median_e2el_ms": 1.0, "_texts": dict(enumerate(texts))}

    rows = [level(1, ["a", "b", "c"]), level(2, ["a", "b", "c", "d"]), level(4, ["a", "x", "c"])]
    serve.check_levels(rows)
    assert [r["check"]["verdict"] for r in rows[:2]] == ["reference", "exact"] and rows[1]["check"]["compared"] == 3
    assert rows[2]["check"]["verdict"].startswith("DIFFERS (1 of 3") and rows[2]["check"]["first_differing"] == [1]
    assert all("_texts" not in r for r in rows)
    text = serve.table({"results": rows})
    assert text.count("<<< OUTPUTS DIFFER") == 1 and "exact vs concurrency 1" in text


def test_a_divergence_without_its_logits_differs_not_judged():
    g = torch.Generator().manual_seed(3)
    (t0, l0), (t1, _) = sequences(g), sequences(g)
    row1 = list(t1)
    row1[2] = (row1[2] + 1) % 50
    c = outputs.compare([t0, row1], [l0 + 1e-4, None], [t0, t1], [l0, None], exact_by_design=False)
    assert c["verdict"].startswith("DIFFERS") and "not kept" in c["verdict"] and outputs.flagged(c)
