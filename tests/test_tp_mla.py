"""Tensor parallelism for the MLA families (deepseek_v3, glm_moe_dsa; docs/parallel.md) with 2 ranks
over gloo on the CPU: query heads split (q_b / q_proj, kv_b, o_proj), the latent path, its cache and
the DSA indexer replicated, dense MLP and shared experts split by columns. The same logits as one
process (fp32 tolerance, as tests/test_tp.py), batch == alone, FP8 dense weights split by scale
block or dequantized, and layouts the heads or columns cannot split refused before any spawn."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from moetier.checkpoint.writer import make_checkpoint
from moetier.engine.llm import LLM
from moetier.errors import MoetierError
from moetier.experts.placement import ExpertOptions
from moetier.layers.fp8_linear import Fp8Weight
from moetier.parallel import Parallel
from tests.helpers import batch_and_alone

from tests.test_tp import ENGINE, GREEDY, PROMPTS, close_enough, logits_of

# tiny-dsv3-plain (q_proj without the low-rank query, rotate-half rotary, two shared experts, tied
# embeddings) has 3 heads, which 2 ranks cannot split: this variant gives it 4 (its other widths,
# 96 dense and 48 shared columns, split as they are) and kv_a / o_proj biases (o_proj's added once,
# after the all-reduce). The 3-head preset is the refusal case.
PLAIN4 = "tiny-dsv3-plain-h4"
# tiny-dsv3 with every head-split FP8 part on 128-wide scale blocks under TP 2: q_b rows per rank
# 2 x (48 + 16) = 128, o_proj columns per rank 2 x 64 = 128, the dense MLP 256 -> 128 per rank;
# the shared expert (32 -> 16 per rank) falls back to its dequantized weights.
ALIGNED = "tiny-dsv3-fp8-aligned"
SLOTS = {"tiny-dsv3": 4, PLAIN4: 2, "tiny-glm5": 4}  # fewer than a rank's experts: decode steps miss


def variants() -> dict[str, dict]:
    from moetier import presets

    t = presets._TINY
    return {PLAIN4: {**t["tiny-dsv3-plain"], "num_attention_heads": 4, "num_key_value_heads": 4,
                     "attention_bias": True},
            ALIGNED: {**t["tiny-dsv3"], "intermediate_size": 256, "qk_nope_head_dim": 48, "v_head_dim": 64,
                      "num_hidden_layers": 2}}


def random_biases(path):
    """make_checkpoint writes zero biases (as transformers initialises them): draw them instead, so
    that a bias added on every rank instead of once shows."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(7)
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            tensors, meta = {k: h.get_tensor(k) for k in h.keys()}, h.metadata()
        for k, t in tensors.items():
            if k.endswith(".bias"):
                tensors[k] = torch.rand(t.shape, generator=g).to(t.dtype) - 0.5
        save_file(tensors, str(f), metadata=meta)
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from moetier import presets

    root = tmp_path_factory.mktemp("tp_mla")
    with pytest.MonkeyPatch.context() as mp:
        for name, d in variants().items():
            mp.setitem(presets._TINY, name, d)
        out = {n: make_checkpoint(root / n, n, seed=4, dtype="float32")
               for n in ("tiny-dsv3", "tiny-dsv3-plain", PLAIN4, "tiny-glm5")}
        random_biases(out[PLAIN4])
        out[ALIGNED] = make_checkpoint(root / ALIGNED, ALIGNED, seed=5, dtype="fp8")
        out["tiny-dsv3-fp8"] = make_checkpoint(root / "dsv3-fp8", "tiny-dsv3", seed=5, dtype="fp8")
    return out


@pytest.mark.parametrize("preset", ["tiny-dsv3", PLAIN4, "tiny-glm5"])
@pytest.mark.parametrize("ep", [1, 2])
@pytest.mark.parametrize("backend", ["resident", "slots"])
def test_logits_equal_one_process(ckpts, preset, ep, backend):
    experts = ExpertOptions(backend=backend, slots=SLOTS[preset] if backend == "slots" else None)
    one = LLM(ckpts[preset], experts=experts, **ENGINE)
    ref = logits_of(one)
    llm = LLM(ckpts[preset], experts=experts, tensor_parallel_size=2, expert_parallel_size=ep, **ENGINE)
    try:
        attn, whole = llm.model.layers[0].attn, one.model.layers[0].attn
        assert attn.hq * 2 == whole.hq and attn.kv_b.shape[0] * 2 == whole.kv_b.shape[0]  # half the heads
        assert llm.model.layers[0].mlp.inter * 2 == one.model.layers[0].mlp.inter  # the dense layer's columns
        shared = llm.model.moe_blocks()[0].shared
        assert shared.inter * 2 == one.model.moe_blocks()[0].shared.inter
        # the latent is shared by every head: each rank holds (and wrote) the whole cache
        assert llm.kv.nbytes() == one.kv.nbytes()
        for got, want in zip(logits_of(llm), ref):
            close_enough(got, want)
        if preset == "tiny-glm5":  # the replicated indexer: rank 0 wrote the same index keys as one process
            used = one.kv.index_k.abs().sum(dim=(0, 2, 3)) > 0
            torch.testing.assert_close(llm.kv.index_k[:, used], one.kv.index_k[:, used], rtol=1e-5, atol=1e-5)
    finally:
        llm.close()
        one.close()


