"""A checkpoint directory: its safetensors shards and their headers (names, dtypes, shapes).

Everything here reads headers only (the first bytes of each shard), so a checkpoint is validated
(validate.py) before a single weight is allocated; missing or unreadable shards are all reported
together, with file and tensor name.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from moetier.errors import CheckpointError, problem_list

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


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
