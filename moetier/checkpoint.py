"""A checkpoint directory: its safetensors shards, their headers, and the tensor names a model expects.

Everything here reads headers only (the first bytes of each shard), so a checkpoint is validated
before a single weight is allocated: missing or unreadable shards, missing, unexpected, misshapen
or non-float tensors are all reported together, with file and tensor name.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from moetier.config import ModelConfig
from moetier.errors import CheckpointError, problem_list

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
FLOAT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
# Tensors some exporters add that carry nothing we need.
IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class TensorInfo:
    file: str  # shard file name, relative to the checkpoint directory
    dtype: str  # safetensors dtype code: F32, BF16, ...
    shape: tuple[int, ...]


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse one safetensors header; checks that the data the header promises is in the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError("file is shorter than a safetensors header")
        (n,) = struct.unpack("<Q", raw)
        if n > min(size - 8, 100 * 2**20):
            raise ValueError(f"header length {n} bytes does not fit the file ({size} bytes)")
        header = json.loads(f.read(n))
    end = 0
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        out[name] = TensorInfo(path.name, meta["dtype"], tuple(meta["shape"]))
        end = max(end, meta["data_offsets"][1])
    if 8 + n + end > size:
        raise ValueError(f"truncated: the header promises {8 + n + end} bytes, the file has {size}")
    return out


class Checkpoint:
    """The tensors of a checkpoint directory, by name, from the shard headers."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.tensors: dict[str, TensorInfo] = {}
        problems: list[str] = []
        for file, names in self._shards().items():
            shard = self.path / file
            if not shard.is_file():
                problems.append(f"{file}: missing shard file, which the index says holds {len(names)} tensors "
                                f"(e.g. {sorted(names)[0]})" if names else f"{file}: missing shard file")
                continue
            try:
                header = read_header(shard)
            except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
                problems.append(f"{file}: unreadable safetensors file ({e})")
                continue
            for name in names or header:
                if name not in header:
                    problems.append(f"{file}: the index places {name} here but the file does not hold it")
                else:
                    self.tensors[name] = header[name]
        if problems:
            raise CheckpointError(problem_list(
                f"checkpoint {self.path} cannot be read", problems,
                "Download the missing or damaged files again (or re-run the conversion that wrote them)."))

    def _shards(self) -> dict[str, set[str]]:
        """shard file -> tensor names it should hold (empty set: whatever its header says)."""
        index = self.path / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index ({e}); download it again")
            shards: dict[str, set[str]] = {}
            for name, file in weight_map.items():
                shards.setdefault(file, set()).add(name)
            return shards
        if (self.path / SINGLE_FILE).is_file():
            return {SINGLE_FILE: set()}
        found = sorted(p.name for p in self.path.glob("*.safetensors"))
        if len(found) == 1:
            return {found[0]: set()}
        what = f"{len(found)} .safetensors files but no {INDEX_FILE}" if found else "no .safetensors files"
        raise CheckpointError(
            f"checkpoint {self.path} has {what}. A checkpoint needs {SINGLE_FILE}, or shards with "
            f"{INDEX_FILE}; .bin (pickle) checkpoints are not supported, convert them to safetensors.")

    def nbytes(self) -> int:
        return sum(os.path.getsize(self.path / f) for f in {t.file for t in self.tensors.values()})


def expected_tensors(cfg: ModelConfig, present: set[str]) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Names and shapes the config implies, and the names that may be absent.

    Routed experts may be stored per expert (published checkpoints) or fused (transformers 5);
    which one is read off the names present, per layer.
    """
    h, d, i_moe = cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size
    want: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    optional: set[str] = set()
    want["lm_head.weight"] = (cfg.vocab_size, h)
    if cfg.tie_word_embeddings:
        optional.add("lm_head.weight")  # some exporters write the tied copy, most do not
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        want[p + "input_layernorm.weight"] = (h,)
        want[p + "post_attention_layernorm.weight"] = (h,)
        a = p + "self_attn."
        for proj, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads), ("v_proj", cfg.num_kv_heads)):
            want[a + proj + ".weight"] = (heads * d, h)
            if cfg.attention_bias:
                want[a + proj + ".bias"] = (heads * d,)
        want[a + "o_proj.weight"] = (h, cfg.num_heads * d)
        if cfg.attention_bias:
            want[a + "o_proj.bias"] = (h,)
        want[a + "q_norm.weight"] = (d,)
        want[a + "k_norm.weight"] = (d,)
        m = p + "mlp."
        if cfg.is_moe_layer(layer):
            want[m + "gate.weight"] = (cfg.num_experts, h)
            if m + "experts.gate_up_proj" in present or m + "experts.down_proj" in present:
                want[m + "experts.gate_up_proj"] = (cfg.num_experts, 2 * i_moe, h)
                want[m + "experts.down_proj"] = (cfg.num_experts, h, i_moe)
            else:
                for e in range(cfg.num_experts):
                    x = f"{m}experts.{e}."
                    want[x + "gate_proj.weight"] = (i_moe, h)
                    want[x + "up_proj.weight"] = (i_moe, h)
                    want[x + "down_proj.weight"] = (h, i_moe)
        else:
            want[m + "gate_proj.weight"] = (cfg.intermediate_size, h)
            want[m + "up_proj.weight"] = (cfg.intermediate_size, h)
            want[m + "down_proj.weight"] = (h, cfg.intermediate_size)
    return want, optional


def validate(cfg: ModelConfig, ckpt: Checkpoint) -> dict[str, tuple[int, ...]]:
    """Check every tensor against the config; returns the expected names and shapes that are present."""
    present = set(ckpt.tensors)
    want, optional = expected_tensors(cfg, present)
    problems: list[str] = []
    missing = sorted(n for n in want if n not in present and n not in optional)
    for name in missing[:20]:
        problems.append(f"missing tensor {name} (shape {list(want[name])})")
    if len(missing) > 20:
        problems.append(f"... and {len(missing) - 20} more missing tensors")
    unexpected = sorted(n for n in present if n not in want and not IGNORED.match(n))
    for name in unexpected[:20]:
        info = ckpt.tensors[name]
        problems.append(f"{info.file}: unexpected tensor {name} (shape {list(info.shape)})")
    if len(unexpected) > 20:
        problems.append(f"... and {len(unexpected) - 20} more unexpected tensors")
    for name in sorted(present & want.keys()):
        info = ckpt.tensors[name]
        if info.shape != want[name]:
            problems.append(f"{info.file}: {name} has shape {list(info.shape)}, the config implies {list(want[name])}")
        if info.dtype not in FLOAT_DTYPES:
            problems.append(f"{info.file}: {name} has dtype {info.dtype}; only float32, bfloat16 and float16 "
                            "weights are supported (quantized checkpoints come later)")
    if problems:
        hint = ("Check that config.json belongs to these weights (layers, experts, sizes)"
                + (", and that the checkpoint is complete." if missing else "."))
        raise CheckpointError(problem_list(f"checkpoint {ckpt.path} does not match its config.json", problems, hint))
    return {n: s for n, s in want.items() if n in present}
