"""Several ranks from the command line: `moetier serve --tp/--ep` answers with the one-process
tokens (a checkpoint, and random weights of a preset made per rank), `--distributed-executor ray`
without ray is one line naming the install, and the per-node preflight (plan/nodes.py): the pure
check, one rank's plan, and a node too small for its ranks refused before any rank loads."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
import torch
from typer.testing import CliRunner

from moetier.cli.app import app
from moetier.engine.llm import LLM
from moetier.errors import MoetierError
from moetier.parallel import Parallel
from moetier.plan.nodes import RankMemory, RankShare, node_problems, rank_plan
from moetier.sampling_params import SamplingParams
from test_server_cli import MOETIER, free_port, wait_up

GiB = 2**30


def cli(*args: str):
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.stdout, r.stderr


def completion(url: str, prompt: str, n: int = 6) -> list[int]:
    body = {"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("extra", [["--tp", "2", "--ep", "2", "--expert-backend", "slots", "--expert-slots", "4"],
                                   ["--ep", "2", "--preset", "tiny", "--expert-budget", "25%",
                                    "--expert-backend", "slots"]])
def test_serve_over_two_ranks_answers_like_one_process(extra):
    """The server over two gloo ranks: the same greedy text as one process (the embedded model; and
    random `tiny` weights, whose EP shares hold the one-process experts)."""
    def run(args):
        port = free_port()
        proc = subprocess.Popen(MOETIER + ["serve", "--port", str(port), "--device", "cpu", "--served-model-name",
                                           "m", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_up(url, proc, timeout=120)
            text = completion(url, "Once upon a time")
            return text, httpx.get(url + "/metrics", timeout=60).text, proc
        finally:
            proc.send_signal(2)
            proc.wait(timeout=60)

    one, _, _ = run([a for a in extra if a not in ("--tp", "--ep", "2")])
    par, scraped, proc = run(extra)
    assert par == one and proc.returncode == 0
    # /metrics asks every rank for its slot caches' counters (between steps: the engine's lock)
    for rank in (0, 1):
        assert f'moetier:expert_rank_hits_total{{model_name="m",rank="{rank}"}}' in scraped
    assert "one rank's share of 2" in proc.stderr.read()


def test_ray_missing_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: `import ray` raises ImportError
    code, _, err = cli("generate", "hi", "--device", "cpu", "--tp", "2", "--distributed-executor", "ray")
    assert code == 2 and err.strip() == ("error: --distributed-executor ray needs Ray, which this install lacks: "
                                         "pip install 'moetier[ray]'")
    code, _, err = cli("serve", "--device", "cpu", "--distributed-executor", "ray")
    assert code == 2 and "pip install 'moetier[ray]'" in err
    code, _, err = cli("generate", "hi", "--distributed-executor", "slurm")
    assert code == 2 and "choose mp or ray" in err


def test_node_problems_names_node_ranks_and_gib():
    shares = [RankShare(0, 60 * GiB, 40 * GiB), RankShare(1, 60 * GiB, 40 * GiB), RankShare(2, 60 * GiB, 40 * GiB)]
    a, b = "gpu-a (10.0.0.1)", "gpu-b (10.0.0.2)"
    fits = [RankMemory(0, a, 70 * GiB, 200 * GiB), RankMemory(1, a, 70 * GiB, 200 * GiB),
            RankMemory(2, b, 70 * GiB, 100 * GiB)]
    assert node_problems(shares, fits) == []
    # the tighter node: its GPU short, and two ranks that each fit alone but not together on one host
    tight = [RankMemory(0, a, 70 * GiB, 80 * GiB), RankMemory(1, a, 50 * GiB, 80 * GiB),
             RankMemory(2, b, None, 100 * GiB)]
    got = node_problems(shares, tight)
    assert got == [
        f"node {a}: rank 1 needs 60.00 GiB of GPU memory but its GPU has 50.00 GiB free (10.00 GiB short)",
        f"node {a}: ranks 0, 1 need 80.00 GiB of host memory together and must keep 4.00 GiB free, but it has "
        "80.00 GiB available (4.00 GiB short)"]
    # the margin is 5% of what is available past 80 GiB
    assert node_problems([RankShare(0, 0, 195 * GiB)], [RankMemory(0, b, None, 200 * GiB)])[0].endswith(
        "must keep 10.00 GiB free, but it has 200.00 GiB available (5.00 GiB short)")


def test_rank_plan_is_a_share(tiny_ckpt):
    from moetier.models.registry import config_from_dir
    from moetier.engine.config import EngineConfig
    from moetier.experts.placement import ExpertOptions
    from moetier.plan.preflight import request_for

    cfg = config_from_dir(tiny_ckpt)
    req = request_for(cfg, torch.float32, "cuda", EngineConfig(), gpu_memory="80GiB", host_memory="100GiB")
    uva = ExpertOptions("uva")

    def item(plan, name, tier="device"):
        return next(i.bytes for i in getattr(plan, tier) if i.name.startswith(name))

    one, ep2, tp2 = (rank_plan(req, uva, Parallel.of(tp, ep)) for tp, ep in ((1, 1), (1, 2), (2, 1)))
    store = "expert store"
    assert item(ep2, store, "host") < item(one, store, "host") * 0.51  # half the rows (+ page alignment)
    assert item(tp2, "KV pages") * 2 == item(one, "KV pages")
    assert item(tp2, "dense: decoder layers") < item(one, "dense: decoder layers")
    assert item(tp2, "dense: embedding") == item(one, "dense: embedding")  # replicated
    with pytest.raises(MoetierError, match="slots"):  # a rank holds 16 of 32 experts under EP 2
        rank_plan(req, ExpertOptions("slots", slots=20), Parallel.of(1, 2))


def test_a_node_too_small_for_its_ranks_is_refused(tiny_ckpt):
    """Two CPU ranks on this machine: a host budget that holds one rank's share but not two is refused
    by the node check (the ranks' needs summed), naming the node, the ranks and GiB."""
    from moetier.models.registry import config_from_dir
    from moetier.engine.config import EngineConfig
    from moetier.experts.placement import ExpertOptions
    from moetier.plan.nodes import rank_plans
    from moetier.plan.preflight import request_for

    config = EngineConfig(tensor_parallel_size=2, max_num_seqs=1, kv_tokens=256)
    req = request_for(config_from_dir(tiny_ckpt), torch.float32, "cpu", config, host_memory="100GiB")
    need = rank_plans(req, ExpertOptions("resident"), Parallel.of(2, 1))[0].host_total
    budget = f"{(4 * GiB + 1.5 * need) / GiB:.3f}GiB"  # the 4 GiB margin, then 1.5 ranks
    code, _, err = cli("generate", "hi", "--model", str(tiny_ckpt), "--device", "cpu", "--tp", "2",
                       "--expert-backend", "resident", "--host-memory", budget, "--max-tokens", "2")
    assert code == 2, err
    assert "a node cannot hold its ranks' share of the plan: node " in err and "ranks 0, 1 need" in err
    assert os.uname().nodename in err and "GiB of host memory together" in err
    # one rank's share fits that budget: a single process is not refused
    one = LLM(tiny_ckpt, device="cpu", max_num_seqs=1, kv_tokens=256)
    assert one.generate(["hi"], SamplingParams(max_tokens=1))[0].outputs[0].token_ids
