"""Builds, caches and calls the compiled host expert kernel (csrc/host_experts.cpp), the `compiled`
HostKernel of cpu_experts.py.

    lib = load()                      # builds at first use, or raises HostExtUnavailable(one line)
    ok, reason = available()          # never raises
    pair_outputs(lib, x, tokens, experts, rows, layout, threads) -> [P, H] fp32
    start(lib, x, tokens, experts, rows, layout, threads).result()   # the same, on the library's own
                                      # native thread: returns at once, result() waits (the GIL released)

The source is plain C++ with OpenMP and a C ABI (no torch or Python headers), compiled with
`-O3 -march=native -fopenmp` into a shared library and called through ctypes, which releases the GIL
for the call (the hybrid backend's main thread keeps launching device work meanwhile). A build takes a
few seconds on 2 cores; the library is cached, never in the source tree:

    $XDG_CACHE_HOME/moetier, else ~/.cache/moetier  ->  host_ext/host_experts-<key>.so

<key> hashes the source (so a change of the kernel's arguments, such as the SwiGLU limit's, never
reuses an older build: its ctypes signature below would not match), the flags, the compiler's identity and the CPU's feature flags: -march=native
code from one machine must never be loaded on another that shares the home directory. Writes are
atomic (a temporary file renamed into place), so concurrent first builds are safe.

The build tools' own conventions say where the compiler and the cache are, never what runs: $CXX
(else c++ / g++ / clang++ on the PATH) and $XDG_CACHE_HOME (above); moetier reads no variable of its own. A failed build is remembered for the process (per
compiler and cache dir) and reported as one line, and the hybrid backend falls back to a torch kernel.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from moetier.activation import checked_limit
from moetier.quant.rows import RowLayout

SOURCE = Path(__file__).with_name("csrc") / "host_experts.cpp"
# the hybrid nodes mode's host-function node (hybrid_nodes.py), linked into the same library
NODE_SOURCE = SOURCE.with_name("host_node.cpp")
HEADERS = (SOURCE.with_name("host_decode.h"),)  # included by SOURCE: part of the build's key
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-std=c++17", "-fPIC", "-shared"]
KINDS = {torch.bfloat16: 0, torch.float32: 1}  # plus quantized rows (uint8), by layout.quant:
# each + 1: weights rounded to bf16 (csrc Kind)
QUANT_KINDS = {"fp8": 2, "nvfp4": 4, "int4": 6, "int4-g32": 8, "int4-asym": 10, "int4-g32-asym": 12}
_LOADED: dict[tuple, ctypes.CDLL | Exception] = {}


class HostExtUnavailable(RuntimeError):
    """The compiled kernel cannot be used here; str() is one line saying why."""


def cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "moetier" / "host_ext"


def compiler() -> str | None:
    """The C++ compiler to use, or None when none is configured or found."""
    cxx = os.environ.get("CXX")
    if cxx:
        return cxx
    return shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _cpu_flags() -> str:
    try:  # Linux: the first processor's feature flags; -march=native depends on exactly these
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _one_line(text: str, limit: int = 300) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    first = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "no output")
    return first[:limit]


def build(cxx: str, out_dir: Path) -> Path:
    """Compile the source with `cxx` into out_dir (cached by key); -> the library's path."""
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        raise HostExtUnavailable(f"C++ compiler {cxx!r} cannot be run ({e}); set CXX") from None
    if version.returncode != 0:
        raise HostExtUnavailable(f"C++ compiler {cxx!r} failed on --version: {_one_line(version.stderr)}")
    for source in (SOURCE, NODE_SOURCE, *HEADERS):  # an install without its package data (pyproject's package-data)
        if not source.is_file():
            raise HostExtUnavailable(f"the kernel source {source} is missing from this install")
    src = b"\0".join(f.read_bytes() for f in (SOURCE, NODE_SOURCE, *HEADERS))
    key = hashlib.sha256(b"\0".join([src, " ".join(FLAGS).encode(), version.stdout.encode(), cxx.encode(),
                                     _cpu_flags().encode(), platform.machine().encode()])).hexdigest()[:16]
    lib = out_dir / f"host_experts-{key}.so"
    if lib.exists():
        return lib
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", prefix=".build-", dir=out_dir)
        os.close(fd)
    except OSError as e:
        raise HostExtUnavailable(f"cannot write the kernel cache {out_dir} ({e}); set XDG_CACHE_HOME") from None
    try:
        r = subprocess.run([cxx, *FLAGS, str(SOURCE), str(NODE_SOURCE), "-o", tmp], capture_output=True, text=True,
                           timeout=600)
        if r.returncode != 0:
            raise HostExtUnavailable(f"building {SOURCE.name} with {cxx} failed: {_one_line(r.stderr)}")
        os.replace(tmp, lib)  # atomic: a concurrent build of the same key writes the same bytes
    except subprocess.TimeoutExpired:
        raise HostExtUnavailable(f"building {SOURCE.name} with {cxx} took over 600 s") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def load() -> ctypes.CDLL:
    """The loaded library (built at first use); raises HostExtUnavailable, the same one each time."""
    cxx = compiler()
    key = (cxx, str(cache_dir()))
    got = _LOADED.get(key)
    if got is None:
        try:
            if cxx is None:
                raise HostExtUnavailable("no C++ compiler found (c++, g++ or clang++ on the PATH; or set "
                                         "CXX)")
            lib = ctypes.CDLL(str(build(cxx, cache_dir())))
            for f in (lib.moetier_host_experts, lib.moetier_host_experts_start):
                f.restype = ctypes.c_int
                f.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int64,
                               ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
                               ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_char_p,
                               ctypes.c_int])
            lib.moetier_host_experts_wait.restype = ctypes.c_int
            lib.moetier_host_experts_wait.argtypes = [ctypes.c_void_p]
            lib.moetier_host_experts_simd_width.restype = ctypes.c_int
            lib.moetier_host_node.restype = None
            lib.moetier_host_node.argtypes = [ctypes.c_void_p]
            lib.moetier_host_node_job_size.restype = ctypes.c_int64
            got = lib
        except HostExtUnavailable as e:
            got = e
        except OSError as e:  # the library exists but does not load (another machine's, a broken file)
            got = HostExtUnavailable(f"the compiled host kernel does not load: {_one_line(str(e))}")
        _LOADED[key] = got
    if isinstance(got, Exception):
        raise got
    return got


