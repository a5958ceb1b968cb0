"""CuTe DSL kernel of the mHC boundary: one thread-block cluster per group of tokens, the
row sums combined through distributed shared memory.

Same function and numerics as `triton_mhc.hc_boundary_kernel` (see `boundary.py`): the
previous sublayer's post (or the embedding's expansion, or given streams), the next
sublayer's pre (mix logits, Sinkhorn) and its input RMSNorm; HEAD: the final collapse (the
streams' mean) and norm. What changes is the dependent chain between a row's column slices,
which is the whole cost at decode sizes (the bytes allow ~0.4 µs):

- A cluster of C = 16 CTAs owns TB tokens; CTA r owns hidden columns [r W, (r + 1) W),
  W = D / C, one column a thread (all four streams). Clusters are independent: a step of
  T tokens launches ceil(T / TB) of them, so every SM that holds a slice of fn works on few
  tokens (the mix GEMV is 24 x 16384 FMAs a token; 16 SMs alone would take ~0.2 µs a token).
  TB is the fewest tokens that keep every cluster resident at once (`resident_clusters`:
  the driver's count, 14 on an H100 SXM; a cluster past it runs as a second wave).
- Before the PDL wait (nothing there depends on the previous kernel) each thread loads its
  column of fn (24 x 4 FP32: 96 KB a CTA, in registers) and of the norm weight, and each
  CTA arms its mbarrier for the peers' bytes; the cluster's arrive is issued there too, its
  wait just before the first remote store (every peer's mbarrier is armed by then).
- The partial sums a row needs (24 mix logits, the streams' 10 Gram products) are reduced
  inside a warp by a reduce-scatter butterfly (31 + 10 shuffles for 34 values, not 170),
  across warps through shared memory, and across the cluster by `st.async` into every
  peer's shared memory, completing on the peer's mbarrier (no global atomics, no flag in
  global memory). Every CTA sums the C partials in rank order: all hold bit-identical
  totals, as the Triton kernel's deterministic split order does.
- Sinkhorn (19 dependent iterations of a 4 x 4 matrix) is the boundary's longest serial
  chain: one lane a token in CTA rank 0's last warp (the "Sinkhorn warp"), which does
  nothing else after the totals — warp 0 of the same CTA normalizes and stores its columns
  too (handed over through shared memory in phase 1) — while the post's four sigmoids run
  on rank 1. Every reciprocal on these paths is MUFU's approximate one (within 1 ulp; an
  IEEE division compiles to a slow-path branch the scheduler cannot interleave). Measured
  on the H200 with the post on the same lane and the norm after it: post + comb 3.0-3.2 µs
  of the 6.0 at 1-64 tokens (the phases build, benchmarks/boundary.py --phases, commit
  94cec64), 2.3 once the mix's scale and base were read before the PDL wait (a28cf20),
  1.8 on its own warp (69a657e).
- The streams are stored as soon as they are computed, before any reduction.
- Deferred comb (`pend_out` / `pend_in`): post and comb are read only by the *next*
  boundary, so a producer may leave comb as its 16 mix logits (softmax input) and the next
  boundary balances them before its own PDL wait, under the sublayer between: Sinkhorn (the
  Sinkhorn warp's 1.8 µs, half the one-token boundary) leaves the critical path, and the
  post / comb reads after the wait become shared-memory reads. A ready word per cluster
  says the logits are written: the producer zeroes it after its PDL wait and before it
  releases its dependents (so no consumer can see a stale word: a consumer starts only
  after that release) and stores READY with release semantics once post and the logits
  are out; the consumer's Sinkhorn warp polls it with acquire loads (bounded: a word
  never set traps after seconds, a launch error instead of a hang). No reliance on the
  kernels between the two boundaries waiting before they release theirs.

Measured (H200, benchmarks/boundary.py, 69a657e): 4.96 / 5.35 / 9.74 / 20.7 µs at 1 / 8 /
16 / 64 tokens, the Triton kernel 13.4 / 26.7 / 42.4 / 43.9; rank 0's Sinkhorn warp 1.8 µs
of the 4.35 µs period at one token (--phases). Since (H100, b4462f1: the resident plan, post
and comb staged in shared memory, conversions and MUFU once): 3.75 / 4.51 / 5.93 / 12.69 µs
at 1 / 8 / 16 / 64 tokens, where each token a cluster is ~410 instructions a thread
(streams, the mix GEMV's 96 FMAs, the partials' reduce-scatter) and two CTAs an SM issue
them at ~0.85 µs a token (the packages' README has the breakdown).

World size 1 only: the TP exchange (glm5_kernels.exchange) stays with the Triton kernel.

`phases` (a build for the benchmark, benchmarks/boundary.py --phases): thread 0 of every CTA
stamps the global nanosecond timer and its SM's cycle counter at the PHASES points into a
13th pointer, so one replayed chain shows where a boundary's time goes (the release after
the previous kernel, the streams and partial sums, the cluster exchange, Sinkhorn, the
norm) without a profiler's serialization. Every build takes the pointer; others ignore it.
"""

from __future__ import annotations

