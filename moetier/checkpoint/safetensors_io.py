"""Write safetensors files tensor by tensor, so a checkpoint larger than RAM can be written.

The header (names, dtypes, shapes, offsets) is known before any data, so it is written first and
each tensor's bytes are appended as they are made; at most one tensor is in memory at a time.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
         torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}


class StreamingWriter:
    """Writes one safetensors file whose tensors are declared up front and then written in order."""

    def __init__(self, path: str | Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: dict[str, str] | None = None):
        self.path = Path(path)
        header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        self._pending: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        for name, dtype, shape in entries:
            n = dtype.itemsize
            for s in shape:
                n *= s
            header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
            self._pending.append((name, dtype, tuple(shape)))
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
        self.nbytes = 8 + len(raw) + offset
        self._f = open(self.path, "wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if not self._pending:
            raise ValueError(f"{self.path}: no more tensors were declared, got {name}")
        want_name, dtype, shape = self._pending.pop(0)
        if (name, tensor.dtype, tuple(tensor.shape)) != (want_name, dtype, shape):
            raise ValueError(f"{self.path}: expected {want_name} {dtype} {list(shape)}, got "
                             f"{name} {tensor.dtype} {list(tensor.shape)}")
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        self._f.write(memoryview(data.numpy()))

    def close(self) -> None:
        self._f.close()
        if self._pending:
            raise ValueError(f"{self.path}: {len(self._pending)} declared tensors were never written")

    def __enter__(self) -> StreamingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self._f.close()
