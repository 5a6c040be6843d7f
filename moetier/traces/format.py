"""The trace file format (documented in docs/traces.md).

    b"MOETRACE" | uint32 version (1) | uint32 header bytes | header (UTF-8 JSON) | records...

The header holds the metadata: model, source text, experts, top_k, layers (the MoE layer indices,
in order), id and weight dtypes, and free-form fields (synthesis parameters, ...). Each record is one
engine step:

    uint32 tokens T | uint8 flags (bit 0: prefill) | uint32 seq [T] |
    ids [L, T, k] (uint16) | weights [L, T, k] (float16, omitted when the header says no weights)

`seq` says which stream (request) each token belongs to. Records append, so a trace is written as
the engine runs and read back as one array per field. The token count is not in the header (a
stream writer does not know it), the reader counts.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from moetier.errors import MoetierError

MAGIC = b"MOETRACE"
VERSION = 1


@dataclass
class Trace:
    """A whole trace in memory: ids [N, L, k] int64, weights [N, L, k] float32 or None."""

    meta: dict
    ids: np.ndarray
    weights: np.ndarray | None
    seq: np.ndarray  # [N] stream of each token
    prefill: np.ndarray  # [N] bool: the token came in a prefill step
    steps: np.ndarray = field(default=None)  # [N] record index of each token

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]

    @property
    def layers(self) -> list[int]:
        return list(self.meta["layers"])

    @property
    def num_experts(self) -> int:
        return int(self.meta["experts"])

    @property
    def top_k(self) -> int:
        return int(self.meta["top_k"])

    def layer_ids(self, i: int) -> np.ndarray:
        """[N, k] ids of the i-th traced layer."""
        return self.ids[:, i, :]


class TraceWriter:
    def __init__(self, path: str | Path, experts: int, top_k: int, layers: list[int], weights: bool = True,
                 **meta):
        if experts > 65535:
            raise MoetierError(f"traces store expert ids as uint16; {experts} experts do not fit")
        self.path = Path(path)
        self.k, self.layers, self.weights = top_k, list(layers), weights
        self.meta = {"experts": experts, "top_k": top_k, "layers": self.layers, "ids": "uint16",
                     "weights": "float16" if weights else None, **meta}
        self._f: BinaryIO = open(self.path, "wb")
        head = json.dumps(self.meta, sort_keys=True).encode()
        self._f.write(MAGIC + struct.pack("<II", VERSION, len(head)) + head)
        self.tokens = 0

    def write(self, ids: np.ndarray, weights: np.ndarray | None = None, seq: np.ndarray | None = None,
              prefill: bool = False) -> None:
        """ids [L, T, k]; weights [L, T, k] (when the trace has weights); seq [T]."""
        ids = np.asarray(ids)
        n_layers, t, k = ids.shape
        if n_layers != len(self.layers) or k != self.k:
            raise ValueError(f"record shape {ids.shape} does not match {len(self.layers)} layers x top-{self.k}")
        seq = np.zeros(t, dtype=np.uint32) if seq is None else np.asarray(seq, dtype=np.uint32)
        self._f.write(struct.pack("<IB", t, 1 if prefill else 0))
        self._f.write(seq.tobytes())
        self._f.write(ids.astype(np.uint16).tobytes())
        if self.weights:
            if weights is None:
                raise ValueError("this trace stores weights; pass them")
            self._f.write(np.asarray(weights, dtype=np.float16).tobytes())
        self.tokens += t

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_trace(path: str | Path) -> Trace:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise MoetierError(f"cannot read trace {path}: {e}") from None
    if data[:8] != MAGIC:
        raise MoetierError(f"{path} is not a moetier trace (it does not start with {MAGIC!r})")
    try:
        version, n = struct.unpack_from("<II", data, 8)
        if version != VERSION:
            raise MoetierError(f"{path}: trace version {version}; this moetier reads version {VERSION}")
        meta = json.loads(data[16:16 + n])
        layers, k = len(meta["layers"]), int(meta["top_k"])
        has_w = meta.get("weights") is not None
    except (struct.error, ValueError, KeyError, TypeError, AttributeError) as e:  # JSON errors are ValueErrors
        raise MoetierError(f"{path}: the trace header is damaged ({type(e).__name__}: {e}); record or "
                           "synthesize the trace again") from None
    pos = 16 + n
    ids, weights, seq, prefill, steps = [], [], [], [], []
    record = 0
    while pos < len(data):
        if pos + 5 > len(data):
            raise MoetierError(f"{path}: truncated record header at byte {pos}")
        t, flags = struct.unpack_from("<IB", data, pos)
        pos += 5
        need = 4 * t + 2 * layers * t * k * (2 if has_w else 1)
        if pos + need > len(data):
            raise MoetierError(f"{path}: record {record} is truncated ({len(data) - pos} of {need} bytes)")
        seq.append(np.frombuffer(data, np.uint32, t, pos))
        pos += 4 * t
        ids.append(np.frombuffer(data, np.uint16, layers * t * k, pos).reshape(layers, t, k).transpose(1, 0, 2))
        pos += 2 * layers * t * k
        if has_w:
            weights.append(np.frombuffer(data, np.float16, layers * t * k, pos).reshape(layers, t, k).transpose(1, 0, 2))
            pos += 2 * layers * t * k
        prefill.append(np.full(t, bool(flags & 1)))
        steps.append(np.full(t, record))
        record += 1
    cat = (lambda xs, shape, dt: np.concatenate(xs) if xs else np.zeros(shape, dt))
    return Trace(
        meta=meta,
        ids=cat(ids, (0, layers, k), np.uint16).astype(np.int64),
        weights=cat(weights, (0, layers, k), np.float16).astype(np.float32) if has_w else None,
        seq=cat(seq, (0,), np.uint32).astype(np.int64),
        prefill=cat(prefill, (0,), bool),
        steps=cat(steps, (0,), np.int64),
    )


def write_trace(path: str | Path, ids: np.ndarray, meta: dict, weights: np.ndarray | None = None,
                seq: np.ndarray | None = None, chunk: int = 4096) -> None:
    """A whole trace at once: ids [N, L, k]; one record per `chunk` tokens (decode tokens)."""
    meta = dict(meta)
    experts, top_k, layers = meta.pop("experts"), meta.pop("top_k"), meta.pop("layers")
    meta.pop("ids", None)
    meta.pop("weights", None)
    with TraceWriter(path, experts, top_k, layers, weights=weights is not None, **meta) as w:
        for s in range(0, ids.shape[0], chunk):
            sl = slice(s, s + chunk)
            w.write(ids[sl].transpose(1, 0, 2), None if weights is None else weights[sl].transpose(1, 0, 2),
                    None if seq is None else seq[sl])