@pytest.mark.parametrize("preset", ["tiny-glm5", PLAIN4])
def test_greedy_batch_equals_each_alone_and_one_process(ckpts, preset):
    experts = ExpertOptions(backend="slots", slots=SLOTS[preset])
    one = LLM(ckpts[preset], experts=experts, **ENGINE)
    want = [o.outputs[0].token_ids for o in one.generate(PROMPTS, GREEDY)]
    one.close()
    llm = LLM(ckpts[preset], experts=experts, tensor_parallel_size=2, expert_parallel_size=2, **ENGINE)
    try:
        batch, alone = batch_and_alone(llm, PROMPTS, GREEDY)
        assert batch == alone == want
    finally:
        llm.close()


def meta_model(preset: str, par: Parallel, fp8_kept: bool = False, **changes):
    from moetier import presets
    from moetier.config import with_dense
    from moetier.models.registry import model_class

    with pytest.MonkeyPatch.context() as mp:
        for name, d in variants().items():
            mp.setitem(presets._TINY, name, d)
        cfg = dataclasses.replace(presets.preset(preset), **changes)
    if fp8_kept:
        cfg = with_dense(dataclasses.replace(cfg, quant="fp8"), "keep")
    return cfg, model_class(cfg)(cfg, torch.bfloat16, "meta", par)


def held_in_fp8(model) -> set[str]:
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, Fp8Weight)}


def test_which_weights_stay_fp8_under_tensor_parallelism():
    tp2 = Parallel(1, 2, 2)
    assert held_in_fp8(meta_model("tiny-dsv3", Parallel(), True)[1]) == {"q_a", "q_b", "kv_a", "o", "w13", "w2"}
    # 2 heads x 40 q rows and 2 x 20 o columns per rank cut the 128-wide blocks: dequantized at load
    assert held_in_fp8(meta_model("tiny-dsv3", tp2, True)[1]) == {"q_a", "kv_a"}
    _, aligned = meta_model(ALIGNED, tp2, True)
    assert held_in_fp8(aligned) == {"q_a", "q_b", "kv_a", "o", "w13", "w2"}
    assert not isinstance(aligned.moe_blocks()[0].shared.w13, Fp8Weight)  # 16 shared columns per rank
    assert held_in_fp8(meta_model(PLAIN4, tp2, True)[1]) == {"kv_a"}  # q_proj 2 x 24 rows: off the blocks


@pytest.mark.parametrize("preset", [ALIGNED, "tiny-dsv3-fp8"])
def test_kept_fp8_split_by_scale_blocks_matches_one_process(ckpts, preset):
    """Each rank loads its rows of q_b and its columns of o_proj with their scale grids where they sit
    on blocks (ALIGNED), or dequantizes them at load (tiny-dsv3): the logits of one process."""
    one = LLM(ckpts[preset], dtype="float32", dense_weights="keep", **ENGINE)
    ref = logits_of(one)
    llm = LLM(ckpts[preset], dtype="float32", dense_weights="keep", tensor_parallel_size=2, **ENGINE)
    try:
        attn = llm.model.layers[1].attn
        if preset == ALIGNED:
            assert attn.q_b.scale.shape == (1, 1) and attn.o.scale.shape == (1, 1)  # 128 rows / columns
        else:
            assert not isinstance(attn.q_b, Fp8Weight) and isinstance(attn.kv_a, Fp8Weight)
        for got, want in zip(logits_of(llm), ref):
            close_enough(got, want)
    finally:
        llm.close()
        one.close()


def test_layouts_the_heads_or_columns_cannot_split_are_refused(ckpts, monkeypatch):
    from moetier.checkpoint.loader import check_parallel

    t0 = time.monotonic()
    with pytest.raises(MoetierError, match=r"tensor parallelism 2 does not divide num_attention_heads \(3\)"):
        LLM(ckpts["tiny-dsv3-plain"], tensor_parallel_size=2, **ENGINE)
    assert time.monotonic() - t0 < 1.0  # refused before spawning (a spawn costs seconds)
    tp2 = Parallel(0, 2, 2)
    for changes, needle in ((dict(intermediate_size=97), r"intermediate_size \(97\)"),
                            (dict(moe_intermediate_size=33), r"the shared experts' width .* \(33\)")):
        cfg = meta_model("tiny-dsv3", Parallel(), **changes)[0]
        with pytest.raises(MoetierError, match=needle):
            check_parallel(cfg, ExpertOptions(), 64, tp2)
    from moetier.models.deepseek_v3 import DeepseekV3ForCausalLM

    monkeypatch.setattr(DeepseekV3ForCausalLM, "tensor_parallel", False)  # a family without splits
    with pytest.raises(MoetierError, match="not implemented for DeepseekV3ForCausalLM"):
        check_parallel(meta_model("tiny-dsv3", Parallel())[0], ExpertOptions(), 64, tp2)


def test_rank_plan_keeps_the_latent_cache_whole(ckpts):
    from moetier.models.registry import config_from_dir
    from moetier.engine.config import EngineConfig
    from moetier.plan.nodes import rank_plan
    from moetier.plan.preflight import request_for

    req = request_for(config_from_dir(ckpts["tiny-glm5"]), torch.float32, "cuda", EngineConfig(),
                      gpu_memory="80GiB", host_memory="100GiB")

    def item(plan, name):
        return next(i.bytes for i in plan.device if i.name.startswith(name))

    one, tp2 = rank_plan(req, ExpertOptions("uva"), Parallel.of(1, 1)), rank_plan(req, ExpertOptions("uva"), Parallel.of(2, 1))
    assert item(tp2, "KV pages") == item(one, "KV pages")  # latent and index keys on every rank
    assert item(tp2, "dense: decoder layers") < item(one, "dense: decoder layers")
