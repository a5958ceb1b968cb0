"""Triton device functions every op family's kernels call: rounding to the model's dtypes
(`round_nearest`, `narrow`, `round_bf16`), torch's sigmoid (`torch_sigmoid`), vLLM's per-token
1x128 FP8 quantization (`quantize_groups`, `FP8_MAX`), block-scale loads (`load_weight_scales`)
an L2 prefetch (`prefetch_l2`) and the PDL prologue of a weight-streaming kernel
(`await_inputs`).

They live here, owned by no op, because the GEMMs, the MoE stage, the KDA and MLA decodes, the
mHC boundary and glm5-comm's exchanges must all round alike: a value one kernel stores in BF16
is the value the next one reads, bit for bit, and equal to what the stock sequence stores.
Each stays a module-level @triton.jit function, so any kernel inlines it.

INTERPRETER (constexpr, true only under TRITON_INTERPRET=1): the CPU interpreter's tl.dot
multiplies BF16 as raw uint16 bits and its FP32 -> BF16 / e4m3 casts truncate (and mis-carry
when asked to round), so there BF16 dots run on exact FP32 upcasts and every narrowing cast is
rounded to nearest-even in FP32 arithmetic first (`round_nearest`), after which the cast is
exact. Same values as the GPU's instructions, different instructions.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait, libdevice

__all__ = [
    "FP8_MAX",
    "await_inputs",
    "load_weight_scales",
    "narrow",
    "prefetch_l2",
    "quantize_groups",
    "round_bf16",
    "round_nearest",
    "torch_sigmoid",
]

FP8_MAX = tl.constexpr(448.0)  # the largest finite e4m3fn value


@triton.jit
def round_nearest(q, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr):
    """FP32 q -> the nearest value with MANTISSA fraction bits (ties to even), as FP32."""
    e = tl.maximum(((q.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, MIN_EXP)
    step = ((e - MANTISSA + 127) << 23).to(tl.float32, bitcast=True)  # the spacing at q
    return ((q / step + 12582912.0) - 12582912.0) * step  # +-1.5*2^23 rounds to an integer


@triton.jit
def narrow(x, dtype: tl.constexpr, INTERPRETER: tl.constexpr):
    """FP32 -> BF16 / FP32 with round-to-nearest-even on every backend."""
    if INTERPRETER and dtype == tl.bfloat16:
        x = round_nearest(x, 7, -119)  # below 2^-119 the spacing floors at 2^-126
    return x.to(dtype)


@triton.jit
def round_bf16(x, INTERPRETER: tl.constexpr):
    """FP32 -> the nearest BF16 value, kept in FP32 (a model-dtype rounding mid-kernel)."""
    return narrow(x, tl.bfloat16, INTERPRETER).to(tl.float32)


@triton.jit
def torch_sigmoid(x, INTERPRETER: tl.constexpr):
    """1 / (1 + exp(-x)) as torch computes it on CUDA (expf, IEEE division): the same FP32
    scores, so the same choice wherever two experts' scores are near a tie."""
    e = tl.exp(-x) if INTERPRETER else libdevice.exp(-x)  # no libdevice on the interpreter
    return tl.math.div_rn(1.0, 1.0 + e)


@triton.jit
def prefetch_l2(ptrs):
    """Warm L2 with the 128-byte lines at ptrs (a hint: nothing is loaded into registers)."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def quantize_groups(x, UE8M0: tl.constexpr, INTERPRETER: tl.constexpr):
    """x [R, 128] FP32 -> (e4m3 codes [R, 128], FP32 scales [R]), vLLM's per-token-group rule."""
    sx = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) / FP8_MAX
    if UE8M0:  # round up to a power of two: carry any mantissa bit into the exponent
        bits = sx.to(tl.int32, bitcast=True)
        sx = ((bits + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    xq = tl.minimum(tl.maximum(x / sx[:, None], -FP8_MAX), FP8_MAX)
    if INTERPRETER:
        xq = round_nearest(xq, 3, -6)  # e4m3: subnormals below 2^-6
    return xq.to(tl.float8e4nv), sx


@triton.jit
def load_weight_scales(ptrs, SCALE_E8M0: tl.constexpr):
    """FP32 weight scales at ptrs: FP32 values, or UE8M0 exponents (2^(e - 127))."""
    s = tl.load(ptrs)
    if SCALE_E8M0:
        s = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return s


@triton.jit
def await_inputs(w_rows_ptr, k_lo, K, ELEMENTS_PER_LINE: tl.constexpr,
                 PDL: tl.constexpr, PREFETCH: tl.constexpr):  # fmt: skip
    """Under PDL: warm L2 with this CTA's first weight lines, then wait for the predecessor.
    (The successor is released after the main loop: releasing it right after this wait was
    measured 0-30 % slower on the H200 — its CTAs compete for the SMs still streaming.)"""
    if PDL:
        if PREFETCH > 0:
            cols = tl.minimum(k_lo + tl.arange(0, PREFETCH) * ELEMENTS_PER_LINE, K - 1)
            prefetch_l2(w_rows_ptr[:, None] + cols[None, :])
        gdc_wait()
