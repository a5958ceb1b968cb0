"""The KDA decode step as two launches, for steps with many heads x tokens.

The one-launch kernel (`triton_kda.kda_decode_kernel`) computes every token's conv, norms and
gates in each CTA that holds a slice of the head's state: at a few heads x tokens that saves
a launch, at many it costs. Each slice recomputes the head's q / k conv, and the step's
[T, K] tiles (tokens spread over the warps) reach the recurrence through cross-warp
reductions: at a verify of 4 tokens on a whole head, 255 registers, ~1,400 shuffles and
~100 barriers a CTA (the SM90 build), too few CTAs in flight to keep HBM busy. Here:

- `kda_inputs_kernel`, a CTA per (request, head): the short conv of the head's q / k / v
  channels (BF16 out, as the model rounds), the L2 norms, the forget gate's decay and beta —
  the same device functions as the one-launch kernel, so the same values — stored FP32 for
  the recurrence, the conv state's new window, and (RF / RG > 0) the gates' low-rank
  up-projections. It releases its dependent at once.
- `kda_recurrence_kernel`, a CTA per (request, head, BV rows of V): its [BV, K] slice of the
  state is read *before* the PDL wait (this layer's previous step wrote it, and every kernel
  since has completed: the inputs kernel waited on them before it released this one), so
  the step's largest read runs under the inputs kernel. Then per token: that token's vectors
  (each a [1, K] row in the state's own layout: no conversion, no barrier; the next token's
  requested before this one's state is stored), the delta rule, the state stored (a verify
  keeps every token's), o out. A whole head normalizes each token from registers; a split
  head hands the norm to its last CTA (`norm_head`, as the one-launch kernel does).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from glm5_kernels.kda.triton_kda import (
    arrive_last,
    low_rank_up,
    new_windows,
    norm_head,
    token_inputs,
)
from glm5_kernels.triton_primitives import narrow, round_bf16, torch_sigmoid


@triton.jit
def kda_inputs_kernel(
    qkv_ptr, f_ptr, b_ptr, gate_ptr, conv_ptr,  # token rows r * T + t; the conv state
    conv_w_ptr, dt_bias_ptr, a_log_ptr, fb_ptr, gb_ptr,
    conv_slot_ptr, conv_off_ptr,
    q_ptr, k_ptr, decay_ptr, v_ptr, beta_ptr, gbuf_ptr,  # FP32 out: [R*T, H, K | V], [R*T, H]
    stride_qkv, stride_f, stride_b, stride_g, stride_cs, stride_cc,
    H, q_scale, lower_bound,
    T: tl.constexpr, TP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    NCP: tl.constexpr, KEEP: tl.constexpr, HAS_LB: tl.constexpr, RF: tl.constexpr,
    RG: tl.constexpr, X8: tl.constexpr, INTERPRETER: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    r, h = tl.program_id(0), tl.program_id(1)
    kk, vv, tt = tl.arange(0, K), tl.arange(0, V), tl.arange(0, TP)
    cq, ck, cv = h * K + kk, H * K + h * K + kk, 2 * H * K + h * V + vv
    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt = tl.load(dt_bias_ptr + h * K + kk).to(tl.float32)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()  # the recurrence's state read overlaps this whole kernel
    conv_row = conv_ptr + tl.load(conv_slot_ptr + r).to(tl.int64) * stride_cs
    offset = tl.load(conv_off_ptr + r)
    row0 = r * T
    rows, live = row0 + tt, tt < T
    new_q, new_k, new_v, dst, n_cols, cols = new_windows(
        conv_row, qkv_ptr, cq, ck, cv, offset, stride_cc, stride_qkv, row0, T, W, NCP, KEEP
    )
    q, k, v, decay, beta = token_inputs(
        conv_row, qkv_ptr, conv_w_ptr, f_ptr, fb_ptr, b_ptr, tt, h, cq, ck, cv, kk, offset,
        stride_cc, stride_qkv, stride_f, stride_b, row0, dt, a, q_scale, lower_bound, T, TP, K,
        W, HAS_LB, RF, X8, INTERPRETER)  # fmt: skip
    at_k = (rows[:, None] * H + h) * K + kk[None, :]
    tl.store(q_ptr + at_k, q, mask=live[:, None])
    tl.store(k_ptr + at_k, k, mask=live[:, None])
    tl.store(decay_ptr + at_k, decay, mask=live[:, None])
    tl.store(v_ptr + (rows[:, None] * H + h) * V + vv[None, :], v, mask=live[:, None])
    tl.store(beta_ptr + rows * H + h, beta, mask=live)
    if RG > 0:
        g = low_rank_up(gate_ptr, stride_g, gb_ptr, row0, T, h * V, TP, V, RG, X8, INTERPRETER)
        tl.store(gbuf_ptr + rows[:, None] * (H * V) + h * V + vv[None, :], g, mask=live[:, None])
    tl.debug_barrier()  # a column written may be one another thread reads
    at = conv_row + dst[:, None] * stride_cc
    keep_cols = cols[:, None] < n_cols
    tl.store(at + cq[None, :], new_q, mask=keep_cols & (cq[None, :] >= 0))
    tl.store(at + ck[None, :], new_k, mask=keep_cols & (ck[None, :] >= 0))
    tl.store(at + cv[None, :], new_v, mask=keep_cols & (cv[None, :] >= 0))


@triton.jit
def _token(q_ptr, k_ptr, decay_ptr, v_ptr, beta_ptr, row, h, H, kk, vv, K: tl.constexpr,
           V: tl.constexpr, NW: tl.constexpr):  # fmt: skip
    """Token row `row`'s q, k, decay ([1, NW, K]: each warp reads the row itself, so it
    lands in the state's own layout), v ([M, NW, 1]) and beta of head h."""
    at = (row * H + h) * K + (tl.arange(0, NW) * 0)[None, :, None] + kk
    return (tl.load(q_ptr + at), tl.load(k_ptr + at), tl.load(decay_ptr + at),
            tl.load(v_ptr + (row * H + h) * V + vv[:, :, None]),
            tl.load(beta_ptr + row * H + h))  # fmt: skip


