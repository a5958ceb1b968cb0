"""Triton kernel of the indexer's selection (`indexer_ref.index_topk_ref`'s contract).

`indexer_topk_kernel`: a CTA per (query row, split of the request's pools) scores its pools
`BP` at a time — each pool's FP8 key and scale read through the block table from vLLM's
pages, q . k for every indexer head on the tensor cores (e4m3 in, FP32 out), relu, times
the key scale, summed over the heads with the row's head weights — and stores the scores
(-inf for pools that end after the row's position). The last CTA of the row to arrive (an
acq_rel counter it resets, so a CUDA graph replays it) selects: scores become order-keeping
integer keys, a 32-step bitwise search finds the count-th largest visible key (skipped where
no more pools are visible than are taken: a short context takes them all), and the pools
above it plus the first pools equal to it (ascending pool order: the reference's stable tie
break) are written out in pool order, kpool token positions each, then the tail and -1s.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _keys(scores):
    """FP32 -> int64 keys in the same order (-0 just below +0)."""
    b = scores.to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(b >= 0, b + 2147483648, -1 - b)


@triton.jit
def indexer_topk_kernel(
    q_ptr, qs_ptr, w_ptr, page_ptr, scale_ptr, bt_ptr, req_ptr, pos_ptr,
    score_ptr, pool_ptr, count_ptr, out_ptr,
    P, S, stride_pb, per_split, count, width, weight_scale,
    stride_qn, stride_qh, stride_sn, stride_wn, stride_bt, stride_on,
    IH: tl.constexpr, H: tl.constexpr, HD: tl.constexpr, KP: tl.constexpr, BP: tl.constexpr,
    PMAX: tl.constexpr, BC: tl.constexpr, TAIL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    n, sp = tl.program_id(0), tl.program_id(1)
    h, d = tl.arange(0, IH), tl.arange(0, HD)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    hm = h < H  # IH: the heads padded to the MMA's 16 rows
    q = tl.load(q_ptr + n * stride_qn + h[:, None] * stride_qh + d[None, :], mask=hm[:, None],
                other=0.0)  # [IH, HD] e4m3  # fmt: skip
    wh = tl.load(w_ptr + n * stride_wn + h, mask=hm, other=0.0)  # (w * q_scale) * scale,
    wh = wh * tl.load(qs_ptr + n * stride_sn + h, mask=hm, other=0.0) * weight_scale  # as ref
    req = tl.load(req_ptr + n).to(tl.int64)
    pos = tl.load(pos_ptr + n).to(tl.int64)
    lo = sp * per_split
    hi = tl.minimum(lo + per_split, P)
    for p0 in range(lo, hi, BP):
        p = p0 + tl.arange(0, BP)
        pm = p < hi
        block = tl.load(bt_ptr + req * stride_bt + p // S, mask=pm, other=0).to(tl.int64)
        slot = p % S
        # A block's page at stride_pb bytes (vLLM packs layers block by block): S keys, then
        # S FP32 scales.
        k = tl.load(page_ptr + block[:, None] * stride_pb + slot[:, None] * HD + d[None, :],
                    mask=pm[:, None], other=0)  # fmt: skip
        k = k.to(tl.float8e4nv, bitcast=True)
        ks = tl.load(scale_ptr + (block * stride_pb + S * HD) // 4 + slot, mask=pm, other=0.0)
        s = tl.dot(q, tl.trans(k)) * ks[None, :]  # [IH, BP]
        score = tl.sum(wh[:, None] * tl.maximum(s, 0.0), axis=0)
        visible = (p + 1) * KP - 1 <= pos
        tl.store(score_ptr + n * PMAX + p, tl.where(visible, score, float("-inf")), mask=pm)
    # Every thread's scores are stored before the one thread issuing the release.
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + n, 1, sem="acq_rel")
    if arrived == tl.num_programs(1) - 1:
        p = tl.arange(0, PMAX)
        visible = ((p + 1) * KP - 1 <= pos) & (p < P)
        # .cg: L1 is not coherent across SMs; the other splits' scores live in L2.
        key = _keys(tl.load(score_ptr + n * PMAX + p, mask=p < P, other=0.0,
                            cache_modifier=".cg"))  # fmt: skip
        seen = tl.sum(visible.to(tl.int32), axis=0)
        k_eff = tl.minimum(seen, count)
        thr = tl.zeros([], tl.int64)  # every key is >= 0: all visible pools, unless
        if seen > count:  # more are visible than are taken (a short context skips this)
            for b in tl.static_range(32):  # the largest t with k_eff visible keys >= t
                cand = thr + (1 << (31 - b))
                above = tl.sum((visible & (key >= cand)).to(tl.int32), axis=0)
                thr = tl.where(above >= k_eff, cand, thr)
        gt = visible & (key > thr)
        need = k_eff - tl.sum(gt.to(tl.int32), axis=0)
        eq = visible & (key == thr)
        sel = gt | (eq & (tl.cumsum(eq.to(tl.int32), axis=0) <= need))
        at = tl.cumsum(sel.to(tl.int32), axis=0) - 1  # the pool's place in pool order
        tl.store(pool_ptr + n * PMAX + at, p, mask=sel)
        tl.debug_barrier()
        j = tl.arange(0, KP)
        for c0 in range(0, count, BC):
            c = c0 + tl.arange(0, BC)
            pool = tl.load(pool_ptr + n * PMAX + c, mask=c < k_eff, other=-1).to(tl.int64)
            tok = tl.where(pool[:, None] >= 0, pool[:, None] * KP + j[None, :], -1)
            tl.store(out_ptr + n * stride_on + c[:, None] * KP + j[None, :], tok.to(tl.int32),
                     mask=(c < count)[:, None])  # fmt: skip
        start = count * KP
        if TAIL:  # the incomplete last pool's tokens up to the position, always selected
            filled = (pos + 1) % KP
            tok = tl.where(j < filled, pos + 1 - filled + j, -1)
            tl.store(out_ptr + n * stride_on + start + j, tok.to(tl.int32), mask=j < KP - 1)
            start += KP - 1
        for w0 in range(start, width, BC):
            w = w0 + tl.arange(0, BC)
            tl.store(out_ptr + n * stride_on + w, tl.full([BC], -1, tl.int32), mask=w < width)
        tl.atomic_xchg(count_ptr + n, 0)
