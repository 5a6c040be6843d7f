"""Shared fixtures: checkpoints written by our writer and by transformers' save_pretrained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

GPU_SKIP = "gpu: needs CUDA"  # .ci/check_skips.py: on a CPU machine this is the only reason a test may skip


def pytest_collection_modifyitems(config, items):
    """Without CUDA every `gpu` test skips with one reason, first (before its own skipif: skipifs are read in order), so CI can
    tell them from a CPU test skipped for a missing dependency (which fails CI)."""
    if torch.cuda.is_available():
        return
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skipif(True, reason=GPU_SKIP), append=False)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """The `tiny` preset in float32, written once per test session."""
    from moetier.checkpoint.writer import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", "tiny", seed=0, dtype="float32")


def hf_checkpoint(out: Path, preset: str, seed: int, max_shard_size: str | None = None) -> Path:
    """A random Qwen3MoeForCausalLM from transformers, saved with save_pretrained, plus our tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moetier import presets
    from moetier.tokenizer.synthetic import write_tokenizer

    d = presets.preset_dict(preset, dtype="float32")
    d.pop("architectures"), d.pop("model_type")
    d["rope_parameters"] = {"rope_type": "default", "rope_theta": d.pop("rope_theta")}
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**d)).eval()
    # transformers initialises norms to 1; random norms make the parity test see every weight.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    write_tokenizer(out)
    return out



def hf_mla_model(preset: str, seed: int, **overrides):
    """A random transformers DeepseekV3ForCausalLM / GlmMoeDsaForCausalLM of a tiny preset, float32.
    Norms, the router's correction bias and the indexer's LayerNorm bias are randomised too
    (transformers initialises them to 1 and 0), so parity sees every weight. overrides: config.json
    fields changed from the preset's."""
    import transformers

    from moetier import presets

    d = {**presets.preset(preset).to_hf_dict(), **overrides}
    arch = d.pop("architectures")[0]
    d.pop("model_type")
    config = getattr(transformers, arch.removesuffix("ForCausalLM") + "Config")(**d)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("norm.bias"):
                p.uniform_(-0.2, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.05, 0.05)
    return model


def hf_mla_checkpoint(out: Path, preset: str, seed: int, **overrides):
    """hf_mla_model saved with save_pretrained, plus our tokenizer. -> (path, the transformers model)."""
    from moetier.tokenizer.synthetic import write_tokenizer

    model = hf_mla_model(preset, seed, **overrides)
    model.save_pretrained(out)
    write_tokenizer(out)
    return out, model


def hf_glm5_next_model(seed: int, preset: str = "tiny-glm5-next", **text_overrides):
    """A random transformers Glm5NextForConditionalGeneration of a tiny preset, float32. What
    transformers initialises to constants (norms, biases, mHC base and scale, the forget gate's
    A_log, kpool's position embedding and gate) is randomised too, so parity sees every weight."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    from moetier import presets

    d = presets.preset_dict(preset, dtype="float32")
    config = Glm5NextConfig(text_config={**d["text_config"], **text_overrides}, vision_config=d.get("vision_config"),
                            tie_word_embeddings=d["tie_word_embeddings"])
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("norm.bias") or name.endswith("hc.base"):
                p.uniform_(-0.2, 0.2)
            elif name.endswith("hc.scale"):
                p.uniform_(0.5, 2.0)
            elif name.endswith("A_log"):
                p.uniform_(-1.0, 1.0)
            elif name.endswith("index_kpool_compress_ape"):
                p.uniform_(-1.0, 1.0)
            elif name.endswith("index_kpool_compress_gate"):
                p.normal_(0.0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.05, 0.05)
    return model


def hf_glm5_next_checkpoint(out: Path, seed: int, **text_overrides):
    """hf_glm5_next_model saved with save_pretrained, plus our tokenizer. -> (path, the model)."""
    from moetier.tokenizer.synthetic import write_tokenizer

    model = hf_glm5_next_model(seed, **text_overrides)
    model.save_pretrained(out)
    write_tokenizer(out)
    return out, model
