"""python -m perf.kernel_asm: what Triton's compiler makes of the FP8 GEMM's configurations for Hopper, on any machine.

Triton compiles for a target without a GPU (its ptxas ships with it), so the code a configuration becomes can be read
where no H200 is lent: which tensor-core instruction its product runs on (wgmma, Hopper's, or mma.sync, Ampere's),
whether its loads are pipelined through shared memory (cp.async) and how wide they are, whether it stores to shared
memory itself (a widened tile on its way to the MMA), its registers, spills and shared memory, and ptxas' performance
warnings. Pointers and the sizes N and K are taken as 16-divisible, as Triton specializes them at launch for the
engine's tensors. It says what runs, not how fast: timings come from perf.fp8_gemm_sweep on the GPU.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from backends.llm.fp8_gemm import GemmConfig, _fp8_weight_gemm_kernel, default_config, swapped

SIGNATURE = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "bias_ptr": "*fp32", "out_ptr": "*bf16",
             "M": "i32", "N": "i32", "K": "i32", "x_scale_ptr": "*fp32", "HAS_BIAS": "constexpr", "IEEE": "constexpr",
             "SPLIT_K": "constexpr", "ITERS": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
             "BLOCK_K": "constexpr", "STAGES": "constexpr", "SWAP": "constexpr", "X_SCALED": "constexpr"}
DIVISIBLE = ("x_ptr", "w_ptr", "scale_ptr", "bias_ptr", "out_ptr", "x_scale_ptr", "N", "K")


def inspect_config(c: GemmConfig, capability: int = 90, w8a8: bool = False) -> dict[str, object]:
    """The compiled kernel's instruction mix and resources for configuration `c` (bf16 inputs, or E4M3 ones with
    row scales: `w8a8`; no bias)."""
    names = list(SIGNATURE)
    source = ASTSource(_fp8_weight_gemm_kernel, SIGNATURE | ({"x_ptr": "*fp8e4nv"} if w8a8 else {}), constexprs=dict(
        HAS_BIAS=False, IEEE=False, SPLIT_K=c.split_k, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        STAGES=c.stages, SWAP=c.swap, X_SCALED=w8a8),
        attrs={(names.index(a),): [["tt.divisibility", 16]] for a in DIVISIBLE})
    kernel = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                            options={"num_warps": c.warps, "num_stages": c.stages})
    ptx = kernel.asm["ptx"]
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        report = subprocess.run([str(ptxas), "-v", f"--gpu-name=sm_{capability}a", f.name, "-o", "/dev/null"],
                                capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", report)
    mma = re.search(r"wgmma\.mma_async[.a-z0-9]*", ptx) or re.search(r"mma\.sync[.a-z0-9]*", ptx)
    return {"mma": mma.group(0) if mma else "none",
            "cp.async": len(re.findall(r"cp\.async\.c[ag]", ptx)),
            "shared stores": len(re.findall(r"st\.shared", ptx)),  # (a widened tile stored back before its MMA)
            "global loads": dict(Counter(re.findall(r"ld\.global[.a-z0-9]*", ptx))),
            "registers": int(registers.group(1)) if registers else None,
            "spills": "spill stores" in report and not re.search(r" 0 bytes spill stores", report),
            "shared KiB": kernel.metadata.shared / 1024,
            "warnings": sorted(set(re.findall(r"\((C\d+)\) ([^']*?) in the function", report)))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m perf.kernel_asm", description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--shape", type=int, nargs=2, default=[6144, 4096], metavar=("N", "K"))
    parser.add_argument("--w8a8", action="store_true", help="E4M3 inputs with row scales (default: bf16 inputs)")
    args = parser.parse_args(argv)
    for m in args.rows:
        c = default_config(m, *args.shape)
        for config in (c, swapped(c)):
            print(f"rows {m}: {config}: {inspect_config(config, w8a8=args.w8a8)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
