"""`moetier make-checkpoint`: random-weight checkpoints in the Hugging Face format for a named shape.

Tensors are generated from a seed derived from (seed, tensor name) and streamed into shards, so a
60 GB preset needs a few tensors' worth of RAM. The same seed gives the same weights whatever the
shard size, expert layout or thread count. Making and quantizing a tensor is serial CPU work (torch's
seeded randn runs on one core), so a pool of threads makes the next tensors while the writer writes
them in order: bytes identical to one thread's.

--dtype fp8 writes a block-scaled FP8 checkpoint (checkpoint/fp8_weights.py): the same random bf16
tensors, every projection quantized by the block rule of quant/fp8_block.py into float8_e4m3fn plus its
`_scale_inv`, written next to each other; embeddings, norms, routers and lm_head stay bf16; config.json
gets torch_dtype bfloat16 and quantization_config. --dtype nvfp4 | int4 | int4-g32 writes the 4-bit
layouts of ModelOpt and compressed-tensors the same way (checkpoint/quant4_writer.py; --format picks
NVFP4's layout).
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

import torch

from moetier import presets
from moetier.checkpoint import quant4_writer as quant4
from moetier.checkpoint.loader import DTYPES
from moetier.checkpoint.safetensors_io import StreamingWriter
from moetier.config import ModelConfig
from moetier.models.registry import config_from_dict
from moetier.errors import MoetierError
from moetier.models.mtp import with_mtp
from moetier.models.registry import model_class
from moetier.quant import fp8_block as fp8
from moetier.quant.fp8_block import checkpoint_config as fp8_config
from moetier.quant.fp8_block import quantizable, scale_name
from moetier.quant.registry import PACKED4
from moetier.tokenizer import Tokenizer
from moetier.tokenizer.synthetic import write_tokenizer

INIT_STD = 0.02  # the initializer_range transformers uses for these models


def tensor_plan(cfg: ModelConfig, fused_experts: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes in the order a checkpoint stores them (layer by layer)."""
    present = set()
    if fused_experts:
        present = {f"model.layers.{i}.mlp.experts.gate_up_proj" for i in cfg.moe_layers}
    want = {w.name: w.shape for w in model_class(cfg).checkpoint_weights(cfg, present) if not w.optional}

    def key(name: str) -> tuple[int, int, str]:
        if name.startswith("model.layers."):
            return (1, int(name.split(".")[2]), name)
        return (0 if "embed" in name else 2, 0, name)

    return [(n, want[n]) for n in sorted(want, key=key)]


def random_tensor(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype)  # as transformers initialises RMSNorm
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=dtype)
    # modulo 2^64 (what manual_seed takes): the same weights as before for every seed below 2^44
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**64)
    return (torch.randn(shape, generator=g) * INIT_STD).to(dtype)


