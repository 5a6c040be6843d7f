"""4-bit checkpoints (issue 30): make-checkpoint --dtype nvfp4 (ModelOpt and compressed-tensors
layouts) and int4 / int4-g32 (compressed-tensors pack-quantized) on qwen3_moe, deepseek_v3 and
glm5_next tiny shapes. Experts stay 4-bit in their rows and are dequantized on use; dense 4-bit
weights are dequantized at load: the same logits, to the bit, as the checkpoint dequantized to
float32 by our references, within 1e-5 of transformers running that float32 checkpoint, the same
greedy tokens; every backend alike; activation scales never read; one line per bad tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from moetier.checkpoint import quant4_weights as q4
from moetier.quant import int4, nvfp4
from tests.test_fp8_checkpoint import logits_of, rel_err

FORMATS = [("nvfp4", None), ("nvfp4", "compressed-tensors"), ("int4", None), ("int4-g32", None),
           ("int4-g32-asym", None)]  # asymmetric: a zero point per group
PRESETS = ["tiny", "tiny-dsv3", "tiny-glm5-next"]


def ckpt(tmp_path, preset, dtype, fmt, seed=0, **kw):
    from moetier.checkpoint.writer import make_checkpoint

    return make_checkpoint(tmp_path / f"{preset}-{dtype}-{fmt}", preset, seed=seed, dtype=dtype, format=fmt, **kw)


def dequantized_copy(src, dst):
    """Every 4-bit weight of src dequantized by the torch references to float32 under its model name,
    scales dropped, config.json without quantization_config: a plain float32 checkpoint."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    qc = cfg.pop("quantization_config", None) or cfg["text_config"].pop("quantization_config")  # glm5_next: in text_config
    group = None if qc.get("quant_algo") == "NVFP4" else qc["config_groups"]["group_0"]["weights"]["group_size"]
    t = {}
    for f in src.glob("*.safetensors"):
        t.update(load_file(f))
    out = {}
    for name, x in t.items():
        if x.dtype == torch.uint8:  # nvfp4 codes: `W` (ModelOpt) or `W_packed`
            w = name.removesuffix("_packed")
            g = t.get(w + "_scale_2")
            s2 = g if g is not None else 1.0 / t[w + "_global_scale"].float()
            if x.dim() == 3 and s2.dim() == 2:  # fused gate_up: gate's and up's tensor scales
                i = x.shape[1] // 2
                out[w] = torch.cat([nvfp4.dequantize(x[:, :i], t[w + "_scale"][:, :i], s2[:, 0]),
                                    nvfp4.dequantize(x[:, i:], t[w + "_scale"][:, i:], s2[:, 1])], dim=1)
            else:
                out[w] = nvfp4.dequantize(x, t[w + "_scale"], s2.reshape(s2.shape[:x.dim() - 2]))
        elif x.dtype == torch.int32 and name.endswith("_packed"):  # int4 codes
            w = name.removesuffix("_packed")
            k = int(t[w + "_shape"][-1])
            zero = t.get(w + "_zero_point")  # asymmetric: eight rows' zero codes a word
            zero = None if zero is None else int4.zero_to_bytes(zero, x.shape[-2])
            out[w] = int4.dequantize(int4.to_bytes(x, k), t[w + "_scale"], group=group, zero=zero)
    codes = {n.removesuffix("_packed") for n, x in t.items() if x.dtype in (torch.uint8, torch.int32)}
    companions = {w + s for w in codes
                  for s in ("_scale", "_scale_2", "_global_scale", "_shape", "_packed", "_zero_point")}
    out.update({n: x.float() for n, x in t.items() if n not in companions and n not in out})
    save_file(out, dst / "model.safetensors")
    cfg["torch_dtype"] = "float32"
    if "text_config" in cfg:  # glm5_next; transformers wants a pad id inside its tiny vocabulary
        cfg["text_config"].update(torch_dtype="float32", pad_token_id=0)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def greedy(model, prompt, steps=4):
    logits = logits_of(model, prompt, steps)
    return logits, logits[len(prompt) - 1:].argmax(-1)


