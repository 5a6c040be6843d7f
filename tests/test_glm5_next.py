"""GLM-5.3-Flash (glm5_next) against transformers' Glm5NextForConditionalGeneration: float32 logits
to 1e-5 relative over a whole prompt longer than a KDA chunk (64) and than index_topk (16). Weights
go through save_pretrained (with its tiny vision tower, which we skip) and our loader. Decode steps,
greedy generate() and the engine: tests/test_glm5_next_engine.py."""

from __future__ import annotations

import pytest
import torch

from moetier.engine.llm import LLM
from tests.conftest import hf_glm5_next_checkpoint
from tests.helpers import Sequence
from tests.test_parity import rel_err


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return hf_glm5_next_checkpoint(tmp_path_factory.mktemp("glm5next") / "ckpt", seed=1)


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def test_prefill_logits_match_transformers(checkpoint):
    path, ref = checkpoint
    model = LLM(path, dtype="float32", device="cpu").model
    ids = prompt(140, 1)  # three KDA chunks (64, 64, 12), 35 kpool groups against a budget of 4
    with torch.no_grad():
        want = ref(ids[None]).logits[0].float()
    assert rel_err(model.logits(Sequence(model, 144, page_size=8).forward(ids)), want) <= 1e-5


def test_vision_tower_is_known_and_skipped(checkpoint):
    from moetier.checkpoint.index import Checkpoint
    from moetier.checkpoint.validate import validate
    from moetier.models.registry import config_from_dir
    from moetier.models.glm5_next import Glm5NextForConditionalGeneration as Model

    path, _ = checkpoint
    cfg, ckpt = config_from_dir(path), Checkpoint(path)
    vision = {n for n in ckpt.tensors if n.startswith("model.visual.")}
    assert vision
    weights = Model.checkpoint_weights(cfg, set(ckpt.tensors))
    assert vision <= {w.name for w in weights if w.skipped}
    assert not vision & {w.name for w in validate(cfg, ckpt, weights)}  # validated, never read
    # an MTP layer after the decoder layers (GLM-5's layout) is known and skipped the same way
    mtp = {f"model.language_model.layers.{cfg.num_layers}.eh_proj.weight",
           f"model.language_model.layers.{cfg.num_layers}.shared_head.head.weight"}
    weights = Model.checkpoint_weights(cfg, set(ckpt.tensors) | mtp)
    assert mtp <= {w.name for w in weights if w.skipped}
    assert Model(cfg, torch.float32).param(next(iter(mtp))) is None


def test_config_problems_are_one_error():
    from moetier.models.registry import config_from_dict
    from moetier.errors import ConfigError
    from moetier.presets import preset_dict

    d = preset_dict("tiny-glm5-next")
    d["text_config"] = {**d["text_config"], "qk_rope_head_dim": 8, "index_topk": 18,
                        "layer_types": ["linear_attention"] * 4 + ["indexed_attention"],
                        "indexer_types": ["full"] * 4 + ["shared"], "index_kpool_always_select_tail": False}
    with pytest.raises(ConfigError) as e:
        config_from_dict(d)
    msg = str(e.value)
    assert "NoPE" in msg and "multiple of index_kpool" in msg and "layer 4 is a 'shared' indexed layer" in msg
    assert "index_kpool_always_select_tail" in msg


def test_clamp_and_sparse_selection_are_what_matches(checkpoint):
    """The parity above is not vacuous: without the SwiGLU clamp, or with the indexer reading every
    pool, the logits miss transformers' by far."""
    path, ref = checkpoint
    model = LLM(path, dtype="float32", device="cpu").model
    ids = prompt(80, 3)
    with torch.no_grad():
        want = ref(ids[None]).logits[0].float()

    def err() -> float:
        return rel_err(model.logits(Sequence(model, 96).forward(ids)), want)

    assert err() <= 1e-5
    for layer in model.layers:
        if not layer.kda and layer.attn.indexer is not None:
            layer.attn.indexer.topk = 128  # every complete pool of the context
    assert err() > 1e-3
    for layer in model.layers:
        if not layer.kda and layer.attn.indexer is not None:
            layer.attn.indexer.topk = 16
    assert err() <= 1e-5
    for block in model.moe_blocks():
        block.shared.swiglu_limit = None
    assert err() > 1e-3


def test_bfloat16_tracks_transformers(checkpoint):
    """bfloat16 on the CPU in both engines (the conv, A_log, dt_bias, mHC base and scale, router gate
    and bias float32 in both): logits close at bf16 precision."""
    path, ref = checkpoint
    ref = type(ref).from_pretrained(path, dtype=torch.bfloat16).eval()
    model = LLM(path, dtype="bfloat16", device="cpu").model
    kda = model.layers[0].attn
    assert model.embed.dtype == torch.bfloat16 and kda.conv.dtype == kda.A_log.dtype == torch.float32
    ids = prompt(70, 4)
    with torch.no_grad():
        want = ref(ids[None]).logits[0].float()
    assert rel_err(model.logits(Sequence(model, 80).forward(ids)), want) <= 2e-2


def test_linear_attn_config_is_read_as_transformers_reads_it():
    from transformers import Glm5NextTextConfig

    from moetier.models.registry import config_from_dict
    from moetier.presets import preset_dict

    d = preset_dict("tiny-glm5-next")
    lac = {"head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 3, "gate_lower_bound": None, "safe_gate": True}
    d["text_config"] = {**d["text_config"], "linear_attn_config": lac}
    ours, hf = config_from_dict(d), Glm5NextTextConfig(**d["text_config"])
    assert (ours.linear_head_dim, ours.linear_heads, ours.linear_conv_width, ours.linear_lower_bound) == (
        hf.linear_head_dim, hf.linear_num_heads, hf.linear_conv_kernel_dim, hf.linear_lower_bound) == (8, 2, 3, -5.0)


def test_softplus_gate_matches_transformers(tmp_path):
    """linear_lower_bound null: the softplus forget gate (A_log from transformers' init then matters)."""
    path, ref = hf_glm5_next_checkpoint(tmp_path / "ckpt", seed=5, linear_lower_bound=None)
    model = LLM(path, dtype="float32", device="cpu").model
    assert model.cfg.linear_lower_bound is None
    ids = prompt(70, 5)
    with torch.no_grad():
        want = ref(ids[None]).logits[0].float()
    assert rel_err(model.logits(Sequence(model, 80).forward(ids)), want) <= 1e-5
