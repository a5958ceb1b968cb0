"""Triton skinny GEMMs for decode: y[M, N] = x[M, K] @ w[N, K]ᵀ with M <= 64.

Weight streaming is the whole cost at these M, so the kernels are laid out for it:
  * swap-AB: a CTA owns BN output columns and computes accᵀ [BN, BM] = w_tile @ x_tileᵀ, so the
    wide weight tile is the MMA's M side and the handful of tokens pads only to BM = 16..64;
  * split-K over a second grid axis when N alone gives too few CTAs to keep every SM's loads
    in flight; the last CTA of a column tile to finish (an acq_rel counter per tile, reset by
    that CTA, so a CUDA graph replays it) sums the FP32 partials in split order — one launch,
    deterministic. Its release, atomic and partial loads cost 1.2-3.3 us on the H200, so
    where the consumer is ours (the MLP's SwiGLU quantization) the FP8 GEMM stores the
    partials unreduced instead (PARTIALS) and the consumer sums them in the same order;
  * weight rows past N are clamped onto the last valid row instead of masked, so every
    weight load is an unmasked full tile; activation rows past M are masked instead: clamped,
    every padded row of every CTA would re-read the same few L2 lines each K step, and at
    M = 1 those hot lines cost a quarter of the bandwidth (measured 67 -> 87 % of HBM on a
    50 MB weight at M = 1 on the H200). Only valid rows are stored.
  * programmatic dependent launch (PDL): a kernel is launched while its predecessor drains,
    prefetches the first PREFETCH 128-byte lines of each of its weight rows into L2 (weights
    never depend on the predecessor), and only then waits for the predecessor's outputs; it
    lets its own successor launch once its main loop is done. This hides most of the ~4 us
    launch-and-ramp cost that otherwise dominates a 2-30 MB weight read.
The FP8 kernel quantizes each 1×128 activation group in registers (the per-token scale of
vLLM's per_token_group_quant_fp8, UE8M0 optional), runs an e4m3 MMA per 128-wide K block and
applies both scales in FP32; with SWIGLU its input is the gate_up output [M, 2K] and the
clamped SwiGLU (rounded to BF16, as the stock sequence stores it) is formed on the fly.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from glm5_kernels.triton_primitives import (
    await_inputs,
    load_weight_scales,
    narrow,
    quantize_groups,
)

# INTERPRETER (constexpr): true only under TRITON_INTERPRET=1, where the BF16 dot runs on FP32
# upcasts and narrowing casts are rounded first (glm5_kernels.triton_primitives says why).


@triton.jit
def _finish(acc, out_ptr, part_ptr, count_ptr, M, N, stride_om,
            BM: tl.constexpr, BN: tl.constexpr, SPLIT_K: tl.constexpr,
            INTERPRETER: tl.constexpr, PARTIALS: tl.constexpr,
            ROUND_BF16: tl.constexpr = False):  # fmt: skip
    """Store accᵀ [BN, BM] into out[M, N], through the split-K fixup when SPLIT_K > 1; with
    PARTIALS, into out[split, M, N] (FP32) instead, for a consumer that sums the splits.
    ROUND_BF16: FP32 out holding the BF16-rounded sums (a BF16 GEMM's output, widened)."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    if PARTIALS:
        tl.store(out_ptrs + tl.program_id(1) * M * stride_om, acc, mask=mask)
    elif SPLIT_K == 1:
        if ROUND_BF16:
            acc = narrow(acc, tl.bfloat16, INTERPRETER).to(tl.float32)
        tl.store(out_ptrs, narrow(acc, out_ptr.dtype.element_ty, INTERPRETER), mask=mask)
    else:
        tiles = tl.num_programs(0)
        tile = tl.arange(0, BN)[:, None] * BM + tl.arange(0, BM)[None, :]
        tl.store(part_ptr + (tl.program_id(1) * tiles + pid_n) * BN * BM + tile, acc)
        # Every thread's partial is stored before the one thread issuing the release.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BN, BM], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                # .cg: L1 is not coherent across SMs; the other partials live in L2.
                p = part_ptr + (s * tiles + pid_n) * BN * BM + tile
                total += tl.load(p, cache_modifier=".cg")
            if ROUND_BF16:
                total = narrow(total, tl.bfloat16, INTERPRETER).to(tl.float32)
            tl.store(out_ptrs, narrow(total, out_ptr.dtype.element_ty, INTERPRETER), mask=mask)
            tl.atomic_xchg(count_ptr + pid_n, 0)


@triton.jit(do_not_specialize=["M"])
def bf16_gemm_kernel(
    x_ptr,  # [M, (N / n_block) K] BF16, row stride stride_xm, unit column stride
    w_ptr,  # [N, K] BF16, k-major
    out_ptr,  # [M, N] BF16 or FP32, row stride stride_om
    part_ptr,  # [SPLIT_K, tiles, BN, BM] FP32 partials (unused when SPLIT_K == 1)
    count_ptr,  # [tiles] int32, zero between launches
    M, N, K, stride_xm, stride_om,
    K_TILES,  # BK tiles per split
    n_block,  # output columns a block: column n reads x's K columns from (n // n_block) K
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, INTERPRETER: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr, ROUND_BF16: tl.constexpr = False,
    THEN: tl.constexpr = False,  # a second weight: rows n_first.. at w2_off elements from w_ptr
    w2_off=0, n_first=0,
):  # fmt: skip
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    offs_k = tl.arange(0, BK)
    rows = tl.minimum(offs_n, N - 1)
    if THEN:  # a tile never straddles the two (the host checks n_first % BN == 0)
        w_rows = w_ptr + tl.where(rows < n_first, rows.to(tl.int64) * K,
                                  w2_off + (rows - n_first).to(tl.int64) * K)  # fmt: skip
    else:
        w_rows = w_ptr + rows * K
    w_ptrs = w_rows[:, None] + offs_k[None, :]
    x_block = x_ptr + (tl.program_id(0) * BN // n_block) * K  # BN divides n_block (the host)
    x_ptrs = x_block + tl.minimum(offs_m, M - 1)[:, None] * stride_xm + offs_k[None, :]
    x_rows = offs_m[:, None] < M
    k_lo = tl.program_id(1) * K_TILES * BK
    k_hi = tl.minimum(k_lo + K_TILES * BK, K)
    await_inputs(w_rows, k_lo, K, 64, PDL, PREFETCH)
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k in range(k_lo, k_hi, BK):
        if EVEN_K:
            w = tl.load(w_ptrs + k)
            x = tl.load(x_ptrs + k, mask=x_rows, other=0.0)
        else:
            in_k = (k + offs_k)[None, :] < K
            w = tl.load(w_ptrs + k, mask=in_k, other=0.0)
            x = tl.load(x_ptrs + k, mask=in_k & x_rows, other=0.0)
        if INTERPRETER:
            w, x = w.to(tl.float32), x.to(tl.float32)
        acc = tl.dot(w, tl.trans(x), acc)
    if PDL:
        gdc_launch_dependents()
    _finish(acc, out_ptr, part_ptr, count_ptr, M, N, stride_om, BM, BN, SPLIT_K, INTERPRETER, False,
            ROUND_BF16)  # fmt: skip


@triton.jit
def _load_input(ptrs, rows, PARTS: tl.constexpr, split_stride, INTERPRETER: tl.constexpr):
    """FP32 values at ptrs: BF16 input, or (PARTS > 0) the BF16 rounding of the sum of PARTS
    FP32 split-K partials split_stride apart, in split order (the fixup's order and rounding,
    so the same bits as a GEMM that reduced its own splits)."""
    if PARTS == 0:
        return tl.load(ptrs, mask=rows, other=0.0).to(tl.float32)
    total = tl.load(ptrs, mask=rows, other=0.0)
    for s in tl.static_range(1, PARTS):
        total += tl.load(ptrs + s * split_stride, mask=rows, other=0.0)
    return narrow(total, tl.bfloat16, INTERPRETER).to(tl.float32)


@triton.jit
def _activation(x_ptrs, rows, K, limit, SWIGLU: tl.constexpr, INTERPRETER: tl.constexpr,
                PARTS: tl.constexpr, split_stride):  # fmt: skip
    """The FP32 activation group at x_ptrs (zero where `rows` is false): x, or SwiGLU(gate at
    x_ptrs, up K columns on), rounded to BF16 as the stock sequence stores it."""
    if SWIGLU:
        gate = _load_input(x_ptrs, rows, PARTS, split_stride, INTERPRETER)
        gate = tl.minimum(gate, limit)
        up = _load_input(x_ptrs + K, rows, PARTS, split_stride, INTERPRETER)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        return narrow(gate * tl.sigmoid(gate) * up, tl.bfloat16, INTERPRETER).to(tl.float32)
    return _load_input(x_ptrs, rows, PARTS, split_stride, INTERPRETER)


@triton.jit(do_not_specialize=["M"])
def quantize_tokens_kernel(
    x_ptr,  # [M, K] BF16 (SWIGLU: [M, 2K] gate_up output; PARTS: [PARTS, M, .] FP32 partials)
    q_ptr,  # [M, K] float8_e4m3fn, contiguous
    s_ptr,  # [M, K/128] FP32, contiguous
    M, K, stride_xm, limit,
    GROUPS: tl.constexpr,  # 128-wide groups per program
    UE8M0: tl.constexpr, SWIGLU: tl.constexpr, INTERPRETER: tl.constexpr, PDL: tl.constexpr,
    PARTS: tl.constexpr = 0,
):  # fmt: skip
    """Per-token 1x128 FP8 quantization once per token, for GEMMs whose many column tiles
    would otherwise each redo it. With PARTS, the input is the unreduced split-K output of
    the producing GEMM (the MLP's gate_up): summing it here spares that GEMM its fixup."""
    row = tl.program_id(0)
    groups = tl.minimum(tl.program_id(1) * GROUPS + tl.arange(0, GROUPS), K // 128 - 1)
    cols = groups[:, None] * 128 + tl.arange(0, 128)[None, :]
    if PDL:
        gdc_wait()
    x = _activation(
        x_ptr + row * stride_xm + cols, True, K, limit, SWIGLU, INTERPRETER, PARTS, M * stride_xm
    )
    xq, sx = quantize_groups(x, UE8M0, INTERPRETER)
    if PDL:
        gdc_launch_dependents()
    # Groups past the end were clamped onto the last one: they store the same values again.
    tl.store(q_ptr + row * K + cols, xq)
    tl.store(s_ptr + row * (K // 128) + groups, sx)


@triton.jit(do_not_specialize=["M"])
def fp8_gemm_kernel(
    x_ptr,  # [M, K] BF16 (SWIGLU: gate_up [M, 2K]; X_FP8: e4m3 codes [M, K])
    xs_ptr,  # X_FP8: [M, K/128] FP32 activation scales, contiguous (else unused)
    w_ptr,  # [N, K] float8_e4m3fn, k-major
    ws_ptr,  # [⌈N/128⌉, K/128] FP32, or uint8 UE8M0 exponents (SCALE_E8M0)
    out_ptr,  # [M, N] BF16 or FP32
    part_ptr, count_ptr,  # split-K partials and counters, as in bf16_gemm_kernel
    M, N, K, stride_xm, stride_om, K_TILES, limit,
    BM: tl.constexpr, BN: tl.constexpr, SPLIT_K: tl.constexpr, KB: tl.constexpr,
    UE8M0: tl.constexpr, SCALE_E8M0: tl.constexpr, SWIGLU: tl.constexpr, X_FP8: tl.constexpr,
    INTERPRETER: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
    PARTIALS: tl.constexpr = False,  # out: [SPLIT_K, M, N] FP32 partials, no fixup
):  # fmt: skip
    BK: tl.constexpr = 128  # one weight scale per 128-wide K block
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    rows_m = tl.minimum(tl.arange(0, BM), M - 1)
    x_rows = tl.arange(0, BM) < M  # padded rows masked, as in bf16_gemm_kernel
    offs_k = tl.arange(0, BK)
    rows_n = tl.minimum(offs_n, N - 1)
    w_ptrs = w_ptr + rows_n[:, None] * K + offs_k[None, :]
    x_ptrs = x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :]
    # BN divides 128 and tiles start at multiples of BN, so every row of this tile (the
    # clamped ones too) lies in one 128-row scale block: one weight scale per K block.
    ws_row = ws_ptr + (tl.program_id(0) * BN // BK) * (K // BK)
    xs_rows = xs_ptr + rows_m[:, None] * (K // BK)
    kt_lo = tl.program_id(1) * K_TILES
    kt_hi = tl.minimum(kt_lo + K_TILES, K // BK)
    await_inputs(w_ptr + rows_n * K, kt_lo * BK, K, 128, PDL, PREFETCH)
    # The scales are plain loads (no MMA operand, so Triton does not pipeline them); used in
    # the step that loads them, every step would stall for an L2 round trip (measured on the
    # H200: a 50 MB FP8 GEMM streams at 66 % of HBM so, 74 % without the scale loads). So
    # each step's scales are loaded one step ahead. (The same for the BF16 activations of
    # the in-GEMM quantization was measured no faster: there the quantization math costs.)
    steps = tl.arange(0, KB)
    sw_next = load_weight_scales(ws_row + kt_lo + steps, SCALE_E8M0)
    if X_FP8:
        sx_next = tl.load(xs_rows + kt_lo + steps[None, :], mask=x_rows[:, None], other=0.0)
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    # KB scale blocks per iteration (the plan keeps every split's block count a multiple of
    # KB): an 8 KB FP8 weight tile alone is too little work per pipelined step.
    for kb in range(kt_lo, kt_hi, KB):
        after = tl.minimum(kb + KB, kt_hi - KB)  # the last step reloads its own
        sw_step = sw_next
        sw_next = load_weight_scales(ws_row + after + steps, SCALE_E8M0)
        if X_FP8:
            sx_step = sx_next
            sx_next = tl.load(xs_rows + after + steps[None, :], mask=x_rows[:, None], other=0.0)
        for j in tl.static_range(KB):
            kt = kb + j
            w = tl.load(w_ptrs + kt * BK)
            sw = tl.sum(tl.where(steps == j, sw_step, 0.0), axis=0)
            if X_FP8:
                xq = tl.load(x_ptrs + kt * BK, mask=x_rows[:, None], other=0.0)
                sx = tl.sum(tl.where(steps[None, :] == j, sx_step, 0.0), axis=1)
            else:
                x_kt = x_ptrs + kt * BK
                x = _activation(x_kt, x_rows[:, None], K, limit, SWIGLU, INTERPRETER, 0, 0)
                xq, sx = quantize_groups(x, UE8M0, INTERPRETER)
            acc += tl.dot(w, tl.trans(xq)) * (sx * sw)[None, :]
    if PDL:
        gdc_launch_dependents()
    _finish(
        acc, out_ptr, part_ptr, count_ptr, M, N, stride_om, BM, BN, SPLIT_K, INTERPRETER, PARTIALS
    )
