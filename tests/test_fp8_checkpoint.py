"""FP8 checkpoints (issue 13): make-checkpoint --dtype fp8, the loader (experts stay FP8 in their
rows, dense float8 weights dequantized at load) against our dequantized reference and against
transformers, validation of block scales, and the random-weight bed with FP8 experts."""

from __future__ import annotations

import pytest
import torch

from moetier.quant import fp8_block as fp8


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# -- checkpoints -------------------------------------------------------------------------------------

RAGGED = {  # every projection ragged: hidden 200 (128 + 72), moe_inter 72, dense inter 136, q rows 128
    "vocab_size": 512, "hidden_size": 200, "intermediate_size": 136, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "moe_intermediate_size": 72,
    "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "rope_theta": 10000.0,
    "max_position_embeddings": 512, "tie_word_embeddings": False, "mlp_only_layers": [1],
    "torch_dtype": "float32",
}


@pytest.fixture
def ragged_preset(monkeypatch):
    from moetier import presets

    monkeypatch.setitem(presets._TINY, "tiny-ragged", RAGGED)
    return "tiny-ragged"


def fp8_ckpt(tmp_path, preset: str, seed: int = 0, **kw):
    from moetier.checkpoint.writer import make_checkpoint

    return make_checkpoint(tmp_path / f"{preset}-fp8", preset, seed=seed, dtype="fp8", **kw)


def dequantized_copy(src, dst):
    """The reference checkpoint: every float8 tensor of src dequantized (fp8.dequantize) to float32,
    scales dropped, config.json without quantization_config."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(f))
    out = {n: (fp8.dequantize(t, tensors[n + "_scale_inv"]) if t.dtype == fp8.FP8 else t.float())
           for n, t in tensors.items() if not n.endswith("_scale_inv")}
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config")
    cfg["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def logits_of(model, prompt, steps: int = 4):
    """Prefill logits, then `steps` greedy decode steps' logits, concatenated."""
    from tests.helpers import Sequence

    seq = Sequence(model, 64)
    out = [model.logits(seq.forward(prompt))]
    for _ in range(steps):
        out.append(model.logits(seq.forward(out[-1][-1:].argmax(-1))))
    return torch.cat(out)


