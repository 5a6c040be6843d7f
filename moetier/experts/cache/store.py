"""The host tier: every routed expert of every MoE layer, one contiguous row per expert.

A row is one expert (quant/rows.RowLayout). The loader fills rows straight from the checkpoint, so the
experts exist once in RAM. A layer with pinned experts (split.py) gets a virtual block: one anonymous
mapping of E rows of which only the cached rows' pages are ever written and pinned, so the host holds
what the GPU does not, and host row e is still expert e.

On CUDA machines each layer's block is pinned at its exact size: page-aligned memory registered
with cudaHostRegister. torch's pinned allocator would round every block up to a power of two
(3.22 GB pins 4 GiB, reference 000), which is how host budgets silently break.
"""

from __future__ import annotations

import mmap
import sys

import torch

from moetier.errors import MoetierError
from moetier.experts.cache.split import backed_ranges
from moetier.quant.rows import RowLayout

PAGE = mmap.PAGESIZE
MAP_NORESERVE = 0x4000 if sys.platform.startswith("linux") else 0  # no swap reserved for unwritten pages


def _aligned_empty(nbytes: int) -> tuple[torch.Tensor, int]:
    """A uint8 CPU tensor of exactly `nbytes` whose start is page-aligned (cudaHostRegister needs it).

    Over-allocates by one page at most; returns the tensor and the bytes allocated.
    """
    raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % PAGE
    return raw[skip: skip + nbytes], nbytes + PAGE


def _virtual_empty(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` over an anonymous mapping (page-aligned): pages cost memory only
    once written. The tensor keeps the mapping alive."""
    flags = mmap.MAP_PRIVATE | MAP_NORESERVE  # fd -1: anonymous
    return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1), flags=flags), dtype=torch.uint8)[:nbytes]


class _Registration:
    """Keeps a cudaHostRegister'ed range registered exactly as long as its memory lives."""

    def __init__(self, base: torch.Tensor):
        self.base = base  # holds the memory alive
        self.ptr = base.data_ptr()
        # cudaHostRegisterPortable (1) | cudaHostRegisterMapped (2): visible to every context, on the
        # device at the same address under unified addressing.
        err = torch.cuda.cudart().cudaHostRegister(self.ptr, base.numel(), 3)
        if int(err) != 0:
            raise MoetierError(f"cudaHostRegister of {base.numel()} bytes failed with error {int(err)}; "
                               "the host may be out of lockable memory (ulimit -l)")

    def __del__(self) -> None:
        try:
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
        except Exception:  # interpreter shutdown
            pass


class HostStore:
    """Per MoE layer a block [E, row] in host memory, pinned at exact size when `pin` is set.
    `dtype` is the model's; the rows take layout.row_dtype(dtype) (uint8 bytes for FP8 rows)."""

    def __init__(self, layers: list[int], num_experts: int, layout: RowLayout, dtype: torch.dtype, pin: bool,
                 pinned: dict[int, tuple[int, ...]] | None = None):
        """pinned: per layer the experts (local ids) the GPU holds for good; their rows are left unbacked."""
        dtype = layout.row_dtype(dtype)
        self.layout, self.dtype, self.num_experts = layout, dtype, num_experts
        self.row_bytes = layout.row_bytes(dtype)
        self.requested_bytes = 0  # the cached rows' bytes
        self.allocated_bytes = 0  # what the process really holds, page alignment included
        self.pinned_bytes = 0
        self.pinned_experts = {layer: tuple(sorted(p)) for layer, p in (pinned or {}).items() if p}
        self._blocks: dict[int, torch.Tensor] = {}
        self._registrations: list[_Registration] = []
        for layer in layers:
            held = self.pinned_experts.get(layer, ())
            nbytes = num_experts * self.row_bytes
            if held:
                base = _virtual_empty(nbytes)
                ranges = backed_ranges(num_experts, held, self.row_bytes, PAGE)
                ranges = [(a, min(b, nbytes)) for a, b in ranges]
                allocated = sum(b - a for a, b in ranges)
            else:
                base, allocated = _aligned_empty(nbytes)
                ranges = [(0, nbytes)]
            block = base.view(dtype).view(num_experts, layout.numel)
            if pin:
                # NOTE: the block keeps its registrations alive: the backends hold blocks, not the store,
                # and the device reads this memory by address (UVA) until the last holder lets go.
                block.pin_registration = [_Registration(base[a:b]) for a, b in ranges]
                self._registrations += block.pin_registration
                self.pinned_bytes += sum(b - a for a, b in ranges)
            self.requested_bytes += (num_experts - len(held)) * self.row_bytes
            self.allocated_bytes += allocated
            self._blocks[layer] = block

    def rows(self, layer: int) -> torch.Tensor:
        """[E, row] CPU tensor of one layer (pinned when the store is)."""
        return self._blocks[layer]

    @property
    def pinned(self) -> bool:
        return bool(self._registrations)

    def report(self) -> dict[str, int]:
        return {"requested_bytes": self.requested_bytes, "allocated_bytes": self.allocated_bytes,
                "pinned_bytes": self.pinned_bytes, "blocks": len(self._blocks), "row_bytes": self.row_bytes}


class DevicePointer:
    """Hands a Triton kernel the device address of pinned host memory (unified addressing: the same
    address as on the host). Triton only asks an argument for data_ptr() and dtype."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor  # keeps the memory alive
        self.dtype = tensor.dtype
        self._ptr = tensor.data_ptr()

    def data_ptr(self) -> int:
        return self._ptr
