"""Compile the skinny-GEMM Triton kernels for one GPU architecture on this machine (Triton ships
ptxas) and check what the PTX must contain. Run as `python compile_cases.py 90|100`; the CPU
suite runs it in a child process, because under TRITON_INTERPRET=1 kernels cannot compile."""

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from glm5_kernels.gemm.triton_skinny import (
    bf16_gemm_kernel,
    fp8_gemm_kernel,
    quantize_tokens_kernel,
)

# Pointers and the sizes Triton sees divisible by 16 at real shapes (it specializes on that).
ALIGNED = {"N", "K", "stride_xm", "stride_om"}
INTS = {n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_om", "K_TILES")}
COMMON = {"INTERPRETER": False, "PDL": True, "PREFETCH": 4}


def _compile(kernel, types: dict, constexprs: dict, arch: int, **options) -> str:
    names = kernel.arg_names
    signature = {n: ("constexpr" if n in constexprs else types[n]) for n in names}
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]]
        for n in names
        if n in ALIGNED or types.get(n, "").startswith("*")
    }
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options).asm["ptx"]


def bf16_cases(arch: int) -> int:
    n = 0
    for bm, split in ((16, 1), (64, 4)):
        types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32"}
        types |= {"count_ptr": "*i32", **INTS}
        constexprs = {"BM": bm, "BN": 64, "BK": 128, "SPLIT_K": split, "EVEN_K": True, **COMMON}
        ptx = _compile(bf16_gemm_kernel, types, constexprs, arch, num_warps=4, num_stages=4)
        if arch == 90:  # tensor cores, pipelined weight loads, programmatic dependent launch
            for needed in ("wgmma", "cp.async", "griddepcontrol.wait"):
                assert needed in ptx, f"bf16 BM={bm} split={split}: no {needed} in the PTX"
        n += 1
    return n


def fp8_cases(arch: int) -> int:
    n = 0
    # The quantize-first GEMM also as the MLP's gate_up (unreduced FP32 partials out), whose
    # consumer is the SwiGLU quantization summing those partials.
    for x_fp8, swiglu, e8m0 in ((False, False, False), (False, True, True), (True, False, False)):
        types = {"x_ptr": "*fp8e4nv" if x_fp8 else "*bf16", "xs_ptr": "*fp32"}
        types |= {"w_ptr": "*fp8e4nv", "ws_ptr": "*u8" if e8m0 else "*fp32"}
        types |= {"out_ptr": "*fp32" if x_fp8 else "*bf16", "part_ptr": "*fp32"}
        types |= {"count_ptr": "*i32", "limit": "fp32"}
        constexprs = {"BM": 32, "BN": 64, "SPLIT_K": 3, "KB": 2, "UE8M0": e8m0}
        constexprs["SCALE_E8M0"] = e8m0
        constexprs |= {"SWIGLU": swiglu, "X_FP8": x_fp8, "PARTIALS": x_fp8, **COMMON}
        ptx = _compile(fp8_gemm_kernel, types | INTS, constexprs, arch, num_warps=4, num_stages=4)
        if arch == 90:
            assert "wgmma" in ptx and "e4m3" in ptx, f"fp8 x_fp8={x_fp8}: no FP8 wgmma"
        for parts in (0, 3) if swiglu else (0,):
            types = {"x_ptr": "*fp32" if parts else "*bf16", "q_ptr": "*fp8e4nv"}
            types |= {"s_ptr": "*fp32", "M": "i32", "K": "i32", "stride_xm": "i32"}
            types["limit"] = "fp32"
            constexprs = {"GROUPS": 8, "UE8M0": e8m0, "SWIGLU": swiglu, "PARTS": parts}
            constexprs |= COMMON
            constexprs.pop("PREFETCH")
            _compile(quantize_tokens_kernel, types, constexprs, arch, num_warps=4)
            n += 1
        n += 1
    return n


if __name__ == "__main__":
    arch = int(sys.argv[1])
    print(f"sm{arch}: compiled {bf16_cases(arch) + fp8_cases(arch)} kernels")