def available() -> tuple[bool, str]:
    """(True, "") or (False, the one-line reason). Builds at the first call."""
    try:
        load()
        return True, ""
    except HostExtUnavailable as e:
        return False, str(e)


def kind_of(rows: torch.Tensor, layout: RowLayout) -> int | None:
    """The kernel's code for these rows, or None when it has none (the caller falls back to torch)."""
    if layout.quant is not None:  # FP8, NVFP4, INT4: byte rows
        return QUANT_KINDS[layout.quant] if rows.dtype == torch.uint8 else None
    return KINDS.get(rows.dtype)


def call_kind(rows: torch.Tensor, layout: RowLayout, bf16: bool) -> tuple[int, int, int]:
    """-> (kind, s13, s2): the kernel's code for these rows in a model of bf16 (True) or fp32 hidden
    states (quantized weights rounded to bf16 in a bf16 model), and the quantized rows' scale offsets
    (else 0; NVFP4's tensor scales follow its down scales, csrc/host_decode.h). Shared
    by every caller of the kernel (_call, experts/hybrid/nodes.py's job), so they agree on the rounding."""
    kind = kind_of(rows, layout)
    if kind is None:
        raise ValueError(f"the compiled host kernel has no code for {rows.dtype} rows of quantization {layout.quant}")
    if layout.quant is not None:
        return kind + int(bf16), layout.s13_offset, layout.s2_offset
    return kind, 0, 0


def limit_arg(layout: RowLayout) -> float:
    """The kernel's `limit` argument: the layout's SwiGLU clamp (checked as the Triton kernels' is), or
    -1.0 for none (the plain SwiGLU; the kernel reads any limit <= 0 or NaN as none)."""
    return -1.0 if layout.swiglu_limit is None else checked_limit(layout.swiglu_limit)


