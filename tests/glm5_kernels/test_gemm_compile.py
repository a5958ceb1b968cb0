"""The skinny-GEMM Triton kernels compile for SM90 (Hopper) and SM100 (Blackwell) on this CPU
(Triton ships ptxas), with the launch options the ops use: catches a kernel that only the
interpreter accepts. On SM90 the MMA must be wgmma and the weight loads pipelined (cp.async),
or the kernels would not stream weights at the rate the benchmarks show.

Under TRITON_INTERPRET=1 (the CPU suite) @triton.jit yields interpreted functions that cannot
be compiled, so each architecture's cases run in a child interpreter without it."""

import os
import subprocess
import sys

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from glm5_kernels.gemm.triton_skinny import (
        bf16_gemm_kernel,
        fp8_gemm_kernel,
        quantize_tokens_kernel,
    )

# Pointers and the sizes Triton sees divisible by 16 at real shapes (it specializes on that).
ALIGNED = {"N", "K", "stride_xm", "stride_om"}


def _compile(kernel, types: dict, constexprs: dict, arch: int, **options):
    names = kernel.arg_names
    signature = {n: ("constexpr" if n in constexprs else types[n]) for n in names}
    attrs = {
        (names.index(n),): [["tt.divisibility", 16]]
        for n in names
        if n in ALIGNED or types.get(n, "").startswith("*")
    }
    src = ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


INTS = {n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_om", "K_TILES")}
COMMON = {"INTERPRETER": False, "PDL": True, "PREFETCH": 4}


@pytest.mark.parametrize("arch", [90, 100], ids=["sm90", "sm100"])
def test_compiles_outside_the_interpreter(arch):
    """The cases below, in a child process where Triton compiles for real."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("this process compiles the cases itself")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", f"sm{arch} and not outside"],  # noqa: E501
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and "skipped" not in child.stdout.splitlines()[-1]


compiled = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1", reason="compiled in a child process"
)


@compiled
@pytest.mark.parametrize("arch", [90, 100], ids=["sm90", "sm100"])
@pytest.mark.parametrize("bm, split", [(16, 1), (64, 4)], ids=["m16", "m64-splitk"])
def test_bf16_kernel_compiles(arch, bm, split):
    types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "part_ptr": "*fp32"}
    types |= {"count_ptr": "*i32", **INTS}
    constexprs = {"BM": bm, "BN": 64, "BK": 128, "SPLIT_K": split, "EVEN_K": True, **COMMON}
    k = _compile(bf16_gemm_kernel, types, constexprs, arch, num_warps=4, num_stages=4)
    if arch == 90:
        assert "wgmma" in k.asm["ptx"] and "cp.async" in k.asm["ptx"]
        assert "griddepcontrol.wait" in k.asm["ptx"]


@compiled
@pytest.mark.parametrize("arch", [90, 100], ids=["sm90", "sm100"])
@pytest.mark.parametrize(
    "x_fp8, swiglu, e8m0", [(False, False, False), (False, True, True), (True, False, False)],
    ids=["fused-quant", "swiglu-ue8m0", "quantized-first"],
)  # fmt: skip
def test_fp8_kernels_compile(arch, x_fp8, swiglu, e8m0):
    types = {"x_ptr": "*fp8e4nv" if x_fp8 else "*bf16", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv"}
    types |= {"ws_ptr": "*u8" if e8m0 else "*fp32", "out_ptr": "*bf16", "part_ptr": "*fp32"}
    types |= {"count_ptr": "*i32", "limit": "fp32", **INTS}
    constexprs = {"BM": 32, "BN": 64, "SPLIT_K": 3, "UE8M0": e8m0, "SCALE_E8M0": e8m0}
    constexprs |= {"SWIGLU": swiglu, "X_FP8": x_fp8, **COMMON}
    k = _compile(fp8_gemm_kernel, types, constexprs, arch, num_warps=4, num_stages=4)
    if arch == 90:
        assert "wgmma" in k.asm["ptx"] and "e4m3" in k.asm["ptx"]
    types = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "limit": "fp32"}
    types |= {"M": "i32", "K": "i32", "stride_xm": "i32"}
    constexprs = {"GROUPS": 8, "UE8M0": e8m0, "SWIGLU": swiglu, "INTERPRETER": False}
    _compile(quantize_tokens_kernel, types, constexprs | {"PDL": True}, arch, num_warps=4)
