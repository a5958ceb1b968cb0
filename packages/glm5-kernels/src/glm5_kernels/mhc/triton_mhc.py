"""Triton kernel of the mHC boundary: the previous sublayer's post, the next sublayer's pre
(mix logits, Sinkhorn) and its input RMSNorm, in one launch.

A CTA owns BT tokens x BD hidden columns of all 4 streams (grid: token blocks x column
splits), and holds them in registers from start to end. Before waiting on the previous
kernel (PDL) it loads its weights: fn's columns for its slice and the norm weight. Phase 1:
the streams of its columns (MODE: given, the embedding expanded, or the post: post (x) y +
comb^T streams, rounded as the model dtype rounds), stored, and their sums over its columns
that the whole row needs: the mix logits (one FP32 dot: streams . fn) and the streams' Gram
matrix G[h, k] = sum_d s_h s_k. The token block's last CTA to arrive sums every split's
partial rows (split order: deterministic) and releases the others. Phase 2: every CTA reads
the sums and computes pre (CTA 0 also post, and comb by Sinkhorn, each token's 4 x 4 in
registers as 16 values: no reductions), the row RMS (trace G) and the norm's 1/rms from G
(sum_d (sum_h pre_h s_h)^2 = pre^T G pre), so the collapse and RMSNorm of its own columns
need no second pass over the row. HEAD: the final collapse (the streams' mean) and norm
instead, no mix.

The wait needs the token block's CTAs resident together (the host keeps the grid within
the SMs); under the interpreter, which runs programs one after another, the phases run as
two launches (PHASE 1, then PHASE 2; each computes the streams from its inputs).

WORLD > 1: the post's (or the expansion's) x is this rank's TP-partial sublayer output, and
phase 1 first all-reduces its tile through the peer mailboxes (glm5_kernels.exchange: every
rank sums the same values in rank order) — the all-reduce and the boundary in one launch.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from glm5_kernels.exchange.triton_exchange import all_reduce_tile
from glm5_kernels.triton_primitives import narrow, round_bf16, torch_sigmoid


@triton.jit
def _x(x_ptr, xr_ptr, peers_ptr, xstate_ptr, t, d, tm, dm, D, rank, slot_elems,
       WORLD: tl.constexpr, PHASE: tl.constexpr, INTERPRETER: tl.constexpr):  # fmt: skip
    """The sublayer output's tile [BT, 1, BD] (FP32 holding BF16): this rank's x, or with
    WORLD > 1 every rank's TP-partial x summed through the peer mailboxes (rank order, one
    rounding: glm5_kernels.exchange). In two phases, the first keeps the sum in xr for the
    second."""
    m2 = tm[:, None] & dm[None, :]
    offs = t[:, None] * D + d[None, :]
    if WORLD > 1 and PHASE == 2:
        x = tl.load(xr_ptr + offs, mask=m2, other=0.0).to(tl.float32)
    else:
        mine = tl.load(x_ptr + offs, mask=m2, other=0.0)
        x = all_reduce_tile(mine, peers_ptr, xstate_ptr, rank, offs, m2, slot_elems,
                            WORLD, INTERPRETER)  # fmt: skip
        if WORLD > 1 and PHASE == 1:
            tl.store(xr_ptr + offs, x.to(tl.bfloat16), mask=m2)  # exact: x holds BF16 values
    return x[:, None, :]


@triton.jit
def _streams(x_ptr, res_ptr, post_ptr, comb_ptr, t, d, tm, dm, D, xr_ptr, peers_ptr,
             xstate_ptr, rank, slot_elems, MODE: tl.constexpr,
             WORLD: tl.constexpr, PHASE: tl.constexpr, INTERPRETER: tl.constexpr):  # fmt: skip
    """The streams [BT, 4, BD] (FP32 holding BF16 values) of tokens t, columns d."""
    h = tl.arange(0, 4)
    t3, h3, d3 = t[:, None, None], h[None, :, None], d[None, None, :]
    m3 = tm[:, None, None] & dm[None, None, :]
    if MODE == 0:
        s = tl.load(res_ptr + t3 * (4 * D) + h3 * D + d3, mask=m3, other=0.0).to(tl.float32)
    elif MODE == 1:
        x = _x(x_ptr, xr_ptr, peers_ptr, xstate_ptr, t, d, tm, dm, D, rank,
               slot_elems, WORLD, PHASE, INTERPRETER)  # fmt: skip
        s = x + tl.zeros([1, 4, 1], tl.float32)
    else:
        # transformers' order in the model dtype: post * y, comb^T @ streams (FP32
        # accumulation, one rounding), then their sum.
        x = _x(x_ptr, xr_ptr, peers_ptr, xstate_ptr, t, d, tm, dm, D, rank,
               slot_elems, WORLD, PHASE, INTERPRETER)  # fmt: skip
        tm3 = tm[:, None, None]
        p = tl.load(post_ptr + t3 * 4 + h3, mask=tm3, other=0.0)
        placed = round_bf16(round_bf16(p, INTERPRETER) * x, INTERPRETER)
        mixed = tl.zeros_like(placed)
        for j in tl.static_range(4):  # source stream j into every stream h: comb[j, h]
            c = tl.load(comb_ptr + t3 * 16 + j * 4 + h3, mask=tm3, other=0.0)  # [BT, 4, 1]
            r = tl.load(res_ptr + t3 * (4 * D) + j * D + d3, mask=m3, other=0.0)  # [BT, 1, BD]
            mixed += round_bf16(c, INTERPRETER) * r.to(tl.float32)
        s = round_bf16(placed + round_bf16(mixed, INTERPRETER), INTERPRETER)
    return s


@triton.jit
def hc_boundary_kernel(
    x_ptr, res_ptr, post_ptr, comb_ptr,  # phase 1's inputs (MODE says which are read)
    fn_ptr, scale_ptr, base_ptr, norm_ptr,  # the next sublayer's mix and norm weights
    streams_ptr, post_out_ptr, comb_out_ptr, normed_ptr,  # outputs
    part_ptr, sum_ptr, bar_ptr,  # workspace: partial rows [splits, max_tokens, PW], their
    # sums [max_tokens, PW], a barrier word per token block
    xr_ptr, peers_ptr, xstate_ptr,  # WORLD > 1: the all-reduce's (see _x)
    T, D, max_tokens, rms_eps, hc_eps, norm_eps, post_mult, rank, slot_elems,
    H: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BTR: tl.constexpr,
    SR: tl.constexpr, NMIX_P: tl.constexpr, MODE: tl.constexpr, STORE: tl.constexpr,
    HEAD: tl.constexpr, SINKHORN: tl.constexpr, PHASE: tl.constexpr,
    INTERPRETER: tl.constexpr, PDL: tl.constexpr, WORLD: tl.constexpr = 1,
):  # fmt: skip
    tl.static_assert(H == 4, "the phase-2 code holds each token's 4 x 4 comb in registers")
    pid_t, pid_s = tl.program_id(0), tl.program_id(1)
    splits = tl.num_programs(1)
    NMIX: tl.constexpr = 24
    PW: tl.constexpr = 40  # a partial row: the mix logits, then the Gram matrix
    HD = 4 * D
    t = pid_t * BT + tl.arange(0, BT)
    tm = t < T
    d = pid_s * BD + tl.arange(0, BD)
    dm = d < D
    h = tl.arange(0, 4)
    # The weights first: they do not depend on the previous kernel.
    if not HEAD:
        c = tl.arange(0, 4 * BD)  # the dot's K: stream c // BD, column c % BD
        j = tl.arange(0, NMIX_P)
        col = pid_s * BD + c % BD
        fn_t = tl.load(fn_ptr + j[None, :] * HD + (c // BD)[:, None] * D + col[:, None],
                       mask=(j[None, :] < NMIX) & (col[:, None] < D), other=0.0)  # fmt: skip
    w = tl.load(norm_ptr + d, mask=dm, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()  # the inputs and the workspace come from earlier kernels
        gdc_launch_dependents()
    s = _streams(x_ptr, res_ptr, post_ptr, comb_ptr, t, d, tm, dm, D, xr_ptr, peers_ptr,
                 xstate_ptr, rank, slot_elems, MODE, WORLD, PHASE,
                 INTERPRETER)  # fmt: skip

    if PHASE != 2:
        if STORE:
            sp = streams_ptr + t[:, None, None] * HD + h[None, :, None] * D + d[None, None, :]
            tl.store(sp, narrow(s, tl.bfloat16, INTERPRETER),
                     mask=tm[:, None, None] & dm[None, None, :])  # fmt: skip
        row = part_ptr + (pid_s * max_tokens + t) * PW  # [BT]
        if not HEAD:
            s2 = tl.reshape(s, [BT, 4 * BD])
            mix = tl.dot(s2, fn_t.to(tl.float32), input_precision="ieee")  # [BT, NMIX_P]
            tl.store(row[:, None] + j[None, :], mix, mask=tm[:, None] & (j[None, :] < NMIX))
        for hh in tl.static_range(4):
            s_h = tl.sum(tl.where(h[None, :, None] == hh, s, 0.0), axis=1)  # [BT, BD]
            g_h = tl.sum(s * s_h[:, None, :], axis=2)  # [BT, 4]: G[hh, k]
            tl.store(row[:, None] + NMIX + hh * 4 + h[None, :], g_h, mask=tm[:, None])

        # Arrive on the token block's word (count in the low 16 bits, generation above).
        # The last to arrive sums the partial rows, then resets the count and advances the
        # generation in one add; in one launch the others wait for the generation.
        tl.debug_barrier()
        word = bar_ptr + pid_t
        old = tl.atomic_add(word, 1, sem="acq_rel")
        if (old & 0xFFFF) == splits - 1:
            _reduce(part_ptr, sum_ptr, pid_t * BT + tl.arange(0, BTR), T, splits, max_tokens,
                    PW, BTR, SR)  # fmt: skip
            tl.debug_barrier()
            tl.atomic_add(word, 65536 - splits, sem="release")
        elif PHASE == 0:
            seen = old
            while (seen >> 16) == (old >> 16):
                seen = tl.load(word, volatile=True)
            tl.atomic_add(word, 0, sem="acquire")  # the sums are visible from here
        tl.debug_barrier()

    if PHASE != 1:
        r_row = sum_ptr + t * PW
        g00, g01, g02, g03 = _row4(r_row + NMIX, tm)
        g10, g11, g12, g13 = _row4(r_row + NMIX + 4, tm)
        g20, g21, g22, g23 = _row4(r_row + NMIX + 8, tm)
        g30, g31, g32, g33 = _row4(r_row + NMIX + 12, tm)
        if HEAD:  # the final collapse is the streams' mean
            p0 = tl.zeros([BT], tl.float32) + 0.25
            p1, p2, p3 = p0, p0, p0
        else:
            # The mix input is the row RMS-normalized: its sum of squares is trace(G).
            r = 1.0 / tl.sqrt_rn((g00 + g11 + g22 + g33) / HD + rms_eps)
            s0 = _f32(scale_ptr)
            s1 = _f32(scale_ptr + 1)
            s2 = _f32(scale_ptr + 2)
            p0, p1, p2, p3 = _row4(r_row, tm)
            p0 = torch_sigmoid(p0 * r * s0 + _f32(base_ptr), INTERPRETER) + hc_eps
            p1 = torch_sigmoid(p1 * r * s0 + _f32(base_ptr + 1), INTERPRETER) + hc_eps
            p2 = torch_sigmoid(p2 * r * s0 + _f32(base_ptr + 2), INTERPRETER) + hc_eps
            p3 = torch_sigmoid(p3 * r * s0 + _f32(base_ptr + 3), INTERPRETER) + hc_eps
            if pid_s == 0:
                q0, q1, q2, q3 = _row4(r_row + 4, tm)
                q0 = post_mult * torch_sigmoid(q0 * r * s1 + _f32(base_ptr + 4), INTERPRETER)
                q1 = post_mult * torch_sigmoid(q1 * r * s1 + _f32(base_ptr + 5), INTERPRETER)
                q2 = post_mult * torch_sigmoid(q2 * r * s1 + _f32(base_ptr + 6), INTERPRETER)
                q3 = post_mult * torch_sigmoid(q3 * r * s1 + _f32(base_ptr + 7), INTERPRETER)
                _store4(post_out_ptr + t * 4, q0, q1, q2, q3, tm)
                _sinkhorn(r_row + 8, base_ptr + 8, comb_out_ptr + t * 16, r * s2, hc_eps, tm,
                          SINKHORN)  # fmt: skip
        # The collapsed row's sum of squares, pre^T G pre, without a pass over the row.
        q = (p0 * (p0 * g00 + p1 * g01 + p2 * g02 + p3 * g03)
             + p1 * (p0 * g10 + p1 * g11 + p2 * g12 + p3 * g13)
             + p2 * (p0 * g20 + p1 * g21 + p2 * g22 + p3 * g23)
             + p3 * (p0 * g30 + p1 * g31 + p2 * g32 + p3 * g33))  # fmt: skip
        rstd = 1.0 / tl.sqrt_rn(q / D + norm_eps)
        hb = h[None, :]
        pre = tl.where(hb == 0, p0[:, None], tl.where(hb == 1, p1[:, None],
                       tl.where(hb == 2, p2[:, None], p3[:, None])))  # fmt: skip
        collapsed = round_bf16(tl.sum(pre[:, :, None] * s, axis=1), INTERPRETER)  # [BT, BD]
        y = w[None, :] * round_bf16(collapsed * rstd[:, None], INTERPRETER)
        tl.store(normed_ptr + t[:, None] * D + d[None, :], narrow(y, tl.bfloat16, INTERPRETER),
                 mask=tm[:, None] & dm[None, :])  # fmt: skip


@triton.jit
def _reduce(part_ptr, sum_ptr, t, T, splits, max_tokens, PW: tl.constexpr, BTR: tl.constexpr,
            SR: tl.constexpr):  # fmt: skip
    """sum_ptr[t] = the sum over splits of part_ptr[split, t] (PW values a row), in split
    order, SR splits a load. L2 loads: other SMs wrote the partials, and this SM's L1 may
    hold an old copy."""
    PW_P: tl.constexpr = triton.next_power_of_2(PW)
    col = tl.arange(0, PW_P)
    tm = t < T
    acc = tl.zeros([BTR, PW_P], tl.float32)
    for s0 in range(0, splits, SR):
        sr = s0 + tl.arange(0, SR)
        ptrs = part_ptr + ((sr[:, None, None] * max_tokens + t[None, :, None]) * PW
                           + col[None, None, :])  # fmt: skip
        m = (sr[:, None, None] < splits) & tm[None, :, None] & (col[None, None, :] < PW)
        acc += tl.sum(tl.load(ptrs, mask=m, other=0.0, cache_modifier=".cg"), axis=0)
    tl.store(sum_ptr + t[:, None] * PW + col[None, :], acc, mask=tm[:, None] & (col[None, :] < PW))


@triton.jit
def _f32(ptr):
    return tl.load(ptr).to(tl.float32)


@triton.jit
def _row4(ptr, tm):
    """Four consecutive reduced values of each token (L2 loads: another CTA wrote them)."""
    a = tl.load(ptr, mask=tm, other=0.0, cache_modifier=".cg")
    b = tl.load(ptr + 1, mask=tm, other=0.0, cache_modifier=".cg")
    c = tl.load(ptr + 2, mask=tm, other=0.0, cache_modifier=".cg")
    d = tl.load(ptr + 3, mask=tm, other=0.0, cache_modifier=".cg")
    return a, b, c, d


@triton.jit
def _store4(ptr, a, b, c, d, tm):
    tl.store(ptr, a, mask=tm)
    tl.store(ptr + 1, b, mask=tm)
    tl.store(ptr + 2, c, mask=tm)
    tl.store(ptr + 3, d, mask=tm)


@triton.jit
def _softmax4(a, b, c, d, eps):
    """softmax over four values, + eps (the reference's comb before Sinkhorn)."""
    top = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    a, b, c, d = tl.exp(a - top), tl.exp(b - top), tl.exp(c - top), tl.exp(d - top)
    inv = 1.0 / (a + b + c + d)
    return a * inv + eps, b * inv + eps, c * inv + eps, d * inv + eps


@triton.jit
def _norm4(a, b, c, d, eps):
    """Four values / (their sum + eps): one reciprocal, four products (the 19 Sinkhorn
    iterations are the boundary's longest serial chain; a product by the reciprocal is
    within one FP32 rounding of the quotient)."""
    inv = 1.0 / (a + b + c + d + eps)
    return a * inv, b * inv, c * inv, d * inv


@triton.jit
def _sinkhorn(m_ptr, b_ptr, out_ptr, gain, eps, tm, ITERS: tl.constexpr):
    """comb = Sinkhorn(softmax_rows(m * gain + b) + eps), 4 x 4 per token, as the reference
    iterates it (columns first), each token's matrix in registers: no reductions."""
    m00, m01, m02, m03 = _row4(m_ptr, tm)
    m10, m11, m12, m13 = _row4(m_ptr + 4, tm)
    m20, m21, m22, m23 = _row4(m_ptr + 8, tm)
    m30, m31, m32, m33 = _row4(m_ptr + 12, tm)
    c00, c01, c02, c03 = _softmax4(m00 * gain + _f32(b_ptr), m01 * gain + _f32(b_ptr + 1),
                                   m02 * gain + _f32(b_ptr + 2),
                                   m03 * gain + _f32(b_ptr + 3), eps)  # fmt: skip
    c10, c11, c12, c13 = _softmax4(m10 * gain + _f32(b_ptr + 4),
                                   m11 * gain + _f32(b_ptr + 5),
                                   m12 * gain + _f32(b_ptr + 6),
                                   m13 * gain + _f32(b_ptr + 7), eps)  # fmt: skip
    c20, c21, c22, c23 = _softmax4(m20 * gain + _f32(b_ptr + 8),
                                   m21 * gain + _f32(b_ptr + 9),
                                   m22 * gain + _f32(b_ptr + 10),
                                   m23 * gain + _f32(b_ptr + 11), eps)  # fmt: skip
    c30, c31, c32, c33 = _softmax4(m30 * gain + _f32(b_ptr + 12),
                                   m31 * gain + _f32(b_ptr + 13),
                                   m32 * gain + _f32(b_ptr + 14),
                                   m33 * gain + _f32(b_ptr + 15), eps)  # fmt: skip
    c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, eps)
    c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, eps)
    c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, eps)
    c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, eps)
    for _ in range(ITERS - 1):
        c00, c01, c02, c03 = _norm4(c00, c01, c02, c03, eps)
        c10, c11, c12, c13 = _norm4(c10, c11, c12, c13, eps)
        c20, c21, c22, c23 = _norm4(c20, c21, c22, c23, eps)
        c30, c31, c32, c33 = _norm4(c30, c31, c32, c33, eps)
        c00, c10, c20, c30 = _norm4(c00, c10, c20, c30, eps)
        c01, c11, c21, c31 = _norm4(c01, c11, c21, c31, eps)
        c02, c12, c22, c32 = _norm4(c02, c12, c22, c32, eps)
        c03, c13, c23, c33 = _norm4(c03, c13, c23, c33, eps)
    _store4(out_ptr, c00, c01, c02, c03, tm)
    _store4(out_ptr + 4, c10, c11, c12, c13, tm)
    _store4(out_ptr + 8, c20, c21, c22, c23, tm)
    _store4(out_ptr + 12, c30, c31, c32, c33, tm)
