"""Block-scaled FP8 weights, the DeepSeek-V3 layout: the plain-torch oracle of every FP8 path.

A weight W [..., N, K] is stored as Q = float8_e4m3fn [..., N, K] and S = `<name>_scale_inv` float32
[..., ceil(N / 128), ceil(K / 128)], one scale per 128 x 128 block (the last blocks of a dimension
that is not a multiple of 128 are ragged: smaller, with a scale of their own). Dequantization is

    W[n, k] = float32(Q[n, k]) * S[n // 128, k // 128]          (then rounded once to the compute dtype)

which is what transformers' FineGrainedFP8 integration does (integrations/finegrained_fp8.py,
Fp8Dequantize; it derives the block from the grid, so it agrees with ceil-div on dimensions that are
multiples of 128 or smaller than 128, and refuses the others). Quantization takes each block's
max |W|: S = amax / 448 (448 = the largest e4m3 value), Q = clamp(W / S) rounded to e4m3 (an
all-zero block gets S = 1), as transformers' Fp8Quantize does.

Nothing here is on the hot path: the loader, the random-weight writer and the CPU backends call it,
and the tests hold the Triton kernels (experts/kernels/grouped_gemm.py, experts/kernels/fp8_gemv.py,
layers/fp8_linear_triton.py) to it. Also here: the format's checkpoint names (which tensors an FP8
checkpoint stores in float8, what their scales are called, the config.json it writes and the rules it
reads one by), the byte offsets of an expert's FP8 row (quant/rows.py lays it out) and FORMAT, this
format's record in quant/registry.py. The Triton tile dequantize is quant/fp8_block_triton.py.
"""

from __future__ import annotations

import torch

from moetier.quant.format import Format

BLOCK = 128  # weight_block_size [128, 128]
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448.0
# config.json `quantization_config` of the checkpoints this reads and writes (DeepSeek-V3, Qwen3-FP8)
QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [BLOCK, BLOCK]}
SCALE_SUFFIX = "_scale_inv"  # `x.weight` -> `x.weight_scale_inv`, fused `experts.down_proj` -> `..._scale_inv`
FP8_CODE = "F8_E4M3"  # safetensors' dtype code of float8_e4m3fn
ROW_ALIGN = 16  # FP8 expert rows: the scales start, and every row starts, on a 16-byte boundary


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """[..., N, K] -> [..., ceil(N / 128), ceil(K / 128)]."""
    if len(shape) < 2:
        raise ValueError(f"block scales need a weight of at least 2 dimensions, got shape {list(shape)}")
    return (*shape[:-2], cdiv(shape[-2], BLOCK), cdiv(shape[-1], BLOCK))


def _expand(scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    # [..., ceil(N/128), ceil(K/128)] -> [..., N, K]: each scale repeated over its (possibly ragged) block
    return scale.repeat_interleave(BLOCK, dim=-2)[..., :n, :].repeat_interleave(BLOCK, dim=-1)[..., :k]


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] (any float dtype) -> (float8_e4m3fn [..., N, K], float32 scale_inv
    [..., ceil(N/128), ceil(K/128)]). Runs where the weight is (CPU or CUDA)."""
    n, k = weight.shape[-2:]
    w = weight.float()
    pn, pk = cdiv(n, BLOCK) * BLOCK - n, cdiv(k, BLOCK) * BLOCK - k
    # zero padding never raises a block's amax, so ragged blocks take the amax of their real part
    padded = torch.nn.functional.pad(w, (0, pk, 0, pn)) if pn or pk else w
    lead = padded.shape[:-2]
    blocks = padded.reshape(*lead, cdiv(n, BLOCK), BLOCK, cdiv(k, BLOCK), BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / _expand(scale, n, k)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(float8 [..., N, K], scale_inv [..., ceil(N/128), ceil(K/128)]) -> [..., N, K] in dtype: the
    product in float32, rounded once to dtype (the Triton kernels compute the same weights)."""
    n, k = q.shape[-2:]
    want = scale_shape(tuple(q.shape))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale_inv of shape {list(scale.shape)} does not fit a weight of shape {list(q.shape)}; "
                         f"128 x 128 blocks need {list(want)}")
    return (q.float() * _expand(scale.float(), n, k)).to(dtype)


