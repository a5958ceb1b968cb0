"""Triton kernel of the KDA decode step: short conv, forget gate, beta, L2-normed q / k, the
gated delta rule on the FP32 state and the gated RMSNorm, in one launch.

A CTA per (request, head, BV rows of V) holds its [BV, K] slice of the head's state in
registers for the whole step (S is [V, K]: each row of V evolves on its own, so the slices
never talk): loaded once from the request's read slot, updated token by token, stored after
each token to its write slot (a verify keeps every token's state: vLLM's rollback layout) or
after the last (a decode). Splitting V spreads one request's state over many SMs: a single
SM cannot move a whole 64 KB head fast enough.

Everything that does not depend on the state is computed first, for all T tokens at once
(nothing is loaded after a store, so no load waits behind one): the short conv of the
head's q / k channels and of the CTA's v channels over the W-1 conv-state columns at the
request's offset and the step's inputs (BF16 out, as the model rounds), the L2 norms, the
forget gate and beta. Then per token

    S = diag(exp g) S;  S += beta (v - S k) k^T;  o = S q

and o (BF16) goes to the output rows with its slice's sum of squares. The head's last CTA
to finish (one atomic counter per request and head, reset by it) sums the slices' squares in
slice order and applies the gated RMSNorm  w * o / rms(o) * sigmoid(gate)  over the whole
head, in place. The conv state: a decode overwrites its window, a verify stores its W-2+T
newest inputs from column 0 (accepting n resumes at column n - 1); each CTA stores its v
channels, the last one the q / k channels every slice read. The inputs are the projections'
outputs read as strided rows (vLLM's fused q | k | v | ... rows need no copy).

With RF / RG > 0 the forget gate's and the output gate's rows are their low-rank halves
(f_a, g_a: RF, RG wide) and the CTA projects its head's columns itself (f_b, g_b: FP32 sums
of exact products, rounded to BF16 as the model's linear is): two launches fewer a layer,
and each CTA reads only its head's K rows of f_b and its V slice's rows of g_b (a split
head's slices leave their projected gate columns in an FP32 buffer for the last CTA).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from glm5_kernels.triton_primitives import narrow, round_bf16, torch_sigmoid


@triton.jit
def conv_window(conv_row_ptr, qkv_ptr, rows, shift, n, c, offset, stride_cc, stride_qkv, row0,
                W: tl.constexpr):  # fmt: skip
    """Rows rows + shift of the step's sequence (the W-1 conv-state columns at the offset,
    then the T inputs), channels c: [len(rows), len(c)] BF16 (rows >= n masked)."""
    i = rows[:, None] + shift
    ptr = tl.where(i < W - 1, conv_row_ptr + (offset + i) * stride_cc + c[None, :],
                   qkv_ptr + (row0 + i - (W - 1)) * stride_qkv + c[None, :])  # fmt: skip
    return tl.load(ptr, mask=(rows[:, None] < n) & (c[None, :] >= 0), other=0.0)


@triton.jit
def short_conv(conv_row_ptr, qkv_ptr, w_ptr, tt, T, c, offset, stride_cc, stride_qkv, row0,
               W: tl.constexpr, INTERPRETER: tl.constexpr):  # fmt: skip
    """Every token's silu(sum_j w[c, j] x[t + j, c]) in FP32, rounded to BF16
    (short_conv_ref): [len(tt), len(c)]."""
    acc = tl.zeros([tt.shape[0], c.shape[0]], tl.float32)
    for j in tl.static_range(W):
        x = conv_window(conv_row_ptr, qkv_ptr, tt, j, T, c, offset, stride_cc, stride_qkv, row0, W)
        acc += tl.load(w_ptr + c * W + j).to(tl.float32)[None, :] * x.to(tl.float32)
    return round_bf16(acc * torch_sigmoid(acc, INTERPRETER), INTERPRETER)


@triton.jit
def low_rank_up(x_ptr, stride_x, w_ptr, row0, T, col0, TP: tl.constexpr, N: tl.constexpr,
                R: tl.constexpr, X8: tl.constexpr, INTERPRETER: tl.constexpr):  # fmt: skip
    """A low-rank projection's second half: rows row0 .. row0 + T of x [., R] times
    w[col0 : col0 + N, :R]^T (w row-major), [TP, N] FP32 sums of exact products rounded to
    BF16 (rows past T: zeros). Every (row, column) pair is one flat index of a [TP * N, RC]
    tile whose RC products (16 bytes of w) a thread sums itself: no sum crosses threads (a
    [rows, cols, RC] tile put RC over the lanes: ~1,500 shuffles and ~100 barriers a
    one-token step, 3.5x the kernel's instructions). The rounds' loads are independent. X8:
    x's rows start 16-byte aligned (a row stride of 8k elements: TP-8's fused projection rows
    are 3336 wide, which Triton's 16-divisibility cannot see), so its loads are vectors too."""
    RC: tl.constexpr = 8  # one 16-byte load of w a round
    i = tl.arange(0, TP * N)
    t, c = i // N, col0 + i % N
    live = t < T
    at = (row0 + t) * stride_x
    if X8:
        at = tl.multiple_of(at, 8)
    acc = tl.zeros([TP * N], tl.float32)
    for j in tl.static_range(0, R, RC):
        jj = j + tl.arange(0, RC)
        x = tl.load(x_ptr + at[:, None] + jj[None, :], mask=live[:, None],
                    other=0.0).to(tl.float32)  # fmt: skip
        w = tl.load(w_ptr + c[:, None] * R + jj[None, :]).to(tl.float32)
        acc += tl.sum(x * w, axis=1)
    return round_bf16(tl.reshape(acc, (TP, N)), INTERPRETER)


@triton.jit
def _gate(gate_ptr, gb_ptr, row0, T, col0, stride_g, TP: tl.constexpr, N: tl.constexpr,
          RG: tl.constexpr, X8: tl.constexpr, INTERPRETER: tl.constexpr):  # fmt: skip
    """The output gate's columns col0 .. col0 + N of the step's rows: loaded, or projected
    from g_a (RG > 0)."""
    if RG > 0:
        return low_rank_up(gate_ptr, stride_g, gb_ptr, row0, T, col0, TP, N, RG, X8, INTERPRETER)
    rows, cols = row0 + tl.arange(0, TP), col0 + tl.arange(0, N)
    return tl.load(gate_ptr + rows[:, None] * stride_g + cols[None, :],
                   mask=(tl.arange(0, TP) < T)[:, None], other=0.0).to(tl.float32)  # fmt: skip


@triton.jit
def forget_decay(f, a, lower_bound, HAS_LB: tl.constexpr, INTERPRETER: tl.constexpr):
    """The forget gate's per-channel decay exp(g) from f + dt_bias."""
    if HAS_LB:  # the safe gate: each step decays by at most exp(lower_bound)
        return tl.exp(lower_bound * torch_sigmoid(a * f, INTERPRETER))
    # -a * softplus(f), linear above 20 as torch's
    return tl.exp(-a * tl.where(f > 20.0, f, tl.log(1.0 + tl.exp(tl.minimum(f, 20.0)))))


@triton.jit
def new_windows(conv_row, qkv_ptr, cq, ck, cv, offset, stride_cc, stride_qkv, row0,
                T: tl.constexpr, W: tl.constexpr, NCP: tl.constexpr,
                KEEP: tl.constexpr):  # fmt: skip
    """The conv state's new columns of the q / k / v channels (read before any column is
    written; stored last): column j of the new window is row j + shift of the sequence (a
    verify keeps its W-2+T newest rows from column 0, a decode moves its window at the
    offset on by T). -> (new_q, new_k, new_v, the columns they go to, how many, cols)."""
    cols = tl.arange(0, NCP)
    if KEEP:
        n_cols, shift, dst = W - 2 + T, 1, cols
    else:
        n_cols, shift, dst = W - 1, T, offset + cols
    new_q = conv_window(conv_row, qkv_ptr, cols, shift, n_cols, cq, offset, stride_cc, stride_qkv,
                        row0, W)  # fmt: skip
    new_k = conv_window(conv_row, qkv_ptr, cols, shift, n_cols, ck, offset, stride_cc, stride_qkv,
                        row0, W)  # fmt: skip
    new_v = conv_window(conv_row, qkv_ptr, cols, shift, n_cols, cv, offset, stride_cc, stride_qkv,
                        row0, W)  # fmt: skip
    return new_q, new_k, new_v, dst, n_cols, cols


@triton.jit
def token_inputs(conv_row, qkv_ptr, conv_w_ptr, f_ptr, fb_ptr, b_ptr, tt, h, cq, ck, cv, kk,
                 offset, stride_cc, stride_qkv, stride_f, stride_b, row0, dt, a, q_scale,
                 lower_bound, T: tl.constexpr, TP: tl.constexpr, K: tl.constexpr,
                 W: tl.constexpr, HAS_LB: tl.constexpr, RF: tl.constexpr, X8: tl.constexpr,
                 INTERPRETER: tl.constexpr):  # fmt: skip
    """Every token's q, k, v (the short conv, BF16-rounded; q and k L2-normed with the eps
    inside the root, q also scaled by K^-1/2), decay and beta, [TP, .] tiles (rows past T:
    masked inputs): what the recurrence reads, before it."""
    q = short_conv(conv_row, qkv_ptr, conv_w_ptr, tt, T, cq, offset, stride_cc, stride_qkv, row0, W,
                   INTERPRETER)  # fmt: skip
    k = short_conv(conv_row, qkv_ptr, conv_w_ptr, tt, T, ck, offset, stride_cc, stride_qkv, row0, W,
                   INTERPRETER)  # fmt: skip
    v = short_conv(conv_row, qkv_ptr, conv_w_ptr, tt, T, cv, offset, stride_cc, stride_qkv, row0, W,
                   INTERPRETER)  # fmt: skip
    q = q / tl.sqrt_rn(tl.sum(q * q, axis=1) + 1e-6)[:, None] * q_scale
    k = k / tl.sqrt_rn(tl.sum(k * k, axis=1) + 1e-6)[:, None]
    rows, live = row0 + tt, tt < T
    if RF > 0:  # f_a rows: this head's columns of f_b here
        f = low_rank_up(f_ptr, stride_f, fb_ptr, row0, T, h * K, TP, K, RF, X8, INTERPRETER)
    else:
        f = tl.load(f_ptr + rows[:, None] * stride_f + h * K + kk[None, :], mask=live[:, None],
                    other=0.0).to(tl.float32)  # fmt: skip
    decay = forget_decay(f + dt[None, :], a, lower_bound, HAS_LB, INTERPRETER)
    beta = torch_sigmoid(tl.load(b_ptr + rows * stride_b + h, mask=live, other=0.0).to(tl.float32),
                         INTERPRETER)  # fmt: skip
    return q, k, v, decay, beta


@triton.jit
def _row(x, tt, t):
    """Row t of a [TP, N] register tile."""
    return tl.sum(tl.where(tt[:, None] == t, x, 0.0), axis=0)


@triton.jit
def _store_state(rec_ptr, slot, stride_rs, state_at, s, BV: tl.constexpr, K: tl.constexpr):
    """The state slice to its slot; slot -1: not stored."""
    keep = (tl.zeros([BV, K], tl.int64) + slot) >= 0
    tl.store(rec_ptr + slot * stride_rs + state_at, s, mask=keep)


@triton.jit
def kda_decode_kernel(
    qkv_ptr, f_ptr, b_ptr, gate_ptr, out_ptr,  # token rows r * T + t
    conv_ptr, rec_ptr,  # caches, updated in place
    conv_w_ptr, dt_bias_ptr, a_log_ptr, norm_w_ptr,
    fb_ptr, gb_ptr,  # f_b [H*K, RF], g_b [H*V, RG] where RF / RG > 0
    conv_slot_ptr, conv_off_ptr, read_slot_ptr, write_slot_ptr,
    part_ptr, count_ptr,  # [R*T, H, NV] FP32 sums of squares; [R*H] int32 zeros
    gbuf_ptr,  # [R*T, H*V] FP32: a split head's projected gate (RG > 0), slice by slice
    stride_qkv, stride_f, stride_b, stride_g, stride_out, stride_cs, stride_cc, stride_rs,
    H, q_scale, lower_bound, eps,
    T: tl.constexpr, TP: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr,
    W: tl.constexpr, NCP: tl.constexpr, KEEP: tl.constexpr, HAS_LB: tl.constexpr,
    RF: tl.constexpr, RG: tl.constexpr, X8: tl.constexpr,
    INTERPRETER: tl.constexpr, PDL: tl.constexpr,
    STATE_EARLY: tl.constexpr = False,  # the state read before the PDL wait (small slices)
):  # fmt: skip
    NV: tl.constexpr = V // BV
    r, h, jv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kk, vv, tt = tl.arange(0, K), jv * BV + tl.arange(0, BV), tl.arange(0, TP)
    cq, ck, cv = h * K + kk, H * K + h * K + kk, 2 * H * K + h * V + vv
    # Before the PDL wait, what does not depend on the previous kernel: the head's small
    # weights, and (STATE_EARLY) this slice of the state, the step's largest read, which then
    # overlaps that kernel's tail. The state was written by this layer's previous step, and
    # every kernel since has completed (the kernel that released this one had waited on its
    # own predecessor, and so on back); the slots are the step's placement, copied before it.
    a = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    dt = tl.load(dt_bias_ptr + h * K + kk).to(tl.float32)
    state_at = h * (V * K) + vv[:, None] * K + kk[None, :]
    if STATE_EARLY:
        s = tl.load(rec_ptr + tl.load(read_slot_ptr + r).to(tl.int64) * stride_rs + state_at)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if not STATE_EARLY:
        s = tl.load(rec_ptr + tl.load(read_slot_ptr + r).to(tl.int64) * stride_rs + state_at)
    conv_row = conv_ptr + tl.load(conv_slot_ptr + r).to(tl.int64) * stride_cs
    offset = tl.load(conv_off_ptr + r)
    row0 = r * T
    new_q, new_k, new_v, dst, n_cols, cols = new_windows(
        conv_row, qkv_ptr, cq, ck, cv, offset, stride_cc, stride_qkv, row0, T, W, NCP, KEEP
    )
    q, k, v, decay, beta = token_inputs(
        conv_row, qkv_ptr, conv_w_ptr, f_ptr, fb_ptr, b_ptr, tt, h, cq, ck, cv, kk, offset,
        stride_cc, stride_qkv, stride_f, stride_b, row0, dt, a, q_scale, lower_bound, T, TP, K,
        W, HAS_LB, RF, X8, INTERPRETER)  # fmt: skip
    rows, live = row0 + tt, tt < T
    if NV > 1 and RG > 0:  # a split head: each slice projects its own gate columns now, in
        # parallel, rather than the head's last CTA all V of them after everyone
        g_slice = low_rank_up(gate_ptr, stride_g, gb_ptr, row0, T, h * V + jv * BV, TP, BV, RG, X8,
                              INTERPRETER)  # fmt: skip
        tl.store(gbuf_ptr + rows[:, None] * (H * V) + h * V + vv[None, :], g_slice,
                 mask=live[:, None])  # fmt: skip

    o_all = tl.zeros([TP, BV], tl.float32)
    next_slot = tl.load(write_slot_ptr + r * T).to(tl.int64)
    for t in tl.static_range(T):
        slot = next_slot
        if t + 1 < T:  # loaded ahead: after this token's store it would wait a round trip
            next_slot = tl.load(write_slot_ptr + r * T + t + 1).to(tl.int64)
        q_t, k_t = _row(q, tt, t), _row(k, tt, t)
        s = s * _row(decay, tt, t)[None, :]
        beta_t = tl.sum(tl.where(tt == t, beta, 0.0), axis=0)
        delta = (_row(v, tt, t) - tl.sum(s * k_t[None, :], axis=1)) * beta_t
        s = s + delta[:, None] * k_t[None, :]
        o = round_bf16(tl.sum(s * q_t[None, :], axis=1), INTERPRETER)  # the model dtype
        o_all = tl.where(tt[:, None] == t, o[None, :], o_all)
        if KEEP:
            _store_state(rec_ptr, slot, stride_rs, state_at, s, BV, K)
    if not KEEP:  # `slot`: the last token's
        _store_state(rec_ptr, slot, stride_rs, state_at, s, BV, K)

    out_at = out_ptr + rows[:, None] * stride_out + h * V
    at = conv_row + dst[:, None] * stride_cc
    keep_cols = cols[:, None] < n_cols
    if NV == 1:  # the whole head here: the norm from registers, no hand-off
        gate = _gate(gate_ptr, gb_ptr, row0, T, h * V, stride_g, TP, BV, RG, X8, INTERPRETER)
        norm_w = tl.load(norm_w_ptr + vv).to(tl.float32)
        rms = tl.sqrt_rn(tl.sum(o_all * o_all, axis=1) / V + eps)
        y = norm_w[None, :] * (o_all / rms[:, None]) * torch_sigmoid(gate, INTERPRETER)
        tl.store(out_at + vv[None, :], narrow(y, tl.bfloat16, INTERPRETER), mask=live[:, None])
        tl.debug_barrier()  # a column written may be one another thread reads
        tl.store(at + cq[None, :], new_q, mask=keep_cols & (cq[None, :] >= 0))
        tl.store(at + ck[None, :], new_k, mask=keep_cols & (ck[None, :] >= 0))
        tl.store(at + cv[None, :], new_v, mask=keep_cols & (cv[None, :] >= 0))
    else:
        _hand_off(o_all, out_at, vv, live, rows, h, jv, r, at, keep_cols, cq, ck, cv, new_q,
                  new_k, new_v, part_ptr, count_ptr, gate_ptr, gbuf_ptr, norm_w_ptr, stride_g, H,
                  eps, TP, V, NV, RG, INTERPRETER)  # fmt: skip


@triton.jit
def _hand_off(o_all, out_at, vv, live, rows, h, jv, r, at, keep_cols, cq, ck, cv, new_q, new_k,
              new_v, part_ptr, count_ptr, gate_ptr, gbuf_ptr, norm_w_ptr, stride_g, H, eps,
              TP: tl.constexpr, V: tl.constexpr, NV: tl.constexpr, RG: tl.constexpr,
              INTERPRETER: tl.constexpr):  # fmt: skip
    """A head split over NV CTAs: o (BF16) and the slice's sum of squares out, this CTA's v
    conv channels (only it reads them); the head's last CTA to arrive applies the gated
    RMSNorm over all V (the gate loaded, or the slices' projections from gbuf: RG > 0) and
    stores the q / k conv channels every slice has read by then."""
    tl.store(out_at + vv[None, :], narrow(o_all, tl.bfloat16, INTERPRETER), mask=live[:, None])
    part_at = part_ptr + (rows * H + h) * NV
    tl.store(part_at + jv, tl.sum(o_all * o_all, axis=1), mask=live)
    tl.debug_barrier()  # a column written may be one another thread reads
    tl.store(at + cv[None, :], new_v, mask=keep_cols & (cv[None, :] >= 0))
    if arrive_last(count_ptr + r * H + h, NV):
        tl.store(at + cq[None, :], new_q, mask=keep_cols & (cq[None, :] >= 0))
        tl.store(at + ck[None, :], new_k, mask=keep_cols & (ck[None, :] >= 0))
        norm_head(out_at, rows, live, h, part_at, gate_ptr, gbuf_ptr, norm_w_ptr, stride_g, H,
                  eps, TP, V, NV, RG, INTERPRETER)  # fmt: skip


@triton.jit
def arrive_last(count_ptr, NV: tl.constexpr):
    """This CTA's slice of a head done (every thread's stores before the release): true in
    the head's last CTA to arrive, which resets the counter for the next step."""
    tl.debug_barrier()
    last = tl.atomic_add(count_ptr, 1, sem="acq_rel") == NV - 1
    tl.debug_barrier()
    if last:
        tl.store(count_ptr, 0)
    return last


@triton.jit
def norm_head(out_at, rows, live, h, part_at, gate_ptr, gbuf_ptr, norm_w_ptr, stride_g, H, eps,
              TP: tl.constexpr, V: tl.constexpr, NV: tl.constexpr, RG: tl.constexpr,
              INTERPRETER: tl.constexpr):  # fmt: skip
    """The gated RMSNorm of a split head's rows, in place, by the CTA that arrived last: the
    slices' sums of squares added in slice order (the same sum whichever CTA is last)."""
    ss = tl.zeros([TP], tl.float32)
    for j in tl.static_range(NV):
        ss += tl.load(part_at + j, mask=live, other=0.0, cache_modifier=".cg")
    va = tl.arange(0, V)
    o_full = tl.load(out_at + va[None, :], mask=live[:, None], other=0.0,
                     cache_modifier=".cg").to(tl.float32)  # fmt: skip
    if RG > 0:
        gate = tl.load(gbuf_ptr + rows[:, None] * (H * V) + h * V + va[None, :],
                       mask=live[:, None], other=0.0, cache_modifier=".cg")  # fmt: skip
    else:
        gate = tl.load(gate_ptr + rows[:, None] * stride_g + h * V + va[None, :],
                       mask=live[:, None], other=0.0).to(tl.float32)  # fmt: skip
    norm_w = tl.load(norm_w_ptr + va).to(tl.float32)
    y = norm_w[None, :] * (o_full / tl.sqrt_rn(ss / V + eps)[:, None])
    y = y * torch_sigmoid(gate, INTERPRETER)
    tl.store(out_at + va[None, :], narrow(y, tl.bfloat16, INTERPRETER), mask=live[:, None])
