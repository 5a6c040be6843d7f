"""NVFP4 and INT4 (issue 30): the torch dequantize references against hand-computed values (every
E2M1 code, e4m3 scales with subnormals, negative zero, the nibble order, INT4's sign offset and the
int32 packing order of compressed-tensors), exact row sizes, config detection and exclusion, and
one-line errors naming the tensor."""

from __future__ import annotations

import pytest
import torch

from moetier.quant import int4, nvfp4, packed4
from moetier.quant import quant_config as qcfg
from moetier.quant.registry import get
from moetier.quant.rows import RowLayout

E4M3 = torch.float8_e4m3fn


def e4m3(*bits: int) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.uint8).view(E4M3)


def test_every_e2m1_code_and_the_nibble_order():
    want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    # bytes 0x10, 0x32, ... : low nibble = even element (code 2j), high nibble = odd (code 2j + 1)
    packed = torch.tensor([[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]], dtype=torch.uint8)
    w = nvfp4.dequantize(packed, e4m3(0x38)[None], 1.0)  # e4m3 0x38 = 1.0
    assert w.tolist() == [want]
    assert torch.signbit(w[0, 8]) and not torch.signbit(w[0, 0])  # code 8 is -0.0
    assert packed4.unpack(torch.tensor([0xA5], dtype=torch.uint8)).tolist() == [5, 10]
    assert packed4.pack(torch.tensor([5, 10])).tolist() == [0xA5]
    codes = torch.arange(16)
    assert torch.equal(nvfp4.decode(codes), torch.tensor(want)) and torch.equal(nvfp4.encode(nvfp4.decode(codes)),
                                                                               codes.to(torch.uint8))


def test_e2m1_encode_is_the_nearest_magnitude_ties_to_the_smaller():
    """encode against the rule written out (the argmin over the eight distances it replaced): every
    midpoint, its float32 neighbours, the magnitudes, signed zeros, values past 6, and random values."""
    from moetier.quant import nvfp4

    mag = torch.tensor(nvfp4.E2M1)
    mids = (mag[1:] + mag[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, torch.zeros(7)), torch.nextafter(mids, torch.full((7,), 9.0)), mag,
                      torch.tensor([0.0, 6.5, 1e30, 1e-38])])
    x = torch.cat([near, -near, torch.tensor([-0.0]), torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 3])
    rule = (x.abs().clamp(max=6.0)[:, None] - mag).abs().argmin(dim=1) + 8 * torch.signbit(x).long()
    assert torch.equal(nvfp4.encode(x), rule.to(torch.uint8))
    assert nvfp4.encode(torch.tensor([0.25, 0.75, 5.0, -5.0, -0.0])).tolist() == [0, 1, 6, 14, 8]


@pytest.mark.parametrize("bits, value", [(0x01, 2.0 ** -9), (0x07, 7 * 2.0 ** -9), (0x08, 2.0 ** -6),
                                         (0x38, 1.0), (0x3C, 1.5), (0x7E, 448.0), (0xB8, -1.0), (0x00, 0.0)])
def test_e4m3_group_scales_with_subnormals_times_the_tensor_scale(bits, value):
    # one row of 32 values = two groups; group 0 takes the scale under test, group 1 scale 2.0 (0x40)
    packed = torch.full((1, 16), 0x77, dtype=torch.uint8)  # every value code 7 = 6.0
    w = nvfp4.dequantize(packed, e4m3(bits, 0x40)[None], torch.tensor(0.25))
    assert w[0, :16].tolist() == [6.0 * value * 0.25] * 16 and w[0, 16:].tolist() == [6.0 * 2.0 * 0.25] * 16


def test_nvfp4_ragged_group_and_batched_tensor_scales():
    packed = torch.full((2, 3, 10), 0x22, dtype=torch.uint8)  # K = 20: groups of 16 and 4; code 2 = 1.0
    scale = e4m3(*[0x38, 0x40] * 6).view(2, 3, 2)  # 1.0 and 2.0
    w = nvfp4.dequantize(packed, scale, torch.tensor([1.0, 0.5]))
    assert w.shape == (2, 3, 20) and w[0, 0, :16].eq(1.0).all() and w[0, 0, 16:].eq(2.0).all()
    assert w[1, 2, :16].eq(0.5).all() and w[1, 2, 16:].eq(1.0).all()


def test_int4_sign_offset_groups_and_the_int32_order_of_compressed_tensors():
    # codes 0..15 are q + 8: -8..7; group 0 of 8 values (scale 1.0), group 1 (scale -0.5)
    codes = torch.arange(16)
    packed = packed4.pack(codes)[None]  # [1, 8]
    w = int4.dequantize(packed, torch.tensor([[1.0, -0.5]], dtype=torch.bfloat16), group=8)
    assert w[0].tolist() == [float(q) for q in range(-8, 0)] + [-0.5 * q for q in range(0, 8)]
    # pack_to_int32: value i of a word in bits 4i..4i+3: word = sum (q_i + 8) << 4i
    words = int4.to_words(packed)
    want = sum(int(c) << (4 * i) for i, c in enumerate(codes[:8].tolist()))
    assert words.shape == (1, 2) and words[0, 0].item() == want - 2 ** 32 * (want >= 2 ** 31)
    assert torch.equal(int4.to_bytes(words, 16), packed)
    ragged = int4.to_words(packed[:, :5])  # K = 10: two words, the second zero-padded
    assert ragged.shape == (1, 2) and torch.equal(int4.to_bytes(ragged, 10), packed[:, :5])


