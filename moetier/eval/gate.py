"""The accuracy gate: one task set run over several engine configurations, each compared with the
first (the reference: resident experts in the checkpoint's own format), item by item.

A configuration's tolerance is the largest difference, in nats per token, that any one scored
log-likelihood may have from the reference's: the item's difference over the tokens it scores (a
choice's few, a whole document's thousands). 0 (the default) means exact: backends of one format compute the same
model with the same kernels, so every log-likelihood is equal and every greedy generation identical.
A format (fp8, nvfp4, int4) gets a tolerance and reports its measured loss: the metrics' differences
with their standard errors (paired over documents where lm-eval gives per-document values), the
greedy generations that changed (past one changed token a generation is another text, so they are
counted, not failed) and the largest log-likelihood difference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from moetier.eval.lmeval import EvalRun, TaskResult


@dataclass
class TaskVerdict:
    label: str
    task: str
    outputs_differing: int
    outputs: int
    max_ll_diff: float  # nats, over the items; nan when the task scores nothing
    max_ll_diff_per_token: float  # nats per token: an item's difference over the tokens it scores
    tolerance: float  # nats per token
    problem: str | None  # None: passes

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def paired_se(a: list[float], b: list[float]) -> float | None:
    """Standard error of mean(b - a) over documents."""
    d = [y - x for x, y in zip(a, b)]
    if len(d) < 2:
        return None
    mean = sum(d) / len(d)
    return math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))


def delta(ref: TaskResult, got: TaskResult, metric: str) -> tuple[float, float | None]:
    """got's metric minus the reference's, and the standard error of that difference."""
    diff = got.metrics[metric] - ref.metrics[metric]
    if metric in ref.per_doc and metric in got.per_doc:
        return diff, paired_se(ref.per_doc[metric], got.per_doc[metric])
    a, b = ref.stderr.get(metric), got.stderr.get(metric)
    return diff, (math.hypot(a, b) if a is not None and b is not None else None)


def judge(label: str, task: str, ref: TaskResult, got: TaskResult, tolerance: float) -> TaskVerdict:
    differing = sum(x != y for x, y in zip(ref.outputs, got.outputs))
    diffs = [abs(x - y) for x, y in zip(ref.lls, got.lls)]
    worst = max(diffs) if diffs else math.nan
    counts = ref.ll_tokens if len(ref.ll_tokens) == len(diffs) else [1] * len(diffs)
    per_token = max((d / n for d, n in zip(diffs, counts)), default=math.nan)
    problem = None
    if (ref.n, len(ref.outputs), len(ref.lls)) != (got.n, len(got.outputs), len(got.lls)):
        problem = (f"other documents than the reference's ({got.n} documents, {len(got.lls)} scores against "
                   f"{ref.n}, {len(ref.lls)})")
    elif diffs and per_token > tolerance:
        problem = f"a log-likelihood differs by {per_token:.3g} nats per token (tolerance {tolerance:g})"
    elif tolerance == 0 and differing:
        problem = f"{differing} of {len(ref.outputs)} greedy outputs differ (tolerance 0: exact)"
    return TaskVerdict(label, task, differing, len(ref.outputs), worst, per_token, tolerance, problem)


def compare(runs: list[EvalRun], tolerance: dict[str, float]) -> list[TaskVerdict]:
    ref = runs[0]
    return [judge(run.label, task, ref.tasks[task], got, tolerance.get(run.label, 0.0))
            for run in runs[1:] for task, got in run.tasks.items()]


def _value(x: float, se: float | None) -> str:
    return f"{x:.4f}" + (f" ± {se:.4f}" if se is not None and math.isfinite(se) else "")


def metric_table(runs: list[EvalRun]) -> list[str]:
    """Every run's metrics, and (after the first) their difference from the first run's."""
    ref = runs[0]
    lines = ["| configuration | task | metric | value ± stderr | Δ vs " + ref.label + " ± stderr |",
             "|---|---|---|---|---|"]
    for run in runs:
        for task, got in run.tasks.items():
            for metric, value in got.metrics.items():
                d = "" if run is ref else _value(*delta(ref.tasks[task], got, metric))
                lines.append(f"| {run.label} | {task} | {metric} | {_value(value, got.stderr.get(metric))} | {d} |")
    return lines


def verdict_table(verdicts: list[TaskVerdict]) -> list[str]:
    lines = ["| configuration | task | greedy outputs differing | max abs Δ log-likelihood (nats) | per token "
             "(nats/token) | tolerance (nats/token) | verdict |", "|---|---|---|---|---|---|---|"]
    for v in verdicts:
        outs = f"{v.outputs_differing} of {v.outputs}" if v.outputs else "-"
        worst = "-" if math.isnan(v.max_ll_diff) else f"{v.max_ll_diff:.3g}"
        per = "-" if math.isnan(v.max_ll_diff_per_token) else f"{v.max_ll_diff_per_token:.3g}"
        lines.append(f"| {v.label} | {v.task} | {outs} | {worst} | {per} | {v.tolerance:g} | "
                     f"{'pass' if v.problem is None else 'FAIL: ' + v.problem} |")
    return lines
