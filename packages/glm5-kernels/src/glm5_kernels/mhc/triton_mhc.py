"""Triton kernel of the mHC boundary: the previous sublayer's post, the next sublayer's pre
(mix logits, Sinkhorn) and its input RMSNorm, in one launch.

A CTA owns BT tokens x BD hidden columns of all H streams (grid: token blocks x column
splits). Phase 1: the streams of its columns (MODE: given, the embedding expanded, or the
post: post (x) y + comb^T streams, rounded as the model dtype rounds), stored, and their
sums over its columns that the whole row needs: the mix logits (streams . fn) and the
streams' Gram matrix G[h, k] = sum_d s_h s_k. Then a barrier over the token block's CTAs.
Phase 2: each CTA sums the partials (the same order in every CTA, so all agree bit for bit),
computes pre / post / comb (Sinkhorn in registers; the row RMS is trace(G)), and the norm's
1/rms from G (sum_d (sum_h pre_h s_h)^2 = pre^T G pre), so the collapse and RMSNorm of its
own columns need no second pass over the row. HEAD: the final collapse (a plain mean over
the streams) and norm instead, no mix.

The barrier needs the token block's CTAs resident together (the host keeps the grid within
the SMs); under the interpreter, which runs programs one after another, or where the grid
would not fit, the phases run as two launches (PHASE 1, then PHASE 2).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from glm5_kernels.gemm.triton_skinny import _narrow
from glm5_kernels.moe.triton_moe import _sigmoid

GIVEN, EXPAND, POST = 0, 1, 2  # where phase 1's streams come from


@triton.jit
def _bf16(x, INTERPRETER: tl.constexpr):
    """FP32 -> the nearest BF16 value, kept in FP32."""
    return _narrow(x, tl.bfloat16, INTERPRETER).to(tl.float32)


@triton.jit
def _streams(x_ptr, res_ptr, post_ptr, comb_ptr, t, d, tm, D,
             H: tl.constexpr, MODE: tl.constexpr, INTERPRETER: tl.constexpr):  # fmt: skip
    """The streams [BT, H, DC] (FP32 holding BF16 values) of tokens t, columns d."""
    h = tl.arange(0, H)
    t3, h3, d3 = t[:, None, None], h[None, :, None], d[None, None, :]
    m3 = tm[:, None, None] & (d3 < D)
    if MODE == 0:
        s = tl.load(res_ptr + t3 * (H * D) + h3 * D + d3, mask=m3 & (h3 < H), other=0.0)
        s = s.to(tl.float32)
    elif MODE == 1:
        x = tl.load(x_ptr + t3 * D + d3, mask=m3, other=0.0).to(tl.float32)
        s = x + tl.zeros([1, H, 1], tl.float32)
    else:
        # transformers' order in the model dtype: post * y, comb^T @ streams (FP32
        # accumulation, one rounding), then their sum.
        x = tl.load(x_ptr + t3 * D + d3, mask=m3, other=0.0).to(tl.float32)
        p = tl.load(post_ptr + t3 * H + h3, mask=tm[:, None, None] & (h3 < H), other=0.0)
        placed = _bf16(_bf16(p, INTERPRETER) * x, INTERPRETER)
        t4, d4 = t[:, None, None, None], d[None, None, None, :]
        j4 = h[None, :, None, None]  # the source stream
        i4 = h[None, None, :, None]  # the destination stream
        m4 = tm[:, None, None, None]
        c = tl.load(comb_ptr + t4 * (H * H) + j4 * H + i4, mask=m4, other=0.0)  # [BT,H,H,1]
        r = tl.load(res_ptr + t4 * (H * D) + j4 * D + d4, mask=m4 & (d4 < D), other=0.0)
        mixed = tl.sum(_bf16(c, INTERPRETER) * r.to(tl.float32), axis=1)
        s = _bf16(placed + _bf16(mixed, INTERPRETER), INTERPRETER)
    return s


@triton.jit
def hc_boundary_kernel(
    x_ptr, res_ptr, post_ptr, comb_ptr,  # phase 1's inputs (MODE says which are read)
    fn_ptr, scale_ptr, base_ptr, norm_ptr,  # the next sublayer's mix and norm weights
    streams_ptr, post_out_ptr, comb_out_ptr, normed_ptr,  # outputs
    part_ptr, bar_ptr,  # workspace: partial sums [splits, max_tokens, PW]; barrier words
    T, D, max_tokens, rms_eps, hc_eps, norm_eps, post_mult,
    H: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, DC: tl.constexpr,
    SP: tl.constexpr, NMIX_P: tl.constexpr, MODE: tl.constexpr, STORE: tl.constexpr,
    HEAD: tl.constexpr, SINKHORN: tl.constexpr, PHASE: tl.constexpr,
    INTERPRETER: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid_t, pid_s = tl.program_id(0), tl.program_id(1)
    splits = tl.num_programs(1)
    NMIX: tl.constexpr = (2 + H) * H
    PW: tl.constexpr = NMIX + H * H  # a partial row: mix logits, then the Gram matrix
    HD = H * D
    t = pid_t * BT + tl.arange(0, BT)
    tm = t < T
    h, k = tl.arange(0, H), tl.arange(0, H)
    j = tl.arange(0, NMIX_P)
    row = part_ptr + (pid_s * max_tokens + t) * PW  # [BT]
    if PDL:
        gdc_wait()  # every input and the workspace come from earlier kernels
        gdc_launch_dependents()

    if PHASE != 2:
        mix = tl.zeros([BT, NMIX_P], tl.float32)
        gram = tl.zeros([BT, H, H], tl.float32)
        for c0 in range(0, BD, DC):
            d = pid_s * BD + c0 + tl.arange(0, DC)
            s = _streams(x_ptr, res_ptr, post_ptr, comb_ptr, t, d, tm, D, H, MODE,
                         INTERPRETER)  # fmt: skip
            if STORE:
                sp = streams_ptr + t[:, None, None] * HD + h[None, :, None] * D + d[None, None, :]
                sm = tm[:, None, None] & (d[None, None, :] < D) & (h[None, :, None] < H)
                tl.store(sp, _narrow(s, tl.bfloat16, INTERPRETER), mask=sm)
            gram += tl.sum(s[:, :, None, :] * s[:, None, :, :], axis=3)
            if not HEAD:
                for hh in tl.static_range(H):
                    s_h = tl.sum(tl.where(h[None, :, None] == hh, s, 0.0), axis=1)  # [BT, DC]
                    f = tl.load(fn_ptr + j[:, None] * HD + hh * D + d[None, :],
                                mask=(j[:, None] < NMIX) & (d[None, :] < D), other=0.0)  # fmt: skip
                    mix += tl.sum(s_h[:, None, :] * f.to(tl.float32)[None, :, :], axis=2)
        if not HEAD:
            tl.store(row[:, None] + j[None, :], mix, mask=tm[:, None] & (j[None, :] < NMIX))
        g_off = NMIX + h[None, :, None] * H + k[None, None, :]
        tl.store(row[:, None, None] + g_off, gram, mask=tm[:, None, None])

    if PHASE == 0:
        # Barrier over the token block's CTAs: read the generation, arrive; the last to
        # arrive resets the count and advances the generation, the others wait for it.
        tl.debug_barrier()
        count, gen_ptr = bar_ptr + 2 * pid_t, bar_ptr + 2 * pid_t + 1
        gen = tl.atomic_add(gen_ptr, 0, sem="acquire")
        arrived = tl.atomic_add(count, 1, sem="acq_rel")
        if arrived == splits - 1:
            tl.atomic_xchg(count, 0, sem="relaxed")
            tl.atomic_add(gen_ptr, 1, sem="release")
        else:
            seen = gen
            while seen == gen:
                seen = tl.atomic_add(gen_ptr, 0, sem="acquire")
        tl.debug_barrier()

    if PHASE != 1:
        # Every split's partial rows of these tokens, summed in split order.
        sp_ = tl.arange(0, SP)
        rows = part_ptr + (sp_[:, None] * max_tokens + t[None, :]) * PW  # [SP, BT]
        pm = (sp_[:, None] < splits) & tm[None, :]
        g = tl.load(rows[:, :, None, None] + NMIX + h[None, None, :, None] * H
                    + k[None, None, None, :], mask=pm[:, :, None, None], other=0.0,
                    cache_modifier=".cg")  # fmt: skip
        gram = tl.sum(g, axis=0)  # [BT, H, H]
        eye = h[None, :, None] == k[None, None, :]
        if HEAD:
            pre = tl.zeros([BT, H], tl.float32) + 1.0 / H
        else:
            m_pre = tl.sum(tl.load(rows[:, :, None] + h[None, None, :], mask=pm[:, :, None],
                                   other=0.0, cache_modifier=".cg"), axis=0)  # fmt: skip
            m_post = tl.sum(tl.load(rows[:, :, None] + H + h[None, None, :],
                                    mask=pm[:, :, None], other=0.0, cache_modifier=".cg"),
                            axis=0)  # fmt: skip
            m_comb = tl.sum(tl.load(rows[:, :, None, None] + 2 * H + h[None, None, :, None] * H
                                    + k[None, None, None, :], mask=pm[:, :, None, None],
                                    other=0.0, cache_modifier=".cg"), axis=0)  # fmt: skip
            # The mix input is the row RMS-normalized: its sum of squares is trace(G).
            sq = tl.sum(tl.sum(tl.where(eye, gram, 0.0), axis=2), axis=1)
            r = 1.0 / tl.sqrt_rn(sq / HD + rms_eps)
            s0 = tl.load(scale_ptr)
            s1 = tl.load(scale_ptr + 1)
            s2 = tl.load(scale_ptr + 2)
            b_pre = tl.load(base_ptr + h)
            b_post = tl.load(base_ptr + H + h)
            b_comb = tl.load(base_ptr + 2 * H + h[:, None] * H + k[None, :])
            pre = _sigmoid(m_pre * r[:, None] * s0 + b_pre[None, :], INTERPRETER) + hc_eps
            post = post_mult * _sigmoid(m_post * r[:, None] * s1 + b_post[None, :], INTERPRETER)
            logit = m_comb * r[:, None, None] * s2 + b_comb[None, :, :]
            e = tl.exp(logit - tl.max(logit, axis=2)[:, :, None])
            comb = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
            for _ in tl.static_range(SINKHORN - 1):
                comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
                comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
            if pid_s == 0:
                tl.store(post_out_ptr + t[:, None] * H + h[None, :], post, mask=tm[:, None])
                c_off = t[:, None, None] * (H * H) + h[None, :, None] * H + k[None, None, :]
                tl.store(comb_out_ptr + c_off, comb, mask=tm[:, None, None])
        # The collapsed row's sum of squares, pre^T G pre, without a pass over the row.
        q = tl.sum(tl.sum(pre[:, :, None] * pre[:, None, :] * gram, axis=2), axis=1)
        rstd = 1.0 / tl.sqrt_rn(q / D + norm_eps)
        for c0 in range(0, BD, DC):
            d = pid_s * BD + c0 + tl.arange(0, DC)
            # The same streams again (recomputed, or re-read: L2-hot), bit for bit phase 1's.
            s = _streams(x_ptr, res_ptr, post_ptr, comb_ptr, t, d, tm, D, H, MODE,
                         INTERPRETER)  # fmt: skip
            collapsed = _bf16(tl.sum(pre[:, :, None] * s, axis=1), INTERPRETER)  # [BT, DC]
            w = tl.load(norm_ptr + d, mask=d < D, other=0.0).to(tl.float32)
            y = w[None, :] * _bf16(collapsed * rstd[:, None], INTERPRETER)
            om = tm[:, None] & (d[None, :] < D)
            tl.store(normed_ptr + t[:, None] * D + d[None, :], _narrow(y, tl.bfloat16,
                     INTERPRETER), mask=om)  # fmt: skip
