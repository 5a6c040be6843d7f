"""`moetier eval`: lm-eval's tasks against a server, offline (docs/eval.md).

    moetier eval                                   the shipped tiny_stdlib tasks, on our server
                                                   (spawned) with the embedded model
    moetier eval --url http://host:8000 --tokenizer DIR --tasks gsm8k --include-path my_tasks/
    moetier eval --compare "resident=--expert-backend resident" --compare "slots=--expert-backend slots
                 --expert-slots 8"                 the gate: every configuration against the first

Bad arguments, lm-eval missing, or a server that does not start: one `error:` line, exit 2. A gate
that fails prints its table and exits 1.
"""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path
from typing import Optional

import typer

from moetier.cli import options as opt
from moetier.errors import MoetierError


def save(out: Path, runs: list, verdicts: list) -> None:
    """The record: every run so far and the gate's verdicts on them."""
    out.write_text(json.dumps({"runs": [r.as_dict() for r in runs], "gate": [v.as_dict() for v in verdicts]},
                              indent=1, default=float))


def parse_configs(values: list[str]) -> list[tuple[str, list[str]]]:
    """--compare LABEL=FLAGS -> [(label, serve flags)], labels unique."""
    out = []
    for v in values:
        label, eq, flags = v.partition("=")
        label = label.strip()
        if not eq or not label or label.startswith("-") or " " in label:
            raise MoetierError(f"--compare {v!r}: give LABEL=FLAGS, like 'slots=--expert-backend slots --expert-slots 8'")
        if label in (c[0] for c in out):
            raise MoetierError(f"--compare: the label {label!r} is given twice; give each configuration its own")
        try:
            out.append((label, shlex.split(flags)))
        except ValueError as e:
            raise MoetierError(f"--compare {v!r}: the flags do not parse ({e})") from None
    return out


def parse_tolerances(values: list[str], labels: list[str]) -> dict[str, float]:
    out = {}
    for v in values:
        label, _, nats = v.partition("=")
        try:
            t = float(nats)
        except ValueError:
            t = -1.0
        if label not in labels or not (math.isfinite(t) and t >= 0):
            raise MoetierError(f"--tolerance {v!r}: give LABEL=NATS with a --compare label "
                               f"({', '.join(labels) or 'none'}) "
                               "and a number >= 0")
        out[label] = t
    return out


