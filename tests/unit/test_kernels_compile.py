"""Every Triton kernel compiles for Hopper (sm_90), here on the CPU.

The other kernel tests run in Triton's interpreter, which accepts code the compiler refuses: a GEMV with a `return`
inside an `if` passed them all and failed to compile on the H200. `triton.compile` runs the real compiler
(to PTX and a cubin, with Triton's own ptxas) without a GPU. It runs in a child process: this one imported the
kernels under TRITON_INTERPRET (tests/conftest.py), which makes them interpreter functions. Pointers are marked
16-byte aligned and strides multiples of 16, as Triton specializes them at launch for torch's allocations, so the code
compiled is the code that runs (unaligned, every bf16 load would be a scalar one).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

GEMV_POINTERS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "w_scale_ptr": "*fp32",
                 "x_scale_ptr": "*fp32", "bias_ptr": "*bf16", "res_ptr": "*bf16", "partial_ptr": "*fp32",
                 "lock_ptr": "*i32"}


LORA_POINTERS = {"perm_ptr": "*i64", "tiles_ptr": "*i64", "weights_ptr": "*fp32", "tile_count_ptr": "*i64",
                 "xa_ptr": "*fp32"}


def gemv(fp8: bool, quantized: bool, split_k: int, pdl: bool, residual: bool, gated: bool = False) -> tuple:
    return ("backends.llm.gemv", "_gemv_kernel", {**GEMV_POINTERS, "w_ptr": "*fp8e4nv" if fp8 else "*bf16"},
            {"N": "i32"}, dict(K=4096, FP8=fp8, QUANTIZED=quantized, STATIC=False, HAS_BIAS=False,
                               RESIDUAL=residual, GATED=gated, EVEN=True, BLOCK_N=8, BLOCK_K=1024, SPLIT_K=split_k,
                               ITERS=4 // split_k, UNROLL=1, PDL=pdl))


def prepare(norm: bool, quantize: bool, static: bool) -> tuple:
    return ("backends.llm.gemv", "_prepare_kernel", {"x_ptr": "*bf16", "out_ptr": "*bf16", "scale_ptr": "*fp32",
                                                     "norm_ptr": "*bf16"}, {"eps": "fp32"},
            dict(K=4096, NORM=norm, QUANTIZE=quantize, STATIC=static, BLOCK=4096, PDL=True))


def partition(fp8_cache: bool) -> tuple:
    cache = "*u8" if fp8_cache else "*bf16"
    strides = ("stride_qb", "stride_qh", "stride_kb", "stride_kt", "stride_kh", "stride_tb", "partitions")
    return ("backends.llm.paged_decode", "_partition_kernel",
            {"q_ptr": "*bf16", "k_ptr": cache, "v_ptr": cache, "tables_ptr": "*i32", "lengths_ptr": "*i32",
             "acc_ptr": "*fp32", "stats_ptr": "*fp32", "counters_ptr": "*i32", "out_ptr": "*bf16"},
            {"scale": "fp32", **{name: "i32" for name in strides}},
            dict(GROUP=4, GROUP_PAD=16, HEAD_DIM=128, HEAD_PAD=128, BLOCK_SIZE=16, TOKENS=32, FP8=fp8_cache,
                 PRECISION="tf32", PARTITIONS_PAD=4))


CASES = {
    "gemv-bf16": gemv(False, False, 1, True, False),  # the batch-1 bf16 projection
    "gemv-bf16-split-residual": gemv(False, False, 2, True, True),  # split K, residual add
    "gemv-fp8-split-residual": gemv(True, False, 2, True, True),  # FP8 weights only
    "gemv-w8a8": gemv(True, True, 1, False, False),  # FP8 weights and per-token FP8 inputs
    "gemv-gated": gemv(False, False, 1, True, False, True),  # SiLU(gate) * up of gate_up
    "gemv-fp8-gated-split": gemv(True, False, 2, True, False, True),
    "prepare-norm": prepare(True, False, False),
    "prepare-quantize": prepare(False, True, False),
    "prepare-norm-static": prepare(True, True, True),
    "paged-partition": partition(False),
    "paged-partition-fp8-cache": partition(True),
    "fp8-weight-gemm": ("backends.llm.fp8_gemm", "_fp8_weight_gemm_kernel",
                        {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "bias_ptr": "*fp32",
                         "out_ptr": "*bf16", "x_scale_ptr": "*fp32", "partial_ptr": "*fp32", "lock_ptr": "*i32"},
                        {"M": "i32", "N": "i32", "K": "i32", "ITERS": "i32"},
                        dict(HAS_BIAS=False, IEEE=False, SPLIT_K=1, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, STAGES=4,
                             SWAP=False, X_SCALED=False)),
    "fp8-weight-gemm-split": ("backends.llm.fp8_gemm", "_fp8_weight_gemm_kernel",  # partial sums added in the kernel
                              {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "bias_ptr": "*fp32",
                               "out_ptr": "*bf16", "x_scale_ptr": "*fp32", "partial_ptr": "*fp32",
                               "lock_ptr": "*i32"}, {"M": "i32", "N": "i32", "K": "i32", "ITERS": "i32"},
                              dict(HAS_BIAS=True, IEEE=False, SPLIT_K=4, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64,
                                   STAGES=4, SWAP=False, X_SCALED=False)),
    "rope-cache-write": ("backends.llm.rope_cache", "_rope_write_kernel",
                         {"qkv_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "slots_ptr": "*i64",
                          "q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16"}, {"stride_t": "i32"},
                         dict(HEADS=32, KV_HEADS=8, HEAD_DIM=128)),
    "lora-shrink": ("backends.llm.lora_kernels", "_shrink_kernel", {**LORA_POINTERS, "x_ptr": "*bf16", "a_ptr": "*bf16"},
                    {"rows_total": "i32", "stride_x": "i32"},
                    dict(K=4096, R=16, SLOTS=64, PARTS=3, SPLITS=4, MIXED=2, BM=16, R_PAD=16, BK=128, K_SPLIT=1024,
                         PRECISION="tf32", PDL=True)),
    "lora-expand": ("backends.llm.lora_kernels", "_expand_kernel",  # software-pipelined: see PIPELINED
                    {**LORA_POINTERS, "b_ptr": "*bf16", "out_ptr": "*bf16"}, {"rows_total": "i32", "stride_out": "i32"},
                    dict(W0=4096, W1=1024, W2=1024, R=16, PARTS=3, SPLITS=4, MIXED=2, BM=16, R_PAD=16, BN=256, CHUNK=4,
                         STAGES=3, PRECISION="tf32", PDL=True)),
}

# kernels whose loops must copy through shared memory (cp.async): what they were written for
PIPELINED = ("lora-shrink", "lora-expand")


def compile_all() -> dict[str, str]:
    """(In the child) each case's outcome: "ok", or the compiler's error."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = {}
    for name, (module, kernel, pointers, scalars, constants) in CASES.items():
        signature = {**pointers, **scalars, **{key: "constexpr" for key in constants}}
        try:
            fn = getattr(importlib.import_module(module), kernel)
            strides = [arg for arg in scalars if arg.startswith("stride")]
            aligned = {(fn.arg_names.index(arg),): [["tt.divisibility", 16]] for arg in [*pointers, *strides]}
            compiled = triton.compile(ASTSource(fn, signature, constants, aligned), target=GPUTarget("cuda", 90, 32))
            ptx = compiled.asm["ptx"]
            ok = ".target sm_90" in ptx and len(compiled.asm["cubin"]) > 0
            results[name] = "ok" if ok else "no sm_90 PTX or cubin"
            if ok and name in PIPELINED and "cp.async" not in ptx:
                results[name] = "no cp.async: the loop's loads were not pipelined through shared memory"
        except Exception as e:  # noqa: BLE001  (reported per case)
            results[name] = f"{type(e).__name__}: {e}"
    return results


@pytest.fixture(scope="module")
def outcomes() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, "-c", "import json; from tests.unit.test_kernels_compile import "
                            "compile_all; print(json.dumps(compile_all()))"],
                           env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_for_hopper(outcomes, case):
    assert outcomes[case] == "ok", outcomes[case]
