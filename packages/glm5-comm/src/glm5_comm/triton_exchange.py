"""glm5-comm's Triton kernels over the peer mailboxes (the exchange's device functions and
its protocol: glm5_kernels.exchange.triton_exchange): the one-shot all-reduce, the
all-reduce + residual + RMSNorm and the MTP input (a CTA a whole row), the logits gather.

The all-reduce, a tile of BM rows x BD columns a CTA: this rank's tile pushed to every peer
and every rank's tile summed in rank order (`exchange_sum`), rounded once, stored; the tile
read cleared back to the sentinel (`clear_read`); the call's last CTA moves the step on
(`next_step`). No NCCL, no barrier on the hot path; capturable. A peer that never arrives
gives NaN after the mailbox's poll budget, never a hang (`wait_tile`).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from glm5_kernels.exchange import SENTINEL32 as _SENTINEL32
from glm5_kernels.exchange.triton_exchange import all_reduce_tile, next_step, wait_tile
from glm5_kernels.triton_primitives import narrow

SENTINEL32 = tl.constexpr(_SENTINEL32)  # 0xFFFFFFFF: FP32 rows' (a NaN no arithmetic makes)
NAN32 = tl.constexpr(0x7FC00000)  # the canonical FP32 quiet NaN


@triton.jit
def one_shot_all_reduce_kernel(
    x_ptr, out_ptr, peers_ptr, state_ptr,
    M, D, stride_x, stride_out, slot_elems, rank,
    WORLD: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr, INTERPRETER: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = (rows[:, None] < M) & (cols[None, :] < D)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    y = all_reduce_tile(x, peers_ptr, state_ptr, rank, rows[:, None] * D + cols[None, :],
                        mask, slot_elems, WORLD, INTERPRETER)  # fmt: skip
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], y.to(tl.bfloat16), mask=mask)


@triton.jit
def _rms_norm_row(x, w, D, eps, INTERPRETER: tl.constexpr):
    """rms_norm_ref of one row held whole (FP32 values of BF16 x, FP32 weight): normalized,
    rounded to BF16, times the weight, rounded."""
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / D + eps)
    normed = narrow(x * rstd, tl.bfloat16, INTERPRETER).to(tl.float32)
    return narrow(w * normed, tl.bfloat16, INTERPRETER)


@triton.jit
def all_reduce_norm_kernel(
    x_ptr, res_ptr, res_out_ptr, normed_ptr, w_ptr, peers_ptr, state_ptr,
    M, D, stride_x, stride_res, stride_res_out, stride_normed, slot_elems, rank, eps,
    WORLD: tl.constexpr, BD: tl.constexpr, INTERPRETER: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """A CTA a row: the row's partial all-reduced (WORLD 1: as it is), added to the residual
    (one rounding), then RMSNorm'd over the whole row it holds — all_reduce_norm_ref's
    roundings: the sum, the residual, the normalized row, the weight product."""
    row = tl.program_id(0)
    cols = tl.arange(0, BD)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # before the wait
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    y = all_reduce_tile(x, peers_ptr, state_ptr, rank, row * D + cols, mask,
                        slot_elems, WORLD, INTERPRETER)  # fmt: skip
    res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    r = narrow(y + res, tl.bfloat16, INTERPRETER)
    tl.store(res_out_ptr + row * stride_res_out + cols, r, mask=mask)
    normed = _rms_norm_row(r.to(tl.float32), w, D, eps, INTERPRETER)
    tl.store(normed_ptr + row * stride_normed + cols, normed, mask=mask)


@triton.jit
def logits_gather_kernel(
    x_ptr, out_ptr, peers_ptr, state_ptr,
    M, S, stride_x, stride_out, slot_elems, rank,
    WORLD: tl.constexpr, BM: tl.constexpr, BS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Vocab-sharded FP32 logits gathered into full rows: a CTA's tile of this rank's shard
    (BM rows x BS columns) pushed to every peer's mailbox (a 0xFFFFFFFF NaN sent as the
    canonical one) and written to its own columns of the full rows; each peer's tile polled
    until no value is the sentinel, written to that peer's columns, and cleared."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BS + tl.arange(0, BS)
    mask = (rows[:, None] < M) & (cols[None, :] < S)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    step = tl.load(state_ptr)
    slot = step % 3
    offs = rows[:, None] * S + cols[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    bits = x.to(tl.int32, bitcast=True)
    sent = tl.where(bits == SENTINEL32, NAN32, bits)
    for p in tl.static_range(WORLD):
        if p != rank:
            peer = tl.load(peers_ptr + p).to(tl.pointer_type(tl.int32))
            tl.store(peer + (slot * WORLD + rank) * slot_elems + offs, sent, mask=mask)
    at_out = out_ptr + rows[:, None] * stride_out + cols[None, :]
    tl.store(at_out + rank * S, x, mask=mask)
    own = tl.load(peers_ptr + rank).to(tl.pointer_type(tl.int32))
    for p in tl.static_range(WORLD):
        if p != rank:
            at = own + (slot * WORLD + p) * slot_elems + offs
            v = wait_tile(at, mask, state_ptr, 1 + p + WORLD * step, SENTINEL32, NAN32)
            tl.store(at_out + p * S, v.to(tl.float32, bitcast=True), mask=mask)
    tl.debug_barrier()  # replicas have read their values before any is cleared
    blank = tl.full(offs.shape, SENTINEL32, tl.int32)
    for p in tl.static_range(WORLD):
        if p != rank:
            tl.store(own + (slot * WORLD + p) * slot_elems + offs, blank, mask=mask)
    next_step(state_ptr, step)


@triton.jit
def embed_norm_kernel(
    x_ptr, pos_ptr, hidden_ptr, out_ptr, ew_ptr, hw_ptr, peers_ptr, state_ptr,
    M, D, stride_x, stride_h, stride_out, slot_elems, rank, eps,
    WORLD: tl.constexpr, BD: tl.constexpr, INTERPRETER: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The MTP eh_proj input, a CTA a row: the vocab-parallel embedding's partial row
    all-reduced (exact: one rank holds it), zeroed at position 0 and enorm'd, beside
    hnorm(hidden) — embed_norm_ref's roundings."""
    row = tl.program_id(0)
    cols = tl.arange(0, BD)
    mask = cols < D
    ew = tl.load(ew_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # before the wait
    hw = tl.load(hw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    y = all_reduce_tile(x, peers_ptr, state_ptr, rank, row * D + cols, mask,
                        slot_elems, WORLD, INTERPRETER)  # fmt: skip
    y = tl.where(tl.load(pos_ptr + row) != 0, y, 0.0)
    tl.store(out_ptr + row * stride_out + cols, _rms_norm_row(y, ew, D, eps, INTERPRETER),
             mask=mask)  # fmt: skip
    h = tl.load(hidden_ptr + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + D + cols, _rms_norm_row(h, hw, D, eps, INTERPRETER),
             mask=mask)  # fmt: skip
