"""Write a block-scaled FP8 copy of a bf16 (or float32) checkpoint directory: every projection that
an FP8 checkpoint stores in float8 (quant/fp8_block.quantizable) quantized by the format's block rule
(quant/fp8_block.quantize), the rest copied; config.json gets the quantization_config that
make-checkpoint --dtype fp8 writes; tokenizer and generation files are copied unchanged.

    python scripts/fp8_copy.py moetier/assets/tiny-stdlib /tmp/tiny-stdlib-fp8

What the accuracy gate compares with the bf16 original (docs/eval.md): the same trained weights in
another format. Single-file or sharded checkpoints (model.safetensors.index.json); the copy is one
file per source shard.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from moetier.quant.fp8_block import checkpoint_config, quantizable, quantize, scale_name


def fp8_copy(src: Path, out: Path) -> list[str]:
    """-> the names written. NOTE: each shard is read whole into memory (a small checkpoint's tool)."""
    out.mkdir(parents=True, exist_ok=True)
    index = src / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [
        "model.safetensors"]
    names, weight_map = [], {}
    for shard in shards:
        tensors = {}
        for name, t in load_file(src / shard).items():
            names.append(name)
            if quantizable(name, tuple(t.shape)):
                tensors[name], tensors[scale_name(name)] = quantize(t)
            else:
                tensors[name] = t
        save_file(tensors, out / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in tensors})
    if index.is_file():
        (out / index.name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    cfg = checkpoint_config(json.loads((src / "config.json").read_text()), names)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", index.name):
            shutil.copy2(f, out / f.name)
    return list(weight_map)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    args = ap.parse_args()
    names = fp8_copy(args.src, args.out)
    print(f"wrote {args.out}: {sum(n.endswith('_scale_inv') for n in names)} FP8 tensors with block scales")


if __name__ == "__main__":
    main()
