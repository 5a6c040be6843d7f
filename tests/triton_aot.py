"""Compiles a Triton kernel for an NVIDIA target on a machine without a GPU, and reads ptxas's
resource report: the CPU-side check that a kernel compiles for the H200 (sm_90a) and fits its
registers without spilling, which the interpreter cannot show.

Uses the ptxas that ships inside the triton wheel; the newest one there must accept the PTX version
this triton emits (triton 3.9 emits PTX 9.x, which its `ptxas-blackwell` (CUDA 13) reads and its
`ptxas` (CUDA 12.9) does not)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Compiled:
    shared: int  # bytes of shared memory per program
    registers: int  # per thread
    spill_bytes: int  # spill stores + spill loads


def ptxas() -> Path | None:
    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    for name in ("ptxas-blackwell", "ptxas"):
        if (bin_dir / name).exists():
            return bin_dir / name
    return None


def compile_sm90(fn, signature: dict[str, str], constexprs: dict, aligned: list[str], num_warps: int,
                 num_stages: int) -> Compiled:
    """fn: a @triton.jit function; signature: argument -> type ("*bf16", "i32", "fp32") for every
    runtime argument; constexprs: the others; aligned: arguments the launcher would find divisible
    by 16 (pointers, strides), which enables vector loads as in a real launch."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {name: "constexpr" if name in constexprs else signature[name] for name in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps,
                                                                      "num_stages": num_stages})
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        p = subprocess.run([str(ptxas()), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", str(Path(tmp) / "k.o")],
                           capture_output=True, text=True)
    report = p.stdout + p.stderr
    assert p.returncode == 0, report
    regs = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert regs and spills, report
    return Compiled(kernel.metadata.shared, int(regs.group(1)), int(spills.group(1)) + int(spills.group(2)))
