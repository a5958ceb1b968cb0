"""Triton device functions of the peer-mailbox exchange (see the package docstring).

Every rank owns a mailbox of 3 slots x WORLD sources x max_tokens * D values (BF16 rows as
int16 bits), the sentinel until written. A call, per tile: `exchange_sum` pushes this rank's
tile into every peer's mailbox at [slot, rank] and sums every rank's tile in rank order in
FP32 (polling its own mailbox until no value is the sentinel: every rank sums the same
values in the same order, so all hold bit-identical rows); `clear_read` puts the sentinel
back over what was read; `next_step` lets the call's last CTA move the step (slot = step %
3) on; `all_reduce_tile` is the three in order, a kernel's all-reduced input tile. A peer
can be at most one step ahead (it needs this rank's push to finish its step), so it writes
the next slot, cleared when this rank read it, never the one being read: no barrier between
calls, capturable (the step lives on the device).

The mailbox's state words (int32 [4], `state_ptr`): the step, the call's CTA arrivals, the
failure code, the poll budget. A peer that never arrives (its process gone, or out of step)
must not hang the GPU: `wait_tile` gives up after the budget's polls, records the first
failure (1 + peer + WORLD * step) and hands the missing values on as NaN. A failed mailbox
stays failed: every later call waits for nothing and hands on NaN, and the host raises
(glm5_comm's `Mailbox.check`).
"""

import triton
import triton.language as tl

from glm5_kernels.exchange import SENTINEL as _SENTINEL
from glm5_kernels.triton_primitives import round_bf16

SENTINEL = tl.constexpr(_SENTINEL)
NAN16 = tl.constexpr(0x7FC0)  # BF16 quiet NaN bits: a value that never arrived


@triton.jit
def wait_tile(at, mask, state_ptr, code, SENT: tl.constexpr, NAN: tl.constexpr):
    """The mailbox tile at `at` (its own, a peer's source), polled until no value is the
    sentinel SENT; after the poll budget (none if the mailbox failed already), the failure
    `code` recorded (the first one stays) and every value of a failed mailbox NaN bits."""
    dead = tl.load(state_ptr + 2, volatile=True) != 0
    left = tl.where(dead, 0, tl.load(state_ptr + 3))
    v = tl.load(at, mask=mask, other=0, volatile=True)
    while (tl.max(tl.where(mask & (v == SENT), 1, 0)) > 0) & (left > 0):
        v = tl.load(at, mask=mask, other=0, volatile=True)
        left -= 1
    lost = tl.max(tl.where(mask & (v == SENT), 1, 0)) > 0
    if lost:
        tl.atomic_cas(state_ptr + 2, 0, code, sem="relaxed")
    return tl.where(dead | lost, NAN, v).to(v.dtype)


@triton.jit
def exchange_sum(x, peers_ptr, state_ptr, rank, step, offs, mask, slot_elems,
                 WORLD: tl.constexpr):  # fmt: skip
    """This rank's BF16 tile x pushed to every peer's mailbox; the FP32 sum over ranks (in
    rank order) of every rank's tile at the same offsets, once each has arrived (NaN where
    one never did: `wait_tile`)."""
    slot = step % 3
    bits = x.to(tl.int16, bitcast=True)
    sent = tl.where(bits == SENTINEL, 0, bits).to(tl.int16)  # -0.0 goes as +0.0
    for p in tl.static_range(WORLD):
        if p != rank:
            peer = tl.load(peers_ptr + p).to(tl.pointer_type(tl.int16))
            tl.store(peer + (slot * WORLD + rank) * slot_elems + offs, sent, mask=mask)
    own = tl.load(peers_ptr + rank).to(tl.pointer_type(tl.int16))
    acc = tl.zeros(x.shape, tl.float32)
    for p in tl.static_range(WORLD):
        if p == rank:
            acc += x.to(tl.float32)
        else:
            at = own + (slot * WORLD + p) * slot_elems + offs
            v = wait_tile(at, mask, state_ptr, 1 + p + WORLD * step, SENTINEL, NAN16)
            acc += v.to(tl.bfloat16, bitcast=True).to(tl.float32)
    return acc


@triton.jit
def clear_read(peers_ptr, rank, slot, offs, mask, slot_elems, WORLD: tl.constexpr):
    """The own mailbox's tile of this slot back to the sentinel, once read: no peer writes it
    again before the slot comes round (a peer is at most one step ahead)."""
    tl.debug_barrier()  # threads holding the same values (replicas) have all read them
    own = tl.load(peers_ptr + rank).to(tl.pointer_type(tl.int16))
    blank = tl.full(offs.shape, SENTINEL, tl.int16)
    for p in tl.static_range(WORLD):
        if p != rank:
            tl.store(own + (slot * WORLD + p) * slot_elems + offs, blank, mask=mask)


@triton.jit
def next_step(state_ptr, step):
    """The last CTA of the call to arrive moves the step on (every CTA read it already)."""
    tl.debug_barrier()  # every thread's mailbox stores before the release
    programs = tl.num_programs(0) * tl.num_programs(1)
    if tl.atomic_add(state_ptr + 1, 1, sem="acq_rel") == programs - 1:
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr, step + 1)


@triton.jit
def all_reduce_tile(x, peers_ptr, state_ptr, rank, offs, mask, slot_elems,
                    WORLD: tl.constexpr, INTERPRETER: tl.constexpr):  # fmt: skip
    """This rank's BF16 tile x summed with every rank's at the same offsets (rank order, one
    BF16 rounding: all_reduce_ref), as FP32; the mailbox tile cleared and the step handed
    on. WORLD 1: x as it is, and the mailbox pointers are never touched (a caller may pass
    any tensor there: an else, not an early return, so that no exchange code is generated)."""
    if WORLD == 1:
        y = x.to(tl.float32)
    else:
        step = tl.load(state_ptr)
        y = exchange_sum(x, peers_ptr, state_ptr, rank, step, offs, mask, slot_elems, WORLD)
        y = round_bf16(y, INTERPRETER)
        clear_read(peers_ptr, rank, step % 3, offs, mask, slot_elems, WORLD)
        next_step(state_ptr, step)
    return y