import operator

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T as _T
from cutlass.cutlass_dsl import dsl_user_op

from glm5_kernels.mhc.boundary import EXPAND, GIVEN, POST  # where the streams come from

H = 4  # residual streams (GLM-5.3-Flash)
NMIX = (2 + H) * H  # mix logits: pre [H], post [H], comb [H, H]
GRAM = ((0, 0), (0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3), (2, 2), (2, 3), (3, 3))
NPART = NMIX + len(GRAM)  # the partial sums of one token: 34
MIX = H + H * H  # a token's post and comb, as a boundary reads them
CLUSTER = 16  # CTAs a cluster (H100 / H200 allow 16 with the non-portable attribute)
# Two CTAs an SM by default (`per_sm`, `min_blocks_per_mp`: ptxas keeps a 256-thread CTA
# within 128 registers; the 2- and 4-token builds took 143 / 188 unbounded; bounded, 128,
# with 8-88 bytes of stack from three tokens a cluster), and the shared memory they need (a
# percentage of the SM's; given, not queried: the kernels compile without a GPU).
SMEM_CARVEOUT = 25
# Where a `phases` build stamps the time (thread 0 of each CTA): entry, the PDL wait's
# return, the CTA's partial sums reduced, the cluster's partials all arrived, the totals
# summed, comb written (rank 0: stamped by the Sinkhorn warp's first thread; rank 1's
# thread 0 after the post; the others pass straight on), and the CTA done (a barrier).
PHASES = ("start", "waited", "partials", "exchanged", "totals", "post_comb", "end")
# A deferred comb's ready word once its producer has stored post and the logits (a magic
# value, not 1: whatever a fresh buffer held cannot pass for it), and the consumer's polls
# (an L2 round trip and a 64 ns back-off each) before it traps: seconds, far beyond any
# sublayer's time.
READY = 0x6D484321
POLLS = 1 << 23


