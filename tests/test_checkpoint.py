"""Config and checkpoint validation: every problem reported at once, with file and tensor name,
before any weight is allocated."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetier.checkpoint.index import Checkpoint
from moetier.checkpoint.validate import validate
from moetier.models.registry import config_from_dict, config_from_dir
from moetier.models.qwen3_moe import Qwen3MoeForCausalLM
from moetier.errors import CheckpointError, ConfigError
from moetier.checkpoint.loader import load_model
from moetier.presets import preset_dict


def copy_ckpt(src, dst):
    shutil.copytree(src, dst)
    return dst


def rewrite(path, change):
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors")


def test_config_unknown_architecture():
    with pytest.raises(ConfigError, match="model_type 'llama'.*not supported.*qwen3_moe"):
        config_from_dict({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})


def test_config_lists_every_problem():
    d = preset_dict("tiny")
    d.update(num_attention_heads=6, num_key_value_heads=4, num_experts_per_tok=40, vocab_size=-1)
    del d["moe_intermediate_size"]
    with pytest.raises(ConfigError) as e:
        config_from_dict(d)
    msg = str(e.value)
    assert "4 problems" in msg
    assert "not a multiple of num_key_value_heads 4" in msg
    assert "num_experts_per_tok 40 is larger than num_experts 32" in msg
    assert "vocab_size must be a positive integer, got -1" in msg
    assert "missing required field 'moe_intermediate_size'" in msg


def test_config_accepts_transformers5_names():
    d = preset_dict("tiny")
    d["num_local_experts"] = d.pop("num_experts")
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    d["dtype"] = d.pop("torch_dtype")
    del d["rope_theta"]
    cfg = config_from_dict(d)
    assert (cfg.num_experts, cfg.rope_theta, cfg.torch_dtype) == (32, 5e5, "float32")


def test_config_rejects_unsupported_features():
    d = preset_dict("tiny")
    d.update(use_sliding_window=True, rope_scaling={"rope_type": "yarn", "factor": 4.0}, hidden_act="gelu")
    with pytest.raises(ConfigError) as e:
        config_from_dict(d)
    assert "use_sliding_window" in str(e.value) and "'yarn'" in str(e.value) and "'gelu'" in str(e.value)


def test_missing_config_and_missing_dir(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        config_from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not readable JSON"):
        config_from_dir(tmp_path)


def test_tensor_problems_listed_together(tiny_ckpt, tmp_path):
    path = copy_ckpt(tiny_ckpt, tmp_path / "bad")

    def change(t):
        del t["model.layers.1.self_attn.q_norm.weight"]
        del t["model.layers.2.mlp.experts.7.down_proj.weight"]
        t["model.layers.0.mlp.shared_expert.weight"] = torch.zeros(4, 4)
        t["model.layers.3.mlp.gate.weight"] = torch.zeros(31, 128)
        t["model.norm.weight"] = torch.zeros(128, dtype=torch.int8)
    rewrite(path, change)
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    msg = str(e.value)
    assert "5 problems" in msg
    assert "missing tensor model.layers.1.self_attn.q_norm.weight (shape [32])" in msg
    assert "missing tensor model.layers.2.mlp.experts.7.down_proj.weight (shape [128, 64])" in msg
    assert "model.safetensors: unexpected tensor model.layers.0.mlp.shared_expert.weight" in msg
    assert "model.safetensors: model.layers.3.mlp.gate.weight has shape [31, 128], the config implies [32, 128]" in msg
    assert "model.norm.weight has dtype I8" in msg


def test_validation_runs_before_allocation(tiny_ckpt, tmp_path, monkeypatch):
    import moetier.checkpoint.loader as loader

    path = copy_ckpt(tiny_ckpt, tmp_path / "bad")
    rewrite(path, lambda t: t.pop("model.embed_tokens.weight"))

    def no_alloc(*a, **k):
        raise AssertionError("the model was allocated before validation")
    monkeypatch.setattr(loader, "build_model", no_alloc)
    with pytest.raises(CheckpointError, match="missing tensor model.embed_tokens.weight"):
        load_model(path)


def test_sharded_missing_and_damaged_shards(tiny_ckpt, tmp_path):
    from moetier.checkpoint.writer import make_checkpoint

    path = make_checkpoint(tmp_path / "sharded", "tiny", dtype="float32", shard_bytes=2 * 2**20)
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) >= 3
    shards[0].unlink()
    shards[1].write_bytes(b"garbage that is not safetensors")
    data = shards[2].read_bytes()
    shards[2].write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as e:
        Checkpoint(path)
    msg = str(e.value)
    assert f"{shards[0].name}: missing shard file" in msg
    assert f"{shards[1].name}: unreadable safetensors file" in msg
    assert f"{shards[2].name}: unreadable safetensors file (truncated" in msg
    assert "Download the missing or damaged files again" in msg


def test_index_names_a_tensor_the_shard_lacks(tmp_path):
    from moetier.checkpoint.writer import make_checkpoint

    path = make_checkpoint(tmp_path / "sharded", "tiny", dtype="float32", shard_bytes=2 * 2**20)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    first = sorted(index["weight_map"])[0]
    other = sorted({f for f in index["weight_map"].values() if f != index["weight_map"][first]})[0]
    index["weight_map"][first] = other
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"{other}: the index places {first} here but the file does not"):
        Checkpoint(path)


def test_no_weights_at_all(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no .safetensors files.*convert them to safetensors"):
        Checkpoint(tmp_path)


def test_tied_checkpoint_may_carry_lm_head(tmp_path):
    from moetier.checkpoint.writer import make_checkpoint

    path = make_checkpoint(tmp_path / "tied", "tiny-gqa", dtype="float32")
    cfg = config_from_dir(path)
    assert cfg.tie_word_embeddings
    weights = Qwen3MoeForCausalLM.checkpoint_weights(cfg, set())
    names = [w.name for w in validate(cfg, Checkpoint(path), weights)]
    assert "lm_head.weight" not in names
    rewrite(path, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    validate(cfg, Checkpoint(path), weights)  # accepted, and the tied embedding is used


def test_a_wrong_size_in_config_is_named_first_and_the_list_capped(tiny_ckpt, tmp_path):
    path = copy_ckpt(tiny_ckpt, tmp_path / "bad")
    d = json.loads((path / "config.json").read_text())
    d["hidden_size"] = 100
    (path / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    lines = str(e.value).splitlines()
    assert "likely cause: config.json gives hidden_size = 100 where" in lines[1] and "have 128" in lines[1]
    assert len(lines) < 20 and "more misshapen tensors" in str(e.value)


def test_a_wrong_layer_count_is_named_first(tiny_ckpt, tmp_path):
    path = copy_ckpt(tiny_ckpt, tmp_path / "bad")
    d = json.loads((path / "config.json").read_text())
    d["num_hidden_layers"] = 2
    (path / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=r"likely cause: config.json says num_hidden_layers 2, the checkpoint "
                                              r"holds layers 0..3 \(4 layers\)"):
        load_model(path)