def quant_problems(qc: object) -> list[str]:
    """What is wrong with a config.json `quantization_config` for this engine (empty: FP8 blocks of 128)."""
    if not isinstance(qc, dict):
        return [f"quantization_config must be an object, got {qc!r}"]
    out = []
    method = qc.get("quant_method")
    if method != "fp8":
        out.append(f"quantization_config.quant_method {method!r} is not supported (only \"fp8\", block-scaled "
                   "e4m3 as DeepSeek-V3 and Qwen3-FP8 publish it)")
        return out
    if qc.get("fmt", "e4m3") != "e4m3":
        out.append(f"quantization_config.fmt {qc.get('fmt')!r} is not supported (only \"e4m3\")")
    if list(qc.get("weight_block_size") or []) != [BLOCK, BLOCK]:
        out.append(f"quantization_config.weight_block_size {qc.get('weight_block_size')!r} is not supported "
                   f"(only [{BLOCK}, {BLOCK}]; per-tensor FP8 has no block scales)")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        out.append(f"quantization_config.activation_scheme {qc.get('activation_scheme')!r} is not supported "
                   "(only \"dynamic\": activations stay in the model dtype)")
    if qc.get("scale_fmt") not in (None, "float32", "fp32"):
        out.append(f"quantization_config.scale_fmt {qc.get('scale_fmt')!r} is not supported (float32 scales only)")
    return out


def scale_name(name: str) -> str:
    """The checkpoint name of a float8 weight's block scale."""
    return name + SCALE_SUFFIX


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """The tensors an FP8 checkpoint stores in float8 (what make-checkpoint --dtype fp8 quantizes):
    projections of 2+ dimensions; not the embeddings, the LM head, norms or MoE routers (published
    FP8 checkpoints keep those in bf16: quantization_config.modules_to_not_convert)."""
    if len(shape) < 2 or name.endswith(SCALE_SUFFIX):
        return False
    return not ("embed_tokens" in name or name.startswith("lm_head") or "norm" in name
                or name.endswith("mlp.gate.weight"))


def not_converted(names: list[str]) -> list[str]:
    """quantization_config.modules_to_not_convert for these checkpoint names (module names, as
    Qwen3-FP8 writes them: lm_head and every router)."""
    return sorted({n.removesuffix(".weight") for n in names
                   if n.startswith("lm_head") or n.endswith("mlp.gate.weight")})


def checkpoint_config(cfg_dict: dict, names: list[str]) -> dict:
    """config.json fields of an FP8 checkpoint of these tensor names."""
    return {**cfg_dict, "torch_dtype": "bfloat16",
            "quantization_config": {**QUANT_CONFIG, "modules_to_not_convert": not_converted(names)}}


def _align(n: int) -> int:
    return -(-n // ROW_ALIGN) * ROW_ALIGN


def row_offsets(hidden: int, inter: int) -> tuple[int, int, int]:
    """(s13, s2, row bytes) of one expert's FP8 row (quant/rows.RowLayout has the picture): the
    gate_up weights [2I, H] then down [H, I] at 0, float32 gate_up scales [2, nI, nH] at s13, down
    scales [nH, nI] at s2, each start and the row's end padded to ROW_ALIGN bytes."""
    ni, nh = cdiv(inter, BLOCK), cdiv(hidden, BLOCK)
    s13 = _align(3 * inter * hidden)
    s2 = s13 + 4 * 2 * ni * nh
    return s13, s2, _align(s2 + 4 * nh * ni)


FORMAT = Format(name="fp8", weight_code=FP8_CODE, scale_suffixes=(SCALE_SUFFIX,), dequantize=dequantize,
                row_bytes=lambda hidden, inter: row_offsets(hidden, inter)[2], config_problems=quant_problems)