@pytest.mark.parametrize("dtype,fmt", FORMATS)
@pytest.mark.parametrize("preset", PRESETS)
def test_4bit_checkpoint_loads_as_its_float32_dequantized_reference(tmp_path, preset, dtype, fmt):
    """Per-expert names everywhere; fused expert tensors on deepseek_v3 (per-expert tensor scales)."""
    from moetier.checkpoint.index import Checkpoint
    from moetier.checkpoint.loader import load_model
    from moetier.experts.placement import ExpertOptions

    fused = preset == "tiny-dsv3"
    path = ckpt(tmp_path, preset, dtype, fmt, seed=3, fused_experts=fused)
    infos = Checkpoint(path).tensors
    expert = next(n for n in infos if (".experts.down_proj" if fused else ".experts.1.down_proj.weight") in n)
    assert infos[expert].dtype == q4.CODES[dtype]
    ref_path = dequantized_copy(path, tmp_path / "ref")
    _, ref, _ = load_model(ref_path, dtype="float32")
    prompt = torch.randint(0, 400, (7,), generator=torch.Generator().manual_seed(5))
    want, want_tokens = greedy(ref, prompt)
    outs = {}
    for backend in ("resident", "slots", "uva", "hybrid"):
        opts = ExpertOptions(backend, slots=3)  # hybrid: the default host kernel, compiled where it builds
        cfg, model, report = load_model(path, dtype="float32", experts=opts)
        lay = model.moe_blocks()[0].experts.layout
        assert cfg.quant == dtype and lay.quant == dtype and f"stay {dtype}" in report.notes[0]
        tier = "device" if backend == "resident" else "host"
        assert report.expert_bytes[tier] == len(cfg.moe_layers) * cfg.num_experts * lay.numel
        outs[backend] = greedy(model, prompt)
    for backend, (logits, tokens) in outs.items():
        # the same float32 weights: the same bits on the backends that run the torch path; hybrid's host
        # kernel (the misses it takes) sums in its own order: fp32 rounding (tests/test_swiglu_clamp.py)
        if backend == "hybrid":
            assert rel_err(logits, want) <= 1e-5, backend
        else:
            assert torch.equal(logits, want), backend
        assert torch.equal(tokens, want_tokens), backend
    import transformers  # on the float32 checkpoint (glm5_next's vision tower, absent, is never run)

    arch = json.loads((ref_path / "config.json").read_text())["architectures"][0]
    try:
        hf = getattr(transformers, arch).from_pretrained(ref_path, dtype=torch.float32).eval()
    except Exception as e:  # an older transformers (the GPU image's) refuses glm5_next's `indexed_attention`
        if "indexed_attention" not in str(e) and hasattr(transformers, arch):
            raise
        return  # the bit-exact comparison with our float32 reference above still held
    with torch.no_grad():
        hf_logits = hf(prompt[None]).logits[0].float()
    assert rel_err(want[:len(prompt)], hf_logits) <= 1e-5


def test_activation_scales_are_never_read(tmp_path):
    """A ModelOpt checkpoint with input_scale on every linear (NaN: any read would poison the logits)
    computes W4A16 and says so once."""
    from safetensors.torch import load_file, save_file

    from moetier.checkpoint.loader import load_model

    path = ckpt(tmp_path, "tiny", "nvfp4", None, seed=1)
    _, clean, _ = load_model(path, dtype="float32")
    prompt = torch.arange(3, 11)
    want = logits_of(clean, prompt, 1)
    f = path / "model.safetensors"
    t = load_file(f)
    for name in [n for n in t if n.endswith("_scale_2")]:
        t[name.removesuffix(".weight_scale_2") + ".input_scale"] = torch.tensor(float("nan"))
    save_file(t, f)
    _, model, report = load_model(path, dtype="float32")
    assert torch.equal(logits_of(model, prompt, 1), want)
    assert sum("never read" in n for n in report.notes) == 1


