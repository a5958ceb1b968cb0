"""The MLA layer's input norms and latent write in one launch (`latent.LatentWrite`): a CTA
per token row reads its q_a | kv_a row of the fused projection's output, RMSNorms each half
and stores q_a's as the query's low-rank input and kv_a's into the latent cache slot.

Numerics are `rms_norm_ref`'s: FP32 sum of squares, the normed row rounded to BF16, then the
BF16 weight multiply rounded again (both products exact in FP32, so only the sum's order and
the root can differ from torch's). Under PDL the norm weights are read before the wait
(they do not depend on the predecessor); the row and its slot after it."""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from glm5_kernels.triton_primitives import narrow, round_bf16


@triton.jit
def _normed(x, w, D: tl.constexpr, eps, INTERPRETER: tl.constexpr):
    """rms_norm_ref of a row x [B] FP32 (zeros past D) with weight w: BF16 values in FP32."""
    rms = tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
    return narrow(round_bf16(x / rms, INTERPRETER) * w, tl.bfloat16, INTERPRETER)


@triton.jit
def latent_write_kernel(
    x_ptr,  # [N, >= Q + L] BF16: q_a | kv_a per row (row stride stride_x, unit columns)
    q_w_ptr, kv_w_ptr,  # [Q], [L] BF16: q_a_layernorm, kv_a_layernorm
    slot_ptr,  # [N] int64, stride stride_s: each row's latent slot (-1: padding, not written)
    q_ptr,  # [N, Q] BF16 out: the normed q_a
    latent_ptr,  # [slots, L] BF16, written at the rows' slots
    stride_x, stride_s, eps,
    Q: tl.constexpr, L: tl.constexpr, BQ: tl.constexpr, BL: tl.constexpr,
    INTERPRETER: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cq, cl = tl.arange(0, BQ), tl.arange(0, BL)
    wq = tl.load(q_w_ptr + cq, mask=cq < Q, other=0.0).to(tl.float32)
    wl = tl.load(kv_w_ptr + cl, mask=cl < L, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
    at = x_ptr + row * stride_x
    q = tl.load(at + cq, mask=cq < Q, other=0.0).to(tl.float32)
    kv = tl.load(at + Q + cl, mask=cl < L, other=0.0).to(tl.float32)
    slot = tl.load(slot_ptr + row * stride_s)
    if PDL:
        gdc_launch_dependents()
    tl.store(q_ptr + row * Q + cq, _normed(q, wq, Q, eps, INTERPRETER), mask=cq < Q)
    # vLLM's padding rows have slot -1: nothing written (its concat_and_cache_mla skips them).
    if slot >= 0:
        tl.store(latent_ptr + slot * L + cl, _normed(kv, wl, L, eps, INTERPRETER), mask=cl < L)
