"""Triton kernel of the indexer's selection (`indexer_ref.index_topk_ref`'s contract).

`indexer_topk_kernel`: a CTA per (query row, split of the request's pools) scores its pools
`BP` at a time — each pool's FP8 key and scale read through the block table from vLLM's
pages, q . k for every indexer head on the tensor cores (e4m3 in, FP32 out), relu, times
the key scale, summed over the heads with the row's head weights — and stores the scores
(-inf for pools that end after the row's position). The last CTA of the row to arrive (an
acq_rel counter it resets, so a CUDA graph replays it) selects over the row's visible pools
only: scores become order-keeping integer keys, eight passes find the count-th largest key 4
bits at a time (sixteen counts a pass in one reduction; keys in registers up to BSEL pools,
streamed from L2 beyond), and the pools above it plus the first pools equal to it (ascending
pool order: the reference's stable tie break) are written out in pool order, kpool token
positions each, then the tail and -1s.
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
def _load_keys(score_ptr, p, pm):
    # .cg: L1 is not coherent across SMs; the other splits' scores are in L2.
    return _keys(tl.load(score_ptr + p, mask=pm, other=0.0, cache_modifier=".cg"))


@triton.jit
def _at_least(key, pm, hi, shift: tl.constexpr):
    """[16]: how many keys sharing the digits `hi` above `shift` have a next 4-bit digit >= j
    (sixteen counts in one reduction: one round of the CTA's barrier, not sixteen)."""
    digit = (key >> shift) & 15
    cand = pm & ((key >> (shift + 4)) == hi)
    j = tl.arange(0, 16)
    return tl.sum((cand[None, :] & (digit[None, :] >= j[:, None])).to(tl.int32), axis=1)


@triton.jit
def _digit(ge, need, hi):
    """The next digit of the need-th largest key among the candidates (ge: _at_least's
    counts): the largest j with ge[j] >= need; what is still needed among its keys."""
    j = tl.arange(0, 16)
    digit = tl.max(tl.where(ge >= need, j, -1), axis=0)
    above = tl.sum(tl.where(j == digit + 1, ge, 0), axis=0)  # keys with a larger digit
    return need - above, hi * 16 + digit


@triton.jit
def _emit(key, pm, p, thr, need, taken, ties, out_row, KP: tl.constexpr):
    """The selected pools among `p`: above the threshold, or equal to it and among the first
    `need` such (ascending pool order: the reference's stable tie break); each written as KP
    token positions at its place in pool order (`taken` before this chunk)."""
    eq = pm & (key == thr)
    sel = (pm & (key > thr)) | (eq & (ties + tl.cumsum(eq.to(tl.int32), axis=0) <= need))
    at = taken + tl.cumsum(sel.to(tl.int32), axis=0) - 1
    j = tl.arange(0, KP)
    tl.store(out_row + at[:, None] * KP + j[None, :], (p[:, None] * KP + j[None, :]).to(tl.int32),
             mask=sel[:, None])  # fmt: skip
    return taken + tl.sum(sel.to(tl.int32), axis=0), ties + tl.sum(eq.to(tl.int32), axis=0)


@triton.jit
def indexer_topk_kernel(
    q_ptr, qs_ptr, w_ptr, page_ptr, scale_ptr, bt_ptr, req_ptr, pos_ptr,
    score_ptr, count_ptr, out_ptr,
    P, S, stride_pb, per_split, count, width, weight_scale,
    stride_qn, stride_qh, stride_wn, stride_bt, stride_on,
    IH: tl.constexpr, H: tl.constexpr, HD: tl.constexpr, KP: tl.constexpr, BP: tl.constexpr,
    PMAX: tl.constexpr, BC: tl.constexpr, BSEL: tl.constexpr, TAIL: tl.constexpr, PDL: tl.constexpr,
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
    wh = wh * tl.load(qs_ptr + n * stride_wn + h, mask=hm, other=0.0) * weight_scale  # as ref
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
        # The visible pools are a prefix of the table: the selection walks only them (a
        # short context costs its own length, not the table's).
        vis = tl.minimum((pos + 1) // KP, P).to(tl.int32)
        k_eff = tl.minimum(vis, count)
        # The count-th largest key, 4 bits a pass, most significant first (_at_least,
        # _digit). With vis <= count every visible pool is taken (threshold 0, need vis):
        # no pass runs. Up to BSEL pools the keys stay in registers from one load; beyond,
        # each pass streams them from L2 in chunks.
        thr = tl.zeros([], tl.int64)
        need = k_eff
        taken = tl.zeros([], tl.int32)
        ties = tl.zeros([], tl.int32)
        row = score_ptr + n * PMAX
        out_row = out_ptr + n * stride_on
        if vis <= BSEL:
            p = tl.arange(0, BSEL)
            pm = p < vis
            key = _load_keys(row, p, pm)
            if vis > count:
                for shift in tl.static_range(28, -1, -4):
                    need, thr = _digit(_at_least(key, pm, thr, shift), need, thr)
            taken, ties = _emit(key, pm, p, thr, need, taken, ties, out_row, KP)
        else:
            for shift in tl.static_range(28, -1, -4):
                ge = tl.zeros([16], tl.int32)
                for c0 in range(0, vis, BSEL):
                    p = c0 + tl.arange(0, BSEL)
                    pm = p < vis
                    ge += _at_least(_load_keys(row, p, pm), pm, thr, shift)
                need, thr = _digit(ge, need, thr)
            for c0 in range(0, vis, BSEL):
                p = c0 + tl.arange(0, BSEL)
                pm = p < vis
                taken, ties = _emit(_load_keys(row, p, pm), pm, p, thr, need, taken, ties,
                                    out_row, KP)  # fmt: skip
        j = tl.arange(0, KP)
        start = count * KP
        for w0 in range(k_eff * KP, start, BC):  # picks beyond the visible pools
            w = w0 + tl.arange(0, BC)
            tl.store(out_ptr + n * stride_on + w, tl.full([BC], -1, tl.int32), mask=w < start)
        if TAIL:  # the incomplete last pool's tokens up to the position, always selected
            filled = (pos + 1) % KP
            tok = tl.where(j < filled, pos + 1 - filled + j, -1)
            tl.store(out_ptr + n * stride_on + start + j, tok.to(tl.int32), mask=j < KP - 1)
            start += KP - 1
        for w0 in range(start, width, BC):
            w = w0 + tl.arange(0, BC)
            tl.store(out_ptr + n * stride_on + w, tl.full([BC], -1, tl.int32), mask=w < width)
        tl.atomic_xchg(count_ptr + n, 0)
