"""Tensor parallelism inside each routed expert (the "columns" expert split, experts/parallel/columns.py,
docs/parallel.md), 2 ranks over gloo on the CPU: rank r holds I/2 of every expert (half the expert
bytes), every rank computes every pair over its columns and one all-reduce sums them. Logits equal
the one-process run within the fp32 tolerance of tests/test_tp.py, batch == alone, the rank plan
counts half the expert bytes, and the layouts columns cannot carry are refused before any spawn."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moetier.checkpoint.loader import check_parallel
from moetier.checkpoint.random_bed import random_bed
from moetier.checkpoint.writer import make_checkpoint
from moetier.engine.llm import LLM
from moetier.errors import MoetierError
from moetier.experts.parallel.columns import ColumnExperts, column_part, resolve
from moetier.experts.placement import ExpertOptions, ExpertPlacement
from moetier.experts.shape import MoeShape
from moetier.parallel import Parallel
from moetier.presets import preset
from tests.helpers import batch_and_alone
from tests.test_tp import ENGINE, GREEDY, PROMPTS, close_enough, logits_of

TP2 = Parallel(0, 2, 2, 1)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tpx")
    out = {name: make_checkpoint(root / name, name, seed=1, dtype="float32") for name in ("tiny", "tiny-dsv3")}
    out["tiny-fused"] = make_checkpoint(root / "fused", "tiny", seed=2, dtype="float32", fused_experts=True)
    return out


@pytest.mark.parametrize("name,backend", [
    ("tiny", "resident"), ("tiny", "slots"), ("tiny", "uva"),
    ("tiny-dsv3", "resident"), ("tiny-dsv3", "slots"), ("tiny-dsv3", "uva"),  # MLA + shared experts
    ("tiny-fused", "slots"),  # fused [E, ...] expert tensors: each rank its I/2 columns of every row
])
def test_columns_logits_equal_one_process(ckpts, name, backend):
    # 4 slots per layer: decode steps miss and overflow, prefill bypasses
    experts = ExpertOptions(backend=backend, slots=4 if backend == "slots" else None, split="columns")
    one = LLM(ckpts[name], experts=experts, **ENGINE)
    ref = logits_of(one)
    llm = LLM(ckpts[name], experts=experts, tensor_parallel_size=2, **ENGINE)
    try:
        got, whole = llm.model.moe_blocks()[0].experts, one.model.moe_blocks()[0].experts
        assert isinstance(got, ColumnExperts) and not isinstance(whole, ColumnExperts)
        assert got.layout.inter * 2 == whole.layout.inter
        tier = "device" if backend == "resident" else "host"
        assert got.nbytes()[tier] * 2 == whole.nbytes()[tier]  # half of every expert on rank 0
        for g, want in zip(logits_of(llm), ref):
            close_enough(g, want)
    finally:
        llm.close()


def test_auto_is_columns_and_the_default_replicate_keeps_every_expert_whole(ckpts):
    par = TP2
    cfg = preset("tiny")
    assert ExpertPlacement(cfg.moe_shape, torch.float32, cfg.moe_layers, ExpertOptions(split="auto"), "meta", 8,
                           par).split == "columns"
    # auto is the default (columns measured faster on two H200s)
    assert ExpertPlacement(cfg.moe_shape, torch.float32, cfg.moe_layers, ExpertOptions(), "meta", 8,
                           par).split == "columns"
    rep = ExpertPlacement(cfg.moe_shape, torch.float32, cfg.moe_layers, ExpertOptions(split="replicate"),
                          "meta", 8, par)
    assert rep.split == "replicate" and rep.layout == cfg.moe_shape.layout
    experts = ExpertOptions(backend="resident", split="replicate")
    llm = LLM(ckpts["tiny"], experts=experts, tensor_parallel_size=2, **ENGINE)
    try:
        ex = llm.model.moe_blocks()[0].experts
        assert not isinstance(ex, ColumnExperts) and ex.layout == cfg.moe_shape.layout
    finally:
        llm.close()


def test_columns_greedy_batch_equals_each_alone_and_one_process(ckpts):
    experts = ExpertOptions(backend="slots", slots=4, split="columns")
    one = LLM(ckpts["tiny-dsv3"], experts=experts, **ENGINE)
    want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY)]
    llm = LLM(ckpts["tiny-dsv3"], experts=experts, tensor_parallel_size=2, **ENGINE)
    try:
        batch, alone = batch_and_alone(llm, PROMPTS, GREEDY)
        assert batch == alone == want
    finally:
        llm.close()


def test_refusals_name_the_numbers_and_the_fix():
    cfg = preset("tiny")
    odd = dataclasses.replace(cfg, moe_intermediate_size=65)
    with pytest.raises(MoetierError, match=r"does not divide the experts' intermediate size \(65\).*replicate"):
        check_parallel(odd, ExpertOptions(split="columns"), 8, TP2)
    check_parallel(odd, ExpertOptions(split="auto"), 8, TP2)  # auto: replicate where columns cannot split
    fp8 = MoeShape(32, 4, 64, 64, "fp8")
    with pytest.raises(MoetierError, match=r"64 / 2 = 32 is not a multiple of 128"):
        resolve("columns", fp8, 2, 1, "slots")
    assert resolve("auto", fp8, 2, 1, "slots") == "replicate"
    assert resolve("auto", MoeShape(32, 4, 64, 512, "fp8"), 2, 1, "slots") == "columns"
    assert resolve("auto", MoeShape(32, 4, 64, 512, "fp8"), 8, 1, "slots") == "replicate"  # 64 per rank
    with pytest.raises(MoetierError, match="expert parallelism 2 already splits"):
        check_parallel(cfg, ExpertOptions(split="columns"), 8, Parallel(0, 2, 2, 2))
    check_parallel(cfg, ExpertOptions(split="auto"), 8, Parallel(0, 2, 2, 2))  # auto under EP: split by owner
    with pytest.raises(MoetierError, match="hybrid"):
        check_parallel(cfg, ExpertOptions("hybrid", split="columns"), 8, TP2)
    assert resolve("auto", cfg.moe_shape, 2, 1, "hybrid") == "replicate"  # the hybrid backend's rule kept
    with pytest.raises(MoetierError, match="expert split 'rows'"):
        check_parallel(cfg, ExpertOptions(split="rows"), 8, TP2)
    assert resolve("columns", cfg.moe_shape, 1, 1, "slots") == "replicate"  # one process: the whole
    # 4-bit rows: each rank's intermediate slice in whole groups (16 nvfp4, 128 int4, 32 int4-g32)
    with pytest.raises(MoetierError, match=r"int4 expert rows need .* whole groups of 128, but 256 / 4 = 64"):
        resolve("columns", MoeShape(32, 4, 64, 256, "int4"), 4, 1, "slots")
    assert resolve("auto", MoeShape(32, 4, 64, 256, "int4"), 2, 1, "slots") == "columns"
    assert resolve("auto", MoeShape(32, 4, 64, 64, "int4-g32"), 2, 1, "slots") == "columns"
    assert resolve("auto", MoeShape(32, 4, 64, 48, "nvfp4"), 2, 1, "slots") == "replicate"  # 24 a rank


def test_column_part_of_fused_and_fp8_scale_grids():
    i, h = 256, 64
    gate_up = torch.arange(2 * i * h).view(2 * i, h)
    got = column_part(gate_up, "gate_up", i, 1, 2)
    assert torch.equal(got, torch.cat([gate_up[128:256], gate_up[384:512]]))
    grid = torch.arange(4 * 1).view(1, 4, 1)  # [E, 2 nI, nH]: gate's 2 blocks, then up's
    assert column_part(grid, "gate_up_scale", i, 1, 2, "fp8").flatten().tolist() == [1, 3]
    down = torch.arange(h * i).view(h, i)
    assert torch.equal(column_part(down, "down", i, 0, 2), down[:, :128])
    assert column_part(torch.arange(2).view(1, 2), "down_scale", i, 1, 2, "fp8").tolist() == [[1]]


def test_column_part_of_4bit_codes_and_group_scales():
    # down [H, I/2] packs two columns a byte: rank 1 of 2 takes bytes [I/4, I/2); its group scales
    # [H, I/g] the groups of those columns; gate / up codes and their scale rows are cut by rows;
    # NVFP4's tensor scales are every rank's
    i, h = 256, 64
    codes = torch.arange(h * i // 2).view(h, i // 2)
    assert torch.equal(column_part(codes, "down", i, 1, 2, "int4"), codes[:, 64:])
    scales = torch.arange(h * 2).view(h, 2)  # int4: groups of 128
    assert torch.equal(column_part(scales, "down_scale", i, 1, 2, "int4"), scales[:, 1:])
    nv = torch.arange(h * 16).view(h, 16)  # nvfp4: groups of 16, 8 a rank
    assert torch.equal(column_part(nv, "down_scale", i, 0, 2, "nvfp4"), nv[:, :8])
    gate_up = torch.arange(2 * i * 4).view(2 * i, 4)  # [2I, G] scale rows: gate's half, then up's
    assert torch.equal(column_part(gate_up, "gate_up_scale", i, 1, 2, "nvfp4"),
                       torch.cat([gate_up[128:256], gate_up[384:]]))
    s2 = torch.tensor([[0.5, 0.25]])
    assert column_part(s2, "gate_up_scale_2", i, 1, 2, "nvfp4") is s2


@pytest.mark.parametrize("quant", [None, "fp8", "nvfp4", "int4", "int4-g32-asym"])
def test_random_bed_columns_are_slices_of_the_replicated_share(quant):
    # a TP rank's dense shards use the generator differently from one process (module docstring), so
    # its columns are slices of the replicated TP share's whole experts, and the ranks' slices tile them
    cfg = dataclasses.replace(preset("tiny"), moe_intermediate_size=256) if quant else preset("tiny")
    one = random_bed(cfg, seed=3, device="cpu", dtype=torch.float32, quant=quant, par=TP2, split="replicate")
    lay, i = one.cfg.moe_shape.layout, cfg.moe_intermediate_size
    layer = cfg.moe_layers[0]
    parts = ("gate", "up", "down") + (("gate_scale", "up_scale", "down_scale") if quant else ())
    parts += ("gate_scale_2", "up_scale_2", "down_scale_2") if quant == "nvfp4" else ()
    parts += ("gate_zero_point", "up_zero_point", "down_zero_point") if quant == "int4-g32-asym" else ()
    for rank in (0, 1):
        bed = random_bed(cfg, seed=3, device="cpu", dtype=torch.float32, quant=quant, par=Parallel(rank, 2, 2, 1),
                         split="columns")
        assert bed.split == "columns" and bed.cfg.moe_shape.quant == quant
        mine = dataclasses.replace(bed.cfg.moe_shape, inter=i // 2).layout
        assert bed.row_bytes == mine.row_bytes(torch.float32) < one.row_bytes
        for part in parts:
            want = column_part(lay.part(one.host[layer], part), part, i, rank, 2, quant)
            assert torch.equal(mine.part(bed.host[layer], part), want)


def test_rank_plan_counts_half_the_expert_bytes(ckpts):
    from moetier.models.registry import config_from_dir
    from moetier.engine.config import EngineConfig
    from moetier.plan.nodes import rank_plan
    from moetier.plan.preflight import request_for

    cfg = config_from_dir(ckpts["tiny"])
    req = request_for(cfg, torch.float32, "cuda", EngineConfig(), gpu_memory="80GiB", host_memory="100GiB")

    def item(plan, name, where="device"):
        return next(i.bytes for i in getattr(plan, where) if i.name.startswith(name))

    for backend, name, where in (("resident", "routed experts", "device"), ("uva", "expert store", "host")):
        whole = rank_plan(req, ExpertOptions(backend, split="replicate"), Parallel.of(2, 1))
        cols = rank_plan(req, ExpertOptions(backend, split="auto"), Parallel.of(2, 1))  # auto: columns
        assert cols.row_bytes * 2 == whole.row_bytes
        if where == "device":
            assert item(cols, name) * 2 == item(whole, name)
        else:  # page-aligned store
            assert item(cols, name, where) < item(whole, name, where) * 0.51
        assert item(cols, "dense: decoder layers") == item(whole, "dense: decoder layers")


I256 = "tiny-i256"  # tiny with an expert intermediate of 256: 128 a rank, whole FP8 blocks and 4-bit groups
# kind -> (--dtype, fused expert tensors, the rows' format)
QUANT_CKPTS = {"fp8": ("fp8", False), "fp8-fused": ("fp8", True), "nvfp4": ("nvfp4", False),
               "int4-fused": ("int4", True), "int4-asym": ("int4-g32-asym", False)}


@pytest.fixture(scope="module")
def quant_ckpts(tmp_path_factory):
    from moetier import presets

    root = tmp_path_factory.mktemp("tpx_quant")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(presets._TINY, I256, {**presets._TINY["tiny"], "moe_intermediate_size": 256,
                                         "num_experts": 8, "num_hidden_layers": 2})
        return {kind: make_checkpoint(root / kind, I256, seed=6, dtype=dtype, fused_experts=fused)
                for kind, (dtype, fused) in QUANT_CKPTS.items()}


@pytest.mark.parametrize("kind,backend", [("fp8", "slots"), ("fp8-fused", "resident"), ("nvfp4", "slots"),
                                          ("int4-fused", "resident"), ("int4-asym", "slots")])
def test_quantized_columns_split_weights_and_their_scales(quant_ckpts, kind, backend):
    """Quantized expert rows under columns: one process's logits. FP8: each rank its 128 gate / up
    rows and down columns with their 128 x 128 scale blocks (per-expert grids, or fused gate_up grids
    [2 nI, nH]). 4-bit: gate / up codes and group-scale rows, down's packed columns with their groups'
    scales, NVFP4's tensor scales whole, a fused INT4 tensor's int32 words turned to bytes before the cut."""
    experts = ExpertOptions(backend=backend, slots=3 if backend == "slots" else None, split="auto")  # columns
    one = LLM(quant_ckpts[kind], dtype="float32", experts=experts, **ENGINE)
    ref = logits_of(one)
    llm = LLM(quant_ckpts[kind], dtype="float32", experts=experts, tensor_parallel_size=2, **ENGINE)
    try:
        ex = llm.model.moe_blocks()[0].experts
        assert isinstance(ex, ColumnExperts) and ex.layout.inter == 128
        assert ex.layout.quant == QUANT_CKPTS[kind][0]
        for g, want in zip(logits_of(llm), ref):
            close_enough(g, want)
    finally:
        llm.close()