def test_hf_quant_config_beside_config_json(tmp_path):
    from moetier.models.registry import config_from_dir

    path = ckpt(tmp_path, "tiny", "nvfp4", None)
    cfg = json.loads((path / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {k: v for k, v in qc.items() if k != "quant_method"}}))
    assert config_from_dir(path).quant == "nvfp4"


@pytest.mark.parametrize("dtype,fmt", [("nvfp4", None), ("int4", None)])
def test_4bit_validation_names_the_tensor(tmp_path, dtype, fmt):
    from safetensors.torch import load_file, save_file

    from moetier.checkpoint.loader import load_model
    from moetier.errors import CheckpointError

    path = ckpt(tmp_path, "tiny-gqa", dtype, fmt, seed=2)
    f = path / "model.safetensors"
    t = load_file(f)
    codes = "" if dtype == "nvfp4" else "_packed"
    e = "model.layers.1.mlp.experts.3."
    del t[e + "up_proj.weight_scale"]                                   # missing scale
    t[e + "gate_proj.weight_scale"] = t[e + "gate_proj.weight_scale"].float()  # scale of the wrong dtype
    t[e + "down_proj.weight" + codes] = t[e + "down_proj.weight" + codes][:, :-1].contiguous()  # wrong shape
    dense = "model.layers.0.self_attn.o_proj.weight"
    del t[dense + "_scale"]                                             # a dense weight's missing scale
    save_file(t, f)
    with pytest.raises(CheckpointError) as err:
        load_model(path)
    msg = str(err.value)
    assert f"missing tensor {e}up_proj.weight_scale" in msg
    assert f"{e}gate_proj.weight_scale has dtype F32" in msg
    assert f"{e}down_proj.weight{codes} has shape" in msg
    assert f"{dense}{codes} holds {dtype} codes but its group scale {dense}_scale is missing" in msg


