"""MTP layers (models/mtp.py) of deepseek_v3 and glm_moe_dsa: loaded on request with their experts
in the model's tiers, and their draft logits against transformers 5.24's MtpModel (the generic MTP
module it builds on the family's own decoder layer; for glm_moe_dsa, whose config transformers does
not give num_mtp_layers, the same MtpModel over GlmMoeDsa's decoder layer with num_mtp_layers set)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moetier.checkpoint.loader import load_model
from moetier.errors import MoetierError
from moetier.experts.placement import ExpertOptions
from moetier.layers.attention import make_batch
from tests.conftest import hf_mla_checkpoint
from tests.test_parity import rel_err


def hf_mtp_checkpoint(out: Path, preset: str, seed: int, mtp_layers: int = 1, copies: bool = True):
    """A tiny checkpoint whose layers num_layers.. are the MTP layers of a random transformers
    MtpModel over the main model -> (path, main model, MtpModel)."""
    from transformers.modeling_layers import MtpModel

    path, ref = hf_mla_checkpoint(out, preset, seed, num_nextn_predict_layers=mtp_layers)
    config = ref.config
    config.num_mtp_layers = mtp_layers
    if getattr(config, "mlp_layer_types", None) is not None:
        config.mtp_mlp_layer_types = ["sparse"] * mtp_layers
    if getattr(config, "layer_types", None) is not None:  # glm_moe_dsa: full attention; indexer_types[0] "full"
        config.mtp_layer_types = [config.layer_types[0]] * mtp_layers
    torch.manual_seed(seed + 100)
    mtp = MtpModel(ref, mtp_layers).eval()
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if "embed_tokens" in name or "shared_head" in name:
                continue
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("norm.bias"):
                p.uniform_(-0.2, 0.2)
            elif p.dim() > 1:
                p.normal_(0.0, 0.1)
        for name, b in mtp.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.05, 0.05)
    n = config.num_hidden_layers
    tensors = {}
    for name, t in mtp.state_dict().items():
        if not name.startswith("layers."):
            continue
        _, d, rest = name.split(".", 2)
        rest = rest.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        tensors[f"model.layers.{n + int(d)}.{rest}"] = t.contiguous()
    if copies:  # what the published checkpoints also hold: copies of the embedding and head
        for d in range(mtp_layers):
            tensors[f"model.layers.{n + d}.embed_tokens.weight"] = ref.model.embed_tokens.weight.detach().clone()
            tensors[f"model.layers.{n + d}.shared_head.head.weight"] = ref.lm_head.weight.detach().clone()
    save_file(tensors, str(path / "mtp.safetensors"))
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        weight_map = {name: "model.safetensors" for name in f.keys()}
    weight_map.update({name: "mtp.safetensors" for name in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path, ref, mtp


def _ours(path, experts=None):
    return load_model(path, dtype="float32", device="cpu", experts=experts, mtp=True)[1]


def _run(model, ids: torch.Tensor, depths: int):
    """Our target forward over ids [T], then MTP depth 0 over rows 0 .. T-2 (row i: token i+1 with
    hidden i) and depth d over rows 0 .. T-2-d (token i+1+d with depth d-1's hidden of row i), every
    depth at the rows' base positions -> (hidden [T, H], [logits of each depth])."""
    t = ids.shape[0]
    kv = model.kv_spec().allocate(8, 4, model.dtype, model.device)
    pages = list(range(kv.num_pages))
    hidden = model.forward(ids, make_batch([(0, t, pages)], 4, "cpu"), kv)
    out, h = [], hidden[:-1]
    for d in range(depths):
        rows = t - 1 - d
        logits, h = model.draft(ids[1 + d:], h[:rows], make_batch([(0, rows, pages)], 4, "cpu"), kv, depth=d)
        out.append(logits)
    return hidden, out


def _theirs(ref, mtp, ids: torch.Tensor, depths: int):
    """transformers: MtpModel.forward_layer, the drafting step it exposes; for glm_moe_dsa (whose
    decoder layer returns (hidden, top-k), which MtpLayer does not unpack, and whose mask type
    "indexed_attention" MtpModel does not map) the same composition written out around
    GlmMoeDsa's own decoder layer."""
    from transformers.cache_utils import MtpCache
    from transformers.masking_utils import create_causal_mask

    t = ids.shape[0]
    with torch.no_grad():
        hidden = ref.model(ids[None]).last_hidden_state
        cache, out, h = MtpCache(config=mtp.config), [], hidden[:, :-1]
        for d in range(depths):
            rows = t - 1 - d
            if ref.config.model_type != "glm_moe_dsa":
                pos = torch.arange(1 + d, 1 + d + rows)[None]
                h = mtp.forward_layer(d, h[:, :rows], pos, cache, input_ids=ids[None, 1 + d:])
            else:
                layer, pos = mtp.layers[d], torch.arange(rows)[None]
                e = ref.model.embed_tokens(ids[None, 1 + d:])
                x = layer.eh_proj(torch.cat([layer.enorm(e), layer.hnorm(h[:, :rows])], dim=-1))
                mask = create_causal_mask(config=ref.config, inputs_embeds=x, attention_mask=None, cache=None,
                                          position_ids=pos, allow_is_causal_skip=False)
                x, _ = layer.mtp_block(x, attention_mask=mask, position_ids=pos,
                                       position_embeddings=ref.model.rotary_emb(x, position_ids=pos))
                h = layer.post_norm(x)
            out.append(mtp._project_to_logits(h)[0].float())
    return hidden[0], out


@pytest.mark.parametrize("preset,seed,mtp_layers", [("tiny-dsv3", 1, 1), ("tiny-dsv3-plain", 2, 2),
                                                    ("tiny-glm5", 3, 1)])
def test_draft_logits_match_transformers(tmp_path, preset, seed, mtp_layers):
    path, ref, mtp = hf_mtp_checkpoint(tmp_path / preset, preset, seed, mtp_layers)
    model = _ours(path)
    assert len(model.mtp) == mtp_layers
    ids = torch.randint(0, model.cfg.vocab_size, (14,), generator=torch.Generator().manual_seed(seed))
    hidden, ours = _run(model, ids, mtp_layers)
    want_hidden, theirs = _theirs(ref, mtp, ids, mtp_layers)
    assert rel_err(hidden, want_hidden) <= 1e-5
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and rel_err(a, b) <= 1e-5
    # not vacuous: the MTP layer's logits are not the model's own head on its hidden states
    assert rel_err(ours[0], model.logits(hidden[:-1])) > 1e-2


def test_mtp_experts_are_moe_layers_in_the_tiers(tmp_path):
    """The MTP layer's routed experts sit in the tiers like the others: counted by moe_layers (the
    plan, the placement, the traces), served by a slots backend with its counters, bit-exact
    against resident."""
    path, _, _ = hf_mtp_checkpoint(tmp_path / "m", "tiny-dsv3", 4)
    resident = _ours(path)
    slots = _ours(path, ExpertOptions("slots", slots=4))
    n = resident.cfg.num_layers
    assert resident.cfg.moe_layers == [1, 2, n] and len(resident.moe_blocks()) == 3
    assert resident.kv_spec().num_layers == n + 1
    ids = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(4))
    _, a = _run(resident, ids, 1)
    slots.reset_experts()
    _, b = _run(slots, ids, 1)
    assert torch.equal(a[0], b[0])
    mtp_block = slots.mtp[0].block.mlp
    assert mtp_block.experts.stats()["steps"] > 0 and mtp_block.experts.stats()["misses"] > 0


