"""Triton kernels of the sparse MLA decode: flash-decoding over the DSA-selected tokens, then
the splits merged and the value-up, in two launches.

`sparse_mla_split_kernel`: a CTA per (query row, BH heads, split of the selected tokens)
walks its split BW tokens at a time: each token's latent row gathered through the block table
(one [BW, L] BF16 load, shared by all BH heads), scores = q_lat . c on the tensor cores,
an online softmax (running max and sum), acc += p . c. Its FP32 partial (acc [BH, L], max,
sum) goes to the workspace. Splitting the selected tokens is what lets one request fill the
GPU (a 2063-token selection is 65 blocks of 32).

`value_up_kernel`: a CTA per (head, BV output columns) holds W_uv's [BV, L] tile (loaded
before the PDL wait: it does not depend on the attention) and, for blocks of BN query rows,
merges the splits (each rescaled to the common max) into o [BN, L], then o . W_uv^T on the
tensor cores: every head's weights are read once a step, however many rows there are. A
step of a few rows (ROWWISE) merges each row's splits SB at a time instead, in one pass:
the one-row step's ~65 splits are ~5 dependent loads, not ~18 rounds.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from glm5_kernels.triton_primitives import narrow


@triton.jit
def _dot(a, b, INTERPRETER: tl.constexpr):
    """a @ b of BF16 tiles into FP32 (the interpreter's BF16 dot multiplies raw bits: there
    it runs on the exact FP32 upcasts; see glm5_kernels.triton_primitives)."""
    if INTERPRETER:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b)


@triton.jit
def sparse_mla_split_kernel(
    q_ptr, cache_ptr, bt_ptr, req_ptr, idx_ptr, part_o_ptr, part_ml_ptr,
    N, H, W, chunk, bs, scale,
    stride_qn, stride_qh, stride_cb, stride_c, stride_bt, stride_idx,
    L: tl.constexpr, BH: tl.constexpr, BW: tl.constexpr, INTERPRETER: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    n, hb, sp = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    heads = hb * BH + tl.arange(0, BH)
    hm = heads < H
    lat = tl.arange(0, L)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    q = tl.load(q_ptr + n * stride_qn + heads[:, None] * stride_qh + lat[None, :],
                mask=hm[:, None], other=0.0)  # fmt: skip
    req = tl.load(req_ptr + n).to(tl.int64)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, L], tl.float32)
    start = sp * chunk
    end = tl.minimum(start + chunk, W)
    for w0 in range(start, end, BW):
        w = w0 + tl.arange(0, BW)
        pos = tl.load(idx_ptr + n * stride_idx + w, mask=w < end, other=-1)
        ok = pos >= 0
        at = tl.where(ok, pos, 0)
        block = tl.load(bt_ptr + req * stride_bt + at // bs, mask=ok, other=0).to(tl.int64)
        row = block * stride_cb + (at % bs) * stride_c  # the latent rows [BW, L], all BH heads
        c = tl.load(cache_ptr + row[:, None] + lat[None, :], mask=ok[:, None],
                    other=0.0)  # fmt: skip
        s = _dot(q, tl.trans(c), INTERPRETER) * scale  # [BH, BW] FP32
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: all zero
        alpha = tl.exp(m_i - base)
        p = tl.exp(s - base[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(narrow(p, tl.bfloat16, INTERPRETER), c, INTERPRETER)
        m_i = m_new
    row = (sp * N + n) * H + heads
    tl.store(part_o_ptr + row[:, None] * L + lat[None, :], acc, mask=hm[:, None])
    tl.store(part_ml_ptr + row * 2, m_i, mask=hm)
    tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=hm)


@triton.jit
def _merge_rows_value_up(part_o_ptr, part_ml_ptr, w, out_ptr, h, v, vm, N, H, splits,
                         stride_on, stride_oh, L: tl.constexpr, SB: tl.constexpr,
                         INTERPRETER: tl.constexpr):  # fmt: skip
    """A few rows (ROWWISE): each row's splits merged SB at a time in one pass ([SB, L] tiles,
    an online rescale to the running max), so a one-row step of ~65 splits waits on ~5 loads
    instead of one per split; then o . W_uv^T on the CUDA cores (one row: no MMA tile)."""
    lat = tl.arange(0, L)
    for n in range(0, N):
        m = tl.full([], float("-inf"), tl.float32)
        den = tl.zeros([], tl.float32)
        o = tl.zeros([L], tl.float32)
        for s0 in range(0, splits, SB):
            s = s0 + tl.arange(0, SB)
            sm = s < splits
            row = (s * N + n) * H + h
            mi = tl.load(part_ml_ptr + row * 2, mask=sm, other=float("-inf"))
            li = tl.load(part_ml_ptr + row * 2 + 1, mask=sm, other=0.0)
            part = tl.load(part_o_ptr + row[:, None] * L + lat[None, :], mask=sm[:, None],
                           other=0.0)  # fmt: skip
            m_new = tl.maximum(m, tl.max(mi, axis=0))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: all zero
            alpha = tl.exp(m - base)
            f = tl.exp(mi - base)
            den = den * alpha + tl.sum(f * li, axis=0)
            o = o * alpha + tl.sum(f[:, None] * part, axis=0)
            m = m_new
        o = o / tl.where(den > 0.0, den, 1.0)  # no token selected: zero
        o = narrow(o, tl.bfloat16, INTERPRETER).to(tl.float32)  # as the MMA path's operand
        y = tl.sum(w.to(tl.float32) * o[None, :], axis=1)  # [BV]
        tl.store(out_ptr + n * stride_on + h * stride_oh + v,
                 narrow(y, tl.bfloat16, INTERPRETER), mask=vm)  # fmt: skip


@triton.jit
def value_up_kernel(
    part_o_ptr, part_ml_ptr, w_ptr, out_ptr,
    N, H, Vd, splits, stride_wh, stride_wv, stride_on, stride_oh,
    L: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr, UNROLL: tl.constexpr,
    SB: tl.constexpr, ROWWISE: tl.constexpr, INTERPRETER: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    h, vb = tl.program_id(0), tl.program_id(1)
    v = vb * BV + tl.arange(0, BV)
    vm = v < Vd
    lat = tl.arange(0, L)
    # W_uv's [BV, L] tile before the wait: it does not depend on the attention.
    w = tl.load(w_ptr + h * stride_wh + v[:, None] * stride_wv + lat[None, :], mask=vm[:, None],
                other=0.0)  # fmt: skip
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if ROWWISE:
        _merge_rows_value_up(part_o_ptr, part_ml_ptr, w, out_ptr, h, v, vm, N, H, splits,
                             stride_on, stride_oh, L, SB, INTERPRETER)  # fmt: skip
    else:
        for n0 in range(0, N, BN):
            rows = n0 + tl.arange(0, BN)
            rm = rows < N
            # The splits UNROLL at a time (the last group masked), so that their partials'
            # loads need not wait on each other (attention.merge_unroll says where it pays).
            # A full unroll over 64 splits took minutes to compile.
            top = tl.full([BN], float("-inf"), tl.float32)
            for s0 in range(0, splits, UNROLL):
                for j in tl.static_range(UNROLL):
                    ml = part_ml_ptr + (((s0 + j) * N + rows) * H + h) * 2
                    here = rm & (s0 + j + tl.zeros_like(rows) < splits)
                    top = tl.maximum(top, tl.load(ml, mask=here, other=float("-inf")))
            base = tl.where(top == float("-inf"), 0.0, top)
            den = tl.zeros([BN], tl.float32)
            o = tl.zeros([BN, L], tl.float32)
            for s0 in range(0, splits, UNROLL):
                for j in tl.static_range(UNROLL):
                    row = ((s0 + j) * N + rows) * H + h
                    here = rm & (s0 + j + tl.zeros_like(rows) < splits)
                    mi = tl.load(part_ml_ptr + row * 2, mask=here, other=float("-inf"))
                    f = tl.exp(mi - base)
                    den += f * tl.load(part_ml_ptr + row * 2 + 1, mask=here, other=0.0)
                    part = tl.load(part_o_ptr + row[:, None] * L + lat[None, :],
                                   mask=here[:, None], other=0.0)  # fmt: skip
                    o += f[:, None] * part
            o = o / tl.where(den > 0.0, den, 1.0)[:, None]  # no token selected: zero
            y = _dot(narrow(o, tl.bfloat16, INTERPRETER), tl.trans(w), INTERPRETER)  # [BN, BV]
            tl.store(out_ptr + rows[:, None] * stride_on + h * stride_oh + v[None, :],
                     narrow(y, tl.bfloat16, INTERPRETER),
                     mask=rm[:, None] & vm[None, :])  # fmt: skip