def load_error(path, edit) -> str:
    """The CheckpointError loading `path` gives after edit(tensors) rewrote its one shard."""
    from safetensors.torch import load_file, save_file

    from moetier.checkpoint.loader import load_model
    from moetier.errors import CheckpointError

    t = load_file(path / "model.safetensors")
    edit(t)
    save_file(t, path / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_model(path)
    return str(err.value)


def test_asymmetric_int4_zero_points_are_checked(tmp_path):
    """A zero point of the wrong dtype or shape is one line naming it; zero points in a checkpoint whose
    config says symmetric are one line saying which to fix."""
    e = "model.layers.1.mlp.experts.3."

    def bad(t):
        t[e + "up_proj.weight_zero_point"] = t[e + "up_proj.weight_zero_point"].to(torch.int64)
        t[e + "gate_proj.weight_zero_point"] = t[e + "gate_proj.weight_zero_point"][:, :-1].contiguous()

    msg = load_error(ckpt(tmp_path, "tiny-gqa", "int4-g32-asym", None, seed=2), bad)
    assert f"{e}up_proj.weight_zero_point has dtype I64; int4-g32-asym wants I32 here (zero points" in msg
    assert f"{e}gate_proj.weight_zero_point has shape" in msg
    msg = load_error(ckpt(tmp_path, "tiny-gqa", "int4-g32", None, seed=2),
                     lambda t: t.update({e + "up_proj.weight_zero_point": torch.zeros(1, 1, dtype=torch.int32)}))
    assert "quantization_config says symmetric; set weights.symmetric false" in msg


@pytest.mark.parametrize("dtype,fmt,patterns", [
    ("nvfp4", None, ["lm_head", "model.layers.*.self_attn*", "*.mlp.gate"]),  # ModelOpt: fnmatch wildcards
    ("nvfp4", "compressed-tensors", ["lm_head", "re:.*self_attn\\..*", "re:.*mlp\\.gate$"]),  # names and re:
    ("int4", None, ["lm_head", "re:.*self_attn\\.[qkvo]_proj$", "re:.*mlp\\.gate$"])])
def test_modules_excluded_by_pattern_load_unquantized(tmp_path, dtype, fmt, patterns):
    """Attention left unquantized as the exporters do (float tensors, excluded by a wildcard or a regex):
    the same logits, to the bit, as the checkpoint dequantized whole; a module the config excludes but
    the checkpoint holds codes for is one line naming it."""
    from safetensors.torch import load_file, save_file

    from moetier.checkpoint.loader import load_model
    from moetier.errors import CheckpointError

    path = ckpt(tmp_path, "tiny", dtype, fmt, seed=4)
    full = load_file(dequantized_copy(path, tmp_path / "ref") / "model.safetensors")
    _, ref, _ = load_model(tmp_path / "ref", dtype="float32")
    f = path / "model.safetensors"
    codes_of = load_file(f)
    cfg = json.loads((path / "config.json").read_text())
    key = "exclude_modules" if dtype == "nvfp4" and fmt is None else "ignore"
    cfg["quantization_config"][key] = patterns
    (path / "config.json").write_text(json.dumps(cfg))
    codes = "" if key == "exclude_modules" else "_packed"
    t = dict(codes_of)
    for name in [n for n in t if ".self_attn." in n and n.endswith(".weight" + codes)]:
        w = name.removesuffix(codes)
        for suffix in ("_scale", "_scale_2", "_global_scale", "_shape", "_packed"):
            t.pop(w + suffix, None)
        t[w] = full[w]  # the float32 weight in place of its codes
    save_file(t, f)
    prompt = torch.arange(2, 9)
    _, model, _ = load_model(path, dtype="float32")
    assert torch.equal(logits_of(model, prompt, 2), logits_of(ref, prompt, 2))
    first = "model.layers.0.self_attn.q_proj.weight"
    t.pop(first)  # one module's codes and scales back
    t.update({n: x for n, x in codes_of.items() if n.startswith(first)})
    save_file(t, f)
    with pytest.raises(CheckpointError, match=f"{first}{codes} is quantized but quantization_config excludes "
                                              f"{first.removesuffix('.weight')}"):
        load_model(path, dtype="float32")


@pytest.mark.parametrize("fmt,suffix,shape", [(None, "_scale_2", (1,)), ("compressed-tensors", "_global_scale", ())])
def test_tensor_scales_stored_as_a_scalar_or_one_element(tmp_path, fmt, suffix, shape):
    """Exporters store a linear's float32 tensor scale as [] or [1]: both load to the same logits; any
    other shape is still one line naming the tensor."""
    from safetensors.torch import load_file, save_file

    from moetier.checkpoint.loader import load_model
    from moetier.errors import CheckpointError

    path = ckpt(tmp_path, "tiny", "nvfp4", fmt, seed=6)
    prompt = torch.arange(4, 10)
    _, model, _ = load_model(path, dtype="float32")
    want = logits_of(model, prompt, 1)
    f = path / "model.safetensors"
    t = load_file(f)
    scales = [n for n in t if n.endswith(suffix)]
    assert any(".experts." in n for n in scales) and any("self_attn" in n for n in scales)
    save_file({n: x.reshape(shape) if n in scales else x for n, x in t.items()}, f)
    _, model, _ = load_model(path, dtype="float32")
    assert torch.equal(logits_of(model, prompt, 1), want)
    bad = "model.layers.0.self_attn.o_proj.weight" + suffix
    save_file({n: x.reshape(2) if n == bad else x for n, x in
               {**t, bad: torch.cat([t[bad].reshape(1), t[bad].reshape(1)])}.items()}, f)
    with pytest.raises(CheckpointError, match=f"{bad} has shape \\[2\\]"):
        load_model(path, dtype="float32")