def test_without_the_flag_mtp_layers_are_skipped_and_the_plan_counts_them_when_loaded(tmp_path):
    from moetier.models.mtp import with_mtp
    from moetier.plan.memory import PlanRequest, count

    path, _, _ = hf_mtp_checkpoint(tmp_path / "m", "tiny-glm5", 5)
    cfg, model, _ = load_model(path, dtype="float32", device="cpu")
    assert len(model.mtp) == 0 and cfg.moe_layers == [1, 2, 3] and cfg.mtp_layers == 0
    on = with_mtp(cfg, True)
    assert on.moe_layers == [1, 2, 3, 4] and on.index_layers == (0, 2, 4)
    assert on.num_parameters() > cfg.num_parameters()
    plans = [count(PlanRequest(c, torch.float32, "cpu", max_model_len=64)) for c in (cfg, on)]
    assert plans[1].request["moe_layers"] == 4 and plans[0].request["moe_layers"] == 3
    assert plans[1].as_dict() != plans[0].as_dict()


def test_mtp_refusals(tmp_path):
    from moetier import presets
    from moetier.models.mtp import with_mtp

    with pytest.raises(MoetierError, match="num_nextn_predict_layers is 0"):
        with_mtp(presets.preset("tiny-dsv3"), True)
    with pytest.raises(MoetierError, match="use method ngram"):
        with_mtp(presets.preset("tiny"), True)
    assert presets.preset("tiny-glm5", mtp_layers=1).num_nextn_predict_layers == 1
    path, _, _ = hf_mtp_checkpoint(tmp_path / "m", "tiny-dsv3", 6)
    (path / "mtp.safetensors").unlink()  # config says one MTP layer, the checkpoint lacks it
    (path / "model.safetensors.index.json").unlink()
    with pytest.raises(MoetierError, match="eh_proj"):
        _ours(path)