@dsl_user_op
def _peer_address(addr: Int32, peer: Int32, *, loc=None, ip=None) -> Int32:
    """A shared-memory address of this CTA mapped to the same offset in CTA `peer`."""
    return Int32(
        llvm.inline_asm(
            _T.i32(), [Int32(addr).ir_value(loc=loc, ip=ip), Int32(peer).ir_value(loc=loc, ip=ip)],
            "mapa.shared::cluster.u32 $0, $1, $2;", "=r,r,r",
            has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )  # fmt: skip


@dsl_user_op
def _push(value: Float32, addr: Int32, mbar: Int32, peer: Int32, *, loc=None, ip=None) -> None:
    """value into CTA `peer`'s shared memory at this CTA's offset `addr`, completing 4 bytes
    of the transaction count of the peer's mbarrier (at this CTA's offset `mbar`)."""
    dst = _peer_address(addr, peer, loc=loc, ip=ip)
    bar = _peer_address(mbar, peer, loc=loc, ip=ip)
    llvm.inline_asm(
        None,
        [dst.ir_value(loc=loc, ip=ip), Float32(value).ir_value(loc=loc, ip=ip),
         bar.ir_value(loc=loc, ip=ip)],
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [$0], $1, [$2];", "r,f,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )  # fmt: skip


def _rows(shape: tuple[int, ...]):
    """A row-major (last index fastest) layout of `shape`."""
    strides, n = [], 1
    for extent in reversed(shape):
        strides.insert(0, n)
        n *= extent
    return cute.make_layout(shape, stride=tuple(strides))


@dsl_user_op
def _bf16(x: Float32, *, loc=None, ip=None) -> Float32:
    """x rounded to BF16 (round to nearest even), held in FP32: one cvt packing it into the
    upper half of a word. Not `x.to(BFloat16).to(Float32)`, which the compiler folds to x
    (measured: every rounding of the post and the norm gone, values off by up to 1e4 ulps)."""
    return Float32(
        llvm.inline_asm(
            _T.f32(), [Float32(x).ir_value(loc=loc, ip=ip)],
            "{ .reg .b32 w; cvt.rn.bf16x2.f32 w, $1, 0f00000000; mov.b32 $0, w; }", "=f,f",
            has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )  # fmt: skip


@dsl_user_op
def _nanosleep(ns: int, *, loc=None, ip=None) -> None:
    """Back off about `ns` nanoseconds (a poll that does not flood the memory system)."""
    llvm.inline_asm(None, [], f"nanosleep.u32 {ns};", "", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)  # fmt: skip


@dsl_user_op
def _trap(*, loc=None, ip=None) -> None:
    """End the launch with an error (a wait that cannot end: better than a hung GPU)."""
    llvm.inline_asm(None, [], "trap;", "", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)  # fmt: skip


@cute.jit
def _stamp(mPhases: cute.Tensor, group: Int32, rank: Int32, tid: Int32,
           at: cutlass.Constexpr[int], who: Int32):  # fmt: skip
    """Thread `who`'s global nanoseconds and SM cycles at PHASES[at] (a `phases` build)."""
    if tid == who:
        n = len(PHASES)
        mPhases[group, 2 * n * rank + at] = cute.arch.globaltimer()
        mPhases[group, 2 * n * rank + n + at] = cute.arch.clock64()


def _sigmoid(x: Float32) -> Float32:
    return cute.arch.rcp_approx(1.0 + cute.math.exp(-x))


def _reduce_scatter(v: list, lane: Int32) -> Float32:
    """The warp's sum of v[lane] for 32 values a lane: each butterfly step keeps half of the
    values (the half this lane's bit selects) and adds the partner's copy of it."""
    m = 16
    while m >= 1:
        upper = (lane & m) != 0
        kept = []
        for i in range(m):
            send = cutlass.select_(upper, v[i], v[i + m])
            keep = cutlass.select_(upper, v[i + m], v[i])
            kept.append(keep + cute.arch.shuffle_sync_bfly(send, offset=m))
        v = kept
        m //= 2
    return v[0]


@cute.jit
def _normalize(rC: cute.Tensor, eps: Float32, rows: cutlass.Constexpr[bool]):
    """rC [H, H]'s rows (or columns) / (their sum + eps), in place: one approximate
    reciprocal (MUFU, within 1 ulp) and four products a line."""
    for a in cutlass.range_constexpr(H):
        at = [(a, b) if const_expr(rows) else (b, a) for b in range(H)]
        # A tree: two adds deep, not four (the 38 normalizations are one dependent chain).
        inv = cute.arch.rcp_approx((rC[at[0]] + rC[at[1]]) + (rC[at[2]] + rC[at[3]]) + eps)
        for b in cutlass.range_constexpr(H):
            rC[at[b]] = rC[at[b]] * inv


@cute.jit
def _sinkhorn(rC: cute.Tensor, eps: Float32, iters: cutlass.Constexpr[int]):
    """Sinkhorn as transformers iterates it (the softmax normalized the rows: columns first,
    then `iters` - 1 rounds of rows and columns), the 4 x 4 matrix in registers. A rolled
    loop: unrolled, its ~1,000 instructions run once a launch straight from L2 (measured
    7 µs of a 12 µs boundary on the H200, instruction-fetch stalls); rolled, they hit the
    instruction cache from the second round."""
    _normalize(rC, eps, False)
    for _ in cutlass.range(iters - 1, unroll=1):
        _normalize(rC, eps, True)
        _normalize(rC, eps, False)


def unfit(hidden: int) -> str | None:
    """Why `hidden` does not tile over a cluster (one column a thread, whole warps of
    columns, at most 1024 threads a CTA), or None."""
    w = hidden // CLUSTER
    if hidden % CLUSTER or not 32 <= w <= 1024 or w % 32:
        return f"needs hidden / {CLUSTER} a multiple of 32 up to 1024 (hidden {hidden})"
    return None


class CuteBoundary:
    """The kernel for one static configuration: `mode` (GIVEN / EXPAND / POST), `head`,
    `store` (the new streams are an output), `tb` tokens a cluster, hidden `D`, the model's
    eps constants and Sinkhorn iterations; `per_sm`: the CTAs an SM it is built for (2:
    ptxas bounds a thread to 128 registers, from three tokens a cluster it spills, 300 bytes
    at eight; 1: up to 255, no spills, half the clusters resident — the benchmark's sweep
    times both)."""

    def __init__(self, *, mode: int, head: bool, store: bool, tb: int, hidden: int,
                 rms_eps: float, hc_eps: float, norm_eps: float, post_mult: float,
                 sinkhorn_iters: int, pdl: bool, phases: bool = False,
                 pend_in: bool = False, pend_out: bool = False, per_sm: int = 2):  # fmt: skip
        assert unfit(hidden) is None, unfit(hidden)
        assert not pend_in or mode == POST, "only a post reads a comb"
        assert not pend_out or not head, "the head leaves no comb"
        assert per_sm in (1, 2), per_sm
        self.mode, self.head, self.store, self.tb, self.per_sm = mode, head, store, tb, per_sm
        # pend_in: post / comb are a deferred comb's producer's (logits, balanced here before
        # the wait); pend_out: this boundary leaves its comb as logits (module docstring).
        self.pend_in, self.pend_out = pend_in, pend_out
        self.D, self.W = hidden, hidden // CLUSTER
        self.rms_eps, self.hc_eps, self.norm_eps = rms_eps, hc_eps, norm_eps
        self.post_mult, self.iters, self.pdl = post_mult, sinkhorn_iters, pdl
        self.phases = phases
        self.warps = self.W // 32
        # Sinkhorn's warp (rank 0's last) hands its columns' norm to warp 0 (module docstring);
        # with one warp a CTA it keeps them, after Sinkhorn.
        self.sink = self.warps - 1
        self.handing = not head and self.warps > 1

    @cute.jit
    def __call__(
        self,
        pX: cute.Pointer,  # (T, D) BF16: the sublayer output (POST) or the embedding (EXPAND)
        pRes: cute.Pointer,  # (T, H, D) BF16: the streams before (POST, GIVEN)
        pPost: cute.Pointer,  # (T, H) FP32 (POST)
        pComb: cute.Pointer,  # (T, H, H) FP32, comb[j, h]: stream j into stream h (POST)
        pFn: cute.Pointer,  # (NMIX, H * D) FP32 or BF16: the next sublayer's mix weights
        pScale: cute.Pointer,  # (3,)
        pBase: cute.Pointer,  # (NMIX,)
        pNorm: cute.Pointer,  # (D,) the next sublayer's (or the final) norm weight
        pStreams: cute.Pointer,  # (T, H, D) BF16 out (store)
        pPostOut: cute.Pointer,  # (T, H) FP32 out
        pCombOut: cute.Pointer,  # (T, H, H) FP32 out
        pNormed: cute.Pointer,  # (T, D) BF16 out
        pPhases: cute.Pointer,  # (T, CLUSTER * 2 * len(PHASES)) Int64 out (phases): row = group
        pReadyIn: cute.Pointer,  # (groups,) Int32: pPost / pComb's ready words (pend_in)
        pReadyOut: cute.Pointer,  # (groups,) Int32 out: pPostOut / pCombOut's (pend_out)
        tokens: Int32,
        stream,
    ):
        D = self.D
        row = lambda p, n: cute.make_tensor(p, cute.make_layout((tokens, n), stride=(n, 1)))  # noqa: E731
        flat = lambda p, n: cute.make_tensor(p, cute.make_layout(n))  # noqa: E731
        self.kernel(
            row(pX, D), row(pRes, H * D), row(pPost, H), row(pComb, H * H),
            cute.make_tensor(pFn, cute.make_layout((NMIX, H * D), stride=(H * D, 1))),
            flat(pScale, 3), flat(pBase, NMIX), flat(pNorm, D),
            row(pStreams, H * D), row(pPostOut, H), row(pCombOut, H * H), row(pNormed, D),
            row(pPhases, CLUSTER * 2 * len(PHASES)), flat(pReadyIn, cute.ceil_div(tokens, self.tb)),
            flat(pReadyOut, cute.ceil_div(tokens, self.tb)), tokens,
        ).launch(
            grid=[CLUSTER, cute.ceil_div(tokens, self.tb), 1], block=[self.W, 1, 1],
            cluster=[CLUSTER, 1, 1], stream=stream, use_pdl=self.pdl,
            min_blocks_per_mp=self.per_sm, preferred_smem_carveout=SMEM_CARVEOUT,
        )  # fmt: skip

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mRes: cute.Tensor, mPost: cute.Tensor,
               mComb: cute.Tensor, mFn: cute.Tensor, mScale: cute.Tensor, mBase: cute.Tensor,
               mNorm: cute.Tensor, mStreams: cute.Tensor, mPostOut: cute.Tensor,
               mCombOut: cute.Tensor, mNormed: cute.Tensor, mPhases: cute.Tensor,
               mReadyIn: cute.Tensor, mReadyOut: cute.Tensor, tokens: Int32):  # fmt: skip
        D, W, TB = self.D, self.W, self.tb
        tid, _, _ = cute.arch.thread_idx()
        _, group, _ = cute.arch.block_idx()
        rank = cute.arch.block_idx_in_cluster()
        lane, warp = cute.arch.lane_idx(), cute.arch.warp_idx()
        col = rank * W + tid
        t0 = group * TB
        at = (mPhases, group, rank, tid)  # where a `phases` build stamps the time
        self._stamp(*at, 0)

        smem = cutlass.memory.SmemAllocator()
        # Each warp's partial sums, then each CTA's (written by the peers), then the totals.
        # Row-major: a warp's lanes write consecutive words, a peer's partials are one run.
        sWarp = smem.allocate_tensor(Float32, _rows((TB, self.warps, NPART)), 16)
        sPeer = smem.allocate_tensor(Float32, _rows((CLUSTER, TB, NPART)), 16)
        sTot = smem.allocate_tensor(Float32, _rows((TB, NPART)), 16)
        # The mix's scale [3] and base [NMIX]: read once, before the wait, by the first
        # threads (the phases build showed them read after the exchange, each a round trip
        # to HBM on rank 0's path: its post, softmax and the norm's pre all wait on them).
        sGain = smem.allocate_tensor(Float32, cute.make_layout(3 + NMIX), 16)
        # Rank 0's Sinkhorn warp's streams and norm weight, for warp 0 to normalize.
        sHand = smem.allocate_tensor(Float32, _rows((TB, H + 1, 32)), 16)
        # Post and comb by token slot, rounded to BF16 as the post reads them (once a CTA,
        # where every thread rounded all 20 of every token: conversions issue at a sixteenth
        # of the FMA rate on Hopper); where comb comes deferred, balanced here (pend_in).
        sMix = smem.allocate_tensor(Float32, _rows((TB, MIX)), 16)
        mbar = smem.allocate_array(cutlass.Int64, 1)

        # Independent of the previous kernel: the weights, and the mbarrier that counts the
        # peers' bytes (armed for all of them at once: a phase completes only when the
        # arrival and every byte are in, in any order).
        if tid == 0:
            cute.arch.mbarrier_init(mbar, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.mbarrier_arrive_and_expect_tx(mbar, CLUSTER * TB * NPART * 4)
        cute.arch.cluster_arrive_relaxed()
        rFn = cute.make_rmem_tensor(cute.make_layout((NMIX, H)), Float32)
        if const_expr(not self.head):
            for j in cutlass.range_constexpr(NMIX):
                for h in cutlass.range_constexpr(H):
                    rFn[j, h] = mFn[j, h * D + col].to(Float32)
        w = mNorm[col].to(Float32)
        if const_expr(not self.head):  # visible to every thread after phase 1's barrier
            if tid < 3:
                sGain[tid] = mScale[tid].to(Float32)
            elif tid < 3 + NMIX:
                sGain[tid] = mBase[tid - 3].to(Float32)
        # The previous boundary's comb, balanced meanwhile, its warp's fn loads in flight
        # (compile-time, then run-time).
        if const_expr(self.pend_in):  # noqa: SIM102
            if warp == self.sink:
                self._resolve(mPost, mComb, mReadyIn, sMix, group, t0, lane, tokens)
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_wait()
        if const_expr(self.pend_out):  # noqa: SIM102 (not ready, before any consumer starts)
            if (rank == 0) & (tid == 0):
                cute.arch.store(mReadyOut.iterator + group, Int32(0), sem="relaxed", scope="gpu")
                cute.arch.fence_acq_rel_gpu()
        if const_expr(self.pdl):
            cute.arch.griddepcontrol_launch_dependents()
        # Phase 1: the streams of this column, stored, and their partial sums. Every
        # token's inputs are requested first, in flight while post and comb reach sMix
        # (the barrier that publishes it). Where comb comes deferred, up to two tokens a
        # cluster: at four, beside fn's 96 registers and the Sinkhorn code, the four tokens'
        # inputs spilled 140 bytes (ptxas -v, SM90; otherwise 8).
        early = TB if TB <= 2 or not self.pend_in else 0
        rIn = cute.make_rmem_tensor(cute.make_layout((TB, 1 + H)), Float32)
        for i in cutlass.range_constexpr(early):
            for k in cutlass.range_constexpr(1 + H):
                rIn[i, k] = Float32(0.0)
            if t0 + i < tokens:
                self._inputs(rIn, i, t0 + i, col, mX, mRes)
        if const_expr(self.mode == POST and not self.pend_in):  # noqa: SIM102 (compile-time)
            # Post and comb of the cluster's tokens into sMix, a value a thread: one round
            # trip for all of them, where every thread read its token's 20 after the
            # previous token's stores (four tokens a cluster: four round trips in a row).
            if tid < TB * MIX:
                i, k = tid // MIX, tid % MIX
                if t0 + i < tokens:
                    if k < H:
                        sMix[i, k] = _bf16(mPost[t0 + i, k])
                    else:
                        sMix[i, k] = _bf16(mComb[t0 + i, k - H])
        if const_expr(self.mode == POST):  # sMix, from the Sinkhorn warp or the loads above
            cute.arch.barrier()
        self._stamp(*at, 1)

        rS = cute.make_rmem_tensor(cute.make_layout((TB, H)), Float32)
        for i in cutlass.range_constexpr(TB):
            t = t0 + i
            for h in cutlass.range_constexpr(H):
                rS[i, h] = Float32(0.0)
            if t < tokens:
                if const_expr(i >= early):
                    self._inputs(rIn, i, t, col, mX, mRes)
                self._streams(rS, rIn, i, sMix)
                if const_expr(self.store):
                    for h in cutlass.range_constexpr(H):
                        mStreams[t, h * D + col] = rS[i, h].to(BFloat16)
        for i in cutlass.range_constexpr(TB):
            part = []
            for j in cutlass.range_constexpr(NMIX):
                acc = Float32(0.0)
                if const_expr(not self.head):
                    for h in cutlass.range_constexpr(H):
                        acc += rFn[j, h] * rS[i, h]
                part.append(acc)
            for a, b in GRAM:
                part.append(rS[i, a] * rS[i, b])
            mine = _reduce_scatter(part[:32], lane)
            extra = [cute.arch.warp_reduction(p, operator.add) for p in part[32:]]
            sWarp[i, warp, lane] = mine
            if lane == 0:
                for k in cutlass.range_constexpr(NPART - 32):
                    sWarp[i, warp, 32 + k] = extra[k]
        if const_expr(self.handing):  # noqa: SIM102 (a compile-time branch, then a run-time one)
            if (rank == 0) & (warp == self.sink):
                for i in cutlass.range_constexpr(TB):
                    for h in cutlass.range_constexpr(H):
                        sHand[i, h, lane] = rS[i, h]
                    sHand[i, H, lane] = w
        cute.arch.barrier()
        self._stamp(*at, 2)

        # The CTA's partials to every CTA of the cluster (their sPeer[rank]), once every
        # peer's mbarrier is armed (the cluster wait).
        cute.arch.cluster_wait()
        peer_base = sPeer.iterator.toint()
        mbar_addr = mbar.toint()
        for k in cutlass.range(tid, TB * NPART, W):
            i, v = k // NPART, k % NPART
            p = Float32(0.0)
            for wi in cutlass.range_constexpr(self.warps):
                p += sWarp[i, wi, v]
            addr = peer_base + (rank * TB * NPART + k) * 4
            for peer in cutlass.range_constexpr(CLUSTER):
                _push(p, addr, mbar_addr, Int32(peer))
        cute.arch.mbarrier_wait(mbar, 0)
        self._stamp(*at, 3)
        for k in cutlass.range(tid, TB * NPART, W):
            i, v = k // NPART, k % NPART
            s = Float32(0.0)
            for r in cutlass.range_constexpr(CLUSTER):
                s += sPeer[r, i, v]
            sTot[i, v] = s
        cute.arch.barrier()
        self._stamp(*at, 4)

        # Phase 2: Sinkhorn (rank 0's last warp, one lane a token) and post (rank 1's warp
        # 0), the collapse and norm (every column; rank 0's warp 0 also the Sinkhorn warp's).
        sinking = (rank == 0) & (warp == self.sink)
        if const_expr(self.pend_out):  # post and the logits, then the ready word
            if sinking:
                if lane < TB:
                    t = t0 + lane
                    if t < tokens:
                        self._pend(sTot, lane, t, sGain, mPostOut, mCombOut)
                cute.arch.fence_acq_rel_gpu()
                cute.arch.sync_warp()
                if lane == 0:
                    cute.arch.store(mReadyOut.iterator + group, Int32(READY), sem="release",
                                    scope="gpu")  # fmt: skip
        elif const_expr(not self.head):
            if sinking & (lane < TB):
                t = t0 + lane
                if t < tokens:
                    self._comb(sTot, lane, t, sGain, mCombOut)
            if (rank == 1) & (warp == 0) & (lane < TB):  # CLUSTER > 1
                t = t0 + lane
                if t < tokens:
                    self._post(sTot, lane, t, sGain, mPostOut)
        self._stamp(*at, 5, who=cutlass.select_(rank == 0, Int32(self.sink * 32), Int32(0)))
        # Every warp but a handing Sinkhorn warp: lane i computes token slot i's pre and
        # 1/rms once (four sigmoids and two rsqrt: MUFU ops, a sixteenth of the FMA rate,
        # that every thread computed for every token), the warp takes them by shuffles.
        sinks = Int32(0)
        if const_expr(self.handing):
            sinks = Int32((rank == 0) & (warp == self.sink))
        if sinks == 0:
            pres, rstds = self._pre_rstd(sTot, cutlass.min(lane, Int32(TB - 1)), sGain)
            for i in cutlass.range_constexpr(TB):
                t = t0 + i
                if t < tokens:
                    pre = [cute.arch.shuffle_sync(p, i) for p in pres]
                    rstd = cute.arch.shuffle_sync(rstds, i)
                    self._normed(pre, rstd, [rS[i, h] for h in range(H)], w, t, col, mNormed)
                    if const_expr(self.handing):  # noqa: SIM102 (compile-time, then run-time)
                        if (rank == 0) & (warp == 0):  # the Sinkhorn warp's columns
                            handed = [sHand[i, h, lane] for h in range(H)]
                            self._normed(pre, rstd, handed, sHand[i, H, lane], t,
                                         col + self.sink * 32, mNormed)  # fmt: skip
        if const_expr(self.phases):  # "end": the CTA's last thread done
            cute.arch.barrier()
        self._stamp(*at, 6)

    def _stamp(self, mPhases, group, rank, tid, point: int, who=None):
        if const_expr(self.phases):
            _stamp(mPhases, group, rank, tid, point, Int32(0) if who is None else who)

    def _inputs(self, rIn, i, t, col, mX, mRes):
        """rIn[i, :] = token t's inputs at column col (FP32 holding BF16 values): x (the
        sublayer output or the embedding) and the streams before, as the mode reads them."""
        D = self.D
        if const_expr(self.mode != GIVEN):
            rIn[i, 0] = mX[t, col].to(Float32)
        if const_expr(self.mode != EXPAND):
            for h in range(H):
                rIn[i, 1 + h] = mRes[t, h * D + col].to(Float32)

    def _streams(self, rS, rIn, i, sMix):
        """rS[i, :] = the streams of token slot i at this column from its inputs rIn[i]
        (FP32 holding BF16 values); post and comb from sMix, rounded to BF16 there (read
        after the PDL wait, or balanced before it where comb was deferred)."""
        if const_expr(self.mode == GIVEN):
            for h in range(H):
                rS[i, h] = rIn[i, 1 + h]
        elif const_expr(self.mode == EXPAND):
            for h in range(H):
                rS[i, h] = rIn[i, 0]
        else:
            # transformers' order in the model dtype: post * y, comb^T @ streams (FP32
            # accumulation in source order, one rounding), then their sum. The sum is a
            # chain of FMAs (a BF16 x BF16 product is exact in FP32, so each equals the
            # product then the add) that no compiler may reassociate: a reordered sum lands
            # a value on the neighbouring BF16, and where post * y cancels the sum, that is
            # the whole value.
            x = rIn[i, 0]
            r = [rIn[i, 1 + j] for j in range(H)]
            post = [sMix[i, h] for h in range(H)]
            comb = [sMix[i, H + k] for k in range(H * H)]
            for h in range(H):
                placed = _bf16(post[h] * x)
                mixed = comb[h] * r[0]
                for j in range(1, H):
                    mixed = cute.math.fma(comb[j * H + h], r[j], mixed)
                rS[i, h] = _bf16(placed + _bf16(mixed))

    def _gram(self, tot, i):
        """The streams' Gram matrix of token slot i, and the mix input's 1/rms (the row's sum
        of squares is trace(G))."""
        g = {}
        for n, (a, b) in enumerate(GRAM):
            g[a, b] = tot[i, NMIX + n]
            g[b, a] = g[a, b]
        trace = g[0, 0] + g[1, 1] + g[2, 2] + g[3, 3]
        return g, cute.math.rsqrt(trace / (H * self.D) + self.rms_eps)

    def _pre(self, tot, i, gain):
        """pre [H] of token slot i from the totals (HEAD: the mean), and the Gram matrix."""
        g, r = self._gram(tot, i)
        if const_expr(self.head):
            pre = [Float32(0.25) for _ in range(H)]
        else:
            pre = [_sigmoid(tot[i, h] * r * gain[0] + gain[3 + h]) + self.hc_eps
                   for h in range(H)]  # fmt: skip
        return pre, g

    def _pre_rstd(self, tot, i, gain):
        """pre [H] of token slot i and the collapsed row's 1/rms: its sum of squares is
        pre^T G pre, no pass over the row."""
        pre, g = self._pre(tot, i, gain)
        q = Float32(0.0)
        for a in range(H):
            inner = Float32(0.0)
            for b in range(H):
                inner += pre[b] * g[a, b]
            q += pre[a] * inner
        return pre, cute.math.rsqrt(q / self.D + self.norm_eps)

    def _normed(self, pre, rstd, streams, w, t, col, mNormed):
        """The normed output of column col from its streams (FP32 holding BF16 values)."""
        collapsed = Float32(0.0)
        for h in range(H):
            collapsed += pre[h] * streams[h]
        y = w * _bf16(_bf16(collapsed) * rstd)
        mNormed[t, col] = y.to(BFloat16)

    def _post(self, tot, i, t, gain, mPostOut):
        """post [H] of token t from token slot i's totals."""
        _, r = self._gram(tot, i)
        for h in range(H):
            z = tot[i, H + h] * r * gain[1] + gain[3 + H + h]
            mPostOut[t, h] = self.post_mult * _sigmoid(z)

    def _logits(self, tot, i, gain):
        """comb's mix logits [H * H] of token slot i (the softmax input: m * gain + b)."""
        _, r = self._gram(tot, i)
        s2 = gain[2]
        return [tot[i, 2 * H + k] * r * s2 + gain[3 + 2 * H + k] for k in range(H * H)]

    def _balance(self, z):
        """Sinkhorn(softmax_rows(z) + eps) [H, H] in registers, as the reference iterates it
        (columns first)."""
        eps = Float32(self.hc_eps)
        rC = cute.make_rmem_tensor(cute.make_layout((H, H), stride=(H, 1)), Float32)
        for a in range(H):  # softmax over each row, + eps
            za = z[a * H : a * H + H]
            top = cute.arch.fmax(cute.arch.fmax(za[0], za[1]), cute.arch.fmax(za[2], za[3]))
            e = [cute.math.exp(za[b] - top) for b in range(H)]
            inv = cute.arch.rcp_approx(e[0] + e[1] + e[2] + e[3])
            for b in range(H):
                rC[a, b] = e[b] * inv + eps
        _sinkhorn(rC, eps, self.iters)
        return rC

    def _comb(self, tot, i, t, gain, mCombOut):
        """comb [H, H] of token t from token slot i's totals, balanced here."""
        rC = self._balance(self._logits(tot, i, gain))
        for a in range(H):
            for b in range(H):
                mCombOut[t, a * H + b] = rC[a, b]

    def _pend(self, tot, i, t, gain, mPostOut, mCombOut):
        """post [H] and comb's logits [H * H] of token t, for the next boundary to balance."""
        self._post(tot, i, t, gain, mPostOut)
        z = self._logits(tot, i, gain)
        for k in range(H * H):
            mCombOut[t, k] = z[k]

    @cute.jit
    def _resolve(self, mPost: cute.Tensor, mComb: cute.Tensor, mReadyIn: cute.Tensor,
                 sMix: cute.Tensor, group: Int32, t0: Int32, lane: Int32,
                 tokens: Int32):  # fmt: skip
        """A deferred comb's producer's post and logits, once its ready word says so, into
        sMix [TB, H + H * H] (post, then comb balanced here; both rounded to BF16 as the
        post reads them): lane i of the Sinkhorn warp for token slot i. Before the PDL wait:
        none of it depends on the previous kernel."""
        if lane < self.tb:
            t = t0 + lane
            if t < tokens:
                word = mReadyIn.iterator + group
                ready = cute.arch.load(word, Int32, sem="acquire", scope="gpu")
                polls = Int32(0)
                while ready != READY:
                    polls += 1
                    if polls > POLLS:
                        _trap()
                    _nanosleep(64)
                    ready = cute.arch.load(word, Int32, sem="acquire", scope="gpu")
                for h in cutlass.range_constexpr(H):
                    sMix[lane, h] = _bf16(mPost[t, h])
                rC = self._balance([mComb[t, k] for k in range(H * H)])
                for a in cutlass.range_constexpr(H):
                    for b in cutlass.range_constexpr(H):
                        sMix[lane, H + a * H + b] = _bf16(rC[a, b])


# Host side: one compiled kernel per static configuration, launched on raw pointers (no
# per-call tensor conversion: a pointer is all the kernel's layouts need).

_DTYPES = {"bfloat16": BFloat16, "float32": Float32, "int32": Int32, "int64": Int64}
# The pointers' element types in argument order; fn, scale, base and norm follow the site's
# weights (FP32 or BF16), an unused pointer keeps its slot's type.
_SLOTS = ("bfloat16", "bfloat16", "float32", "float32", None, None, None, None,
          "bfloat16", "float32", "float32", "bfloat16", "int64", "int32", "int32")  # fmt: skip


def _pointer(dtype: str, address: int):
    numeric = _DTYPES[dtype]
    return cute.runtime.make_ptr(numeric, address, cute.AddressSpace.gmem,
                                 assumed_align=numeric.width // 8)  # fmt: skip


def slot_dtypes(weights: tuple[str, str, str, str]) -> tuple[str, ...]:
    """The 15 pointers' dtypes for a site whose (fn, scale, base, norm) have `weights`."""
    it = iter(weights)
    return tuple(s if s is not None else next(it) for s in _SLOTS)


# Compiled kernels by (dtypes, static arguments), for the process: a compile takes seconds,
# and every MhcBoundary of a process (each decode a bench or tune builds, the PDL-off one of
# a kernel table) asks for the same few.
_COMPILED: dict[tuple, object] = {}


def compile_boundary(dtypes: tuple[str, ...], **static):
    """The compiled kernel for `static` (CuteBoundary's arguments) and the pointers' dtypes
    (compiled once a process)."""
    import cuda.bindings.driver as cuda  # noqa: F401  (the stream type the kernel takes)

    # The builds' options at their defaults, spelled out: one key per kernel.
    static = {"phases": False, "pend_in": False, "pend_out": False, "per_sm": 2, **static}
    key = (tuple(dtypes), tuple(sorted(static.items())))
    if key not in _COMPILED:
        kernel = CuteBoundary(**static)
        fake = [_pointer(dt, 0) for dt in dtypes]
        _COMPILED[key] = cute.compile(kernel, *fake, Int32(1), cute.runtime.make_fake_stream())
    return _COMPILED[key]


def resident_clusters(compiled, threads: int) -> int | None:
    """How many clusters of `compiled` (a `compile_boundary` kernel, `threads` a CTA) the
    current GPU runs at once, by the driver's occupancy query; None where it does not say.
    Not the SMs x 2 CTAs an SM / CLUSTER one would guess: a cluster's CTAs share one GPC, and
    the GPCs of one GPU hold different SM counts (an H100 SXM: 132 SMs, 14 clusters of 16 at
    two CTAs an SM, where 16 seemed to fit; the 16th cluster ran as a second wave)."""
    import cuda.bindings.driver as cu
    import cuda.bindings.runtime as rt

    err, count = rt.cudaLibraryGetKernelCount(compiled.library)
    if err != rt.cudaError_t.cudaSuccess or count != 1:
        return None
    err, (kernel,) = rt.cudaLibraryEnumerateKernels(1, compiled.library)
    if err != rt.cudaError_t.cudaSuccess:
        return None
    err, function = cu.cuKernelGetFunction(cu.CUkernel(int(kernel)))
    if err != cu.CUresult.CUDA_SUCCESS:
        return None
    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = CLUSTER, 1, 1
    config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
    cluster = cu.CUlaunchAttribute()
    cluster.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    dims = cu.CUlaunchAttributeValue()
    dims.clusterDim.x, dims.clusterDim.y, dims.clusterDim.z = CLUSTER, 1, 1
    cluster.value = dims
    config.attrs, config.numAttrs = [cluster], 1
    err, n = cu.cuOccupancyMaxActiveClusters(function, config)
    return n if err == cu.CUresult.CUDA_SUCCESS and n > 0 else None


def launch(compiled, tensors, tokens: int, stream: int) -> None:
    """Run `compiled` on the 15 tensors (contiguous, of their slots' dtypes) for `tokens`."""
    import cuda.bindings.driver as cuda

    ptrs = [_pointer(str(t.dtype).removeprefix("torch."), t.data_ptr()) for t in tensors]
    compiled(*ptrs, Int32(tokens), cuda.CUstream(stream))