def test_int4_zero_points_subtract_per_group_and_pack_eight_rows_a_word():
    # codes 0..15 in one row, groups of 8: zero codes 3 and 12 -> (code - z) * scale
    packed = packed4.pack(torch.arange(16)[None])
    zero = torch.tensor([[3, 12]], dtype=torch.uint8)
    w = int4.dequantize(packed, torch.tensor([[1.0, -0.5]], dtype=torch.bfloat16), group=8, zero=zero)
    want = [c - 3.0 for c in range(8)] + [(c - 12.0) * -0.5 for c in range(8, 16)]
    assert w[0].tolist() == want
    # compressed-tensors packs zero points along N: row 8w + i in bits 4i..4i+3 of word w
    z = (torch.arange(10 * 2) % 16).to(torch.uint8).reshape(10, 2)
    words = int4.zero_to_words(z)
    assert words.shape == (2, 2) and words[0, 0].item() == sum(int(z[i, 0]) << (4 * i) for i in range(8)) - 2**32
    assert torch.equal(int4.zero_to_bytes(words, 10), z)
    with pytest.raises(ValueError, match="do not hold 10 rows"):
        int4.zero_to_bytes(words[:1], 10)
    with pytest.raises(ValueError, match="zero points must be uint8 codes of the scales' shape"):
        int4.dequantize(packed, torch.ones(1, 2, dtype=torch.bfloat16), group=8, zero=zero[:, :1])


@pytest.mark.parametrize("name", ["nvfp4", "int4", "int4-g32", "int4-asym", "int4-g32-asym"])
def test_quantize_round_trips_within_the_format_step(name):
    w = torch.randn(3, 40, 200, generator=torch.Generator().manual_seed(1))
    if name == "nvfp4":
        q, s, s2 = nvfp4.quantize(w)
        back = nvfp4.dequantize(q, s, s2)
        tol = 0.25  # E2M1's coarsest relative step near the group max
    else:
        q, s, *z = int4.quantize(w, int4.GROUPS[name], asymmetric=name in int4.ASYMMETRIC)
        back = int4.dequantize(q, s, group=int4.GROUPS[name], zero=z[0] if z else None)
        tol = 0.2
        s2 = z[0] if z else None
    assert back.shape == w.shape
    assert ((back - w).norm() / w.norm()).item() < tol
    assert get(name).dequantize(*((q, s) if s2 is None else (q, s, s2))).equal(back)


@pytest.mark.parametrize("name, hidden, inter, row", [
    ("nvfp4", 2048, 768, 2_654_336), ("int4", 2048, 768, 2_433_024), ("int4-g32", 2048, 768, 2_654_208),
    ("int4-asym", 2048, 768, 2_469_888), ("int4-g32-asym", 2048, 768, 2_801_664),
    ("nvfp4", 72, 36, 4_480), ("int4", 72, 36, 4_224), ("int4-asym", 72, 36, 4_352)])  # ragged
def test_4bit_row_bytes_are_exact(name, hidden, inter, row):
    lay = RowLayout(hidden, inter, name)
    weights = 3 * hidden * inter
    exact = {"nvfp4": weights * 0.5625 + 12, "int4": weights * (0.5 + 2 / 128), "int4-g32": weights * (0.5 + 2 / 32),
             "int4-asym": weights * (0.5 + 3 / 128), "int4-g32-asym": weights * (0.5 + 3 / 32)}
    assert lay.numel == get(name).row_bytes(hidden, inter) == row and row % 128 == 0  # packed4.ROW_END
    if hidden % 128 == 0 and inter % 128 == 0:
        assert row - exact[name] < 128  # only the row's end padding on top of the formats' own bytes