def eval_cmd(
    url: Optional[str] = typer.Option(None, "--url", metavar="<url>", help="Evaluate the OpenAI-compatible server "
                                      "at this base URL (ours or any other) instead of starting ours."),
    model: opt.Model = None,
    device: opt.Device = "auto",
    compare: list[str] = typer.Option([], "--compare", metavar="<label=flags>", help="The gate: run the tasks on "
                                      "our server once per configuration (`moetier serve` flags after --model and "
                                      "--device); each is compared with the first. Repeat for each configuration."),
    tolerance: list[str] = typer.Option([], "--tolerance", metavar="<label=nats>", help="Largest difference of any "
                                        "log-likelihood from the reference's, in nats per token it scores (default 0: "
                                        "exact, greedy outputs identical too)."),
    tasks: str = typer.Option("tiny_stdlib", "--tasks", metavar="<names>", help="Comma-separated lm-eval task "
                              "names; tiny_stdlib: the shipped held-out standard-library tasks of the embedded model."),
    include_path: list[Path] = typer.Option([], "--include-path", metavar="<dir>", help="A folder of lm-eval task "
                                            "YAMLs with local data_files (repeat for several)."),
    tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", metavar="<dir>", help="The checkpoint directory "
                                             "whose tokenizer lm-eval counts tokens with (default: --model's)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="At most this many documents per task."),
    max_length: Optional[int] = typer.Option(None, "--max-length", help="lm-eval's context in tokens: rolling "
                                             "windows and truncation (default: the shipped tasks' 256, else 2048)."),
    num_concurrent: int = typer.Option(1, "--num-concurrent", help="Requests in flight at once (1: each request "
                                       "alone, so that configurations compute the same batches)."),
    api: str = typer.Option("completions", "--api", help="completions (lm-eval's local-completions: every task "
                            "type) or chat (local-chat-completions: generation tasks, chat template applied)."),
    out: Optional[Path] = typer.Option(None, "--out", metavar="<file>", help="Write every run's metrics, outputs, "
                                       "log-likelihoods and the gate's verdicts as JSON."),
    jobs: int = typer.Option(1, "--jobs", help="Servers starting at once for --compare, ahead of the one being "
                             "evaluated (evaluations stay one at a time). They share the device: each plans its "
                             "automatic sizes on the memory the others leave, so give --gpu-memory in the flags "
                             "where that matters."),
) -> None:
    """Run lm-eval's tasks against our server (spawned) or any OpenAI-compatible URL, offline; with
    --compare, the accuracy gate over engine configurations (docs/eval.md)."""
    from moetier.eval import gate

    try:
        configs = parse_configs(compare)
        tolerances = parse_tolerances(tolerance, [c[0] for c in configs])
        if url is not None and (configs or model is not None):
            raise MoetierError("--url evaluates a running server: --compare and --model start servers of our own; "
                               "give one or the other (--tokenizer names the tokenizer for --url)")
        if api not in ("completions", "chat"):
            raise MoetierError(f"--api {api!r}: choose completions or chat")
        if limit is not None:
            opt.at_least(limit, 1, "--limit")
        if max_length is not None:
            opt.at_least(max_length, 2, "--max-length")
        opt.at_least(num_concurrent, 1, "--num-concurrent")
        opt.at_least(jobs, 1, "--jobs")
        if jobs > 1 and url is not None:
            raise MoetierError("--jobs starts servers of our own for --compare; --url evaluates one running server")
        for p in include_path:
            if not p.is_dir():
                raise MoetierError(f"--include-path {p}: no such directory")
        if out is not None:
            opt.output_file(out, "--out")
        from moetier.default_model import default_model_dir

        tok_dir = tokenizer or model or default_model_dir()
        if not (tok_dir / "tokenizer.json").is_file():
            raise MoetierError(f"--tokenizer {tok_dir}: no tokenizer.json there; give the checkpoint directory")
        from moetier.eval import lmeval
        from moetier.eval.tasks import max_length_of, resolve

        lmeval.import_lm_eval()  # one line when it is missing, before any server starts
        todo = resolve([t.strip() for t in tasks.split(",")])
        kw = dict(api=api, include=include_path, limit=limit, max_length=max_length or max_length_of(todo),
                  concurrent=num_concurrent)
        if url is not None:
            runs = [lmeval.run(url, tok_dir, todo, label=url, **kw)]
        else:
            from moetier.eval.spawn import started_ahead

            base = (["--model", str(model)] if model is not None else []) + ["--device", device]
            runs, served = [], [(label, base + flags) for label, flags in configs or [("serve", [])]]
            for label, flags in served:
                typer.echo(f"moetier eval: {label}: moetier serve {shlex.join(flags)}", err=True)
            for label, flags, server in started_ahead(served, jobs):
                run = lmeval.run(server.url, tok_dir, todo, label=label, **kw)
                run.serve_flags = flags
                runs.append(run)
                typer.echo(f"moetier eval: {label}: {run.seconds:.1f} s", err=True)
                if out is not None and configs:  # each finished run kept: a gate cut short loses only the rest
                    save(out, runs, gate.compare(runs, tolerances) if len(runs) > 1 else [])
    except MoetierError as e:
        opt.fail(e)
    verdicts = gate.compare(runs, tolerances) if len(runs) > 1 else []
    typer.echo("\n".join(gate.metric_table(runs)))
    if verdicts:
        typer.echo("\n" + "\n".join(gate.verdict_table(verdicts)))
    typer.echo(f"\n({', '.join(f'{r.label} {r.seconds:.1f} s' for r in runs)}; max length {kw['max_length']} tokens)")
    if out is not None:
        save(out, runs, verdicts)
    failed = [v for v in verdicts if v.problem is not None]
    if failed:
        typer.echo(f"gate: FAILED ({len(failed)} of {len(verdicts)} configuration-task pairs)", err=True)
        raise typer.Exit(1)
    if verdicts:
        typer.echo(f"gate: passed ({len(verdicts)} configuration-task pairs)", err=True)
