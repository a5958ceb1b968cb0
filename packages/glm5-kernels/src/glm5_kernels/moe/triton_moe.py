"""Triton kernels of the MoE stage: routing, then the experts grouped by expert, in three launches.

  route_kernel   program t picks token t's routes (sigmoid + bias top-k, ties to the lower
                 id, renormalized weights); the last to finish lays them out grouped by
                 expert: the shared expert's M rows first, then each touched expert's rows
                 together, cut into groups of at most CHUNK tokens (one group = one expert's
                 weights read once for all of its tokens in the group). The same programs,
                 or (QUANT_APART) M x D/1024 more beside them, quantize the tokens to FP8 in
                 1x128 groups, once for every expert that reads them.
                 router_route_kernel: the same with the router GEMM in it (the split-K
                 Router's tiles; the last program sums the partials and routes every token).
  gate_up_kernel a CTA per (group, BN gate columns): gate and up tiles of that expert against
                 the group's gathered tokens, clamped SwiGLU in the epilogue, BF16 rows.
  down_kernel    a CTA per (group, BN output columns): the group's rows quantized in
                 registers, the down product into FP32 route rows; with FINALIZE the last
                 CTA of each column tile (acq_rel counter, reset by it) weights and sums every
                 token's routes in route order and adds the shared expert: one launch,
                 deterministic.

Weights are e4m3 with 128x128 block scales (FP32 or UE8M0 bytes). An expert's tensors are
found at base + e * stride; the shared expert (id E) at base + its element offset from the
routed stack, so one launch serves both without copying either.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from glm5_kernels.triton_primitives import (
    await_inputs,
    load_weight_scales,
    narrow,
    prefetch_l2,
    quantize_groups,
    torch_sigmoid,
)

# A picked expert's key: below every key, padding's (-inf: ~-2^63 + 2^55) included. Not a
# value's: an expert whose score + bias is below -2 has a key below -2^62.
REMOVED: tl.constexpr = tl.constexpr(-(2**63))


@triton.jit
def _ordered(v):
    """FP32 -> int32 of the same order (negative values: magnitude bits flipped)."""
    b = v.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _quantize_groups(x_ptr, xq_ptr, xs_ptr, t, g0, D, stride_xm, UE8M0: tl.constexpr,
                     QUANT_GROUPS: tl.constexpr, INTERPRETER: tl.constexpr):  # fmt: skip
    """Token t's 128-groups g0 .. g0 + QUANT_GROUPS - 1 -> e4m3 codes and one FP32 scale
    each (vLLM's group rule). Past the end: the last group again (the same values stored
    twice)."""
    c = tl.arange(0, 128)
    groups = tl.minimum(g0 + tl.arange(0, QUANT_GROUPS), D // 128 - 1)
    cols = groups[:, None] * 128 + c[None, :]
    x = tl.load(x_ptr + t * stride_xm + cols).to(tl.float32)
    xq, sx = quantize_groups(x, UE8M0, INTERPRETER)
    tl.store(xq_ptr + t * D + cols, xq)
    tl.store(xs_ptr + t * (D // 128) + groups, sx)


@triton.jit
def _quantize_token(x_ptr, xq_ptr, xs_ptr, t, D, stride_xm, UE8M0: tl.constexpr,
                    QUANT_GROUPS: tl.constexpr, INTERPRETER: tl.constexpr):  # fmt: skip
    """Token t's D values -> e4m3 codes and one FP32 scale per 128."""
    for g0 in range(0, D // 128, QUANT_GROUPS):
        _quantize_groups(x_ptr, xq_ptr, xs_ptr, t, g0, D, stride_xm, UE8M0, QUANT_GROUPS,
                         INTERPRETER)  # fmt: skip


@triton.jit
def _lay_out(ids_ptr, route_row_ptr, group_expert_ptr, group_row_ptr, group_count_ptr,
             row_token_ptr, M, E, G, CHUNK, MAX_CHUNKS: tl.constexpr, TOP_K: tl.constexpr,
             BR: tl.constexpr, BE: tl.constexpr, SHARED: tl.constexpr):  # fmt: skip
    """Every token's routes (ids, stored by other programs or threads before) laid out by the
    one program that saw them all: sorted by (expert, route), route r of expert e is row
    S + its position (SHARED: the shared expert holds rows 0..M-1 and the first groups,
    S = M; else S = 0), so each expert's rows are contiguous and in token order; the groups
    cut at CHUNK rows."""
    routes = M * TOP_K
    r = tl.arange(0, BR)
    every = tl.load(ids_ptr + r, mask=r < routes, other=-1, cache_modifier=".cg")
    ok = (r < routes) & (every >= 0) & (every < E)
    e = tl.where(ok, every, BE - 1)  # BE > E: bin BE - 1 collects what is not a route
    experts = tl.arange(0, BE)
    count = tl.where(experts < E, tl.histogram(e, BE), 0)
    order = tl.sort((e << 16) | r)  # by expert, then route (= token) order
    route, pos = order & 0xFFFF, tl.arange(0, BR)
    routed = (order >> 16) < E
    s0 = M if SHARED else 0  # the routes' first row
    tl.store(route_row_ptr + route, tl.where(routed, s0 + pos, -1), mask=route < routes)
    tl.store(row_token_ptr + s0 + pos, route // TOP_K, mask=routed)
    if SHARED:
        tl.store(row_token_ptr + r, r, mask=r < M)
    # Groups: the shared expert's chunks, then each touched expert's, then unused ones.
    chunks = (count + CHUNK - 1) // CHUNK
    row_base = s0 + tl.cumsum(count, axis=0) - count
    g0 = tl.cdiv(M, CHUNK) if SHARED else 0  # the routed experts' first group
    group_base = g0 + tl.cumsum(chunks, axis=0) - chunks
    for i in tl.static_range(MAX_CHUNKS):
        if SHARED and i * CHUNK < M:
            tl.store(group_expert_ptr + i, E)
            tl.store(group_row_ptr + i, i * CHUNK)
            tl.store(group_count_ptr + i, tl.minimum(M - i * CHUNK, CHUNK))
        mine = i < chunks
        g = group_base + i
        tl.store(group_expert_ptr + g, experts, mask=mine)
        tl.store(group_row_ptr + g, row_base + i * CHUNK, mask=mine)
        tl.store(group_count_ptr + g, tl.minimum(count - i * CHUNK, CHUNK), mask=mine)
    used = g0 + tl.sum(chunks, axis=0)
    for unused in range(0, G, BE):
        g = unused + experts
        tl.store(group_expert_ptr + g, -1, mask=(g >= used) & (g < G))


@triton.jit(do_not_specialize=["M", "G", "CHUNK"])
def route_kernel(
    logits_ptr,  # [M, E] FP32 router logits (ROUTE), row stride stride_lm
    bias_ptr,  # [E] e_score_correction_bias
    ids_ptr,  # [M, TOP_K] int32: written (ROUTE) or read
    weights_ptr,  # [M, TOP_K] FP32: written (ROUTE) or read
    route_row_ptr,  # [M, TOP_K] int32 out: each route's row (-1: an id outside [0, E))
    group_expert_ptr, group_row_ptr, group_count_ptr,  # [G] int32 out (expert -1: unused)
    row_token_ptr,  # [rows] int32 out: the token of each route row
    x_ptr, xq_ptr, xs_ptr,  # x [M, D] BF16 -> e4m3 codes [M, D], FP32 scales [M, D/128]
    count_ptr,  # [1] int32 arrival counter, zero between launches
    M, E, D, stride_lm, stride_xm, scaling, G, CHUNK,
    MAX_CHUNKS: tl.constexpr,  # >= the groups one expert can need: ceil(M / CHUNK)
    TOP_K: tl.constexpr, KP: tl.constexpr, BR: tl.constexpr, BE: tl.constexpr,
    ROUTE: tl.constexpr, UE8M0: tl.constexpr, QUANT_GROUPS: tl.constexpr,
    INTERPRETER: tl.constexpr, PDL: tl.constexpr, SHARED: tl.constexpr = True,
    QUANT_APART: tl.constexpr = False, RELEASE_EARLY: tl.constexpr = False,
):  # fmt: skip
    """Program t < M picks token t's routes and quantizes the token, or (QUANT_APART) leaves
    that to programs M.. (QUANT_GROUPS groups of one token each: the routing program's
    dependent chain is then the pick alone); the last program to finish lays the routes
    out (`_lay_out`). RELEASE_EARLY: the expert kernel released right after the wait, so
    its CTAs are resident at their own wait when the routes are laid out (a few programs
    here: they take no SM the expert kernel needs); its wait still waits for this whole
    launch to complete."""
    t = tl.program_id(0)
    if PDL:
        gdc_wait()
        if RELEASE_EARLY:
            gdc_launch_dependents()
    if QUANT_APART and t >= M:
        per_token = tl.cdiv(D // 128, QUANT_GROUPS)
        q = t - M
        _quantize_groups(x_ptr, xq_ptr, xs_ptr, q // per_token, (q % per_token) * QUANT_GROUPS,
                         D, stride_xm, UE8M0, QUANT_GROUPS, INTERPRETER)  # fmt: skip
    elif not QUANT_APART:
        _quantize_token(x_ptr, xq_ptr, xs_ptr, t, D, stride_xm, UE8M0, QUANT_GROUPS,
                        INTERPRETER)  # fmt: skip
    kcols = tl.arange(0, KP)
    if ROUTE and t < M:
        cols = tl.arange(0, BE)
        valid = cols < E
        score = torch_sigmoid(tl.load(logits_ptr + t * stride_lm + cols, mask=valid, other=0.0),
                              INTERPRETER)  # fmt: skip
        bias = tl.load(bias_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        choice = tl.where(valid, score + bias, -float("inf"))
        # One max per route: the value's order in the high word, the lower id winning ties
        # in the low word (a stable descending sort's order).
        key = (_ordered(choice).to(tl.int64) << 32) | (BE - 1 - cols).to(tl.int64)
        ids = tl.zeros([KP], dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.max(key, axis=0)
            idx = (BE - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
            ids = tl.where(kcols == j, idx, ids)
            key = tl.where(cols == idx, REMOVED, key)
        picked = kcols < TOP_K
        s = torch_sigmoid(tl.load(logits_ptr + t * stride_lm + ids, mask=picked, other=0.0),
                          INTERPRETER)  # fmt: skip
        s = tl.where(picked, s, 0.0)
        weights = s / (tl.sum(s, axis=0) + 1e-20) * scaling
        tl.store(ids_ptr + t * TOP_K + kcols, ids, mask=picked)
        tl.store(weights_ptr + t * TOP_K + kcols, weights, mask=picked)
    # Every program's ids are stored before the one thread issuing its arrival.
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        _lay_out(ids_ptr, route_row_ptr, group_expert_ptr, group_row_ptr, group_count_ptr,
                 row_token_ptr, M, E, G, CHUNK, MAX_CHUNKS, TOP_K, BR, BE, SHARED)  # fmt: skip
        tl.atomic_xchg(count_ptr, 0)
    if PDL and not RELEASE_EARLY:
        gdc_launch_dependents()


@triton.jit
def _pick_routes(part_ptr, logits_ptr, bias_ptr, ids_ptr, weights_ptr, M, E, scaling,
                 SPLIT_K: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr,
                 BE: tl.constexpr, BT: tl.constexpr, INTERPRETER: tl.constexpr):  # fmt: skip
    """Every token's logits (the split-K partials summed in split order, stored) and routes,
    BT tokens at a time: route_kernel's pick, one max per route over a [BT, BE] tile."""
    cols = tl.arange(0, BE)
    kcols = tl.arange(0, KP)
    valid = cols < E
    bias = tl.load(bias_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    for t0 in range(0, M, BT):
        tok = t0 + tl.arange(0, BT)
        live = (tok < M)[:, None]
        at = tok[:, None] * E + cols[None, :]
        logit = tl.zeros([BT, BE], dtype=tl.float32)
        for split in tl.static_range(SPLIT_K):
            # .cg: L1 is not coherent across SMs; the other programs' partials live in L2.
            logit += tl.load(part_ptr + split * M * E + at, mask=live & valid[None, :],
                             other=0.0, cache_modifier=".cg")  # fmt: skip
        tl.store(logits_ptr + at, logit, mask=live & valid[None, :])
        score = torch_sigmoid(logit, INTERPRETER)
        choice = tl.where(valid[None, :], score + bias[None, :], -float("inf"))
        key = (_ordered(choice).to(tl.int64) << 32) | (BE - 1 - cols)[None, :].to(tl.int64)
        ids = tl.zeros([BT, KP], dtype=tl.int32)
        route = tl.full([BT, BE], -1, dtype=tl.int32)  # which pick took each expert
        for j in tl.static_range(TOP_K):
            best = tl.max(key, axis=1)
            idx = (BE - 1 - (best & 0xFFFFFFFF)).to(tl.int32)
            hit = cols[None, :] == idx[:, None]
            ids = tl.where(kcols[None, :] == j, idx[:, None], ids)
            route = tl.where(hit, j, route)
            key = tl.where(hit, REMOVED, key)
        # Every pick's score at once, after the picks (one reduction, not one a pick: each
        # is a CTA-wide round of barriers): route j's score alone in its row among zeros,
        # so the sum is exactly it.
        mine = route[:, None, :] == kcols[None, :, None]
        s = tl.sum(tl.where(mine, score[:, None, :], 0.0), axis=2)
        weights = s / (tl.sum(s, axis=1)[:, None] + 1e-20) * scaling
        picked = live & (kcols[None, :] < TOP_K)
        out = tok[:, None] * TOP_K + kcols[None, :]
        tl.store(ids_ptr + out, ids, mask=picked)
        tl.store(weights_ptr + out, weights, mask=picked)


@triton.jit(do_not_specialize=["M", "G", "CHUNK"])
def router_route_kernel(
    gate_ptr,  # [E, D] BF16 router weight, k-major
    part_ptr,  # [SPLIT_K, M, E] FP32 scratch: each split's partial logits
    logits_ptr,  # [M, E] FP32 out: the router logits
    bias_ptr, ids_ptr, weights_ptr, route_row_ptr,  # as route_kernel's (ids, weights: out)
    group_expert_ptr, group_row_ptr, group_count_ptr, row_token_ptr,
    x_ptr, xq_ptr, xs_ptr, count_ptr,
    M, E, D, stride_xm, scaling, G, CHUNK,
    K_TILES,  # BK tiles per split
    MAX_CHUNKS: tl.constexpr, TOP_K: tl.constexpr, KP: tl.constexpr, BR: tl.constexpr,
    BE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    SPLIT_K: tl.constexpr, BT: tl.constexpr, UE8M0: tl.constexpr, QUANT_GROUPS: tl.constexpr,
    INTERPRETER: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
    SHARED: tl.constexpr = True, QUANT_APART: tl.constexpr = False,
):  # fmt: skip
    """The router GEMM and route_kernel in one launch. Program p < tiles x SPLIT_K computes
    the partial logits of BN experts over one split of K (the Router's swap-AB tile: accᵀ
    [BN, BM] = gate tile @ x tileᵀ) and stores them; program t < M quantizes token t after
    its tile, or (QUANT_APART) the programs after the tiles' do, QUANT_GROUPS groups of one
    token each (route_kernel's split: the tiles' programs arrive sooner); the last program
    to arrive sums every token's partials, picks its routes (`_pick_routes`) and lays them
    out (`_lay_out`). One arrival counter for the whole launch, where the separate router's
    split-K fixup and route_kernel each had one."""
    pid = tl.program_id(0)
    tiles = tl.cdiv(E, BN)
    split = pid // tiles
    offs_n = (pid % tiles) * BN + tl.arange(0, BN)
    w_rows = gate_ptr + tl.minimum(offs_n, E - 1) * D
    k_lo = split * K_TILES * BK
    await_inputs(w_rows, k_lo, D, 64, PDL, PREFETCH)
    if split < SPLIT_K:
        offs_m = tl.arange(0, BM)
        offs_k = tl.arange(0, BK)
        w_ptrs = w_rows[:, None] + offs_k[None, :]
        x_ptrs = x_ptr + tl.minimum(offs_m, M - 1)[:, None] * stride_xm + offs_k[None, :]
        x_rows = offs_m[:, None] < M
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        for k in range(k_lo, tl.minimum(k_lo + K_TILES * BK, D), BK):  # D % BK == 0
            w = tl.load(w_ptrs + k)
            x = tl.load(x_ptrs + k, mask=x_rows, other=0.0)
            if INTERPRETER:
                w, x = w.to(tl.float32), x.to(tl.float32)
            acc = tl.dot(w, tl.trans(x), acc)
        at = part_ptr + split * M * E + offs_m[None, :] * E + offs_n[:, None]
        tl.store(at, acc, mask=(offs_n[:, None] < E) & (offs_m[None, :] < M))
    if QUANT_APART:
        if split >= SPLIT_K:
            per_token = tl.cdiv(D // 128, QUANT_GROUPS)
            q = pid - tiles * SPLIT_K
            _quantize_groups(x_ptr, xq_ptr, xs_ptr, q // per_token,
                             (q % per_token) * QUANT_GROUPS, D, stride_xm, UE8M0, QUANT_GROUPS,
                             INTERPRETER)  # fmt: skip
    elif pid < M:
        _quantize_token(x_ptr, xq_ptr, xs_ptr, pid, D, stride_xm, UE8M0, QUANT_GROUPS,
                        INTERPRETER)  # fmt: skip
    # Every thread's partials are stored before the one thread issuing the release.
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        _pick_routes(part_ptr, logits_ptr, bias_ptr, ids_ptr, weights_ptr, M, E, scaling,
                     SPLIT_K, TOP_K, KP, BE, BT, INTERPRETER)  # fmt: skip
        tl.debug_barrier()  # the ids this program's threads stored, read by all of them
        _lay_out(ids_ptr, route_row_ptr, group_expert_ptr, group_row_ptr, group_count_ptr,
                 row_token_ptr, M, E, G, CHUNK, MAX_CHUNKS, TOP_K, BR, BE, SHARED)  # fmt: skip
        tl.atomic_xchg(count_ptr, 0)
    if PDL:
        gdc_launch_dependents()


@triton.jit
def _expert_base(group_expert_ptr, group, E, stride_e, shared_offset):
    """(expert id, element offset of its tensor from the routed stack's base)."""
    e = tl.load(group_expert_ptr + group)
    return e, _expert_offset(e, E, stride_e, shared_offset)


@triton.jit
def _expert_offset(e, E, stride_e, shared_offset):
    """Expert e's tensor as an element offset from the routed stack's base (E: the shared)."""
    return tl.where(e == E, shared_offset, e.to(tl.int64) * stride_e)


@triton.jit(do_not_specialize=["M"])
def gate_up_kernel(
    xq_ptr, xs_ptr,  # [M, D] e4m3 tokens and their [M, D/128] FP32 scales
    w_ptr, ws_ptr,  # routed w13 [E, 2I, D] e4m3, scales [E, 2I/128, D/128]
    act_ptr,  # [rows, I] BF16 out: SwiGLU of each route row
    group_expert_ptr, group_row_ptr, group_count_ptr, row_token_ptr,
    part_ptr,  # SPLIT > 1: [SPLIT, rows, 2I] FP32 scratch, each split's gate | up partials
    count_ptr,  # SPLIT > 1: [G, I / BN] int32 arrival counters, zero between launches
    M, E, D, I, w_shared, ws_shared,  # shared expert: element offsets from w_ptr / ws_ptr
    limit, rows_total,
    BM: tl.constexpr, BN: tl.constexpr, KB: tl.constexpr, SPLIT: tl.constexpr,
    SCALE_E8M0: tl.constexpr, INTERPRETER: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """SPLIT > 1 (few tokens: a CTA per column tile and expert streams too few bytes at a
    time to fill HBM): SPLIT CTAs share a tile's K, each stores its FP32 partials, and the
    last of them to arrive sums them in split order and applies the SwiGLU. (The split's
    partials summed by the down kernel instead cost it 30 us on the H200: every down CTA
    summed them again.)"""
    pid_n, group, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if PDL:
        gdc_wait()
    # The group's expert, first row and row count in one round trip (all three were just
    # written by the routing launch; an unused group's row and count are read and ignored).
    e, w_off = _expert_base(group_expert_ptr, group, E, 2 * I * D, w_shared)
    row0 = tl.load(group_row_ptr + group)
    count = tl.load(group_count_ptr + group)
    if e >= 0:
        s_off = _expert_offset(e, E, (2 * I // 128) * (D // 128), ws_shared)
        offs_m = tl.arange(0, BM)
        in_rows = offs_m < count
        tok = tl.load(row_token_ptr + row0 + offs_m, mask=in_rows, other=0)
        offs_k = tl.arange(0, 128)
        offs_n = pid_n * BN + tl.arange(0, BN)
        x_ptrs = xq_ptr + tok[:, None] * D + offs_k[None, :]
        xs_rows = xs_ptr + tok[:, None] * (D // 128)
        wg_ptrs = w_ptr + w_off + offs_n[:, None] * D + offs_k[None, :]
        wu_ptrs = wg_ptrs + I * D
        # BN divides 128: the tile's gate rows share one scale row, and so do its up rows.
        sg_row = ws_ptr + s_off + (pid_n * BN // 128) * (D // 128)
        su_row = sg_row + (I // 128) * (D // 128)
        steps = tl.arange(0, KB)
        acc_g = tl.zeros([BN, BM], dtype=tl.float32)
        acc_u = tl.zeros([BN, BM], dtype=tl.float32)
        k_lo = split * (D // 128 // SPLIT)  # the plan makes each split a multiple of KB
        k_hi = k_lo + D // 128 // SPLIT
        # Scales one step ahead (as the skinny FP8 GEMM does: an L2 round trip per step else).
        sg_next = load_weight_scales(sg_row + k_lo + steps, SCALE_E8M0)
        su_next = load_weight_scales(su_row + k_lo + steps, SCALE_E8M0)
        sx_next = tl.load(xs_rows + k_lo + steps[None, :], mask=in_rows[:, None], other=0.0)
        for kb in range(k_lo, k_hi, KB):
            after = tl.minimum(kb + KB, k_hi - KB)
            sg_step, su_step, sx_step = sg_next, su_next, sx_next
            sg_next = load_weight_scales(sg_row + after + steps, SCALE_E8M0)
            su_next = load_weight_scales(su_row + after + steps, SCALE_E8M0)
            sx_next = tl.load(xs_rows + after + steps[None, :], mask=in_rows[:, None], other=0.0)
            for j in tl.static_range(KB):
                kt = kb + j
                wg = tl.load(wg_ptrs + kt * 128)
                wu = tl.load(wu_ptrs + kt * 128)
                xq = tl.load(x_ptrs + kt * 128, mask=in_rows[:, None], other=0.0)
                sx = tl.sum(tl.where(steps[None, :] == j, sx_step, 0.0), axis=1)
                sg = tl.sum(tl.where(steps == j, sg_step, 0.0), axis=0)
                su = tl.sum(tl.where(steps == j, su_step, 0.0), axis=0)
                acc_g += tl.dot(wg, tl.trans(xq)) * (sx * sg)[None, :]
                acc_u += tl.dot(wu, tl.trans(xq)) * (sx * su)[None, :]
        if PDL:
            gdc_launch_dependents()
        out = act_ptr + (row0 + offs_m)[None, :] * I + offs_n[:, None]
        if SPLIT == 1:
            tl.store(out, _swiglu(acc_g, acc_u, limit, INTERPRETER), mask=in_rows[None, :])
        else:
            part = part_ptr + (row0 + offs_m)[None, :] * (2 * I) + offs_n[:, None]
            mine = part + split * rows_total * (2 * I)
            tl.store(mine, acc_g, mask=in_rows[None, :])
            tl.store(mine + I, acc_u, mask=in_rows[None, :])
            # Every thread's partials are stored before the one thread issuing the arrival.
            tl.debug_barrier()
            counter = count_ptr + group * tl.num_programs(0) + pid_n
            if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT - 1:
                gate = tl.zeros([BN, BM], dtype=tl.float32)
                up = tl.zeros([BN, BM], dtype=tl.float32)
                for s in tl.static_range(SPLIT):  # split order: the same sum every launch
                    # .cg: the other CTAs' partials are in L2, not in this SM's L1.
                    at = part + s * rows_total * (2 * I)
                    gate += tl.load(at, mask=in_rows[None, :], other=0.0, cache_modifier=".cg")
                    up += tl.load(at + I, mask=in_rows[None, :], other=0.0, cache_modifier=".cg")
                tl.store(out, _swiglu(gate, up, limit, INTERPRETER), mask=in_rows[None, :])
                tl.atomic_xchg(counter, 0)


@triton.jit
def _swiglu(gate, up, limit, INTERPRETER: tl.constexpr):
    """vLLM's sequence: the gate_up output in BF16, clamped SwiGLU in FP32, stored in BF16."""
    gate = tl.minimum(narrow(gate, tl.bfloat16, INTERPRETER).to(tl.float32), limit)
    up = narrow(up, tl.bfloat16, INTERPRETER).to(tl.float32)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return narrow(gate * tl.sigmoid(gate) * up, tl.bfloat16, INTERPRETER)


@triton.jit(do_not_specialize=["M", "G"])
def down_kernel(
    act_ptr,  # [rows, I] BF16 SwiGLU rows
    w_ptr, ws_ptr,  # routed w2 [E, D, I] e4m3, scales [E, D/128, I/128]
    rows_ptr,  # [rows, D] FP32 out: each route's expert output, unweighted
    out_ptr,  # FINALIZE: [M, D] BF16 out
    count_ptr,  # FINALIZE: [D / (BN * NT)] int32 arrival counters, zero between launches
    group_expert_ptr, group_row_ptr, group_count_ptr,
    route_row_ptr, weights_ptr,  # [M, TOP_K]
    M, E, D, I, w_shared, ws_shared, stride_om, G,
    BM: tl.constexpr, BN: tl.constexpr, NT: tl.constexpr, BT: tl.constexpr,
    TOP_K: tl.constexpr, KP: tl.constexpr, SCALE_E8M0: tl.constexpr, UE8M0: tl.constexpr,
    FINALIZE: tl.constexpr, INTERPRETER: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
    SHARED: tl.constexpr = True,
):  # fmt: skip
    """A CTA owns NT column tiles of BN, run as one flattened loop: with I = 512 (TP 4) one
    tile is only 4 K blocks."""
    pid_n, group = tl.program_id(0), tl.program_id(1)
    n0 = pid_n * BN * NT
    offs_k = tl.arange(0, 128)
    # The routing was written two launches back (the routing kernel had finished before
    # gate_up could release this launch), so this CTA's expert, rows and the finalization's
    # routes are read before the wait, off the chain that follows it; and L2 is warmed with
    # the expert's first weight lines while gate_up drains.
    e, w_off = _expert_base(group_expert_ptr, group, E, D * I, w_shared)
    s_off = _expert_offset(e, E, (D // 128) * (I // 128), ws_shared)
    row0 = tl.load(group_row_ptr + group)
    count = tl.load(group_count_ptr + group)
    w_rows = w_ptr + w_off + (n0 + tl.arange(0, BN))[:, None] * I
    tokens = tl.arange(0, BT)
    live = tokens < M
    kcols = tl.arange(0, KP)
    # Every token's routes (row, weight) early where they are a few registers (at 64 tokens
    # the [BT, KP] tiles took the kernel from 186 registers to 255 and a spill).
    EARLY: tl.constexpr = FINALIZE and BT * KP <= 128
    if EARLY:
        at = tokens[:, None] * TOP_K + kcols[None, :]
        routes = live[:, None] & (kcols < TOP_K)[None, :]
        route_rows = tl.load(route_row_ptr + at, mask=routes, other=-1)
        route_weights = tl.load(weights_ptr + at, mask=routes, other=0.0)
    if PDL:
        if PREFETCH > 0 and e >= 0:
            lines = tl.minimum(tl.arange(0, PREFETCH) * 128, I - 1)
            prefetch_l2(w_rows + lines[None, :])
        gdc_wait()
    if e >= 0:
        offs_m = tl.arange(0, BM)
        in_rows = offs_m < count
        k_tiles = I // 128
        a_ptrs = act_ptr + (row0 + offs_m)[:, None] * I + offs_k[None, :]
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        for it in range(0, NT * k_tiles):
            tile = it // k_tiles
            kt = it - tile * k_tiles
            w = tl.load(w_rows + tile * BN * I + kt * 128 + offs_k[None, :])
            a = tl.load(a_ptrs + kt * 128, mask=in_rows[:, None], other=0.0).to(tl.float32)
            aq, sa = quantize_groups(a, UE8M0, INTERPRETER)
            # BN divides 128: one scale row per tile.
            s_row = ws_ptr + s_off + ((n0 + tile * BN) // 128) * k_tiles
            sw = load_weight_scales(s_row + kt, SCALE_E8M0)
            acc += tl.dot(w, tl.trans(aq)) * (sa * sw)[None, :]
            if kt == k_tiles - 1:
                offs_n = n0 + tile * BN + tl.arange(0, BN)
                out = rows_ptr + (row0 + offs_m)[None, :] * D + offs_n[:, None]
                tl.store(out, acc, mask=in_rows[None, :])
                acc = tl.zeros([BN, BM], dtype=tl.float32)
    if PDL:
        gdc_launch_dependents()
    if FINALIZE:
        # Every CTA of the column block arrives, the unused groups' too; the last one sums.
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == G - 1:
            for tile in range(NT):
                offs_n = n0 + tile * BN + tl.arange(0, BN)
                routed = tl.zeros([BT, BN], dtype=tl.float32)
                for j in tl.static_range(TOP_K):
                    if EARLY:  # route j's column: its one value plus zeros, exactly it
                        r = tl.sum(tl.where(kcols[None, :] == j, route_rows, 0), axis=1)
                        r = tl.where(live, r, -1)
                        w = tl.sum(tl.where(kcols[None, :] == j, route_weights, 0.0), axis=1)
                    else:
                        r = tl.load(route_row_ptr + tokens * TOP_K + j, mask=live, other=-1)
                        w = tl.load(weights_ptr + tokens * TOP_K + j, mask=live, other=0.0)
                    # .cg: the other CTAs' rows are in L2, not in this SM's L1.
                    y = tl.load(
                        rows_ptr + r[:, None] * D + offs_n[None, :], mask=(r >= 0)[:, None],
                        other=0.0, cache_modifier=".cg",
                    )  # fmt: skip
                    routed += w[:, None] * y
                # The stock sum: routed output in BF16 plus the shared expert's BF16 output.
                total = narrow(routed, tl.bfloat16, INTERPRETER).to(tl.float32)
                if SHARED:
                    shared = tl.load(
                        rows_ptr + tokens[:, None] * D + offs_n[None, :], mask=live[:, None],
                        other=0.0, cache_modifier=".cg",
                    )  # fmt: skip
                    total += narrow(shared, tl.bfloat16, INTERPRETER).to(tl.float32)
                out = out_ptr + tokens[:, None] * stride_om + offs_n[None, :]
                tl.store(out, narrow(total, tl.bfloat16, INTERPRETER), mask=live[:, None])
            tl.atomic_xchg(count_ptr + pid_n, 0)