@triton.jit
def kda_recurrence_kernel(
    q_ptr, k_ptr, decay_ptr, v_ptr, beta_ptr, gbuf_ptr,  # the inputs kernel's
    gate_ptr, out_ptr, rec_ptr, norm_w_ptr, read_slot_ptr, write_slot_ptr,
    part_ptr, count_ptr,  # [R*T, H, NV] FP32 sums of squares; [R*H] int32 zeros
    stride_g, stride_out, stride_rs, H, eps,
    T: tl.constexpr, TP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    NW: tl.constexpr, KEEP: tl.constexpr, RG: tl.constexpr, INTERPRETER: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # The slice's BV rows as [M, NW, K] (row m * NW + w in warp w): the token vectors each
    # warp reads itself broadcast over m in registers and every sum over K stays in a warp.
    NV: tl.constexpr = V // BV
    M: tl.constexpr = BV // NW
    r, h, jv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kk = tl.arange(0, K)[None, None, :]
    vv = jv * BV + tl.arange(0, M)[:, None] * NW + tl.arange(0, NW)[None, :]  # [M, NW]
    state_at = h * (V * K) + vv[:, :, None] * K + kk
    s = tl.load(rec_ptr + tl.load(read_slot_ptr + r).to(tl.int64) * stride_rs + state_at)
    norm_w = tl.load(norm_w_ptr + vv).to(tl.float32)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    row0 = r * T
    out_at = out_ptr + row0 * stride_out + h * V
    nq, nk, nd, nv, nb = _token(q_ptr, k_ptr, decay_ptr, v_ptr, beta_ptr, row0, h, H, kk, vv,
                                K, V, NW)  # fmt: skip
    for t in tl.static_range(T):
        q_t, k_t, d_t, v_t, b_t = nq, nk, nd, nv, nb
        if t + 1 < T:  # the next token's, in flight while this one's state is stored
            nq, nk, nd, nv, nb = _token(q_ptr, k_ptr, decay_ptr, v_ptr, beta_ptr, row0 + t + 1,
                                        h, H, kk, vv, K, V, NW)  # fmt: skip
        s = s * d_t
        delta = (v_t - tl.sum(s * k_t, axis=2)[:, :, None]) * b_t
        s = s + delta * k_t
        o = round_bf16(tl.sum(s * q_t, axis=2), INTERPRETER)  # [M, NW], the model dtype
        if KEEP:
            slot = tl.load(write_slot_ptr + r * T + t).to(tl.int64)
            keep = (tl.zeros([M, NW, K], tl.int64) + slot) >= 0
            tl.store(rec_ptr + slot * stride_rs + state_at, s, mask=keep)
        at = out_at + t * stride_out + vv
        if NV == 1:  # the whole head here: this token's norm from registers
            if RG > 0:
                gate = tl.load(gbuf_ptr + (row0 + t) * (H * V) + h * V + vv)
            else:
                gate = tl.load(gate_ptr + (row0 + t) * stride_g + h * V + vv).to(tl.float32)
            rms = tl.sqrt_rn(tl.sum(tl.sum(o * o, axis=1), axis=0) / V + eps)
            y = norm_w * (o / rms) * torch_sigmoid(gate, INTERPRETER)
            tl.store(at, narrow(y, tl.bfloat16, INTERPRETER))
        else:
            tl.store(at, narrow(o, tl.bfloat16, INTERPRETER))
            tl.store(part_ptr + ((row0 + t) * H + h) * NV + jv,
                     tl.sum(tl.sum(o * o, axis=1), axis=0))  # fmt: skip
    if not KEEP:
        slot = tl.load(write_slot_ptr + r * T + T - 1).to(tl.int64)
        keep = (tl.zeros([M, NW, K], tl.int64) + slot) >= 0
        tl.store(rec_ptr + slot * stride_rs + state_at, s, mask=keep)
    if NV > 1:  # noqa: SIM102 (a compile-time branch, then a run-time one)
        if arrive_last(count_ptr + r * H + h, NV):
            tt = tl.arange(0, TP)
            rows = row0 + tt
            norm_head(out_ptr + rows[:, None] * stride_out + h * V, rows, tt < T, h,
                      part_ptr + (rows * H + h) * NV, gate_ptr, gbuf_ptr, norm_w_ptr, stride_g,
                      H, eps, TP, V, NV, RG, INTERPRETER)  # fmt: skip
