"""The Hugging Face + accelerate peer of `bench decode`: built from our tensors it is the same model
(logits to 1e-5 in float32, same greedy tokens), offloads the expert share the budget says through
accelerate's hooks, and routes by supplied ids when told to."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from moetier.bench.peer_hf import build_hf_peer, expert_rows, hf_state_dict, offloaded_layers
from moetier.experts.placement import ExpertOptions
from tests.helpers import Sequence
from moetier.checkpoint.loader import load_model
from tests.conftest import hf_checkpoint


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    return hf_checkpoint(tmp_path_factory.mktemp("peer") / "tiny", "tiny", seed=7)


def ours_greedy(model, prompt: list[int], n: int) -> list[int]:
    seq = Sequence(model, len(prompt) + n)
    x, out = torch.tensor(prompt), []
    for _ in range(n):
        nxt = int(model.logits(seq.forward(x))[-1].argmax())
        out.append(nxt)
        x = torch.tensor([nxt])
    return out


def rel_err(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("preset,fused", [("tiny-odd", False), ("tiny-odd", True), ("tiny-gqa", True)])
def test_state_dict_inverts_the_loader(tmp_path, preset, fused):
    from moetier.checkpoint.writer import make_checkpoint

    path = make_checkpoint(tmp_path / preset, preset, seed=3, dtype="float32", fused_experts=fused)
    _, model, _ = load_model(path, dtype="float32", experts=ExpertOptions("uva"))
    want = {}
    for f in path.glob("*.safetensors"):
        want.update(load_file(f))
    got = dict(hf_state_dict(model, fused_experts=fused))
    if model.cfg.tie_word_embeddings:
        want.pop("lm_head.weight", None)
    assert sorted(got) == sorted(want)
    for name, t in got.items():
        assert torch.equal(t, want[name]), name
    # experts read from rows given by layer (bench decode's host store) instead of the model's own
    zero = {layer: torch.zeros_like(rows) for layer, rows in expert_rows(model).items()}
    for name, t in hf_state_dict(model, fused_experts=fused, rows=zero):
        assert (".mlp.experts." in name) == (not t.any()), name


def test_offloaded_layers_follow_the_budget():
    layers = [1, 3, 5, 7]
    assert offloaded_layers(layers, 1.0) == []
    assert offloaded_layers(layers, 0.5) == [5, 7]
    assert offloaded_layers(layers, 0.25) == [3, 5, 7]
    assert offloaded_layers(layers, 0.0) == layers
    with pytest.raises(Exception):
        offloaded_layers(layers, 1.5)


@pytest.mark.parametrize("backend,budget", [("resident", 1.0), ("slots", 0.5), ("uva", 0.25)])
def test_peer_is_our_model(hf_tiny, backend, budget):
    _, model, _ = load_model(hf_tiny, dtype="float32", experts=ExpertOptions(backend))
    peer = build_hf_peer(model, budget, device="cpu")
    r = peer.report
    moe = model.cfg.moe_layers
    assert peer.offloaded == moe[len(moe) - round(len(moe) * (1 - budget)):]
    assert r["expert_bytes_offloaded"] == r["offloaded_bytes"]
    assert r["offloaded_share"] == pytest.approx(1 - budget)
    total = sum(t.numel() * t.element_size() for _, t in hf_state_dict(model))
    assert r["gpu_bytes"] + r["offloaded_bytes"] == total
    # accelerate's offload hooks are live: offloaded experts wait on the meta device between forwards
    for i in moe:
        devs = {p.device.type for p in peer.model.model.layers[i].mlp.experts.parameters()}
        assert devs == ({"meta"} if i in peer.offloaded else {"cpu"})
        if i in peer.offloaded:  # streamed from a pageable copy of its own, not from our store
            held = peer.model.model.layers[i].mlp.experts._hf_hook.weights_map["gate_up_proj"]
            assert not held.is_pinned()
            ours = expert_rows(model)[i].untyped_storage().data_ptr()
            assert held.untyped_storage().data_ptr() != ours

    prompt = torch.randint(0, model.cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = peer.model(prompt).logits.float()
    for b in range(2):
        ours = model.logits(Sequence(model, 64).forward(prompt[b]))
        assert rel_err(ours, theirs[b]) <= 1e-5

    out = peer.decode(prompt.tolist(), new_tokens=5, warmup=3)
    assert out["timed_steps"] == 5 and out["timed_tokens"] == 10 and out["tok_s"] > 0
    assert out["peer"]["expert_budget"] == budget and out["peer"]["offloaded_layers"] == len(peer.offloaded)
    assert out["tokens"] == [ours_greedy(model, p, 8) for p in prompt.tolist()]
    peer.close()


def test_tied_embeddings(tmp_path):
    path = hf_checkpoint(tmp_path / "gqa", "tiny-gqa", seed=2)
    _, model, _ = load_model(path, dtype="float32")
    peer = build_hf_peer(model, 0.5, device="cpu")
    assert peer.model.lm_head.weight is peer.model.model.embed_tokens.weight
    prompt = list(range(5, 17))
    assert peer.decode([prompt], new_tokens=5, warmup=1)["tokens"] == [ours_greedy(model, prompt, 6)]


def test_routing_override_forces_the_supplied_ids(hf_tiny):
    _, model, _ = load_model(hf_tiny, dtype="float32", experts=ExpertOptions("slots"))
    peer = build_hf_peer(model, 0.5, device="cpu")
    c = model.cfg
    g = torch.Generator().manual_seed(5)
    n, traced = 9, 3  # fewer traced layers than MoE layers: layer j takes traced layer j mod 3
    ids = torch.stack([torch.stack([torch.randperm(c.num_experts, generator=g)[:c.top_k] for _ in range(traced)])
                       for _ in range(n)])  # [N, L, k]
    seen: dict[int, list] = {i: [] for i in c.moe_layers}

    def spy(layer):
        def hook(module, args):
            seen[layer].append((args[1].clone(), args[2].clone()))  # top_k_index [T, k], weights [T, k]
        return hook

    handles = [peer.model.model.layers[i].mlp.experts.register_forward_pre_hook(spy(i)) for i in c.moe_layers]
    peer.replay(ids)
    prompt = torch.randint(0, c.vocab_size, (2, 4), generator=g).tolist()
    peer.decode(prompt, new_tokens=3, warmup=1)  # 8 prefill tokens, then 3 steps of 2: 14 tokens
    for j, layer in enumerate(c.moe_layers):
        chosen = torch.cat([i for i, _ in seen[layer]])
        weights = torch.cat([w for _, w in seen[layer]])
        assert torch.equal(chosen, ids[torch.arange(14) % n, j % traced])
        assert torch.allclose(weights.sum(-1), torch.ones(14))  # norm_topk_prob: renormalised
    peer.replay(None)
    for h in handles:
        h.remove()
    assert peer.decode(prompt, new_tokens=2, warmup=1)["tokens"] == [ours_greedy(model, p, 3) for p in prompt]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peer_offloads_to_the_gpu(hf_tiny):
    _, model, _ = load_model(hf_tiny, dtype="float32", device="cuda", experts=ExpertOptions("slots"))
    peer = build_hf_peer(model, 0.5, device="cuda")
    assert peer.report["offloaded_share"] == pytest.approx(0.5)
    off = peer.model.model.layers[peer.offloaded[0]].mlp.experts
    assert {p.device.type for p in off.parameters()} == {"meta"}
    assert off._hf_hook.weights_map["gate_up_proj"].device.type == "cpu"
    assert not off._hf_hook.weights_map["gate_up_proj"].is_pinned()
    prompt = torch.randint(0, model.cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = peer.model(prompt.cuda()).logits.float()
    ours = model.logits(Sequence(model, 64).forward(prompt[0].cuda()))
    assert rel_err(ours, theirs[0]) <= 1e-4
    out = peer.decode(prompt.tolist(), new_tokens=6, warmup=2)
    assert out["tokens"][0] == ours_greedy(model, prompt[0].tolist(), 8)
    peer.close()
