"""`moetier make-checkpoint`: random-weight checkpoints in the Hugging Face format for a named shape.

Tensors are generated one at a time from a seed derived from (seed, tensor name), and streamed into
shards, so a 60 GB preset needs one tensor's worth of RAM. The same seed gives the same weights
whatever the shard size or expert layout.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Callable, Iterator

import torch

from moetier import presets
from moetier.checkpoint.loader import DTYPES
from moetier.checkpoint.safetensors_io import StreamingWriter
from moetier.config import ModelConfig, config_from_dict
from moetier.errors import MoetierError
from moetier.models.registry import model_class
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
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
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


def _shards(plan: list[tuple[str, tuple[int, ...]]], itemsize: int, max_bytes: int) -> Iterator[list]:
    shard, size = [], 0
    for name, shape in plan:
        n = itemsize * int(torch.Size(shape).numel())
        if shard and size + n > max_bytes:
            yield shard
            shard, size = [], 0
        shard.append((name, shape))
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
                    progress: Callable[[int, int], None] | None = None, overwrite: bool = False) -> Path:
    if dtype not in DTYPES:
        raise MoetierError(f"unsupported --dtype {dtype!r}; choose float32, bfloat16 or float16")
    if not shard_bytes > 0:
        raise MoetierError(f"the shard size must be positive, got {shard_bytes} bytes")
    torch_dtype = DTYPES[dtype]
    d = presets.preset_dict(preset, layers, dtype=str(torch_dtype).removeprefix("torch."))
    out = Path(out)
    prepare_out(out, overwrite)
    vocab_needed = write_tokenizer(out)
    tok = Tokenizer.from_dir(out)
    if d["vocab_size"] < vocab_needed:
        raise MoetierError(f"preset {preset} has vocab_size {d['vocab_size']} < tokenizer size {vocab_needed}")
    # Stop ids are the generated tokenizer's, not the published model's (its ids mean other text here).
    d["eos_token_id"] = tok.eos_token_ids[0] if len(tok.eos_token_ids) == 1 else tok.eos_token_ids
    d["bos_token_id"] = None
    cfg = config_from_dict(d, source=f"preset {preset}")
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": d["eos_token_id"], "do_sample": False}, indent=2) + "\n")

    plan = tensor_plan(cfg, fused_experts)
    shards = list(_shards(plan, torch_dtype.itemsize, shard_bytes))
    total = sum(torch_dtype.itemsize * int(torch.Size(s).numel()) for _, s in plan)
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, done = {}, 0
    meta = {"format": "pt", "moetier_preset": preset, "moetier_seed": str(seed)}
    for file, shard in zip(files, shards):
        entries = [(n, torch_dtype, s) for n, s in shard]
        with StreamingWriter(out / file, entries, meta) as w:
            for name, shape in shard:
                fused = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
                t = (_fused if fused else random_tensor)(name, shape, seed, torch_dtype)
                w.write(name, t)
                weight_map[name] = file
                done += t.numel() * t.element_size()
                if progress:
                    progress(done, total)
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