def test_mtp_layers_split_under_tensor_and_expert_parallelism():
    """Built on the meta device with rank 0's layout: the MTP layer's attention heads and shared
    expert split under tp 2 like a decoder layer's, and its experts under ep 2."""
    from moetier import presets
    from moetier.checkpoint.loader import build_model, check_parallel
    from moetier.models.mtp import with_mtp
    from moetier.parallel import Parallel

    cfg = with_mtp(presets.preset("tiny-glm5", mtp_layers=1), True)
    for par in (Parallel(0, 2, 2, 1), Parallel(0, 2, 1, 2), Parallel(0, 2, 2, 2)):
        check_parallel(cfg, ExpertOptions(), 64, par)
    model, placement, rows = build_model(cfg, torch.float32, "meta", ExpertOptions(), 64, Parallel(0, 2, 2, 1))
    head = model.mtp[0].block.attn
    assert cfg.num_layers in rows and head.hq == cfg.num_heads // 2


def test_trace_hooks_with_mtp_layers_loaded(tmp_path):
    """A draft step runs the MTP layer alone: the recorder writes its first pass of the step (the
    catch-up over the positions the step made valid) as the MTP layer's own column, the replayer
    routes the MTP layer from that column at its cursor without moving it, and the target's steps
    move it as before."""
    from moetier.traces.format import read_trace
    from moetier.traces.hooks import Recorder, Replayer

    path, _, _ = hf_mtp_checkpoint(tmp_path / "m", "tiny-dsv3", 7)
    model = _ours(path)
    mtp = model.cfg.num_layers
    ids = torch.randint(0, 512, (10,), generator=torch.Generator().manual_seed(7))
    rec = Recorder(model, tmp_path / "t.mtrace")
    seen = {}
    hook = model.mtp[0].block.mlp.route_hook
    model.mtp[0].block.mlp.route_hook = lambda layer, i, w: seen.setdefault(layer, hook(layer, i, w))
    _run(model, ids, 1)  # target step over 10 tokens, then a draft pass over the first 9
    model.mtp[0].block.mlp.route_hook = hook
    rec.end_step(["a"], [10], kept=[9])  # the harness's MTP pass covers 9 positions: write those
    rec.close()
    trace = read_trace(tmp_path / "t.mtrace")
    assert trace.layers == [1, 2, mtp] and trace.num_tokens == 9
    assert np.array_equal(trace.ids[:, 2], seen[mtp][0].numpy())
    rep = Replayer(model, trace)
    routed = {}
    block = model.mtp[0].block.mlp
    hook = block.route_hook
    block.route_hook = lambda layer, i, w: routed.setdefault(layer, hook(layer, i, w))
    _run(model, ids, 1)
    rep.close()
    assert int(rep.cursor) == 10  # the target's 10 tokens; the MTP step kept it
    # the MTP layer replays its own column, from the cursor the target's step left
    assert np.array_equal(routed[mtp][0].numpy(), trace.ids[(10 + np.arange(9)) % 9, 2])
