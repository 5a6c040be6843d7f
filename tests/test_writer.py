from __future__ import annotations

import json

import torch

from tests.helpers import Sequence
from safetensors import safe_open

from moetier.checkpoint.index import Checkpoint
from moetier.models.registry import config_from_dir
from moetier.checkpoint.loader import load_model
from moetier.presets import preset
from moetier.checkpoint.safetensors_io import StreamingWriter
from moetier.checkpoint.writer import make_checkpoint, tensor_plan


def test_streaming_writer_is_read_by_safetensors(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(6)}
    entries = [(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    with StreamingWriter(tmp_path / "x.safetensors", entries) as w:
        for n, t in tensors.items():
            w.write(n, t)
    with safe_open(str(tmp_path / "x.safetensors"), "pt") as f:
        for n, t in tensors.items():
            assert torch.equal(f.get_tensor(n), t)


def test_same_seed_same_files_any_sharding(tmp_path):
    a = make_checkpoint(tmp_path / "a", "tiny", seed=3, dtype="bf16")
    b = make_checkpoint(tmp_path / "b", "tiny", seed=3, dtype="bf16", shard_bytes=2**20)
    c = make_checkpoint(tmp_path / "c", "tiny", seed=4, dtype="bf16")
    assert (a / "model.safetensors").read_bytes() == make_checkpoint(
        tmp_path / "a2", "tiny", seed=3, dtype="bf16").joinpath("model.safetensors").read_bytes()
    index = json.loads((b / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ta, tb = Checkpoint(a), Checkpoint(b)
    assert set(ta.tensors) == set(tb.tensors)
    with safe_open(str(a / "model.safetensors"), "pt") as fa, safe_open(str(c / "model.safetensors"), "pt") as fc:
        name = "model.layers.0.mlp.experts.3.up_proj.weight"
        f = tb.tensors[name].file
        with safe_open(str(b / f), "pt") as fb:
            assert torch.equal(fa.get_tensor(name), fb.get_tensor(name))
        assert not torch.equal(fa.get_tensor(name), fc.get_tensor(name))
    assert index["metadata"]["total_size"] == preset("tiny").num_parameters() * 2


def test_files_do_not_depend_on_the_thread_count(tmp_path):
    """The pool makes tensors ahead of the writer, which writes them in order: one thread's bytes, for
    plain, FP8 (weight then scale) and 4-bit (packed codes, scales) layouts, sharded too."""
    for dtype, shard in (("bf16", 2**20), ("fp8", 4 * 2**30), ("nvfp4", 2**20)):
        one = make_checkpoint(tmp_path / f"{dtype}-1", "tiny", seed=2, dtype=dtype, shard_bytes=shard, threads=1)
        many = make_checkpoint(tmp_path / f"{dtype}-3", "tiny", seed=2, dtype=dtype, shard_bytes=shard, threads=3)
        files = sorted(p.name for p in one.glob("*.safetensors"))
        assert files and files == sorted(p.name for p in many.glob("*.safetensors"))
        assert (len(files) > 1) == (shard == 2**20)
        for f in files:
            assert (one / f).read_bytes() == (many / f).read_bytes(), (dtype, f)


def test_fused_layout_holds_the_same_weights(tmp_path):
    a = make_checkpoint(tmp_path / "a", "tiny-odd", seed=1, dtype="float32")
    b = make_checkpoint(tmp_path / "b", "tiny-odd", seed=1, dtype="float32", fused_experts=True)
    assert "model.layers.1.mlp.experts.gate_up_proj" in Checkpoint(b).tensors
    _, ma, _ = load_model(a)
    _, mb, _ = load_model(b)
    ids = torch.arange(20)
    la = ma.logits(Sequence(ma, 32).forward(ids))
    lb = mb.logits(Sequence(mb, 32).forward(ids))
    assert torch.equal(la, lb)


def test_large_preset_plan_counts_every_parameter():
    cfg = preset("qwen3-30b-a3b")
    plan = tensor_plan(cfg)
    n = sum(torch.Size(s).numel() for _, s in plan)
    assert n == cfg.num_parameters()
    assert 30.4e9 < n < 30.6e9  # Qwen3-30B-A3B: 30.5 B parameters
    assert 235.0e9 < preset("qwen3-235b-a22b").num_parameters() < 235.2e9
    names = [name for name, _ in plan]
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "model.norm.weight"
    assert len(names) == 3 + 48 * (9 + 3 * 128)  # 8 attention and norm tensors, the router, 3 per expert


def test_written_config_loads_and_uses_tokenizer_eos(tmp_path):
    from moetier.tokenizer import Tokenizer

    path = make_checkpoint(tmp_path / "t", "tiny", dtype="bf16")
    cfg = config_from_dir(path)
    tok = Tokenizer.from_dir(path)
    assert set(cfg.eos_token_ids) == set(tok.eos_token_ids)
    assert cfg.torch_dtype == "bfloat16"