@pytest.mark.parametrize("name", ["nvfp4", "int4", "int4-g32", "int4-asym"])
def test_row_parts_round_trip_through_the_reference(name):
    h, i, e = 72, 36, 3
    lay = RowLayout(h, i, name)
    rows = torch.zeros(e, lay.numel, dtype=torch.uint8)
    g = torch.Generator().manual_seed(2)
    want13, want2 = [], []
    for x in range(e):
        for part, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
            w = torch.randn(shape, generator=g)
            if name == "nvfp4":
                q, s, s2 = nvfp4.quantize(w)
                lay.part(rows, part + "_scale_2", x).copy_(s2)
                ref = nvfp4.dequantize(q, s, s2)
            elif lay.asymmetric:
                q, s, z = int4.quantize(w, lay.group, asymmetric=True)
                lay.part(rows, part + "_zero_point", x).copy_(z)
                ref = int4.dequantize(q, s, group=lay.group, zero=z)
            else:
                q, s = int4.quantize(w, lay.group)
                ref = int4.dequantize(q, s, group=lay.group)
            lay.part(rows, part, x).copy_(q)
            lay.part(rows, part + "_scale", x).copy_(s)
            (want2 if part == "down" else want13).append(ref)
    w13, w2 = lay.weights(rows, torch.float32)
    assert torch.equal(w13, torch.stack([torch.cat(want13[2 * x:2 * x + 2]) for x in range(e)]))
    assert torch.equal(w2, torch.stack(want2))
    assert lay.part(rows, "gate_up", None).shape == (e, 2 * i, h // 2)


def test_errors_name_the_tensor():
    q = torch.zeros(4, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"^layers.0.w: scales of shape \[4, 2\] do not fit"):
        nvfp4.dequantize(q, torch.zeros(4, 2, dtype=E4M3), 1.0, name="layers.0.w")
    with pytest.raises(ValueError, match=r"^layers.0.w: scales must be float8_e4m3fn, got bfloat16"):
        nvfp4.dequantize(q, torch.zeros(4, 1, dtype=torch.bfloat16), 1.0, name="layers.0.w")
    with pytest.raises(ValueError, match=r"^x: scales must be bfloat16, got float16"):
        int4.dequantize(q, torch.zeros(4, 1, dtype=torch.float16), name="x")
    with pytest.raises(ValueError, match=r"^x.weight_packed: pack-quantized weights must be int32"):
        int4.to_bytes(q, 16, "x.weight_packed")


MODELOPT = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
            "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}
CT_NVFP4 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                                          "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                                      "group_size": 16, "symmetric": True},
                                          "input_activations": None}},
            "ignore": ["lm_head", "re:.*mlp\\.gate$"]}
CT_INT4 = {"quant_method": "compressed-tensors", "format": "pack-quantized",
           "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
               "num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}}},
           "ignore": ["lm_head"]}


def test_config_detection_and_exclusion():
    assert qcfg.format_of(MODELOPT) == "nvfp4" and qcfg.layout(MODELOPT) == "modelopt"
    assert qcfg.format_of(CT_NVFP4) == "nvfp4" and qcfg.layout(CT_NVFP4) == "compressed-tensors"
    assert qcfg.format_of(CT_INT4) == "int4"
    g32 = {**CT_INT4, "config_groups": {"g": {"weights": {**CT_INT4["config_groups"]["group_0"]["weights"],
                                                          "group_size": 32}}}}
    assert qcfg.format_of(g32) == "int4-g32" and get("int4-g32").config_problems(g32) == []
    hq = {"producer": {"name": "modelopt"}, "quantization": {k: v for k, v in MODELOPT.items() if k != "quant_method"}}
    assert qcfg.from_hf_quant_config(hq) == MODELOPT
    for qc in (MODELOPT, CT_NVFP4, CT_INT4):
        assert get(qcfg.format_of(qc)).config_problems(qc) == []
        assert qcfg.excluded(qc, "lm_head") and not qcfg.excluded(qc, "model.layers.3.mlp.experts.1.up_proj")
    assert qcfg.excluded(MODELOPT, "model.layers.12.mlp.gate") and qcfg.excluded(CT_NVFP4, "model.layers.12.mlp.gate")
    assert not qcfg.excluded(CT_NVFP4, "model.layers.12.mlp.gate_proj")
    assert not qcfg.activation_scales(MODELOPT) and not qcfg.activation_scales(CT_NVFP4)
    w4a4 = {**CT_NVFP4, "config_groups": {"g": {**CT_NVFP4["config_groups"]["group_0"],
                                                "input_activations": {"num_bits": 4, "type": "float"}}}}
    assert qcfg.activation_scales(w4a4)
    asym = {**CT_INT4, "config_groups": {"g": {"weights": {**CT_INT4["config_groups"]["group_0"]["weights"],
                                                           "symmetric": False}}}}
    assert qcfg.format_of(asym) == "int4-asym" and get("int4-asym").config_problems(asym) == []
    assert qcfg.example("int4-g32-asym")["config_groups"]["group_0"]["weights"]["symmetric"] is False
    assert "group_size 32" in get("nvfp4").config_problems({**MODELOPT, "group_size": 32})[0]


def test_an_unknown_quantization_config_is_one_line_naming_what_is_read():
    from moetier.models.registry import config_from_dict
    from moetier.errors import ConfigError
    from moetier.presets import preset_dict

    for qc, field in (({"quant_method": "awq"}, "quant_method 'awq'"),
                      ({**CT_INT4, "format": "marlin-24"}, "format 'marlin-24'"),
                      ({**MODELOPT, "quant_algo": "FP8"}, "quant_algo 'FP8'")):
        assert qcfg.format_of(qc) is None
        with pytest.raises(ConfigError, match=field + ".* is not supported; this engine reads block FP8"):
            config_from_dict({**preset_dict("tiny"), "quantization_config": qc})