def _fused(name: str, shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    """A fused expert tensor made of the same per-expert tensors the unfused layout would hold."""
    prefix = name.rsplit("experts.", 1)[0] + "experts."
    if name.endswith("gate_up_proj"):
        i = shape[1] // 2
        parts = [torch.cat([random_tensor(f"{prefix}{e}.gate_proj.weight", (i, shape[2]), seed, dtype),
                            random_tensor(f"{prefix}{e}.up_proj.weight", (i, shape[2]), seed, dtype)])
                 for e in range(shape[0])]
    else:
        parts = [random_tensor(f"{prefix}{e}.down_proj.weight", shape[1:], seed, dtype) for e in range(shape[0])]
    return torch.stack(parts)


Entry = tuple[str, torch.dtype, tuple[int, ...]]


def _entries(name: str, shape: tuple[int, ...], dtype: torch.dtype, quant: bool) -> list[Entry]:
    """The tensors one planned weight becomes: itself, or its FP8 weight and block scale."""
    if quant and quantizable(name, shape):
        return [(name, fp8.FP8, shape), (scale_name(name), torch.float32, fp8.scale_shape(shape))]
    return [(name, dtype, shape)]


def _nbytes(entries: list[Entry]) -> int:
    return sum(dtype.itemsize * int(torch.Size(shape).numel()) for _, dtype, shape in entries)


def _shards(units: list[list[Entry]], max_bytes: int) -> Iterator[list[Entry]]:
    # a unit (a weight and its scale) never straddles two shards
    shard, size = [], 0
    for unit in units:
        n = _nbytes(unit)
        if shard and size + n > max_bytes:
            yield shard
            shard, size = [], 0
        shard.extend(unit)
        size += n
    if shard:
        yield shard


def prepare_out(out: Path, overwrite: bool) -> None:
    """An empty directory at `out`, or one clear error (never a traceback from deep inside)."""
    if out.exists() and not out.is_dir():
        raise MoetierError(f"--out {out} is a file; give a directory to write the checkpoint into")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise MoetierError(f"--out {out} exists and is not empty; choose another --out or pass --overwrite")
        shutil.rmtree(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".moetier-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise MoetierError(f"--out {out}: cannot write there ({e.strerror or e}); choose a writable directory") from None


def make_checkpoint(out: str | Path, preset: str, layers: int | None = None, seed: int = 0,
                    dtype: str = "bf16", fused_experts: bool = False, shard_bytes: int = 4 * 2**30,
                    progress: Callable[[int, int], None] | None = None, overwrite: bool = False,
                    format: str | None = None, mtp_layers: int | None = None, threads: int | None = None) -> Path:
    """mtp_layers: the DeepSeek-V3 family's MTP layers to write (num_nextn_predict_layers; presets.py).
    threads: tensors made at once (default: one per core); the files do not depend on it."""
    quant = dtype == "fp8"
    four = dtype in PACKED4
    if dtype not in DTYPES and not quant and not four:
        raise MoetierError(f"unsupported --dtype {dtype!r}; choose float32, bfloat16, float16, fp8 or one of the "
                           f"4-bit formats: {', '.join(PACKED4)}")
    if format is not None and not four:
        raise MoetierError(f"--format {format} names a 4-bit layout; it goes with --dtype {', '.join(PACKED4)}")
    layout = quant4.check(dtype, format) if four else None
    if not shard_bytes > 0:
        raise MoetierError(f"the shard size must be positive, got {shard_bytes} bytes")
    torch_dtype = torch.bfloat16 if quant or four else DTYPES[dtype]  # fp8, 4-bit: quantized from random bf16
    d = presets.preset_dict(preset, layers, dtype=str(torch_dtype).removeprefix("torch."), mtp_layers=mtp_layers)
    text = d.get("text_config", d)  # a multimodal config keeps the language model's fields there
    if quant and fused_experts and text["moe_intermediate_size"] % fp8.BLOCK:
        raise MoetierError(f"--dtype fp8 --fused-experts needs moe_intermediate_size a multiple of {fp8.BLOCK} "
                           f"(preset {preset} has {text['moe_intermediate_size']}): a fused gate_up's block scales "
                           "would mix gate and up rows; drop --fused-experts")
    out = Path(out)
    prepare_out(out, overwrite)
    vocab_needed = write_tokenizer(out)
    tok = Tokenizer.from_dir(out)
    if text["vocab_size"] < vocab_needed:
        raise MoetierError(f"preset {preset} has vocab_size {text['vocab_size']} < tokenizer size {vocab_needed}")
    # Stop ids are the generated tokenizer's, not the published model's (its ids mean other text here).
    text["eos_token_id"] = tok.eos_token_ids[0] if len(tok.eos_token_ids) == 1 else tok.eos_token_ids
    text["bos_token_id"] = None
    cfg = config_from_dict(d, source=f"preset {preset}")
    plan = tensor_plan(with_mtp(cfg, bool(mtp_layers)), fused_experts)  # the MTP layers' weights written too
    if quant:
        cfg = config_from_dict(fp8_config(d, [n for n, _ in plan]), source=f"preset {preset}")
    if four:
        cfg = config_from_dict(quant4.config(d, [n for n, _ in plan], dict(plan), dtype, layout),
                               source=f"preset {preset}")
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": text["eos_token_id"], "do_sample": False}, indent=2) + "\n")

    units = [quant4.entries(n, s, torch_dtype, dtype, layout) if four else _entries(n, s, torch_dtype, quant)
             for n, s in plan]
    shards = list(_shards(units, shard_bytes))
    total = sum(_nbytes(u) for u in units)
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, done = {}, 0
    meta = {"format": "pt", "moetier_preset": preset, "moetier_seed": str(seed)}
    planned = dict(plan)

    def make(name: str, dtype_: torch.dtype) -> list[tuple[str, torch.Tensor]]:
        base = name.removesuffix("_packed") if four and name not in planned else name
        fused = base.endswith(("experts.gate_up_proj", "experts.down_proj"))
        t = (_fused if fused else random_tensor)(base, planned[base], seed, torch_dtype)
        if four and dtype_ != torch_dtype:
            return quant4.tensors(base, t, dtype, layout)
        if dtype_ == fp8.FP8:
            q, scale = fp8.quantize(t)
            return [(name, q), (scale_name(name), scale)]
        return [(name, t)]

    workers = max(1, threads or os.cpu_count() or 1)
    with ThreadPoolExecutor(workers) as pool:
        for file, shard in zip(files, shards):
            jobs = [(name, dtype_) for name, dtype_, _ in shard
                    if not (name.endswith(fp8.SCALE_SUFFIX) or (four and name not in planned and not (
                        name.endswith("_packed") and name[:-7] in planned)))]  # scales: with their weight
            ahead: deque = deque()
            with StreamingWriter(out / file, shard, meta) as w:
                for i in range(len(jobs)):
                    while len(ahead) < min(2 * workers, len(jobs) - i):  # a window: bounded memory
                        ahead.append(pool.submit(make, *jobs[i + len(ahead)]))
                    for n, x in ahead.popleft().result():
                        w.write(n, x)
                        weight_map[n] = file
                        done += x.numel() * x.element_size()
                    if progress:
                        progress(done, total)
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