@pytest.mark.parametrize("preset,shard", [("tiny", None), ("ragged", 64 * 1024)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_checkpoint_loads_as_its_dequantized_reference(tmp_path, ragged_preset, preset, shard, dtype):
    """Experts stay FP8 in their rows and are dequantized on use; dense FP8 weights are dequantized at
    load: the same weights as the dequantized checkpoint, so the same logits to the bit."""
    from moetier.checkpoint.index import Checkpoint
    from moetier.checkpoint.loader import load_model
    from moetier.experts.placement import ExpertOptions

    preset = ragged_preset if preset == "ragged" else preset
    path = fp8_ckpt(tmp_path, preset, seed=4, **({"shard_bytes": shard} if shard else {}))
    if shard:
        assert (path / "model.safetensors.index.json").is_file()
    infos = Checkpoint(path).tensors
    assert infos["model.layers.0.self_attn.q_proj.weight"].dtype == "F8_E4M3"
    assert infos["model.layers.0.mlp.experts.3.down_proj.weight_scale_inv"].dtype == "F32"
    assert infos["model.embed_tokens.weight"].dtype == "BF16" and infos["model.layers.0.mlp.gate.weight"].dtype == "BF16"
    ref_path = dequantized_copy(path, tmp_path / "ref")
    _, ref, _ = load_model(ref_path, dtype=dtype)
    prompt = torch.randint(0, 500, (9,), generator=torch.Generator().manual_seed(2))
    want = logits_of(ref, prompt)
    for backend in ("resident", "slots", "uva"):
        cfg, model, report = load_model(path, dtype=dtype, experts=ExpertOptions(backend, slots=3))
        assert cfg.quant == "fp8"
        rows = model.moe_blocks()[0].experts
        lay = cfg.moe_shape.layout
        assert lay.quant == "fp8" and (rows.rows if backend == "resident" else rows.host).dtype == torch.uint8
        # the load report counts FP8 row bytes exactly
        moe_layers = len(cfg.moe_layers)
        tier = "device" if backend == "resident" else "host"
        assert report.expert_bytes[tier] == moe_layers * cfg.num_experts * lay.numel
        assert "stay FP8" in report.notes[0]
        assert torch.equal(logits_of(model, prompt), want), backend


def test_fp8_checkpoint_matches_transformers(tmp_path):
    """transformers 5.24 loads FP8 checkpoints on the CPU by dequantizing them (FineGrainedFP8 with
    dequantize=True: no GPU); its rule is ours on block-aligned shapes. Ragged shapes are not compared
    here: its CPU dequantization derives the block from the grid and refuses them (the ragged case is
    held to our dequantized reference above)."""
    pytest.importorskip("accelerate")
    from transformers import Qwen3MoeForCausalLM

    from moetier.checkpoint.loader import load_model

    path = fp8_ckpt(tmp_path, "tiny", seed=5)
    hf = Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _, model, _ = load_model(path, dtype="float32")
    prompt = torch.randint(0, 500, (11,), generator=torch.Generator().manual_seed(3))
    ours = logits_of(model, prompt, steps=0)
    with torch.no_grad():
        want = hf(prompt[None]).logits[0].float()
    assert rel_err(ours, want) <= 1e-5
    # and the weights transformers dequantized are the ones our rows hold
    w13, w2 = model.moe_blocks()[0].experts.layout.weights(model.moe_blocks()[0].experts.rows[6:7], torch.float32)
    hf_experts = hf.model.layers[0].mlp.experts
    assert torch.equal(w13[0], hf_experts.gate_up_proj[6].float())
    assert torch.equal(w2[0], hf_experts.down_proj[6].float())


def test_fp8_validation_names_scales(tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    from moetier.checkpoint.loader import load_model
    from moetier.errors import CheckpointError, ConfigError

    path = fp8_ckpt(tmp_path, "tiny-gqa", seed=1)
    f = path / "model.safetensors"
    good = load_file(f)
    t = dict(good)
    del t["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"]
    t["model.layers.0.self_attn.o_proj.weight_scale_inv"] = torch.ones(2, 2)
    t["model.layers.2.mlp.experts.1.down_proj.weight"] = good["model.layers.2.mlp.experts.1.down_proj.weight"].bfloat16()
    save_file(t, f)
    with pytest.raises(CheckpointError) as err:
        load_model(path)
    msg = str(err.value)
    assert "missing tensor model.layers.1.mlp.experts.3.up_proj.weight_scale_inv (shape [1, 1])" in msg
    assert "block scale of a float8 weight" in msg
    assert "model.layers.0.self_attn.o_proj.weight_scale_inv has shape [2, 2], the config implies [1, 1]" in msg
    assert "routed expert model.layers.2.mlp.experts.1.down_proj.weight is BF16" in msg
    # float8 weights under a config.json without quantization_config
    save_file(good, f)
    cfg = json.loads((path / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="float8 .* but config.json has no quantization_config"):
        load_model(path)
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": {**qc, "weight_block_size": [1, 128]}}))
    with pytest.raises(ConfigError, match="weight_block_size"):
        load_model(path)


def test_make_checkpoint_fp8_cli(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "c"
    p = subprocess.run([sys.executable, "-m", "moetier.cli", "make-checkpoint", "--preset", "tiny-odd", "--layers",
                        "2", "--dtype", "fp8", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {k: qc[k] for k in fp8.QUANT_CONFIG} == fp8.QUANT_CONFIG and "lm_head" in qc["modules_to_not_convert"]
    bad = subprocess.run([sys.executable, "-m", "moetier.cli", "make-checkpoint", "--preset", "tiny", "--dtype",
                          "fp8", "--fused-experts", "--out", str(tmp_path / "d")], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode != 0 and "multiple of 128" in bad.stderr and "Traceback" not in bad.stderr


def test_random_bed_fp8_runs_every_backend_alike():
    from moetier import presets
    from moetier.checkpoint.random_bed import random_bed, use_backend
    from tests.helpers import Sequence

    cfg = presets.preset("tiny-gqa", dtype="float32")
    bed = random_bed(cfg, seed=3, device="cpu", dtype=torch.float32, quant="fp8")
    lay = bed.cfg.moe_shape.layout
    assert lay.quant == "fp8" and bed.row_bytes == lay.numel
    rows = next(iter(bed.host.values()))
    assert rows.dtype == torch.uint8 and lay.part(rows, "down_scale").gt(0).all()
    prompt = torch.arange(5, 17)
    outs = []
    for backend in ("resident", "slots", "uva"):
        use_backend(bed, backend, budget=0.5)
        outs.append(bed.model.logits(Sequence(bed.model, 32).forward(prompt)))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("preset", ["tiny-dsv3", "tiny-glm5"])
def test_fp8_mla_checkpoints_load_as_their_dequantized_reference(tmp_path, preset):
    """The published GLM-5 and DeepSeek-V3 weights are FP8: the MLA projections (kv_b_proj split into
    the absorbed W_UK / W_UV at load), the DSA indexer, dense layers and shared experts dequantize at
    load; routed experts stay FP8 rows. Same logits as the dequantized checkpoint, to the bit, on
    every backend (tiny shapes are ragged against 128 blocks, which transformers' CPU path refuses)."""
    from moetier.checkpoint.index import Checkpoint
    from moetier.checkpoint.loader import load_model
    from moetier.experts.placement import ExpertOptions

    path = fp8_ckpt(tmp_path, preset, seed=6)
    infos = Checkpoint(path).tensors
    assert infos["model.layers.0.self_attn.kv_b_proj.weight"].dtype == "F8_E4M3"
    _, ref, _ = load_model(dequantized_copy(path, tmp_path / "ref"), dtype="float32")
    prompt = torch.randint(0, 400, (13,), generator=torch.Generator().manual_seed(5))
    want = logits_of(ref, prompt)
    for backend in ("resident", "slots", "uva"):
        cfg, model, _ = load_model(path, dtype="float32", experts=ExpertOptions(backend, slots=3))
        assert cfg.quant == "fp8" and model.moe_blocks()[0].experts.layout.quant == "fp8"
        assert torch.equal(logits_of(model, prompt), want), backend