def pair_outputs(lib: ctypes.CDLL, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor,
                 rows: torch.Tensor, layout: RowLayout, threads: int, block_bytes: int = 0) -> torch.Tensor:
    """Unweighted outputs of pairs (tokens[i], experts[i]) -> [P, H] fp32. x [T, H] in the compute dtype
    (the kernel reads it as fp32); rows [E, R] contiguous CPU rows. With x in bf16 the kernel rounds
    what the other paths hold in bf16: FP8 weights after scaling, and the SwiGLU before the down
    projection (the GPU kernel's down dot reads it as bf16); the dot products accumulate in fp32. Under
    layout.swiglu_limit the gate and up dots are clamped in fp32 before silu (activation.silu_mul's order).
    block_bytes: weight bytes per work item the threads take in turn (0: the kernel's 64 KB)."""
    return _call(lib.moetier_host_experts, x, tokens, experts, rows, layout, threads, block_bytes)[0]


class Started:
    """A call running on the library's own native thread (start()); result() waits for it. It holds
    every tensor the call reads or writes until then. `times`: (start, end) of the call on the
    time.perf_counter clock (CLOCK_MONOTONIC), once waited for."""

    def __init__(self, lib: ctypes.CDLL, y: torch.Tensor, keep: tuple):
        self.lib, self.y, self._keep = lib, y, keep
        self.times: tuple[float, float] | None = None

    def result(self) -> torch.Tensor:
        if self.times is None:
            t = (ctypes.c_double * 2)()
            if self.lib.moetier_host_experts_wait(t) != 0:  # ctypes releases the GIL while it waits
                raise RuntimeError("compiled host kernel: nothing was started")
            self.times, self._keep = (t[0], t[1]), ()
        return self.y


def start(lib: ctypes.CDLL, x: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor, rows: torch.Tensor,
          layout: RowLayout, threads: int, block_bytes: int = 0, out: torch.Tensor | None = None) -> Started:
    """pair_outputs, started on the library's native thread; returns at once (the arguments are checked
    and the pairs grouped first, on the caller). One call at a time per process: wait before the next.
    out: a contiguous fp32 [P, H] CPU tensor to write into (e.g. pinned, for the upload), else a new one."""
    y, keep = _call(lib.moetier_host_experts_start, x, tokens, experts, rows, layout, threads, block_bytes, out)
    return Started(lib, y, keep)


def _call(fn, x, tokens, experts, rows, layout, threads, block_bytes, out=None):
    bf16 = x.dtype == torch.bfloat16
    kind, s13, s2 = call_kind(rows, layout, bf16)
    if not rows.is_contiguous() or rows.dim() != 2:
        raise ValueError("the compiled host kernel needs contiguous [E, R] rows")
    xs = x.float().contiguous()
    tok = tokens.to(torch.int64).contiguous()
    exp = experts.to(torch.int64).contiguous()
    p, hdim, inter = tok.numel(), layout.hidden, layout.inter
    h = torch.empty(p, inter, dtype=torch.float32)  # the SwiGLU of every pair: scratch
    y = torch.empty(p, hdim, dtype=torch.float32) if out is None else out
    if y.shape != (p, hdim) or y.dtype != torch.float32 or not y.is_contiguous() or y.device.type != "cpu":
        raise ValueError(f"out must be a contiguous float32 CPU tensor [{p}, {hdim}]")
    err = ctypes.create_string_buffer(256)
    rc = fn(rows.data_ptr(), rows.shape[0], rows.shape[1] * rows.element_size(), kind, hdim,
            inter, s13, s2, int(bf16), xs.data_ptr(), xs.shape[0],
            tok.data_ptr(), exp.data_ptr(), p, h.data_ptr(), y.data_ptr(), threads, block_bytes,
            limit_arg(layout), err, 256)
    if rc != 0:
        raise ValueError(f"compiled host kernel: {err.value.decode()}")
    return y, (xs, tok, exp, h, rows)
